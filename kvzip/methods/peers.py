"""Peers: transformers' own quantized KV caches as kvzip methods, so `kvzip bench` measures them in the same run.

- `hf-fp8`: `Fp8QuantizedLayer` (QuantizedCache backend "fp8"): keys and values in float8 e4m3 with a per-tensor
  scale calibrated on the prefill and frozen after it (later values saturate at the fp8 range, as the CPU cast
  does; the stock layer's CUDA cast makes them NaN).
- `hf-int4`, `hf-int2`: `QuantoQuantizedLayer` (backend "quanto", KIVI-style): groups of `q_group_size` values
  quantized with a scale and a shift, the newest tokens kept in full precision until `residual_length` of them
  have gathered, then the whole cache is re-quantized. Needs `optimum-quanto`.

The layers are transformers' own, unchanged: they return dequantized K/V to the stock SDPA path (no `attend`).
kvzip adds only the memory report, counted from what the layers really hold: the quantized tensors' bytes (packed
codes plus every scale and shift, walked through quanto's tensor subclasses) plus the full-precision residual.

Both layers dequantize their whole store at every step, which makes a teacher-forced 4k x 8 pass hours on a CPU
(fp8's cast runs one value at a time). For scoring passes only, `PeerCache.for_scoring` lets them keep the
dequantized copy between the steps that change it: the same numbers bit for bit, the memory report unchanged, but
the process holds a full-precision copy and the pass's speed is not the peer's (the bench drops it).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
from transformers.cache_utils import Fp8QuantizedLayer, QuantoQuantizedLayer

from kvzip.errors import UserError
from kvzip.methods.base import (FullBytes, KVCache, Method, check_choice, check_positive, model_layout, record_shape,
                                tensor_bytes)
from kvzip.rope import attention_windows


def stored_bytes(obj) -> int:
    """Bytes really held by a quantized state: plain tensors, quanto QTensor/PackedTensor subclasses (walked through
    their inner tensors `_data`, `_scale`, `_shift`), or tuples of them (fp8 keeps (codes, scale))."""
    if obj is None:
        return 0
    if isinstance(obj, (tuple, list)):
        return sum(stored_bytes(o) for o in obj)
    if type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
        names, _ = obj.__tensor_flatten__()
        return sum(stored_bytes(getattr(obj, n)) for n in names)
    return tensor_bytes(obj)


class _PeerMemory(FullBytes):
    """Memory report for transformers' quantized layers (mixed in first); their full-cache equivalent is `FullBytes`
    over `cumulative_length` (their get_seq_length), every layer full attention. With `keep` set (scoring passes),
    `_dequantize` keeps its result for the keys and for the values until the layer replaces that state."""

    keep = False
    _kept: list | None = None  # [keys, values]: (the state the copy was made from, its dequantized copy)

    def reset(self) -> None:
        super().reset()
        self._kept = None

    def _slot(self, stored) -> int:
        """0 for the keys' state, 1 for the values' (the layers dequantize the very objects they hold)."""
        if self._kept is None:
            self._kept = [None, None]
        return 0 if stored is self._quantized_keys else 1

    def _dequantize(self, stored):
        if not self.keep:
            return super()._dequantize(stored)
        slot = self._slot(stored)
        held = self._kept[slot]
        if held is None or held[0] is not stored:  # a flush replaced the state: dequantize it once
            held = self._kept[slot] = (stored, super()._dequantize(stored))
        return held[1]

    def lazy_initialization(self, key_states, value_states):
        record_shape(self, key_states)
        super().lazy_initialization(key_states, value_states)

    def memory(self) -> dict[str, int]:
        residual = tensor_bytes(self.keys, self.values) if self.keys is not None else 0
        return {"device": residual, "codes": stored_bytes(self._quantized_keys) + stored_bytes(self._quantized_values)}


class PeerFp8Layer(_PeerMemory, Fp8QuantizedLayer):
    """Two changes to transformers' layer. It saturates at the fp8 range before the cast: the scale is frozen on the
    prefill, so a later token can exceed it; the CPU cast saturates, but the CUDA cast turns such values into NaN
    (seen on an H200 in bf16: perplexity NaN, top-1 agreement 0.41), which would measure a crash, not fp8. And the
    scale is one per row, calibrated on the row's real tokens (the stock one spans the batch, left padding included),
    so a row of a batch is cached exactly as it would be alone."""

    padding = None  # (B,) left padding of each row, from KVCache.on_prefill

    def set_padding(self, padding: torch.Tensor) -> None:
        self.padding = padding

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise UserError("hf-fp8 cannot reorder its rows (beam search): each row's fp8 scale is frozen on its prefill; "
                        "decode with one row per sequence instead")

    def _quantize(self, tensor, scale=None):
        if scale is None:  # calibrate one scale per row on its real tokens, so a batch row quantizes as if alone
            real = torch.ones(tensor.shape[0], tensor.shape[2], dtype=torch.bool, device=tensor.device)  # (B, T)
            if self.padding is not None:
                real = torch.arange(tensor.shape[2], device=tensor.device) >= self.padding.to(tensor.device)[:, None]
            amax = tensor.float().abs().masked_fill(~real[:, None, :, None], 0).amax((1, 2, 3), keepdim=True)
            scale = (amax / self.fp8_max).clamp(min=torch.finfo(torch.float32).tiny)  # (B, 1, 1, 1)
        limit = self.fp8_max * scale
        return super()._quantize(torch.maximum(torch.minimum(tensor.float(), limit), -limit), scale)

    def _dequantize(self, stored):
        """The copy is matched by the state's scale, which is frozen: each step appends codes to a new tuple with it,
        so the copy dequantizes the new tokens alone (the cast is elementwise: the same values), into a buffer that
        grows by doubling, of which the valid part is returned as a view."""
        cast = lambda codes: Fp8QuantizedLayer._dequantize(self, (codes, stored[1]))  # noqa: E731
        if not self.keep:
            return cast(stored[0])
        slot = self._slot(stored)
        held = self._kept[slot]  # (scale, buffer, tokens in it): the scale is the state's lasting part
        buffer, done = (held[1], held[2]) if held is not None and held[0] is stored[1] else (None, 0)
        n = stored[0].shape[-2]
        if buffer is None or buffer.shape[-2] < n:
            grown = torch.empty(*stored[0].shape[:-2], max(2 * n, 256), stored[0].shape[-1], dtype=self.keys.dtype,
                                device=stored[0].device)
            if done:
                grown[..., :done, :] = buffer[..., :done, :]
            buffer = grown
        buffer[..., done:n, :] = cast(stored[0][..., done:, :])
        self._kept[slot] = (stored[1], buffer, n)
        return buffer[..., :n, :]


class PeerQuantoLayer(_PeerMemory, QuantoQuantizedLayer):
    def set_padding(self, padding: torch.Tensor) -> None:
        """quanto quantizes groups within one token's head vector, so a row never depends on the others."""


class PeerCache(KVCache):
    def for_scoring(self) -> bool:
        """Keep the dequantized copies between the steps that change them (see the module's docstring)."""
        for layer in self.layers:
            layer.keep = True
        return True


def _full_attention_only(model, name: str) -> None:
    """transformers' QuantizedCache refuses models with sliding-window layers (its layers keep every token); so do we."""
    if any(w is not None for w in attention_windows(model)):
        raise UserError(f"method '{name}' (transformers' QuantizedCache) needs a model whose layers all use full "
                        "attention; this model has sliding-window layers")


@dataclass
class HfFp8(Method):
    """transformers QuantizedCache(backend="fp8"): float8 e4m3 keys and values, one frozen scale per tensor."""

    name = "hf-fp8"
    lossless_options = None
    summary = "peer: transformers' fp8 quantized cache (per-tensor scale), stock attention"

    def plan_budget(self, budget, fixed):
        """No option changes its size: one byte a value (its per-row scales are negligible)."""
        from kvzip.budget import Plan

        return Plan({}, 1 / budget.shape.element_size)

    def make_cache(self, model, dictionaries=None) -> KVCache:
        layers, _, _ = model_layout(model)
        _full_attention_only(model, self.name)
        return PeerCache([PeerFp8Layer() for _ in range(layers)], self)


@dataclass
class _Quanto(Method):
    q_group_size: int = 64
    residual_length: int = 128
    test_options = {"q_group_size": "16", "residual_length": "8"}
    lossless_options = None  # the prefill is quantized whatever residual_length says

    bits = 4

    def __post_init__(self):
        check_positive(q_group_size=self.q_group_size, residual_length=self.residual_length)
        check_choice("q_group_size", self.q_group_size, (16, 32, 64, 128))

    def plan_budget(self, budget, fixed):
        """The bit width is the method's; F sets the residual (up to `residual_length - 1` newest tokens in full
        precision) and, when even a 16-token residual does not fit, the group size (a scale and a shift in the
        model's dtype per `q_group_size` values) grows to the widest that divides the head size (up to 128)."""
        from kvzip.budget import TOLERANCE, Plan

        t, e = budget.tokens, budget.shape.element_size
        widest = max(g for g in (16, 32, 64, 128) if budget.shape.head_dim % g == 0)  # a group stays in one head
        groups = [self.q_group_size] if "q_group_size" in fixed else sorted({min(self.q_group_size, widest), widest})

        def expected(group: int, residual: int) -> float:
            """The peak: the prompt is quantized, then the residual grows to `residual - 1` tokens and is quantized
            with everything on the next one; the most is held just before the last such step, or at the end."""
            code, n = (self.bits / 8 + 2 * e / group) / e, budget.new_tokens
            held = lambda k: (k % residual) + (budget.prompt_tokens + k - k % residual) * code  # noqa: E731
            last_full = n - (n + 1) % residual  # the last k <= n where the residual holds residual - 1 tokens
            return max(held(n), held(last_full) if last_full >= 0 else 0.0) / t

        for group in groups:
            if "residual_length" in fixed:
                if expected(group, self.residual_length) <= budget.fraction * (1 + TOLERANCE):
                    return Plan({"q_group_size": group}, expected(group, self.residual_length))
                continue
            residual = next((r for r in range(budget.new_tokens + 1, 15, -1) if expected(group, r) <= budget.fraction),
                            None)  # the longest full-precision residual that fits
            if residual is not None:
                return Plan({"q_group_size": group, "residual_length": residual}, expected(group, residual))
        residual = self.residual_length if "residual_length" in fixed else 16
        smallest = {k: v for k, v in (("q_group_size", groups[-1]), ("residual_length", residual)) if k not in fixed}
        return Plan(smallest, expected(groups[-1], residual))  # kvzip.budget.plan notes how far from F it lands

    def make_cache(self, model, dictionaries=None) -> KVCache:
        if importlib.util.find_spec("optimum") is None or importlib.util.find_spec("optimum.quanto") is None:
            raise UserError(f"method '{self.name}' needs optimum-quanto: pip install optimum-quanto")
        layers, _, head_dim = model_layout(model)
        _full_attention_only(model, self.name)
        if head_dim % self.q_group_size:
            raise UserError(f"method '{self.name}': q_group_size {self.q_group_size} must divide head_dim {head_dim}")
        return PeerCache([PeerQuantoLayer(nbits=self.bits, q_group_size=self.q_group_size,
                                        residual_length=self.residual_length) for _ in range(layers)], self)


@dataclass
class HfInt4(_Quanto):
    """transformers QuantizedCache(backend="quanto", nbits=4): KIVI-style int4 with a full-precision residual."""

    name = "hf-int4"
    summary = "peer: transformers' quanto int4 cache (groups + fp residual), stock attention"
    bits = 4


@dataclass
class HfInt2(_Quanto):
    """transformers QuantizedCache(backend="quanto", nbits=2): KIVI-style int2 with a full-precision residual."""

    name = "hf-int2"
    summary = "peer: transformers' quanto int2 cache (groups + fp residual), stock attention"
    bits = 2
