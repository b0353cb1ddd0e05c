"""The detail tier: every finished thought's full K/V, kept off the compute device until a query zooms in on it.

zoomr's device holds summaries, not thoughts; the detail is what comes back on zoom-in. It lives in host memory
(pinned, with non-blocking copies on CUDA), and every report counts it (the `host` tier), so its format decides
whether device and host together stay below a full cache:
- `int8` (default): int8 with one fp16 scale per vector, 66 B per vector at head_dim 64 (256 B in fp32, 128 B in
  bf16); a zoomed thought comes back with int8 rounding;
- `int4`: four bits a channel, two to a byte: keys with a scale and a low per channel over the thought's tokens (a
  key's few large channels get their own range, as KIVI quantizes keys), values with a scale and a low per group of
  32 channels of each vector; ~39 B per vector at head_dim 64 for a thought of 40 tokens, with int4 rounding;
- `host`: dense copies in the compute dtype (the paper's setting), exact on zoom-in;
- `fadkv`: codes over the layer's post-RoPE dictionary at the sparsity it was trained for, by FAD-KV's screening
  coder (kvzip.sparse.screen, fused on a CPU), int16 indices and fp16 coefficients (32 B per vector at s = 8), with
  coding error on zoom-in. (OMP over every atom, Lexico's coder, made each row ~30% slower at the capacity workload,
  3.6 against 5.2 tok/s; screening's error at its defaults is 1.06-1.09x OMP's, docs/fadkv.md.)
A stored thought is a pair of parts (K, V), each a tuple of host tensors.
"""

from __future__ import annotations

import math

import torch

from kvzip import kernels
from kvzip.methods.base import tensor_bytes
from kvzip.sparse.coded_attention import FP16_TINY, dequantize, pack_nibbles, quantize, unpack_nibbles
from kvzip.sparse.omp import reconstruct
from kvzip.sparse.screen import screen

DETAILS = ("int8", "int4", "host", "fadkv")


def offload(x: torch.Tensor) -> torch.Tensor:
    """A copy of x off the compute device: pinned CPU memory with a non-blocking copy on CUDA."""
    if x.device.type != "cuda":
        return x.clone()
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    return host.copy_(x, non_blocking=True)


def part_bytes(stored) -> int:
    """Bytes of one stored thought (both parts)."""
    return sum(tensor_bytes(*part) for part in stored)


def _stateless(stores: list) -> bool:
    """Whether the layers' tiers are all one kind that keeps no per-layer state (one call can serve every layer)."""
    return type(stores[0]) in (DenseDetail, Int8Detail, Int4Detail) and all(type(s) is type(stores[0]) for s in stores)


def store_layers(stores: list, k: torch.Tensor, v: torch.Tensor, separate: bool = False) -> list:
    """One thought of several layers at once: k, v (L, Hkv, n, d), `stores` the layers' tiers -> one stored thought
    per layer. The tiers that keep no per-layer state store all layers in one pass, each layer's part a view of it
    (`separate`: a copy of its own, for layers that free their detail one by one)."""
    if not _stateless(stores):
        return [s.store(k[i], v[i]) for i, s in enumerate(stores)]
    parts = stores[0].store(k, v)
    own = (lambda x: x.clone()) if separate else (lambda x: x)  # noqa: E731
    return [tuple(tuple(own(x[i]) for x in part) for part in parts) for i in range(len(stores))]


def load_layers(stores: list, stored: list, device, dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One thought of several layers back on `device`: K, V (Hkv, n, d) per layer. Where the tiers keep no per-layer
    state and the parts have one shape, all layers are decoded in one pass."""
    shapes = {tuple(x.shape for part in p for x in part) if p is not None else None for p in stored}
    if not _stateless(stores) or len(shapes) > 1 or None in shapes:
        return [s.load(p, device, dtype) for s, p in zip(stores, stored)]
    parts = tuple(tuple(torch.stack(xs) for xs in zip(*(p[i] for p in stored))) for i in range(2))
    k, v = stores[0].load(parts, device, dtype)
    return list(zip(k, v))


class DenseDetail:
    """detail=host: dense copies in the compute dtype."""

    def store(self, k: torch.Tensor, v: torch.Tensor):
        """k, v (Hkv, n, d) -> what the tier keeps of them."""
        return (offload(k),), (offload(v),)

    def load(self, stored, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """A stored thought back on `device`: K, V (Hkv, n, d) in `dtype`."""
        (k,), (v,) = ([x.to(device, non_blocking=True) for x in part] for part in stored)
        return k, v

    def load_keys(self, stored, device, dtype) -> torch.Tensor:
        """The keys of a stored thought alone (zoomr's reread): K (Hkv, n, d) in `dtype`."""
        return self.load(stored, device, dtype)[0]


class Int8Detail(DenseDetail):
    """detail=int8: int8 codes with one fp16 scale per vector, as fadkv stores its coefficients
    (kvzip.sparse.coded_attention.quantize: the codes are divided by the scale as stored, so they decode with it exactly)."""

    def store(self, k, v):
        return tuple((offload(q), offload(scale)) for q, scale in (quantize(x, "int8") for x in (k, v)))

    def load(self, stored, device, dtype):
        (k, k_scale), (v, v_scale) = ([x.to(device, non_blocking=True) for x in part] for part in stored)
        return dequantize(k, k_scale).to(dtype), dequantize(v, v_scale).to(dtype)

    def load_keys(self, stored, device, dtype):
        k, k_scale = (x.to(device, non_blocking=True) for x in stored[0])
        return dequantize(k, k_scale).to(dtype)


class Int4Detail(DenseDetail):
    """detail=int4: asymmetric four-bit codes, two to a byte. Keys (..., n, d) get a scale and a low per channel over
    the thought's n tokens, values a scale and a low per `GROUP` channels of each vector; both stored in fp16, and the
    codes computed against the stored (rounded) scale and low, so they decode with them exactly."""

    GROUP = 32  # value channels per scale (fewer where the head size is not a multiple of it)
    LEVELS = 15

    def store(self, k, v):
        d = v.shape[-1]
        group = math.gcd(self.GROUP, d)
        k = k.float()
        kq = self._quantize(k, k.amin(-2, keepdim=True), k.amax(-2, keepdim=True))
        groups = v.float().unflatten(-1, (d // group, group))  # (..., n, d / group, group)
        vq = self._quantize(groups, groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True))
        # codes (..., n, d / 2); scales and lows (..., n, d / group)
        vq = (vq[0].flatten(-2), vq[1].squeeze(-1), vq[2].squeeze(-1))
        return tuple(tuple(offload(x) for x in part) for part in (kq, vq))

    def _quantize(self, x, low, high):
        """x (..., c) and its range, broadcastable -> (codes packed two to a byte (..., c / 2), scale, low) in fp16."""
        scale = ((high - low) / self.LEVELS).clamp(min=FP16_TINY).half()
        low = low.half()
        codes = ((x - low.float()) / scale.float()).round_().clamp_(0, self.LEVELS).to(torch.uint8)
        return pack_nibbles(codes), scale, low

    def load(self, stored, device, dtype):
        (k, k_scale, k_low), (v, v_scale, v_low) = ([x.to(device, non_blocking=True) for x in part] for part in stored)
        k = unpack_nibbles(k).float() * k_scale.float() + k_low.float()
        groups = unpack_nibbles(v).float().unflatten(-1, (v_scale.shape[-1], -1))
        v = (groups * v_scale.float()[..., None] + v_low.float()[..., None]).flatten(-2)
        return k.to(dtype), v.to(dtype)


class CodedDetail(DenseDetail):
    """detail=fadkv: screening codes over one layer's post-RoPE dictionary (kvzip.sparse.dictionary.LayerAtoms)."""

    def __init__(self, atoms, sparsity: int, kv_heads: int):
        self.atoms, self.sparsity, self.kv_heads = atoms, sparsity, kv_heads

    def store(self, k, v):
        a = self.atoms
        out, fused = [], k.device.type == "cpu" and kernels.available()
        for x, atoms, gram in ((k if a.key_mean is None else k - a.key_mean[:, None], a.keys, a.key_gram),
                               (v, a.values, a.value_gram)):
            idx, coef = screen(x.float().reshape(-1, x.shape[-1]), atoms, self.sparsity, gram=gram, fused=fused)
            out.append((offload(idx.to(torch.int16)), offload(coef.half())))
        return tuple(out)

    def load(self, stored, device, dtype):
        (k, k_coef), (v, v_coef) = ([x.to(device, non_blocking=True) for x in part] for part in stored)
        a = self.atoms
        shape = (self.kv_heads, -1, a.keys.shape[1])
        k = reconstruct(a.keys, k.long(), k_coef).view(shape)  # codes (Hkv * n, s) -> (Hkv, n, d)
        v = reconstruct(a.values, v.long(), v_coef).view(shape)
        return (k if a.key_mean is None else k + a.key_mean[:, None]).to(dtype), v.to(dtype)
