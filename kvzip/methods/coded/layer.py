"""`FadkvLayer`: one layer of a fadkv or lexico cache: dense sinks and buffer, older tokens coded.

It stores what it is given (`update`) and attends (`attend`, by kvzip.methods.coded.attend.coded_attention over its
tiers and what this forward hands it in `state`: kvzip.methods.coded.forward.CodedState); coding runs after the
forward for every layer at once (kvzip.methods.coded.compress, called by `FadkvCache.after_forward`).
"""

from __future__ import annotations

import torch

from kvzip import kernels
from kvzip.methods.base import DenseLayer, tensor_bytes
from kvzip.methods.coded.attend import LayerInputs, Tiers, coded_attention
from kvzip.methods.coded.coding import CodedOptions
from kvzip.methods.coded.state import CodedKind
from kvzip.methods.coded.zoom import HostDetail, zoomed_attention
from kvzip.rope import as_rope, from_pairs, visible_from
from kvzip.sparse.dictionary import LayerAtoms


class FadkvLayer(DenseLayer):
    """Dense sinks and buffer (keys, values, positions), older tokens coded (`coded_keys`, `coded_values`:
    kvzip.methods.coded.state, at `coded_pos`). `idx` is the layer's index in its cache, what `state` keys its
    inputs by."""

    # codes, overlays and atom counts are per-row state beyond keys and values: reordering rows is refused
    ROW_TENSORS = ()

    def __init__(self, cfg: CodedOptions, atoms: LayerAtoms, rope=None, sliding=None, idx: int = 0):
        super().__init__(sliding)
        self.idx = idx
        self.rope = None if rope is None else as_rope(rope)  # this layer's Rope when keys are coded before RoPE
        self.cfg, self.atoms = cfg, atoms  # atoms: the layer's shared dictionary (with rope, keys in pair order)
        self.key_mean = atoms.key_mean  # (Hkv, d) or None; with rope, in `to_pairs` order
        mean = None if self.key_mean is None else self.key_mean.float()
        # the key mean as the fused kernel reads it: fp32, in the model's channel order
        self.kernel_mean = None if mean is None else (
            mean if self.rope is None else from_pairs(mean, self.rope.dim)).contiguous()
        self.pad = None  # (B,) left-padding tokens of each row (positions below it are padding), set by the prefill
        self.detail = None  # with `zoom`: every token's exact keys and values off the device (coded/zoom.py)

    def set_padding(self, padding: torch.Tensor) -> None:
        """Each row's left padding, from the first prompt's mask (a later prompt continues the same rows)."""
        if self.pad is None:
            self.pad = padding

    def reset(self) -> None:
        super().reset()
        self.pad, self.detail = None, None

    def update(self, key_states, value_states, *args, **kwargs):
        """The dense tier's update; with `zoom`, the new tokens' exact keys and values also go to the detail tier."""
        out = super().update(key_states, value_states, *args, **kwargs)
        if self.cfg.zoom:
            if self.detail is None:
                self.detail = HostDetail()
            self.detail.append(key_states, value_states)
        return out

    def dense_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dense tier (sinks + buffer) is kept in half precision when the model runs fp32: it is a cache, not a
        compute buffer."""
        return torch.float16 if dtype == torch.float32 else dtype

    def lazy_initialization(self, key_states, value_states):
        super().lazy_initialization(key_states, value_states)  # keys, values, positions: the dense tier
        b, h = self.batch, self.kv_heads
        self.coded_pos = torch.zeros(b, 0, dtype=torch.long, device=self.device)  # (B, T), -1: a hole
        a, fmt = self.atoms, self.cfg.coef_format
        packed = self.cfg.packed_numbers(a.keys.shape[0])  # index_bits=0: ten-bit numbers where they fit
        self.coded_keys = CodedKind(a.keys, a.grams, a.slot, self.cfg.sparsity, fmt, b, h, packed)
        self.coded_values = CodedKind(a.values, a.grams, a.slot + 1, self.cfg.value_sparsity or self.cfg.sparsity, fmt,
                                      b, h, packed)

    @property
    def kinds(self) -> tuple[CodedKind, CodedKind]:
        return self.coded_keys, self.coded_values

    def tiers(self) -> Tiers:
        return Tiers(self.keys, self.values, self.positions, self.coded_keys, self.coded_values, self.coded_pos)

    def attend(self, module, query, key, value, mask, scaling, state=None):
        """Attention over the dense and coded tiers, with what `state` (a `CodedState`) hands this layer; coding runs
        after the forward (FadkvCache.after_forward)."""
        inputs = LayerInputs() if state is None else state.of(self.idx)
        if self.cfg.zoom and query.shape[2] == 1 and self.coded_pos.shape[1]:
            return zoomed_attention(query, mask, scaling, self.tiers(), self.key_mean, self.rope, inputs, self.detail,
                                    self.cfg.zoom, self.cfg.zoom_chunk)
        return coded_attention(query, mask, scaling, self.tiers(), self.key_mean, self.rope, inputs)

    def fused(self) -> bool:
        """Whether one new token's attention runs in the fused CPU kernel (kvzip/kernels) rather than the PyTorch
        reference: `kernel=auto`, no `zoom` (the PyTorch path), on the CPU, int8, int4 or fp16 coefficients, head
        sizes and sparsities the kernel holds, and the kernel built."""
        d = self.keys.shape[-1]
        return (self.cfg.kernel == "auto" and not self.cfg.zoom and self.keys.device.type == "cpu"
                and self.coded_keys.codes.stored.dtype in (torch.int8, torch.uint8, torch.float16) and d % 16 == 0
                and d <= 256
                and max(self.coded_keys.sparsity, self.coded_values.sparsity) <= 64 and kernels.available())

    def memory(self) -> dict[str, int]:
        k, v = (kind.bytes() for kind in self.kinds)
        out = {"device": tensor_bytes(self.keys, self.values), "codes": k["codes"] + v["codes"],
               "dictionary": k["dictionary"] + v["dictionary"]}
        if self.detail is not None and self.detail.keys is not None:  # exact detail off the device, a step's zoom on it
            out["host"] = self.detail.bytes()
            zoomed = min(self.cfg.zoom * self.cfg.zoom_chunk, self.coded_pos.shape[1])
            vector = self.keys.shape[-1] * self.detail.keys.element_size()
            out["device"] += 2 * self.batch * self.kv_heads * zoomed * vector
        return out

    def _slide(self) -> None:
        """Sliding-window layer, after attending: drop what its next query can no longer see. Coded tokens before the
        window become holes (position -1, never seen) with their atoms counted off, and a column that is a hole in
        every row goes; the dense tier loses its oldest columns where every row's are out of the window (a row's
        others stay, hidden by the model's mask)."""
        cut = visible_from(self.seen, self.sliding)
        gone = (self.coded_pos >= 0) & (self.coded_pos < cut)  # (B, T)
        if bool(gone.any()):
            for kind in self.kinds:
                kind.forget(gone)
            self.coded_pos = self.coded_pos.masked_fill(gone, -1)
            keep = (self.coded_pos >= 0).any(0).nonzero().squeeze(-1)  # (T',) columns some row still needs
            for kind in self.kinds:
                kind.codes.keep(keep)
            self.coded_pos = self.coded_pos.index_select(1, keep)
        drop = int((self.positions < cut).sum(1).min())  # holes (-1) and old tokens lead each row
        if drop:
            for name in ("keys", "values", "positions"):
                self.drop(name, drop)
