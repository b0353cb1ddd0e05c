"""Attention on a fadkv or lexico layer's codes, as a function of explicit inputs: the PyTorch reference and the
dispatch to the fused CPU kernel.

`coded_attention(query, mask, scaling, tiers, key_mean, rope, inputs)` reads the layer's tiers (`Tiers`: the dense
keys, values and positions, the coded keys and values at their positions), its key mean and RoPE, and what this
forward hands every layer (`LayerInputs`, built by kvzip.methods.coded.forward: whether the fused kernel runs, the
rows' first visible positions, RoPE's tables). Decoding never keeps a dense copy of the past:
- one new token per row on the CPU runs `torch.ops.kvzip.coded_decode_attention` (kvzip/kernels) when `kernel=auto`
  and the kernel is built: one pass per row and KV head;
- otherwise the reference: post-RoPE scores gather q·D by code and add one q·mean term; pre-RoPE scores rebuild one
  chunk of SCORE_CHUNK keys at a time (mean added back, RoPE applied, chunk dropped); values are summed per atom and
  multiplied by the value dictionary once (kvzip/sparse/coded_attention.py), or rebuilt chunk by chunk for a multi-token
  query (a chat follow-up), whose many query rows share them.
"""

from __future__ import annotations

import typing

import torch

from kvzip.attention import causal_tail, dense_attention, gather_mask
from kvzip.methods.coded.state import CodedKind
from kvzip.rope import Rope, to_pairs, turn_pairs
from kvzip.sparse import coded_attention as coded
from kvzip.sparse.omp import reconstruct

# pre-RoPE scores rebuild at most this many coded keys at a time (per row and KV head): never a dense copy of the past
SCORE_CHUNK = 2048


class Tiers(typing.NamedTuple):
    """What a coded layer holds, as attention reads it: the dense tier (keys, values (B, Hkv, S, d) and their
    positions (B, S)) and the coded tier (kvzip.methods.coded.state.CodedKind per kind, at `coded_pos` (B, T), -1 a
    hole)."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    coded_keys: CodedKind
    coded_values: CodedKind
    coded_pos: torch.Tensor


class LayerInputs(typing.NamedTuple):
    """What one forward hands a coded layer (kvzip.methods.coded.forward.CodedState): whether its attention runs in
    the fused kernel, and the tables that path needs. `first` (B,): each row's first visible position when the mask
    hides exactly the positions before it (else None: the mask is gathered); `cos_sin` (P, 2, dim/2) fp32: RoPE's
    scaled cos and sin for the kernel; `turns` (B, T, dim/2) complex: RoPE at the coded tokens' positions for the
    pre-RoPE reference; `mean` (Hkv, d) fp32: the key mean in the model's channel order, for the kernel."""

    fused: bool = False
    first: torch.Tensor | None = None
    cos_sin: torch.Tensor | None = None
    turns: torch.Tensor | None = None
    mean: torch.Tensor | None = None


def coded_attention(query, mask, scaling, tiers: Tiers, key_mean: torch.Tensor | None, rope: Rope | None,
                    inputs: LayerInputs) -> torch.Tensor:
    """query (B, Hq, q, d) over the dense and coded tiers -> (B, q, Hq, d). `key_mean` (Hkv, d) or None; `rope` the
    layer's RoPE when keys are coded before it (key atoms and mean then in `to_pairs` order), else None."""
    b, hq, q, d = query.shape
    t = tiers.coded_pos.shape[1]
    if t == 0:  # nothing coded yet (the prompt's own forward): plain SDPA over the dense tier, as `full` runs it
        out = dense_attention(query, tiers.keys.to(query.dtype), tiers.values.to(query.dtype), mask, scaling,
                              positions=tiers.positions)
        return out.nan_to_num(0.0)  # a left-padding query sees nothing: keep its (never used) output finite
    if q == 1 and inputs.fused:
        return fused_attention(query, mask, scaling, tiers, rope, inputs)
    h = tiers.keys.shape[1]
    g = hq // h
    # (B, H, g*q, d): query heads grouped under their KV head, scaled once here rather than every score
    qg = query.float().reshape(b, h, g * q, d) * scaling
    dense_scores = qg @ tiers.keys.float().transpose(-1, -2)  # (B, H, gq, S)
    scores = torch.cat([coded_key_scores(qg, tiers.coded_keys, key_mean, rope, inputs), dense_scores], -1)
    positions = torch.cat([tiers.coded_pos, tiers.positions], 1)
    allowed = allowed_tokens(mask, positions, q, scores.shape[-1], query.device)
    allowed = allowed.expand(b, q, -1)[:, None, None].expand(b, h, g, q, -1).reshape(b, h, g * q, -1)
    # A left-padding query sees nothing: its softmax is NaN. Its weights become 0, so its output (and the keys and
    # values the next layer computes for that padding) stay finite: a NaN coded there would reach the whole row
    # through the per-atom value sums (0 x NaN).
    w = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)  # (B, H, gq, T+S)
    out = w[..., t:] @ tiers.values.float()  # (B, H, gq, d)
    if q > 1:  # several query positions (a follow-up prompt) share each rebuilt value: rebuild chunk by chunk
        out = out + rebuilt_values(w[..., :t], tiers.coded_values, d)
    else:  # decoding: weights summed per atom, one product with the value dictionary
        out = out + coded_value_sum(w[..., :t], tiers.coded_values)
    return out.view(b, h, g, q, d).reshape(b, hq, q, d).transpose(1, 2).to(query.dtype).contiguous()


def coded_key_scores(qg: torch.Tensor, keys: CodedKind, key_mean: torch.Tensor | None, rope: Rope | None,
                     inputs: LayerInputs) -> torch.Tensor:
    """qg (B, H, G, d), scaled, against the coded keys -> (B, H, G, T): pre-RoPE keys rebuilt chunk by chunk
    (`prerope_scores`), post-RoPE ones by q·D gathered by code plus one q·mean term."""
    if rope is not None:
        return prerope_scores(qg, keys, key_mean, rope, inputs.turns)
    scores = coded.coded_scores(keys.atom_scores(qg), keys.numbers(), keys.codes.coefficients())
    return scores if key_mean is None else scores + qg @ key_mean[None, :, :, None].float()  # (B, H, G, 1)


def coded_value_sum(w: torch.Tensor, values: CodedKind) -> torch.Tensor:
    """One decode query's weights w (B, H, G, T) over the coded values -> Σ_t w_t v_t (B, H, G, d): weights summed
    per atom (value scales folded in), one product with the value dictionary."""
    v_idx, v_st, v_sc = values.numbers(), values.codes.stored, values.codes.scale
    w = w if v_sc is None else w * v_sc.float().transpose(-1, -2)
    w_atoms = coded.atom_weights(w, v_idx.long(), coded.dequantize(v_st, None), values.n_total() + 1)
    return values.values_from_atoms(w_atoms)


def fused_attention(query, mask, scaling, tiers: Tiers, rope: Rope | None, inputs: LayerInputs) -> torch.Tensor:
    """query (B, Hq, 1, d) -> (B, 1, Hq, d) by `torch.ops.kvzip.coded_decode_attention`: the same attention as the
    reference path, in one pass per row and KV head. Without `inputs.first` the mask is gathered for the kernel."""
    b, hq, _, d = query.shape
    h = tiers.keys.shape[1]
    qg = (query.float().reshape(b, h, hq // h, d) * scaling).contiguous()  # (B, H, G, d)
    allowed, first = None, inputs.first
    if first is None:
        positions = torch.cat([tiers.coded_pos, tiers.positions], 1)
        width = positions.shape[1]
        allowed = allowed_tokens(mask, positions, 1, width, query.device)
        allowed = allowed.expand(b, 1, width).reshape(b, width).contiguous()
    dim = None if rope is None else rope.dim  # pre-RoPE: the kernel turns keys in the model's order
    k_atoms, v_atoms = tiers.coded_keys.lookup(dim), tiers.coded_values.lookup()
    k, v = tiers.coded_keys.codes, tiers.coded_values.codes
    out = torch.ops.kvzip.coded_decode_attention(
        qg, k.idx, k.stored, k.scale, *k_atoms, v.idx, v.stored, v.scale, *v_atoms, inputs.mean, inputs.cos_sin,
        tiers.coded_pos, tiers.keys, tiers.values, allowed, first, tiers.positions)
    return out.reshape(b, hq, 1, d).transpose(1, 2).to(query.dtype)


def rebuilt_chunks(kind: CodedKind, batch: int):
    """Yield (slice, vectors (B, H, Tc, d)) for each chunk of SCORE_CHUNK coded tokens of `kind`, rebuilt from their
    codes with one fused gather-and-weighted-sum (`embedding_bag`, every row and KV head in one call). The caller uses
    a chunk and drops it before the next, so no dense copy of the past is ever kept."""
    idx, stored, scale = kind.codes.idx, kind.codes.stored, kind.codes.scale
    atoms = kind.atom_table(batch)  # (B, Ntot + 1, d)
    b, n, d = atoms.shape
    atoms = atoms.reshape(b * n, d)  # each row's atoms in its own block of n
    rows = coded.row_offsets(b, n, atoms.device)
    for c in range(0, idx.shape[2], SCORE_CHUNK):
        part = slice(c, c + SCORE_CHUNK)
        coef = coded.dequantize(stored[:, :, part], None if scale is None else scale[:, :, part])  # (B, H, Tc, s)
        yield part, reconstruct(atoms, kind.numbers(idx[:, :, part]).int() + rows, coef)


def rebuilt_values(w: torch.Tensor, values: CodedKind, dim: int) -> torch.Tensor:
    """w (B, H, G, T) weights of the coded tokens -> Σ_t w_t v_t (B, H, G, dim), chunk by chunk. For many query rows
    this is far cheaper than per-atom sums, whose cost grows with the rows (G·T·s scatter-adds against T·s·d
    multiply-adds here)."""
    out = w.new_zeros(*w.shape[:3], dim)
    for part, rebuilt in rebuilt_chunks(values, w.shape[0]):
        out += w[..., part] @ rebuilt  # (B, H, G, d)
    return out


def prerope_scores(qg: torch.Tensor, keys: CodedKind, key_mean: torch.Tensor | None, rope: Rope,
                   turns: torch.Tensor) -> torch.Tensor:
    """qg (B, H, G, d) against keys coded before RoPE -> (B, H, G, T): each rebuilt chunk of keys gets the key mean
    added back and RoPE applied at the token's position (`turns` (B, T, dim/2) complex), then is dotted with the
    query: O(T·s·d) work. Atoms and key mean are stored in `to_pairs` order (and the query taken in it: a dot product
    does not care), so RoPE is one in-place complex product per chunk."""
    mean = None if key_mean is None else key_mean[None, :, None, :]  # (1, H, 1, d)
    qp = to_pairs(qg, rope.dim)
    out = qg.new_empty(*qg.shape[:3], turns.shape[1])
    for part, rebuilt in rebuilt_chunks(keys, qg.shape[0]):  # (B, H, Tc, d), in pair order like the atoms
        if mean is not None:
            rebuilt += mean
        turn_pairs(rebuilt, turns[:, None, part])  # RoPE at each position
        out[..., part] = qp @ rebuilt.transpose(-1, -2)  # (B, H, G, Tc)
    return out


def allowed_tokens(mask, positions, q, width, device):
    """Boolean (B, q, width) of which stored tokens each query may see. positions (B, width) are the stored tokens'
    virtual positions; a hole (-1) is never seen. Holes are masked whether or not there are any: asking would read
    a value back to the host inside the forward."""
    holes = positions < 0
    if mask is not None:
        m = gather_mask(mask, positions.clamp(min=0))[:, 0]  # (B, q, width)
        m = m if m.dtype == torch.bool else m == 0
        return m & ~holes[:, None, :]
    allowed = ~holes[:, None, :]
    return allowed & causal_tail(q, width, device)[None] if q > 1 else allowed
