"""Attention computed directly on dictionary codes, and the coefficient storage formats.

A coded token t of one KV head is `idx[t]` (s atom numbers) and `coef[t]` (s coefficients): k_t ≈ Σ_j coef[t,j] D[idx[t,j]].
- Scores: q·k_t = Σ_j coef[t,j] (q·D)[idx[t,j]]. q·D is computed once per query (N dot products), then gathered by
  code: O(N·d + T·s) per query head instead of O(T·d), and no key is ever rebuilt. The gather-and-weighted-sum is
  one `embedding_bag` over a table whose rows are atoms and whose columns are the KV head's query rows (3.7x faster
  on CPU than gather, multiply and sum as three ops, measured at 8,192 coded tokens).
- Values: Σ_t w_t v_t = Σ_t w_t Σ_j coef[t,j] D[idx[t,j]] = (Σ over atoms of the weight each atom received) · D.
  Weights are scattered onto atoms (T·s adds) and multiplied by the value dictionary once (N·d).

Coefficients are stored as fp16, or in 8 bits with one fp16 scale per vector (int8: absmax/127; fp8: e4m3, absmax/448),
or in 4 bits two to a byte with one fp16 scale per vector (int4: absmax/7, the low nibble first; an even sparsity).
Atom numbers are int16, or packed in 10 bits for dictionaries of up to 1,024 atoms (`pack_indices`: each number's low
byte, then its two high bits four to a byte: s + ceil(s/4) bytes a token, 1.25 B a number for s a multiple of 4).
"""

from __future__ import annotations

import torch

from kvzip.sparse.omp import reconstruct

COEF_FORMATS = ("fp16", "int8", "fp8", "int4")
INT4_MAX = 7  # int4 codes run -7..7, stored with 8 added (1..15) so that a byte holds two without sign bits
INT8_MAX = 127  # the largest int8 magnitude both signs reach: a vector's largest coefficient is stored as +-127
FP8_MAX = 448  # the largest finite float8 e4m3 value: a vector's largest coefficient is stored as +-448
FP16_TINY = 2.0 ** -24  # the smallest positive fp16 (subnormal): a scale rounded to fp16 never becomes 0


def quantize(coef: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """coef (..., s) float -> (stored (..., s), or (..., s / 2) uint8 for int4; scale (..., 1) fp16 or None)."""
    if fmt == "fp16":
        return coef.half(), None
    amax = coef.abs().amax(-1, keepdim=True).float()  # (..., 1)
    if fmt == "int8":
        scale = _half_scale(amax / INT8_MAX)
        return (coef.float() / scale.float()).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale
    if fmt == "fp8":
        scale = _half_scale(amax / FP8_MAX)
        return (coef.float() / scale.float()).to(torch.float8_e4m3fn), scale
    if fmt == "int4":
        if coef.shape[-1] % 2:
            raise ValueError(f"int4 coefficients pack two a byte: the sparsity must be even, got {coef.shape[-1]}")
        scale = _half_scale(amax / INT4_MAX)
        q = ((coef.float() / scale.float()).round().clamp(-INT4_MAX, INT4_MAX) + 8).to(torch.uint8)
        return pack_nibbles(q), scale
    raise ValueError(f"coefficient format {fmt!r} is not one of {', '.join(COEF_FORMATS)}")


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Four-bit codes (..., c) uint8, c even -> two a byte (..., c / 2), the low nibble first."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """`pack_nibbles` undone: (..., c / 2) uint8 -> (..., c) uint8."""
    return torch.stack([packed & 15, packed >> 4], -1).flatten(-2)


PACKED_ATOMS = 1 << 10  # the most atom numbers `pack_indices` holds


def packed_width(s: int) -> int:
    """Bytes a token's s packed atom numbers take: s low bytes, then ceil(s / 4) bytes of high bits."""
    return s + (s + 3) // 4


def pack_indices(idx: torch.Tensor) -> torch.Tensor:
    """Atom numbers (..., s) below PACKED_ATOMS -> (..., packed_width(s)) uint8: the s low bytes, then the two high
    bits of numbers 4j..4j+3 in byte j of the tail, number 4j in its lowest bits."""
    s = idx.shape[-1]
    wide = idx.int()
    high = torch.nn.functional.pad(wide >> 8, (0, (-s) % 4)).view(*idx.shape[:-1], -1, 4)  # (..., ceil(s/4), 4)
    tail = high[..., 0] | (high[..., 1] << 2) | (high[..., 2] << 4) | (high[..., 3] << 6)
    return torch.cat([(wide & 255).to(torch.uint8), tail.to(torch.uint8)], -1)


def unpack_indices(packed: torch.Tensor, s: int) -> torch.Tensor:
    """`pack_indices` undone: (..., packed_width(s)) uint8 -> (..., s) int32."""
    low, tail = packed[..., :s].int(), packed[..., s:].int()
    high = torch.stack([tail & 3, (tail >> 2) & 3, (tail >> 4) & 3, tail >> 6], -1).flatten(-2)[..., :s]
    return low | (high << 8)


def _half_scale(scale: torch.Tensor) -> torch.Tensor:
    """A per-vector scale as fp16, never 0: an all-zero code (a padding token's zero key) would otherwise divide 0 by 0."""
    return scale.clamp(min=FP16_TINY).half()


def dequantize(stored: torch.Tensor, scale: torch.Tensor | None, dtype=torch.float32) -> torch.Tensor:
    if stored.dtype == torch.float8_e4m3fn:  # a 256-entry table: exact, and ~6x faster than torch's CPU fp8 cast
        table = _fp8_table(stored.device, dtype)
        out = table.index_select(0, stored.reshape(-1).view(torch.uint8).int()).view(stored.shape)
    elif stored.dtype == torch.uint8:  # int4, two a byte
        out = unpack_nibbles(stored).to(dtype) - 8
    else:
        out = stored.to(dtype)
    return out if scale is None else out * scale.to(dtype)


_FP8_TABLES: dict = {}


def _fp8_table(device, dtype) -> torch.Tensor:
    """The value of each of the 256 e4m3 bit patterns, in dtype on device (made once)."""
    key = (str(device), dtype)
    if key not in _FP8_TABLES:
        _FP8_TABLES[key] = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(dtype).to(device)
    return _FP8_TABLES[key]


def row_offsets(rows: int, per_row: int, device) -> torch.Tensor:
    """(rows, 1, 1, 1) int32 offsets r * per_row: shift each row's codes into its own block of a stacked table."""
    return (torch.arange(rows, dtype=torch.int32, device=device) * per_row).view(rows, 1, 1, 1)


def coded_scores(qd: torch.Tensor, idx: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """Scores of grouped queries against coded keys.

    qd (B, H, G, N): each of G query rows (query heads of the KV head x query positions) dotted with every atom.
    idx (B, H, T, s) integer, coef (B, H, T, s) float. Returns (B, H, G, T).
    """
    b, h, g, n = qd.shape
    table = qd.transpose(-1, -2).reshape(b * h * n, g)  # (B*H*N, G): one block of N rows per (row, KV head)
    bags = idx.int() + row_offsets(b * h, n, qd.device).view(b, h, 1, 1)
    return reconstruct(table, bags, coef).transpose(-1, -2)  # (B, H, G, T)


def atom_weights(w: torch.Tensor, idx: torch.Tensor, coef: torch.Tensor, n_atoms: int) -> torch.Tensor:
    """Attention weights w (B, H, G, T) over coded values -> weight received by each atom (B, H, G, N)."""
    b, h, g, t = w.shape
    s = idx.shape[3]
    src = (w[..., None] * coef[:, :, None]).reshape(b, h, g, t * s)  # (B, H, G, T*s)
    out = w.new_zeros(b, h, g, n_atoms)
    return out.scatter_add_(-1, idx.reshape(b, h, 1, t * s).expand(b, h, g, t * s), src)
