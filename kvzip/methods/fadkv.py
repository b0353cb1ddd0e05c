"""`fadkv` and `lexico`: dictionary-coded KV caches with attention computed on the codes.

FAD-KV (Zhu et al., 2026) and its predecessor Lexico (Kim et al., ICML 2025; arXiv:2412.08890). Per layer and KV head:
- the first `sinks` tokens and the most recent `buffer` tokens stay dense (sinks draw outsized attention, so a
  coding error there costs the most; the buffer absorbs tokens until `code_chunk` of them can be coded at once);
- older tokens are coded as `sparsity` atom indices (int16) and coefficients (fp16, or 8 bits with a scale:
  `coef_format`) over the layer's key or value dictionary. The per-head key mean (stored in the dictionary file) is
  removed before coding. Keys are coded as the dictionary was trained: before RoPE (the default file; RoPE undone at
  coding time) or after it;
- decoding never keeps a dense copy of the past. Post-RoPE scores gather q·D by code and add one q·mean term;
  pre-RoPE scores rebuild one chunk of keys at a time (mean added back, RoPE applied, chunk dropped). Values are
  summed per atom and multiplied by the value dictionary once (kvzip/sparse/attention.py).
FAD-KV's coder is screening (top-n candidates by |Dᵀx|, pursuit on the pool); Lexico's is OMP over all atoms.

Fixed-size adaptation (FAD-KV): per sequence, a reference count per atom over live codes. When a coded vector's
relative residual exceeds `adapt_threshold`, its normalised residual becomes a new atom in place of an inactive one
(count zero, least recently used) and the vector is re-coded. The shared dictionary is never written: a sequence's replaced atoms
live in its own overlay (atom number -> vector), so batched rows cannot corrupt each other, and the dictionary size a
sequence sees stays N. `adapt=append` grows the overlay past N instead (the ablation the paper argues against);
`adapt=none` keeps the dictionary static. Each kind's state (codes, overlay, atom counts) is one
`kvzip.methods.coded.state.CodedKind`; coding and adaptation are kvzip/methods/coded/coding.py. Options and the
measurements behind their defaults: docs/fadkv.md.

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
from kvzip.methods.base import DenseLayer, KVCache, Method, check_choice, check_positive, model_layout, tensor_bytes
from kvzip.methods.coded.coding import ADAPT, CodingStats, code_kinds, left_holed
from kvzip.methods.coded.state import CodedKind
from kvzip.placement import layer_devices
from kvzip.rope import attention_windows, as_rope, layer_ropes, phasors, to_pairs, turn_pairs, visible_from
from kvzip.sparse import CACHE_CODERS, KEY_MODES, KEY_OPTIONS, attention as coded
from kvzip.sparse.dictionary import LayerAtoms, prepare_for_devices
from kvzip.sparse.omp import reconstruct
from kvzip.sparse.screen import PICKS, SHOTS

# pre-RoPE scores rebuild at most this many coded keys at a time (per row and KV head): never a dense copy of the past
SCORE_CHUNK = 2048


class FadkvLayer(DenseLayer):
    """Dense sinks and buffer (keys, values, positions), older tokens coded (`coded_keys`, `coded_values`:
    kvzip.methods.coded.state, at `coded_pos`)."""

    def __init__(self, cfg: "Fadkv", atoms: LayerAtoms, rope=None, rope_memo=None, sliding=None, group=None):
        super().__init__(sliding)
        # the layers this one is coded with, after the last of them has attended (a layer built alone: itself)
        self.group = LayerGroup([self]) if group is None else group
        self.rope = None if rope is None else as_rope(rope)  # this layer's Rope when keys are coded before RoPE
        self.rope_memo = {} if rope_memo is None else rope_memo  # shared by a cache's layers: RoPE tables per step
        self.cfg, self.atoms = cfg, atoms  # atoms: the layer's shared dictionary (with rope, keys in pair order)
        self.key_mean = atoms.key_mean  # (Hkv, d) or None; with rope, in `to_pairs` order

    @property
    def stats(self) -> CodingStats:
        """The coding totals of this layer's group (every layer of a cache)."""
        return self.group.stats

    def dense_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dense tier (sinks + buffer) is kept in half precision when the model runs fp32: it is a cache, not a
        compute buffer."""
        return torch.float16 if dtype == torch.float32 else dtype

    def lazy_initialization(self, key_states, value_states):
        super().lazy_initialization(key_states, value_states)  # keys, values, positions: the dense tier
        b, h = self.batch, self.kv_heads
        self.coded_pos = torch.zeros(b, 0, dtype=torch.long, device=self.device)  # (B, T), -1: a hole
        a, fmt = self.atoms, self.cfg.coef_format
        self.coded_keys = CodedKind(a.keys, a.grams, a.slot, self.cfg.sparsity, fmt, b, h)
        self.coded_values = CodedKind(a.values, a.grams, a.slot + 1, self.cfg.value_sparsity or self.cfg.sparsity, fmt,
                                      b, h)
        self.pad = None  # (B,) left-padding tokens of each row (positions below it are padding), set by the prefill

    @property
    def kinds(self) -> tuple[CodedKind, CodedKind]:
        return self.coded_keys, self.coded_values

    def attend(self, module, query, key, value, mask, scaling):
        if self.pad is None:  # the first forward: what of each row is left padding
            self.pad = leading_padding(mask, self.batch, self.keys.device)
        out = self._attention(query, mask, scaling)
        self.group.attended(self, prefill=query.shape[2] > 1)
        return out

    def memory(self) -> dict[str, int]:
        k, v = (kind.bytes() for kind in self.kinds)
        return {"device": tensor_bytes(self.keys, self.values), "codes": k["codes"] + v["codes"],
                "dictionary": k["dictionary"] + v["dictionary"]}

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
            self.keys, self.values = self.keys[:, :, drop:], self.values[:, :, drop:]
            self.positions = self.positions[:, drop:]

    # ---- attention on codes ---------------------------------------------------------------------------------
    def _attention(self, query, mask, scaling):
        b, hq, q, d = query.shape
        t = self.coded_pos.shape[1]
        if t == 0:  # nothing coded yet (the prompt's own forward): plain SDPA over the dense tier, as `full` runs it
            out = dense_attention(query, self.keys.to(query.dtype), self.values.to(query.dtype), mask, scaling,
                                  positions=self.positions)
            return out.nan_to_num(0.0)  # a left-padding query sees nothing: keep its (never used) output finite
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
            values = self.coded_values
            v_idx, v_st, v_sc = values.codes.idx, values.codes.stored, values.codes.scale
            w_coded = w[..., :t] if v_sc is None else w[..., :t] * v_sc.float().transpose(-1, -2)  # scales folded in
            w_atoms = coded.atom_weights(w_coded, v_idx.long(), coded.dequantize(v_st, None), values.n_total() + 1)
            out = out + values.values_from_atoms(w_atoms)
        return out.view(b, h, g, q, d).reshape(b, hq, q, d).transpose(1, 2).to(query.dtype).contiguous()

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
        """Code this layer's due tokens on its own (the cache codes all its layers together: `LayerGroup`)."""
        compress([self], prefill, self.stats)

    def plan(self, prefill: bool) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Which dense columns each row codes now and which it keeps, on the row's own schedule (as if it ran alone):
        a prefill codes all beyond the sinks and buffer, a decode step a whole number of chunks once a chunk has
        gathered. Left padding is neither coded nor kept. None when no row codes."""
        pad = self.pad if self.pad is not None else torch.zeros(self.batch, dtype=torch.long, device=self.keys.device)
        real = self.positions >= pad[:, None]  # (B, S) real tokens; holes (-1) and left padding are not
        due = []
        for n in real.sum(1).tolist():
            sinks = min(self.cfg.sinks, n)
            codeable = n - sinks - self.cfg.buffer
            if codeable <= 0 or (not prefill and codeable < self.cfg.code_chunk):
                codeable = 0
            elif not prefill:
                codeable -= codeable % self.cfg.code_chunk
            due.append((sinks, codeable))
        if not any(codeable for _, codeable in due):
            return None
        plan = []
        for b, (sinks, codeable) in enumerate(due):
            cols = real[b].nonzero().squeeze(-1)
            plan.append((cols[sinks : sinks + codeable], torch.cat([cols[:sinks], cols[sinks + codeable :]])))
        return plan

    def vectors(self, plan, rows: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The keys and values the plan codes, as the dictionaries hold them: (B', H, width, d) fp32 each for rows
        (B',), each row's right-aligned after zero filler, and which entries are real (B', width). Keys are centred
        (key mean removed) and, for pre-RoPE dictionaries, turned back to how k_proj wrote them, in pair order."""
        h, d = self.kv_heads, self.keys.shape[-1]
        keys = torch.zeros(len(rows), h, width, d, device=self.keys.device)
        values, real = torch.zeros_like(keys), torch.zeros(len(rows), width, dtype=torch.bool, device=keys.device)
        for i, b in enumerate(rows):
            cols = plan[b][0]
            if not len(cols):
                continue
            k = self.keys[b][:, cols].float()  # (H, c_b, d)
            if self.rope is not None:
                k = turn_pairs(to_pairs(k, self.rope.dim), phasors(self.positions[b, cols], self.rope, inverse=True))
            if self.key_mean is not None:
                k = k - self.key_mean[:, None, :]
            keys[i, :, width - len(cols) :] = k
            values[i, :, width - len(cols) :] = self.values[b][:, cols].float()
            real[i, width - len(cols) :] = True
        return keys, values, real

    def store(self, plan, codes: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keep the codes (idx, coef (B, H, width, s) for keys, then values) of the plan's tokens and drop those
        tokens from the dense tier. Rows stay rectangular by holes (position -1, masked) at the front of each tier."""
        for kind, (idx, coef) in zip(self.kinds, codes):
            kind.codes.append(idx, coef, self.cfg.coef_format)
        self.coded_pos = torch.cat([self.coded_pos, self._holed(self.positions, [code for code, _ in plan])], 1)
        self._compact_codes()
        index, valid = left_holed([keep for _, keep in plan])  # (B, S') gather index and which entries are real
        self.keys, self.values = gather_tokens(self.keys, index), gather_tokens(self.values, index)
        self.positions = self.positions.gather(1, index).masked_fill(~valid, -1)

    def _compact_codes(self) -> None:
        """Each row's real coded tokens right-aligned, holes in front, the tier as wide as its fullest row. Rows of a
        batch code on their own schedules, so each compress leaves holes in the rows that coded less; without this
        they would pile up, a chunk's width per row out of phase (8 rows: the coded tier 1.5x a full cache)."""
        real = self.coded_pos >= 0  # (B, T)
        width = int(real.sum(1).max())
        if width == real.shape[1]:
            return
        index, valid = left_holed([row.nonzero().squeeze(-1) for row in real])  # (B, width)
        for kind in self.kinds:
            kind.codes.gather(index)
        self.coded_pos = self.coded_pos.gather(1, index).masked_fill(~valid, -1)

    def _holed(self, pos: torch.Tensor, cols: list[torch.Tensor]) -> torch.Tensor:
        """Positions (B, width) of each row's chosen columns, -1 for the holes in front of a shorter row."""
        index, valid = left_holed(cols)
        return pos.gather(1, index).masked_fill(~valid, -1)


# the most vectors (per kind, over layers, rows and heads) built for one coder call: a decode step of every layer
# (30 x 8 x 96 for SmolLM2 at batch 8) fits; a long prompt's prefill is coded a few layers at a time
MAX_VECTORS = 1 << 16


def compress(layers: list[FadkvLayer], prefill: bool, stats: CodingStats) -> None:
    """Code the due tokens of all `layers` (`FadkvLayer.plan`) in as few coder calls as MAX_VECTORS allows: keys and
    values of every layer and row together when their sparsity is the same. Each layer then stores its codes."""
    plans = [(layer, plan) for layer in layers if (plan := layer.plan(prefill)) is not None]
    if not plans:
        return
    t0 = time.perf_counter()
    batch = layers[0].batch
    rows = [b for b in range(batch) if any(len(plan[b][0]) for _, plan in plans)]
    width = max(len(plan[b][0]) for _, plan in plans for b in rows)
    row_index = torch.tensor(rows, device=layers[0].keys.device)
    per_layer = len(rows) * layers[0].kv_heads * width
    step = max(1, MAX_VECTORS // per_layer)
    cfg = layers[0].cfg
    for start in range(0, len(plans), step):
        part = plans[start : start + step]
        built = [layer.vectors(plan, rows, width) for layer, plan in part]  # (keys, values, real) per layer
        kinds = [kind for layer, _ in part for kind in layer.kinds]  # keys, values of each layer
        x = [v for keys, values, _ in built for v in (keys, values)]  # (B', H, width, d) each
        real = [r[:, None, :].expand(-1, x[0].shape[1], -1) for _, _, r in built for _ in (0, 1)]
        codes = [None] * len(kinds)
        calls = [range(len(kinds))] if len({kind.sparsity for kind in kinds}) == 1 else [range(0, len(kinds), 2),
                                                                                          range(1, len(kinds), 2)]
        for call in calls:
            xs = torch.stack([x[i] for i in call]).flatten(2, 3)  # (L, B', H·width, d)
            rs = torch.stack([real[i] for i in call]).flatten(2, 3)
            idx, coef = code_kinds([kinds[i] for i in call], row_index, xs, rs, cfg, stats, part[0][0].seen)
            for j, i in enumerate(call):
                codes[i] = (_full_rows(idx[j], row_index, batch, width), _full_rows(coef[j], row_index, batch, width))
        for n, (layer, plan) in enumerate(part):
            layer.store(plan, codes[2 * n : 2 * n + 2])
    stats.seconds += time.perf_counter() - t0


def _full_rows(codes: torch.Tensor, rows: torch.Tensor, batch: int, width: int) -> torch.Tensor:
    """codes (B', H·width, s) of rows (B',) -> (B, H, width, s), zero (holes) in the rows that coded nothing."""
    out = codes.new_zeros(batch, codes.shape[1] // width, width, codes.shape[-1])
    out[rows] = codes.view(len(rows), -1, width, codes.shape[-1])
    return out


class LayerGroup:
    """The layers of one cache on one device, coded together: when the last of them has attended in a forward, every
    layer's due tokens are coded in one pass (a layer's coding only changes what its next forward sees, so deferring
    it to the end of this one changes nothing), then sliding-window layers drop what their next query cannot see.
    The groups of a cache split over devices share one CodingStats."""

    def __init__(self, layers: list[FadkvLayer], stats: CodingStats | None = None):
        self.layers, self.stats = layers, CodingStats() if stats is None else stats

    def attended(self, layer: FadkvLayer, prefill: bool) -> None:
        if layer is not self.layers[-1]:
            return
        compress(self.layers, prefill, self.stats)
        for lay in self.layers:
            if lay.sliding is not None:
                lay._slide()


class FadkvCache(KVCache):
    def __init__(self, layers: list[FadkvLayer], method: "Fadkv", shared_bytes: int):
        super().__init__(layers, method)
        self.shared_bytes = shared_bytes  # the shared dictionary: reported apart, not counted as cache, like weights

    def stats(self) -> dict:
        layers = [lay for lay in self.layers if lay.is_initialized]
        if not layers:
            return {}
        totals = layers[0].stats  # one CodingStats for the whole cache (LayerGroup)
        coded_tokens = layers[0].coded_pos.shape[1]
        active = sum(int((kind.refcount > 0).sum()) for lay in layers for kind in lay.kinds)
        return {
            "tokens_coded": coded_tokens,
            "mean_residual": round(totals.residual_sum / max(totals.vectors, 1), 4),
            "atoms_replaced": totals.replaced,
            "atoms_active": round(active / (2 * len(layers) * layers[0].batch), 1),
            "dictionary_atoms": max(kind.n_total() for lay in layers for kind in lay.kinds),  # as a row sees it
            "coding_ms_per_token": round(1000 * totals.seconds / max(coded_tokens * layers[0].batch, 1), 3),
            "dictionary_shared_bytes": self.shared_bytes,
        }


@dataclass
class Fadkv(Method):
    """FAD-KV (Zhu et al., 2026): screening coder, fixed-size adaptive dictionary, attention on the codes."""

    name = "fadkv"
    summary = "FAD-KV: dictionary-coded K/V (screening coder, fixed-size adaptive dictionary), attention on codes"
    needs_dictionary = True
    test_options = {"sparsity": "4", "screen_pool": "8", "buffer": "8", "code_chunk": "4", "sinks": "2",
                    "adapt_threshold": "0.3"}
    lossless_options = {"buffer": "100000"}
    sparsity: int = 8
    value_sparsity: int = 0  # atoms per value vector; 0: the same as `sparsity` (keys)
    coef_format: str = "int8"  # same agreement as fp8 at 4k (0.953 both), and its CPU decode is a plain cast
    coder: str = "screen"
    screen_pool: int = 16
    screen_shots: int = 2
    screen_pick: str = "champions"
    adapt: str = "fixed"
    adapt_threshold: float = 0.5
    max_new_atoms: int = 4
    buffer: int = 128
    code_chunk: int = 32
    sinks: int = 4
    keys: str = "auto"  # auto: as the dictionary was trained; the default file is the pre-RoPE one when shipped
    preferred_keys: typing.ClassVar[str] = "pre-rope"

    def __post_init__(self):
        check_choice("coef_format", self.coef_format, coded.COEF_FORMATS)
        check_choice("keys", self.keys, KEY_OPTIONS)
        check_choice("coder", self.coder, CACHE_CODERS)
        check_choice("adapt", self.adapt, ADAPT)
        check_choice("screen_shots", self.screen_shots, SHOTS)
        check_choice("screen_pick", self.screen_pick, PICKS)
        if self.value_sparsity < 0:
            raise ValueError(f"value_sparsity must be >= 0 (0: the same as sparsity), got {self.value_sparsity}")
        check_positive(sparsity=self.sparsity, screen_pool=self.screen_pool, code_chunk=self.code_chunk,
                       max_new_atoms=self.max_new_atoms, adapt_threshold=self.adapt_threshold)
        if self.buffer < 0 or self.sinks < 0:
            raise ValueError("buffer and sinks must be >= 0")

    def dictionary_keys(self) -> tuple[str, ...]:
        """`keys` when set; with keys=auto the method's preferred mode first, then the other."""
        if self.keys != "auto":
            return (self.keys,)
        return (self.preferred_keys, *(m for m in KEY_MODES if m != self.preferred_keys))

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
        if max(self.sparsity, self.value_sparsity) > dictionaries.num_atoms:
            raise UserError(f"sparsity {max(self.sparsity, self.value_sparsity)} exceeds the dictionary's "
                            f"{dictionaries.num_atoms} atoms")
        devices = layer_devices(model)  # a model split over devices: each layer's atoms, codes and group on its own
        prepared = prepare_for_devices(dictionaries, devices, paired=[r.dim for r in ropes] if ropes else False)
        shared = sum(tensor_bytes(a) for a in (dictionaries.keys, dictionaries.values))
        stats, groups, memos, built = CodingStats(), {}, {}, []
        for i, device in enumerate(devices):
            group = groups.setdefault(device, LayerGroup([], stats))
            group.layers.append(FadkvLayer(self, prepared[i], rope=ropes[i] if ropes else None,
                                           rope_memo=memos.setdefault(device, {}), sliding=windows[i], group=group))
            built.append(group.layers[-1])
        return FadkvCache(built, self, shared)


@dataclass
class Lexico(Fadkv):
    """Lexico (Kim et al., ICML 2025): OMP over the whole dictionary, static dictionary."""

    name = "lexico"
    summary = "Lexico: dictionary-coded K/V with OMP and a static dictionary (the FAD-KV baseline)"
    test_options = {"sparsity": "4", "buffer": "8", "code_chunk": "4", "sinks": "2"}
    coder: str = "omp"
    adapt: str = "none"
    preferred_keys: typing.ClassVar[str] = "post-rope"  # as Lexico codes them (q·D shared by every token)

