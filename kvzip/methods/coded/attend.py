"""Attention on a fadkv or lexico layer's codes: the PyTorch reference and the dispatch to the fused CPU kernel.

`CodedAttention` is the attention half of `kvzip.methods.fadkv.FadkvLayer` (a mixin: it reads the layer's dense
tier `keys`, `values`, `positions`, its coded tiers `coded_keys`, `coded_values` at `coded_pos`, its `rope`, `key_mean`
and options `cfg`). Decoding never keeps a dense copy of the past:
- one new token per row on the CPU runs `torch.ops.kvzip.coded_decode_attention` (kvzip/kernels) when `kernel=auto`
  and the kernel is built: one pass per row and KV head;
- otherwise the reference: post-RoPE scores gather q·D by code and add one q·mean term; pre-RoPE scores rebuild one
  chunk of SCORE_CHUNK keys at a time (mean added back, RoPE applied, chunk dropped); values are summed per atom and
  multiplied by the value dictionary once (kvzip/sparse/coded_attention.py), or rebuilt chunk by chunk for a multi-token
  query (a chat follow-up), whose many query rows share them.
"""

from __future__ import annotations

import torch

from kvzip import kernels
from kvzip.attention import causal_tail, dense_attention, gather_mask
from kvzip.methods.coded.state import CodedKind
from kvzip.rope import angles, from_pairs, phasors, to_pairs, turn_pairs
from kvzip.sparse import coded_attention as coded
from kvzip.sparse.omp import reconstruct

# pre-RoPE scores rebuild at most this many coded keys at a time (per row and KV head): never a dense copy of the past
SCORE_CHUNK = 2048


class CodedAttention:
    """The attention methods of a coded layer (module docstring)."""

    def _attention(self, query, mask, scaling):
        b, hq, q, d = query.shape
        t = self.coded_pos.shape[1]
        if t == 0:  # nothing coded yet (the prompt's own forward): plain SDPA over the dense tier, as `full` runs it
            out = dense_attention(query, self.keys.to(query.dtype), self.values.to(query.dtype), mask, scaling,
                                  positions=self.positions)
            return out.nan_to_num(0.0)  # a left-padding query sees nothing: keep its (never used) output finite
        if q == 1 and self._fused():
            return self._fused_attention(query, mask, scaling)
        h = self.kv_heads
        g = hq // h
        # (B, H, g*q, d): query heads grouped under their KV head, scaled once here rather than every score
        qg = query.float().reshape(b, h, g * q, d) * scaling
        dense_scores = qg @ self.keys.float().transpose(-1, -2)  # (B, H, gq, S)
        if self.rope is not None:
            scores = torch.cat([self._prerope_scores(qg), dense_scores], -1)
            positions = torch.cat([self.coded_pos, self.positions], 1)
        else:
            keys = self.coded_keys
            k_scores = coded.coded_scores(keys.atom_scores(qg), keys.codes.idx, keys.codes.coefficients())
            if self.key_mean is not None:
                k_scores = k_scores + qg @ self.key_mean[None, :, :, None].float()  # (B, H, gq, 1)
            scores = torch.cat([k_scores, dense_scores], -1)
            positions = torch.cat([self.coded_pos, self.positions], 1)
        allowed = self._allowed(mask, positions, q, scores.shape[-1], query.device)
        allowed = allowed.expand(b, q, -1)[:, None, None].expand(b, h, g, q, -1).reshape(b, h, g * q, -1)
        # A left-padding query sees nothing: its softmax is NaN. Its weights become 0, so its output (and the keys and
        # values the next layer computes for that padding) stay finite: a NaN coded there would reach the whole row
        # through the per-atom value sums (0 x NaN).
        w = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)  # (B, H, gq, T+S)
        out = w[..., t:] @ self.values.float()  # (B, H, gq, d)
        if q > 1:  # several query positions (a follow-up prompt) share each rebuilt value: rebuild chunk by chunk
            out = out + self._rebuilt_values(w[..., :t])
        else:  # decoding: weights summed per atom, one product with the value dictionary
            values = self.coded_values
            v_idx, v_st, v_sc = values.codes.idx, values.codes.stored, values.codes.scale
            w_coded = w[..., :t] if v_sc is None else w[..., :t] * v_sc.float().transpose(-1, -2)  # scales folded in
            w_atoms = coded.atom_weights(w_coded, v_idx.long(), coded.dequantize(v_st, None), values.n_total() + 1)
            out = out + values.values_from_atoms(w_atoms)
        return out.view(b, h, g, q, d).reshape(b, hq, q, d).transpose(1, 2).to(query.dtype).contiguous()

    def _fused(self) -> bool:
        """Whether one new token's attention runs in the fused CPU kernel (kvzip/kernels) rather than the PyTorch
        reference below: `kernel=auto`, on the CPU, int8 or fp16 coefficients, head sizes and sparsities the kernel
        holds, and the kernel built."""
        d = self.keys.shape[-1]
        return (self.cfg.kernel == "auto" and self.keys.device.type == "cpu"
                and self.coded_keys.codes.stored.dtype in (torch.int8, torch.float16) and d % 16 == 0 and d <= 256
                and max(self.coded_keys.sparsity, self.coded_values.sparsity) <= 64 and kernels.available())

    def _fused_attention(self, query, mask, scaling):
        """query (B, Hq, 1, d) -> (B, 1, Hq, d) by `torch.ops.kvzip.coded_decode_attention`: the same attention as
        the reference path, in one pass per row and KV head."""
        b, hq, _, d = query.shape
        h = self.kv_heads
        qg = (query.float().reshape(b, h, hq // h, d) * scaling).contiguous()  # (B, H, G, d)
        allowed, first = None, self._first_visible(mask, b) if self.sliding is None else None
        if first is None:
            positions = torch.cat([self.coded_pos, self.positions], 1)
            width = positions.shape[1]
            allowed = self._allowed(mask, positions, 1, width, query.device)
            allowed = allowed.expand(b, 1, width).reshape(b, width).contiguous()
        dim = None if self.rope is None else self.rope.dim  # pre-RoPE: the kernel turns keys in the model's order
        k_atoms, v_atoms = self.coded_keys.lookup(dim), self.coded_values.lookup()
        k, v = self.coded_keys.codes, self.coded_values.codes
        if self.key_mean is not None and "mean" not in self.__dict__:
            mean = self.key_mean.float()
            self.mean = (mean if dim is None else from_pairs(mean, dim)).contiguous()
        out = torch.ops.kvzip.coded_decode_attention(
            qg, k.idx, k.stored, k.scale, *k_atoms, v.idx, v.stored, v.scale, *v_atoms,
            None if self.key_mean is None else self.mean,
            None if self.rope is None else self._rope_cs(), self.coded_pos, self.keys, self.values, allowed, first,
            self.positions)
        return out.reshape(b, hq, 1, d).transpose(1, 2).to(query.dtype)

    def _first_visible(self, mask, batch: int) -> torch.Tensor | None:
        """(B,) each row's first visible position when the mask (B|1, 1, 1, P) of one new token hides exactly the
        positions before it (the engine's left padding), so that the kernel can tell what a query sees from the
        tokens' positions; None for any other mask. Checked once per forward and shared by the cache's layers."""
        if mask is None:
            return torch.zeros(batch, dtype=torch.long, device=self.keys.device)
        memo, key = self._step_memo(), ("first", id(mask))
        if key not in memo:
            seen = mask[:, 0, 0] if mask.dtype == torch.bool else mask[:, 0, 0] == 0  # (B|1, P)
            first = (~seen).long().cumprod(-1).sum(-1)  # hidden positions before the first visible one
            exact = bool((seen == (torch.arange(seen.shape[-1], device=seen.device) >= first[:, None])).all())
            memo[key] = first.expand(batch).contiguous() if exact else None
        return memo[key]

    def _rope_cs(self) -> torch.Tensor:
        """(P, 2, dim/2) fp32: RoPE's scaled cos and sin at every position up to the newest, for the fused kernel;
        shared by the layers with this RoPE and kept across steps, grown by 1,024 positions when outgrown."""
        key = ("cs", id(self.rope))
        table = self.rope_memo.get(key)
        if table is None or table.shape[0] < self.seen:
            cos, sin = angles(torch.arange(self.seen + 1024, device=self.keys.device), self.rope.inv_freq)
            table = torch.stack([cos, sin], 1).mul_(self.rope.scale).contiguous()
            self.rope_memo[key] = table
        return table

    def _rebuilt_chunks(self, kind: CodedKind):
        """Yield (slice, vectors (B, H, Tc, d)) for each chunk of SCORE_CHUNK coded tokens, rebuilt from their codes
        with one fused gather-and-weighted-sum (`embedding_bag`, every row and KV head in one call). The caller uses
        a chunk and drops it before the next, so no dense copy of the past is ever kept."""
        idx, stored, scale = kind.codes.idx, kind.codes.stored, kind.codes.scale
        atoms = kind.atom_table(self.batch)  # (B, Ntot + 1, d)
        b, n, d = atoms.shape
        atoms = atoms.reshape(b * n, d)  # each row's atoms in its own block of n
        rows = coded.row_offsets(b, n, atoms.device)
        for c in range(0, idx.shape[2], SCORE_CHUNK):
            part = slice(c, c + SCORE_CHUNK)
            coef = coded.dequantize(stored[:, :, part], None if scale is None else scale[:, :, part])  # (B, H, Tc, s)
            yield part, reconstruct(atoms, idx[:, :, part].int() + rows, coef)

    def _rebuilt_values(self, w: torch.Tensor) -> torch.Tensor:
        """w (B, H, G, T) weights of the coded tokens -> Σ_t w_t v_t (B, H, G, d), chunk by chunk. For many query rows
        this is far cheaper than per-atom sums, whose cost grows with the rows (G·T·s scatter-adds against T·s·d
        multiply-adds here)."""
        out = w.new_zeros(*w.shape[:3], self.values.shape[-1])
        for part, values in self._rebuilt_chunks(self.coded_values):
            out += w[..., part] @ values  # (B, H, G, d)
        return out

    def _prerope_scores(self, qg: torch.Tensor) -> torch.Tensor:
        """qg (B, H, G, d) against keys coded before RoPE -> (B, H, G, T): each rebuilt chunk of keys gets the key mean
        added back and RoPE applied at the token's position, then is dotted with the query: O(T·s·d) work.
        Atoms and key mean are stored in `to_pairs` order (and the query taken in it: a dot product does not care),
        so RoPE is one in-place complex product per chunk."""
        mean = None if self.key_mean is None else self.key_mean[None, :, None, :]  # (1, H, 1, d)
        qp = to_pairs(qg, self.rope.dim)
        turns = self._rope_table()  # (B, T, dim/2) complex
        out = qg.new_empty(*qg.shape[:3], self.coded_pos.shape[1])
        for part, keys in self._rebuilt_chunks(self.coded_keys):  # keys (B, H, Tc, d), in pair order like the atoms
            if mean is not None:
                keys += mean
            turn_pairs(keys, turns[:, None, part])  # RoPE at each position
            out[..., part] = qp @ keys.transpose(-1, -2)  # (B, H, G, Tc)
        return out

    def _step_memo(self) -> dict:
        """What the layers of a cache compute once per forward and share (RoPE turns, the mask's first visible
        positions): emptied when a new forward begins (the layers' `seen` moved on)."""
        memo = self.rope_memo.setdefault("step", {})
        if memo.get("seen") != self.seen:
            memo.clear()
            memo["seen"] = self.seen
        return memo

    def _rope_table(self) -> torch.Tensor:
        """RoPE turns (B, T, dim/2) complex of the coded tokens' positions. Layers with the same RoPE and window code
        the same positions, so the table is computed by the first of them in a forward and reused by the others (kept
        only until the next step)."""
        memo = self._step_memo()
        key = (id(self.rope), self.sliding, self.coded_pos.shape[1])
        if key not in memo:
            memo[key] = phasors(self.coded_pos, self.rope)
        return memo[key]

    @staticmethod
    def _allowed(mask, positions, q, width, device):
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
