"""`fadkv` and `lexico`: dictionary-coded KV caches with attention computed on the codes.

FAD-KV (Zhu et al., 2026) and its predecessor Lexico (Kim et al., ICML 2025; arXiv:2412.08890). Per layer and KV head:
- the first `sinks` tokens and the most recent `buffer` tokens stay dense (sinks draw outsized attention, so a
  coding error there costs the most; the buffer absorbs tokens until a chunk of `chunk` can be coded at once);
- older tokens are coded as `s` atom indices (int16) and coefficients (fp16, or 8 bits with a scale) over the layer's
  key or value dictionary. The per-head key mean (stored in the dictionary file) is removed before coding. Keys are
  coded as the dictionary was trained: before RoPE (the default file; RoPE undone at coding time) or after it;
- decoding never keeps a dense copy of the past. Post-RoPE scores gather q·D by code and add one q·mean term;
  pre-RoPE scores rebuild one chunk of keys at a time (mean added back, RoPE applied, chunk dropped). Values are
  summed per atom and multiplied by the value dictionary once (kvzip/sparse/attention.py).
FAD-KV's coder is screening (top-n candidates by |Dᵀx|, pursuit on the pool); Lexico's is OMP over all atoms.

Fixed-size adaptation (FAD-KV): per sequence, a reference count per atom over live codes. When a coded vector's
relative residual exceeds `tau`, its normalised residual becomes a new atom in place of an inactive one (count zero,
least recently used) and the vector is re-coded. The shared dictionary is never written: a sequence's replaced atoms
live in its own overlay (atom number -> vector), so batched rows cannot corrupt each other, and the dictionary size a
sequence sees stays N. `adapt=append` grows the overlay past N instead (the ablation the paper argues against);
`adapt=none` keeps the dictionary static.

Models with more than one kind of layer: pre-RoPE keys are turned by each layer's own RoPE (kvzip.rope: Gemma 3's
local and global bases, Phi-3's partial rotary, where only the first channels turn), and a sliding-window layer drops
every token, coded or dense, that its next query can no longer see (the atoms those codes used are counted off).
"""

from __future__ import annotations

import time
import typing
from dataclasses import dataclass

import torch

from kvzip.attention import causal_tail, dense_attention, gather_mask, gather_tokens, leading_padding
from kvzip.errors import UserError
from kvzip.methods.base import KVCache, KVLayer, Method, check_choice, check_positive, model_layout, tensor_bytes
from kvzip.rope import attention_windows, as_rope, layer_ropes, phasors, to_pairs, turn_pairs, visible_from
from kvzip.sparse import CACHE_CODERS, KEY_MODES, KEY_OPTIONS, attention as coded
from kvzip.sparse.dictionary import prepare_layers
from kvzip.sparse.omp import omp, reconstruct
from kvzip.sparse.screen import PICKS, SHOTS, screen

ADAPT = ("fixed", "append", "none")
# pre-RoPE scores rebuild at most this many coded keys at a time (per row and KV head): never a dense copy of the past
SCORE_CHUNK = 2048


class _Overlay:
    """One sequence-batch's replaced or appended atoms for one dictionary: ids (B, R) (-1 = free), vectors (B, R, d)."""

    def __init__(self, batch: int, dim: int, device):
        self.ids = torch.full((batch, 0), -1, dtype=torch.long, device=device)
        self.vectors = torch.zeros(batch, 0, dim, device=device)

    def put(self, row: int, atom: int, vector: torch.Tensor) -> None:
        hit = (self.ids[row] == atom).nonzero()
        if len(hit) == 0:
            hit = (self.ids[row] == -1).nonzero()
        if len(hit) == 0:  # no free slot in this row: widen every row by one
            self.ids = torch.cat([self.ids, self.ids.new_full((self.ids.shape[0], 1), -1)], 1)
            self.vectors = torch.cat([self.vectors, self.vectors.new_zeros(self.ids.shape[0], 1, self.vectors.shape[-1])], 1)
            slot = self.ids.shape[1] - 1
        else:
            slot = int(hit[0])
        self.ids[row, slot] = atom
        self.vectors[row, slot] = vector

    def bytes(self) -> int:
        used = int((self.ids >= 0).sum())
        return used * (self.vectors.shape[-1] * self.vectors.element_size() + 8)


class FadkvLayer(KVLayer):
    def __init__(self, cfg: "Fadkv", d_k, d_v, g_k, g_v, key_mean, rope=None, rope_memo=None, sliding=None):
        super().__init__(sliding)
        self.rope = None if rope is None else as_rope(rope)  # this layer's Rope when keys are coded before RoPE
        self.rope_memo = {} if rope_memo is None else rope_memo  # shared by a cache's layers: RoPE tables per step
        self.cfg = cfg
        self.dicts = {"k": (d_k, g_k), "v": (d_v, g_v)}  # shared (N, d) atoms and (N, N) Gram, fp32
        self.n_atoms = d_k.shape[0]
        self.key_mean = key_mean  # (Hkv, d) or None; with rope, it and d_k are in `to_pairs` order
        self.coded_vectors = 0
        self.residual_sum = 0.0
        self.replaced = 0
        self.coding_s = 0.0

    def lazy_initialization(self, key_states, value_states):
        super().lazy_initialization(key_states, value_states)
        b, h, _, d = key_states.shape
        dev = key_states.device
        # Dense tier kept in half precision when the model runs fp32: it is a cache, not a compute buffer.
        self.dense_dtype = torch.float16 if key_states.dtype == torch.float32 else key_states.dtype
        self.keys = torch.zeros(b, h, 0, d, dtype=self.dense_dtype, device=dev)  # (B, H, S, d) sinks + buffer
        self.values = torch.zeros_like(self.keys)
        self.dense_pos = torch.zeros(b, 0, dtype=torch.long, device=dev)  # (B, S)
        self.coded_pos = torch.zeros(b, 0, dtype=torch.long, device=dev)  # (B, T)
        idx_dtype = torch.int16 if self.n_atoms + 4096 < 32767 else torch.int32
        self.codes = {}
        for kind in "kv":
            s = self.cfg.atoms_per_vector(kind)
            stored, scale = coded.quantize(torch.zeros(b, h, 0, s, device=dev), self.cfg.coef)
            self.codes[kind] = [torch.zeros(b, h, 0, s, dtype=idx_dtype, device=dev), stored, scale]
        self.overlay = {kind: _Overlay(b, d, dev) for kind in "kv"}
        self.pad = None  # (B,) left-padding tokens of each row (positions below it are padding), set by the prefill
        self.refcount = {kind: torch.zeros(b, self.n_atoms, dtype=torch.long, device=dev) for kind in "kv"}
        self.last_used = {kind: torch.full((b, self.n_atoms), -1, dtype=torch.long, device=dev) for kind in "kv"}

    # ---- cache protocol -------------------------------------------------------------------------------------
    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[2]
        self.keys = torch.cat([self.keys, key_states.to(self.dense_dtype)], dim=2)
        self.values = torch.cat([self.values, value_states.to(self.dense_dtype)], dim=2)
        new = torch.arange(self.seen, self.seen + q, device=self.dense_pos.device).expand(self.batch, q)
        self.dense_pos = torch.cat([self.dense_pos, new], dim=1)
        self.seen += q
        return key_states, value_states

    def attend(self, module, query, key, value, mask, scaling):
        if self.pad is None:  # the first forward: what of each row is left padding
            self.pad = leading_padding(mask, self.batch, self.keys.device)
        out = self._attention(query, mask, scaling)
        self._compress(prefill=query.shape[2] > 1)
        if self.sliding is not None:
            self._slide()
        return out

    def memory(self) -> dict[str, int]:
        codes = sum(tensor_bytes(*c) for c in self.codes.values())
        overlay = sum(o.bytes() for o in self.overlay.values())
        return {"device": tensor_bytes(self.keys, self.values), "codes": codes, "dictionary": overlay}

    def _slide(self) -> None:
        """Sliding-window layer, after attending: drop what its next query can no longer see. Coded tokens before the
        window become holes (position -1, never seen) with their atoms counted off, and a column that is a hole in
        every row goes; the dense tier loses its oldest columns where every row's are out of the window (a row's
        others stay, hidden by the model's mask)."""
        cut = visible_from(self.seen, self.sliding)
        gone = (self.coded_pos >= 0) & (self.coded_pos < cut)  # (B, T)
        if bool(gone.any()):
            for kind in "kv":
                for row in range(self.batch):
                    used = self.codes[kind][0][row][:, gone[row]].reshape(-1).long()
                    self.refcount[kind][row].scatter_add_(0, used, -torch.ones_like(used))
            self.coded_pos = self.coded_pos.masked_fill(gone, -1)
            keep = (self.coded_pos >= 0).any(0).nonzero().squeeze(-1)  # (T',) columns some row still needs
            self.codes = {k: [None if x is None else x.index_select(2, keep) for x in c] for k, c in self.codes.items()}
            self.coded_pos = self.coded_pos.index_select(1, keep)
        drop = int((self.dense_pos < cut).sum(1).min())  # holes (-1) and old tokens lead each row
        if drop:
            self.keys, self.values = self.keys[:, :, drop:], self.values[:, :, drop:]
            self.dense_pos = self.dense_pos[:, drop:]

    # ---- attention on codes ---------------------------------------------------------------------------------
    def _atom_scores(self, kind: str, qg: torch.Tensor) -> torch.Tensor:
        """qg (B, H, G, d) -> q·atom for every atom this sequence sees, plus a spare zero column (B, H, G, Ntot+1)."""
        d_base, _ = self.dicts[kind]
        ov = self.overlay[kind]
        n_tot = self._n_total(kind)
        qd = qg @ d_base.T  # (B, H, G, N)
        pad = qd.new_zeros(*qd.shape[:-1], n_tot + 1 - self.n_atoms)
        qd = torch.cat([qd, pad], -1)
        if ov.ids.shape[1]:
            ids = torch.where(ov.ids >= 0, ov.ids, n_tot)  # free slots write the spare column
            q_ov = torch.einsum("bhgd,brd->bhgr", qg, ov.vectors)  # (B, H, G, R)
            qd.scatter_(-1, ids[:, None, None, :].expand_as(q_ov), q_ov)
            qd[..., n_tot] = 0
        return qd

    def _values_from_atoms(self, kind: str, w_atoms: torch.Tensor) -> torch.Tensor:
        """w_atoms (B, H, G, Ntot+1) -> Σ weight·atom (B, H, G, d), overlay atoms replacing their base atoms."""
        d_base, _ = self.dicts[kind]
        ov = self.overlay[kind]
        if ov.ids.shape[1] == 0:
            return w_atoms[..., : self.n_atoms] @ d_base
        ids = torch.where(ov.ids >= 0, ov.ids, self._n_total(kind))[:, None, None, :].expand(*w_atoms.shape[:-1], -1)
        w_ov = w_atoms.gather(-1, ids)  # (B, H, G, R)
        w_base = w_atoms.scatter(-1, ids, 0.0)
        return w_base[..., : self.n_atoms] @ d_base + torch.einsum("bhgr,brd->bhgd", w_ov, ov.vectors)

    def _attention(self, query, mask, scaling):
        b, hq, q, d = query.shape
        t = self.coded_pos.shape[1]
        if t == 0:  # nothing coded yet (the prompt's own forward): plain SDPA over the dense tier, as `full` runs it
            out = dense_attention(query, self.keys.to(query.dtype), self.values.to(query.dtype), mask, scaling,
                                  positions=self.dense_pos)
            return out.nan_to_num(0.0)  # a left-padding query sees nothing: keep its (never used) output finite
        h = self.kv_heads
        g = hq // h
        # (B, H, g*q, d): query heads grouped under their KV head, scaled once here rather than every score
        qg = query.float().reshape(b, h, g * q, d) * scaling
        dense_scores = qg @ self.keys.float().transpose(-1, -2)  # (B, H, gq, S)
        if self.rope is not None:
            scores = torch.cat([self._prerope_scores(qg), dense_scores], -1)
            positions = torch.cat([self.coded_pos, self.dense_pos], 1)
        else:
            k_idx, k_st, k_sc = self.codes["k"]
            k_scores = coded.coded_scores(self._atom_scores("k", qg), k_idx, coded.dequantize(k_st, k_sc))
            if self.key_mean is not None:
                k_scores = k_scores + qg @ self.key_mean[None, :, :, None].float()  # (B, H, gq, 1)
            scores = torch.cat([k_scores, dense_scores], -1)
            positions = torch.cat([self.coded_pos, self.dense_pos], 1)
        allowed = self._allowed(mask, positions, q, scores.shape[-1], query.device)
        if allowed is not None:
            allowed = allowed.expand(b, q, allowed.shape[-1]).view(b, 1, 1, q, -1).expand(b, h, g, q, allowed.shape[-1]).reshape(b, h, g * q, -1)
            scores = scores.masked_fill(~allowed, float("-inf"))
        w = torch.softmax(scores, dim=-1)  # (B, H, gq, T+S)
        if allowed is not None:
            # A left-padding query sees nothing: its softmax is NaN. Its weights become 0, so its output (and the keys
            # and values the next layer computes for that padding) stay finite: a NaN coded there would reach the
            # whole row through the per-atom value sums (0 x NaN).
            w = w.nan_to_num(0.0)
        out = w[..., t:] @ self.values.float()  # (B, H, gq, d)
        if q > 1:  # several query positions (a follow-up prompt) share each rebuilt value: rebuild chunk by chunk
            out = out + self._rebuilt_values(w[..., :t])
        else:  # decoding: weights summed per atom, one product with the value dictionary
            v_idx, v_st, v_sc = self.codes["v"]
            w_coded = w[..., :t] if v_sc is None else w[..., :t] * v_sc.float().transpose(-1, -2)  # scales folded in
            w_atoms = coded.atom_weights(w_coded, v_idx.long(), coded.dequantize(v_st, None), self._n_total("v") + 1)
            out = out + self._values_from_atoms("v", w_atoms)
        return out.view(b, h, g, q, d).reshape(b, hq, q, d).transpose(1, 2).to(query.dtype).contiguous()

    def _rebuilt_chunks(self, kind: str):
        """Yield (slice, vectors (B, H, Tc, d)) for each chunk of SCORE_CHUNK coded tokens, rebuilt from their codes
        with one fused gather-and-weighted-sum (`embedding_bag`, every row and KV head in one call). The caller uses
        a chunk and drops it before the next, so no dense copy of the past is ever kept."""
        idx, stored, scale = self.codes[kind]
        atoms = self._atom_table(kind)  # (B, Ntot + 1, d)
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
        for part, values in self._rebuilt_chunks("v"):
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
        for part, keys in self._rebuilt_chunks("k"):  # keys (B, H, Tc, d), in pair order like the atoms
            if mean is not None:
                keys += mean
            turn_pairs(keys, turns[:, None, part])  # RoPE at each position
            out[..., part] = qp @ keys.transpose(-1, -2)  # (B, H, G, Tc)
        return out

    def _rope_table(self) -> torch.Tensor:
        """RoPE turns (B, T, dim/2) complex of the coded tokens' positions. Layers with the same RoPE and window code
        the same positions, so the table is computed by the first of them in a forward and reused by the others (kept
        only until the next step)."""
        if self.rope_memo.get("seen") != self.seen:
            self.rope_memo.clear()
            self.rope_memo["seen"] = self.seen
        key = (id(self.rope), self.sliding, self.coded_pos.shape[1])
        if key not in self.rope_memo:
            self.rope_memo[key] = phasors(self.coded_pos, self.rope)
        return self.rope_memo[key]

    def _atom_table(self, kind: str) -> torch.Tensor:
        """(B, Ntot, d): the atoms each row sees, the shared dictionary patched by the row's overlay."""
        d_base, _ = self.dicts[kind]
        ov = self.overlay[kind]
        n_tot = self._n_total(kind)
        table = torch.cat([d_base, d_base.new_zeros(n_tot - self.n_atoms + 1, d_base.shape[1])]).expand(self.batch, -1, -1)
        if not ov.ids.shape[1]:
            return table
        ids = torch.where(ov.ids >= 0, ov.ids, n_tot)  # free slots write the spare last row
        return table.scatter(1, ids[..., None].expand_as(ov.vectors), ov.vectors)

    @staticmethod
    def _allowed(mask, positions, q, width, device):
        """Boolean (B|1, q, width) of which stored tokens each query may see, or None when all may. positions (B, width)
        are the stored tokens' virtual positions; a hole (-1) is never seen."""
        holes = positions < 0
        if mask is not None:
            m = gather_mask(mask, positions.clamp(min=0))[:, 0]  # (B, q, width)
            m = m if m.dtype == torch.bool else m == 0
            return m & ~holes[:, None, :]
        allowed = None
        if q > 1:
            allowed = causal_tail(q, width, device)[None]
        if bool(holes.any()):
            allowed = (~holes[:, None, :]) if allowed is None else allowed & ~holes[:, None, :]
        return allowed

    # ---- coding ---------------------------------------------------------------------------------------------
    def _compress(self, prefill: bool) -> None:
        """Code each row's oldest dense tokens beyond its sinks and buffer, on the row's own schedule (as if it ran
        alone): a prefill codes all of them, a decode step a whole number of chunks once a chunk has gathered. Rows
        stay rectangular by holes (position -1, masked) at the front of each tier; left padding is dropped, not coded."""
        pad = self.pad if self.pad is not None else torch.zeros(self.batch, dtype=torch.long, device=self.keys.device)
        real = self.dense_pos >= pad[:, None]  # (B, S) real tokens; holes (-1) and left padding are not
        plan = []  # per row: (sinks, tokens to code, real dense columns in order)
        for b, n in enumerate(real.sum(1).tolist()):
            sinks = min(self.cfg.sinks, n)
            codeable = n - sinks - self.cfg.buffer
            if codeable <= 0 or (not prefill and codeable < self.cfg.chunk):
                codeable = 0
            elif not prefill:
                codeable -= codeable % self.cfg.chunk
            plan.append((sinks, codeable, real[b].nonzero().squeeze(-1)))
        if not any(c for _, c, _ in plan):
            return
        t0 = time.perf_counter()
        code = [cols[s : s + c] for s, c, cols in plan]
        keep = [torch.cat([cols[:s], cols[s + c :]]) for s, c, cols in plan]
        xs = {"k": [], "v": []}
        for b, cols in enumerate(code):
            k = self.keys[b][:, cols].float()  # (H, c_b, d)
            if self.rope is not None:  # keys=pre-rope: code the key as k_proj wrote it, in pair order
                k = turn_pairs(to_pairs(k, self.rope.dim), phasors(self.dense_pos[b, cols], self.rope, inverse=True))
            if self.key_mean is not None:
                k = k - self.key_mean[:, None, :]
            xs["k"].append(k)
            xs["v"].append(self.values[b][:, cols].float())
        width = max(len(c) for c in code)
        for kind in "kv":
            idx, coef = self._code(kind, xs[kind], width)
            st, sc = coded.quantize(coef, self.cfg.coef)
            old = self.codes[kind]
            self.codes[kind] = [torch.cat([old[0], idx.to(old[0].dtype)], 2), torch.cat([old[1], st], 2),
                                None if sc is None else torch.cat([old[2], sc], 2)]
        self.coded_pos = torch.cat([self.coded_pos, self._holed(self.dense_pos, code)], 1)
        index, valid = _left_holed(keep)  # (B, S') gather index and which entries are real
        self.keys, self.values = gather_tokens(self.keys, index), gather_tokens(self.values, index)
        self.dense_pos = self.dense_pos.gather(1, index).masked_fill(~valid, -1)
        self.coding_s += time.perf_counter() - t0

    def _holed(self, pos: torch.Tensor, cols: list[torch.Tensor]) -> torch.Tensor:
        """Positions (B, width) of each row's chosen columns, -1 for the holes in front of a shorter row."""
        index, valid = _left_holed(cols)
        return pos.gather(1, index).masked_fill(~valid, -1)

    def _n_total(self, kind: str) -> int:
        ov = self.overlay[kind]
        return max(self.n_atoms, int(ov.ids.max()) + 1 if ov.ids.numel() else 0)

    def _row_dictionary(self, kind: str, row: int):
        """The (Ntot, d) atoms and Gram this row codes with: the shared ones, patched by the row's overlay."""
        d_base, g_base = self.dicts[kind]
        ov = self.overlay[kind]
        live = ov.ids[row] >= 0
        if not bool(live.any()):
            return d_base, g_base
        ids, vecs = ov.ids[row][live], ov.vectors[row][live]
        n_tot = max(self.n_atoms, int(ids.max()) + 1)
        if n_tot == self.n_atoms:  # adapt=fixed: replaced atoms only, so copies of the shared tensors are patched
            atoms, gram = d_base.clone(), g_base.clone()
        else:
            atoms = torch.cat([d_base, d_base.new_zeros(n_tot - self.n_atoms, d_base.shape[1])])
            gram = torch.zeros(n_tot, n_tot, device=g_base.device)
            gram[: self.n_atoms, : self.n_atoms] = g_base
        atoms[ids] = vecs
        rows = atoms[ids] @ atoms.T  # (R, Ntot)
        gram[ids] = rows
        gram[:, ids] = rows.T
        return atoms, gram

    def _coder(self, kind, x, atoms, gram):
        s = self.cfg.atoms_per_vector(kind)
        if self.cfg.coder == "omp":
            return omp(x, atoms, s, gram=gram)
        return screen(x, atoms, s, n=self.cfg.pool, gram=gram, shots=self.cfg.shots, pick=self.cfg.pick)

    def _code(self, kind: str, xs: list[torch.Tensor], width: int):
        """xs: per row (H, m_b, d) fp32 -> idx, coef (B, H, width, s), each row's codes after holes (atom 0,
        coefficient 0) that fill it to `width`. Adapts each row's dictionary when asked; holes are never coded."""
        s = self.cfg.atoms_per_vector(kind)
        h, d = xs[0].shape[0], xs[0].shape[-1]
        out_idx = torch.zeros(self.batch, h, width, s, dtype=torch.long, device=xs[0].device)
        out_coef = torch.zeros(self.batch, h, width, s, device=xs[0].device)
        for row, x in enumerate(xs):
            m = x.shape[1]
            if m == 0:
                continue
            flat = x.reshape(h * m, d)
            atoms, gram = self._row_dictionary(kind, row)
            idx, coef = self._coder(kind, flat, atoms, gram)
            err = _relative_error(flat, atoms, idx, coef)
            if self.cfg.adapt != "none":
                idx, coef, err = self._adapt(kind, row, flat, atoms, idx, coef, err)
            self.residual_sum += float(err.sum())
            self.coded_vectors += flat.shape[0]
            self._count(kind, row, idx)
            out_idx[row, :, width - m :] = idx.view(h, m, -1)
            out_coef[row, :, width - m :] = coef.view(h, m, -1)
        return out_idx, out_coef

    def _count(self, kind, row, idx):
        n_tot = self._n_total(kind)
        for table, fill in ((self.refcount, 0), (self.last_used, -1)):
            if table[kind].shape[1] < n_tot:
                grow = table[kind].new_full((self.batch, n_tot - table[kind].shape[1]), fill)
                table[kind] = torch.cat([table[kind], grow], 1)
        flat = idx.reshape(-1)
        self.refcount[kind][row].scatter_add_(0, flat, torch.ones_like(flat))
        self.last_used[kind][row, flat] = self.seen

    def _adapt(self, kind, row, x, atoms, idx, coef, err):
        """Turn the residuals of the worst-coded vectors into atoms (replacing inactive ones), then re-code them.
        Returns idx, coef and the relative errors err (M,), updated where vectors were re-coded."""
        bad = (err > self.cfg.tau).nonzero().flatten()
        if len(bad) == 0:
            return idx, coef, err
        bad = bad[err[bad].argsort(descending=True)][: self.cfg.max_new]
        res = x[bad] - reconstruct(atoms, idx[bad], coef[bad])  # (nb, d)
        placed = 0
        n_tot = self._n_total(kind)
        counts = torch.zeros(n_tot, dtype=torch.long, device=x.device)
        counts[: self.refcount[kind].shape[1]] += self.refcount[kind][row][:n_tot]
        counts.scatter_add_(0, idx.reshape(-1), torch.ones_like(idx.reshape(-1)))
        last = torch.full((n_tot,), -1, dtype=torch.long, device=x.device)
        last[: self.last_used[kind].shape[1]] = self.last_used[kind][row][:n_tot]
        for i in range(len(bad)):
            if self.cfg.adapt == "fixed":
                free = (counts == 0).nonzero().flatten()
                if len(free) == 0:
                    break
                atom = int(free[last[free].argmin()])
            else:
                atom = self._n_total(kind)
                counts = torch.cat([counts, counts.new_zeros(1)])
                last = torch.cat([last, last.new_full((1,), -1)])
            self.overlay[kind].put(row, atom, res[i] / res[i].norm().clamp(min=1e-8))
            counts[atom] = 1  # reserved: the next bad vector must not take it
            self.replaced += 1
            placed += 1
        if placed == 0:  # no inactive atom to replace: re-coding would give the same codes
            return idx, coef, err
        atoms, gram = self._row_dictionary(kind, row)
        new_idx, new_coef = self._coder(kind, x[bad], atoms, gram)
        idx, coef, err = idx.clone(), coef.clone(), err.clone()
        idx[bad], coef[bad] = new_idx, new_coef
        err[bad] = _relative_error(x[bad], atoms, new_idx, new_coef)  # other codes use no replaced atom
        return idx, coef, err


def _left_holed(cols: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row column lists -> (index (B, width), valid (B, width)): each row's columns right-aligned, holes in front
    (index 0, not valid), width the longest row's."""
    width = max(len(c) for c in cols)
    device = cols[0].device
    index = torch.zeros(len(cols), width, dtype=torch.long, device=device)
    valid = torch.zeros(len(cols), width, dtype=torch.bool, device=device)
    for b, c in enumerate(cols):
        if len(c):
            index[b, width - len(c) :] = c
            valid[b, width - len(c) :] = True
    return index, valid


def _relative_error(x, atoms, idx, coef) -> torch.Tensor:
    """||x - D c|| / ||x|| per row of x (M, d) for codes idx, coef (M, s) over atoms (N, d)."""
    return (x - reconstruct(atoms, idx, coef)).norm(dim=-1) / x.norm(dim=-1).clamp(min=1e-8)


class FadkvCache(KVCache):
    def stats(self) -> dict:
        layers = [lay for lay in self.layers if lay.is_initialized]
        if not layers:
            return {}
        coded_vecs = sum(lay.coded_vectors for lay in layers)
        coded_tokens = layers[0].coded_pos.shape[1]
        active = sum(int((lay.refcount[k] > 0).sum()) for lay in layers for k in "kv")
        return {
            "tokens_coded": coded_tokens,
            "mean_residual": round(sum(lay.residual_sum for lay in layers) / coded_vecs, 4) if coded_vecs else 0.0,
            "atoms_replaced": sum(lay.replaced for lay in layers),
            "atoms_active": round(active / (2 * len(layers) * layers[0].batch), 1),
            "dictionary_atoms": max(lay._n_total(k) for lay in layers for k in "kv"),  # per layer and kind, as a row sees it
            "coding_ms_per_token": round(1000 * sum(lay.coding_s for lay in layers) / max(coded_tokens * layers[0].batch, 1), 3),
            "dictionary_shared_bytes": self.method.shared_bytes,
        }


@dataclass
class Fadkv(Method):
    """FAD-KV (Zhu et al., 2026): screening coder, fixed-size adaptive dictionary, attention on the codes."""

    name = "fadkv"
    summary = "FAD-KV: dictionary-coded K/V (screening coder, fixed-size adaptive dictionary), attention on codes"
    needs_dictionary = True
    test_options = {"sparsity": "4", "pool": "8", "buffer": "8", "chunk": "4", "sinks": "2", "tau": "0.3"}
    lossless_options = {"buffer": "100000"}
    sparsity: int = 8
    sparsity_v: int = 0  # atoms per value vector; 0: the same as `sparsity` (keys)
    coef: str = "int8"  # same agreement as fp8 at 4k (0.953 both), and its CPU decode is a plain cast
    coder: str = "screen"
    pool: int = 16
    shots: int = 2
    pick: str = "champions"
    adapt: str = "fixed"
    tau: float = 0.5
    max_new: int = 4
    buffer: int = 128
    chunk: int = 32
    sinks: int = 4
    keys: str = "auto"  # auto: as the dictionary was trained; the default file is the pre-RoPE one when shipped
    preferred_keys: typing.ClassVar[str] = "pre-rope"

    def __post_init__(self):
        check_choice("coef", self.coef, coded.COEF_FORMATS)
        check_choice("keys", self.keys, KEY_OPTIONS)
        check_choice("coder", self.coder, CACHE_CODERS)
        check_choice("adapt", self.adapt, ADAPT)
        check_choice("shots", self.shots, SHOTS)
        check_choice("pick", self.pick, PICKS)
        if self.sparsity_v < 0:
            raise ValueError(f"sparsity_v must be >= 0 (0: the same as sparsity), got {self.sparsity_v}")
        check_positive(sparsity=self.sparsity, pool=self.pool, chunk=self.chunk, max_new=self.max_new, tau=self.tau)
        if self.buffer < 0 or self.sinks < 0:
            raise ValueError("buffer and sinks must be >= 0")
        self.shared_bytes = 0

    def dictionary_keys(self) -> tuple[str, ...]:
        """`keys` when set; with keys=auto the method's preferred mode first, then the other."""
        if self.keys != "auto":
            return (self.keys,)
        return (self.preferred_keys, *(m for m in KEY_MODES if m != self.preferred_keys))

    def atoms_per_vector(self, kind: str) -> int:
        return self.sparsity_v if kind == "v" and self.sparsity_v else self.sparsity

    def make_cache(self, model, dictionaries=None) -> KVCache:
        if dictionaries is None:
            raise UserError(f"method '{self.name}' needs a dictionary trained for this model, and none was given")
        trained = dictionaries.meta.get("keys", "post-rope")
        if self.keys != "auto" and trained != self.keys:
            raise UserError(f"method '{self.name}' with keys={self.keys} needs a dictionary of {self.keys} keys; this one "
                            f"was trained on {trained} keys: use a dictionary trained on {self.keys} keys")
        ropes = layer_ropes(model, f"{self.name} with a pre-RoPE dictionary") if trained == "pre-rope" else None
        windows = attention_windows(model, self.name)
        layers, kv_heads, head_dim = model_layout(model)
        if max(self.sparsity, self.sparsity_v) > dictionaries.keys.shape[1]:
            raise UserError(f"sparsity {max(self.sparsity, self.sparsity_v)} exceeds the dictionary's "
                            f"{dictionaries.keys.shape[1]} atoms")
        prepared = prepare_layers(dictionaries, model.device, paired=[r.dim for r in ropes] if ropes else False)
        self.shared_bytes = sum(tensor_bytes(a) for a in (dictionaries.keys, dictionaries.values))
        memo: dict = {}
        return FadkvCache([FadkvLayer(self, *prepared[i], rope=ropes[i] if ropes else None, rope_memo=memo,
                                      sliding=windows[i]) for i in range(layers)], self)


@dataclass
class Lexico(Fadkv):
    """Lexico (Kim et al., ICML 2025): OMP over the whole dictionary, static dictionary."""

    name = "lexico"
    summary = "Lexico: dictionary-coded K/V with OMP and a static dictionary (the FAD-KV baseline)"
    test_options = {"sparsity": "4", "buffer": "8", "chunk": "4", "sinks": "2"}
    coder: str = "omp"
    adapt: str = "none"
    preferred_keys: typing.ClassVar[str] = "post-rope"  # as Lexico codes them (q·D shared by every token)

