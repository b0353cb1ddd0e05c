"""`zoomr`: ZoomR (Yang et al., ACL 2026): thoughts indexed by summaries, zoom-in to the few thoughts a query needs.

Reasoning is cut into thoughts while decoding (`on_step` watches each row's text; a thought ends at a paragraph break
by default). Each finished thought keeps a summary on the device: `r` representative tokens (`summary=pooled`,
training-free) or the tokens the model wrote between summary markers (`summary=generated`). Its index is the mean
of its summary keys per layer and KV head (`index=mean`), or the summary keys themselves (`index=max`: a thought
scores the largest of the query's logits with its summary keys, i.e. the attention logits the model itself computes
for those tokens, rather than the logit of a mean of keys rotated to different positions); `index_space=content`
scores with RoPE undone on both sides. Every thought's full K/V (the detail) goes off the device, to CPU memory
(pinned, with non-blocking copies on CUDA): `detail=int8` (default) as int8 with one scale per vector, half the
bytes of bf16 and a quarter of fp32, so that device and host together hold less than a full cache;
`detail=host` as dense copies in the compute dtype (the paper's setting); `detail=fadkv` as sparse codes over the
FAD-KV dictionary of kvzip/methods/fadkv.py, ~8x fewer host bytes, reconstructed with coding error when zoomed in.

Zoom-in, and why it is applied one step late: at a selection point every query head of every layer scores the index
keys and votes for its top-`k` thoughts; the `c` most-voted thoughts (votes summed over heads and layers) are zoomed
in. Layer L attends before layer L+1 has even computed its query, so the consensus can only exist after the whole
forward. The votes are therefore cast during the forward of the token that ends a sentence/thought and the new
selection is applied from the next forward on (the paper recomputes selection only at semantic boundaries, so the
zoom set is constant in between anyway; `select=token` votes at every step, still one step late).

Active context on the device, per row = prompt (its own segment, kept in full; it holds the attention sinks) + all
summaries + the zoomed thoughts' full K/V + the recent tail (the last `window` tokens and the whole unfinished
thought). Rows of a left-padded batch have their own thoughts; the device buffer is padded per row (position -1).

Models with more than one kind of layer (Gemma 3's sliding-window and global layers): each layer turns keys back
by its own RoPE (kvzip.rope), and a sliding-window layer applies all of the above within its window only: its
active context drops whatever its next query can no longer see, its detail of a thought goes once the thought has
left the window, and it votes only for thoughts still (partly) inside the window.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import torch

from kvzip.attention import causal_tail, gather_mask, leading_padding
from kvzip.errors import UserError
from kvzip.methods.base import KVCache, KVLayer, Method, check_choice, check_positive, model_layout, tensor_bytes
from kvzip.rope import attention_windows, layer_ropes, unrotate, visible_from
from kvzip.sparse.omp import omp, reconstruct

_SENTENCE_END = re.compile(r"[.!?][\"')\]]?\s")


def centre_index(keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """index_norm=centered: keys (B, Hkv, T, R, d) minus their mean over each row's real thoughts, then unit length.

    What every thought's summary shares (the words of the task that recur in each note, the common direction of a
    head's keys) scores the same for all thoughts and only decides which thought wins when the query is about
    nothing in particular: the thought that stated those words first then collects the votes. Removing the mean
    leaves what tells thoughts apart; unit length stops a long key from winning on its norm alone.
    """
    w = valid[:, None, :, :, None].to(keys.dtype)  # (B, 1, T, R, 1)
    mean = (keys * w).sum((2, 3), keepdim=True) / w.sum((2, 3), keepdim=True).clamp(min=1)
    return torch.nn.functional.normalize((keys - mean) * w, dim=-1)


def parse_boundary(spec: str) -> tuple[tuple[str, ...], frozenset[int]]:
    """'\\n\\n|id:198' -> (strings, token ids): items split on '|', backslash escapes decoded, 'id:N' is a token id."""
    strings, ids = [], set()
    for item in spec.split("|"):
        if item.startswith("id:") and item[3:].isdigit():
            ids.add(int(item[3:]))
        elif item:
            strings.append(item.encode().decode("unicode_escape"))
    if not strings and not ids:
        raise ValueError(f"boundary={spec!r} names no string or token id")
    return tuple(strings), frozenset(ids)


RANK_QUANTUM = 1e-4  # scores closer than this rank as equal: float noise of a batch's padding must not flip a choice


def ranked(scores: torch.Tensor) -> torch.Tensor:
    """Indices of `scores` (..., n) from highest to lowest, ties (within RANK_QUANTUM) to the lowest index. topk leaves
    ties unordered, and summary picks and votes meet exact ties (a thought repeating earlier text scores 0 throughout)
    and near ties (the same row in another batch computes through other padding): either would make a row choose
    differently in a batch than alone."""
    return torch.sort(torch.round(scores / RANK_QUANTUM), dim=-1, descending=True, stable=True).indices


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., d) -> (int8 codes (..., d), fp16 scale (..., 1)): symmetric, one scale per vector (its largest |x|)."""
    scale = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-8) / 127
    return (x.float() / scale).round().clamp(-127, 127).to(torch.int8), scale.half()


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.float()).to(dtype)


class Row:
    """One batch row's segmentation: prompt ranges, finished thoughts, the open thought, the zoom set."""

    def __init__(self, pad: int, end: int):
        self.keep = [(pad, end)]  # kept in full: the prompt (and any later multi-token input)
        self.thoughts: list[tuple[int, int]] = []  # finished thoughts' detail ranges [start, end)
        self.spans: list[tuple[int, int] | None] = []  # generated summary span of each thought (None: pooled)
        self.cur = end  # first position of the open thought
        self.text, self.char_pos = "", []  # open thought's text; (position, char end) per token
        self.summary_start: int | None = None
        self.zoom: list[int] = []
        self.tail_from = end  # first tail position kept at the last rebuild


class ZoomRLayer(KVLayer):
    def __init__(self, cache: "ZoomRCache", idx: int, rope=None, sliding: int | None = None):
        super().__init__(sliding)
        self.cache, self.idx, self.version = cache, idx, 0
        self.rope = rope  # this layer's Rope, for index_space=content and pick=novel

    def lazy_initialization(self, key_states, value_states):
        super().lazy_initialization(key_states, value_states)
        self.keys = key_states[:, :, :0]  # (B, Hkv, S, d) active context
        self.values = value_states[:, :, :0]
        self.pos = torch.empty(self.batch, 0, dtype=torch.long, device=self.device)  # (B, S), -1 = empty slot
        self.received = torch.empty(self.batch, 0, device=self.device)  # (B, S) attention received (pick=attention)
        self.summary_pos = [[] for _ in range(self.batch)]  # per row, per thought: (r,) positions kept on device
        self.index = [[] for _ in range(self.batch)]  # per row, per thought: (Hkv, 1 or r, d) index keys
        self.detail = [[] for _ in range(self.batch)]  # per row, per thought: K and V parts off the device
        self.stacked = None  # (index keys (B, Hkv, T, R, d), valid (B, T, R)) built lazily
        self.host_bytes = 0

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[2]
        self.keys = torch.cat([self.keys, key_states], dim=2)
        self.values = torch.cat([self.values, value_states], dim=2)
        new = torch.arange(self.seen, self.seen + q, device=self.device).expand(self.batch, q)
        self.pos = torch.cat([self.pos, new], dim=1)
        self.received = torch.cat([self.received, self.received.new_zeros(self.batch, q)], dim=1)
        self.seen += q
        return self.keys, self.values

    def attend(self, module, query, key, value, mask, scaling):
        c = self.cache
        if self.idx == 0:
            c.begin_forward(mask, query.shape[2], self.batch, self.device)
        t0 = time.perf_counter()
        if self.version != c.version:
            self._rebuild(visible_from(self.seen - query.shape[2], self.sliding))
        c.overhead_s += time.perf_counter() - t0
        out = self._attention(query, mask, scaling)
        t0 = time.perf_counter()
        for b, t in c.finishing:
            self._finalize(b, t)
        if c.any_voting:
            self._vote(query[:, :, -1])
        if self.sliding is not None:
            self._slide()
        c.overhead_s += time.perf_counter() - t0
        return out

    def _slide(self):
        """Sliding-window layer, after attending: drop what the next query cannot see (the buffer's oldest slots:
        each row is sorted with its padding in front) and the detail of thoughts that have left the window."""
        cut = visible_from(self.seen, self.sliding)
        self.pos = self.pos.masked_fill(self.pos < cut, -1)
        drop = int((self.pos < 0).sum(1).min())
        if drop:
            self.keys, self.values = self.keys[:, :, drop:], self.values[:, :, drop:]
            self.pos, self.received = self.pos[:, drop:], self.received[:, drop:]
        for b, row in enumerate(self.cache.rows):
            for t, part in enumerate(self.detail[b]):
                if part is not None and row.thoughts[t][1] <= cut:
                    self.host_bytes -= sum(tensor_bytes(*x) for x in part)
                    self.detail[b][t] = None

    def _attention(self, query, mask, scaling):
        """query (B, Hq, q, d) over the active buffer -> (B, q, Hq, d)."""
        q_len, s = query.shape[2], self.keys.shape[2]
        valid = (self.pos >= 0)[:, None, None, :]  # (B, 1, 1, S)
        if mask is not None:
            m = gather_mask(mask, self.pos.clamp(min=0)) & valid
        else:
            m = valid & causal_tail(q_len, s, valid.device)
        if not self.cache.method_pick_attention:
            out = torch.nn.functional.scaled_dot_product_attention(
                query, self.keys, self.values, attn_mask=m, scale=scaling, enable_gqa=query.shape[1] != self.kv_heads)
            return out.transpose(1, 2).contiguous()
        rep = query.shape[1] // self.kv_heads
        k = self.keys.repeat_interleave(rep, dim=1)  # (B, Hq, S, d)
        w = ((query @ k.transpose(-1, -2)) * scaling).masked_fill(~m, float("-inf")).softmax(-1).nan_to_num()  # (B, Hq, q, S)
        self.received += w.sum((1, 2))
        return (w @ self.values.repeat_interleave(rep, dim=1)).transpose(1, 2).contiguous()

    def _row_index(self, b: int, start: int, end: int) -> torch.Tensor:
        p = self.pos[b]
        return ((p >= start) & (p < end)).nonzero().squeeze(-1)  # buffer slots of positions [start, end)

    def _finalize(self, b: int, t: int):
        """Thought t of row b just ended (all its tokens are in the tail): summary, index key, detail off-device."""
        c, row = self.cache, self.cache.rows[b]
        start, end = row.thoughts[t]
        slots = self._row_index(b, start, end)
        span = row.spans[t]
        if span is not None:
            keep = self._row_index(b, *span)
        else:
            r = min(c.method.r, slots.numel())
            if c.method.pick == "even":
                keep = slots[torch.linspace(0, slots.numel() - 1, r).round().long()]
            else:
                if c.method.pick == "novel":
                    score = self._novelty(b, start, slots)
                elif c.method.pick == "attention":
                    score = self.received[b, slots]
                else:
                    score = self.keys[b, :, slots].norm(dim=-1).sum(0)
                keep = slots[ranked(score)[:r].sort().values]
        self.summary_pos[b].append(self.pos[b, keep])
        summary = self.keys[b, :, keep]  # (Hkv, r, d)
        if c.content_index:  # index_space=content: the keys as k_proj wrote them, before the rotation
            summary = unrotate(summary, self.pos[b, keep], self.rope)
        self.index[b].append(summary if c.method.index == "max" else summary.mean(1, keepdim=True))  # (Hkv, r or 1, d)
        self.stacked = None
        if c.keep_detail:
            self.detail[b].append(self._store(self.keys[b, :, slots], self.values[b, :, slots]))
            self.host_bytes += sum(tensor_bytes(*part) for part in self.detail[b][-1])

    def _novelty(self, b: int, start: int, slots: torch.Tensor) -> torch.Tensor:
        """pick=novel: per token of a finished thought, 1 - the largest cosine of its key with any key on the device
        from before the thought (prompt, earlier summaries), RoPE undone on both, summed over KV heads. Tokens the
        thought shares with what is already kept ("Note", "box") score low; its own content scores high."""
        rope = self.rope
        rows = self.cache.rows
        first = rows[b].keep[0][0] if rows else 0  # the row's first real token: its left padding is no reference
        ref = ((self.pos[b] >= first) & (self.pos[b] < start)).nonzero().squeeze(-1)  # (R,) slots before the thought
        mine = unrotate(self.keys[b, :, slots].float(), self.pos[b, slots], rope)  # (Hkv, n, d)
        if ref.numel() == 0:
            return mine.norm(dim=-1).sum(0)
        seen = unrotate(self.keys[b, :, ref].float(), self.pos[b, ref], rope)  # (Hkv, R, d)
        cos = torch.nn.functional.normalize(mine, dim=-1) @ torch.nn.functional.normalize(seen, dim=-1).transpose(1, 2)
        return (1 - cos.amax(-1)).sum(0)  # (n,)

    def _store(self, k, v):
        """k, v (Hkv, n, d) -> what the detail tier keeps: dense copies (detail=host), int8 with one scale per
        vector (detail=int8), or dictionary codes (detail=fadkv: idx int16, coef fp16)."""
        c = self.cache
        if c.detail == "host":
            return (c.offload(k),), (c.offload(v),)
        if c.detail == "int8":
            return tuple((c.offload(q), c.offload(scale)) for q, scale in map(quantize_int8, (k, v)))
        d_k, d_v, g_k, g_v, mean = c.coder[self.idx]
        out = []
        for x, atoms, gram in ((k if mean is None else k - mean[:, None], d_k, g_k), (v, d_v, g_v)):
            idx, coef = omp(x.float().reshape(-1, self.head_dim), atoms, c.sparsity, gram=gram)
            out.append((c.offload(idx.to(torch.int16)), c.offload(coef.half())))
        return tuple(out)

    def _load(self, b: int, t: int):
        """Thought t of row b back on the device: (K, V) each (Hkv, n, d)."""
        (k, *kc), (v, *vc) = ([x.to(self.device, non_blocking=True) for x in part] for part in self.detail[b][t])
        c = self.cache
        if c.detail == "host":
            return k, v
        if c.detail == "int8":
            return dequantize_int8(k, kc[0], self.dtype), dequantize_int8(v, vc[0], self.dtype)
        d_k, d_v, _, _, mean = c.coder[self.idx]
        shape = (self.kv_heads, -1, self.head_dim)
        k = reconstruct(d_k, k.long(), kc[0]).view(shape)  # codes (Hkv * n, s) -> (Hkv, n, d)
        v = reconstruct(d_v, v.long(), vc[0]).view(shape)
        return (k if mean is None else k + mean[:, None]).to(self.dtype), v.to(self.dtype)

    def _vote(self, q):
        """q (B, Hq, d): every head votes for its top-k thoughts; votes land in the cache's (B, T) tally."""
        c = self.cache
        if self.stacked is None:
            n = max(len(ix) for ix in self.index)
            if n == 0:
                return
            r = max(x.shape[1] for ix in self.index for x in ix)
            keys = q.new_zeros(self.batch, self.kv_heads, n, r, self.head_dim)
            valid = torch.zeros(self.batch, n, r, dtype=torch.bool, device=q.device)
            for b, ix in enumerate(self.index):
                for t, x in enumerate(ix):
                    keys[b, :, t, : x.shape[1]] = x
                    valid[b, t, : x.shape[1]] = True
            if c.method.index_norm == "centered":
                keys = centre_index(keys, valid)
            self.stacked = (keys, valid)
        keys, valid = self.stacked  # (B, Hkv, T, R, d), (B, T, R)
        if c.content_index:  # the query turned back too: content against content, no relative position
            q = unrotate(q.transpose(0, 1), self.pos[:, -1], self.rope).transpose(0, 1)
        k = keys.repeat_interleave(q.shape[1] // self.kv_heads, dim=1)  # (B, Hq, T, R, d)
        scores = torch.einsum("bhd,bhtrd->bhtr", q, k).masked_fill(~valid[:, None], float("-inf")).amax(-1)  # (B, Hq, T)
        valid = valid.any(-1)  # (B, T)
        if self.sliding is not None:  # a sliding-window layer votes only for thoughts it can still see
            cut = visible_from(self.seen, self.sliding)
            ends = [[e for _, e in row.thoughts[: valid.shape[1]]] for row in c.rows]
            ends = torch.tensor([e + [0] * (valid.shape[1] - len(e)) for e in ends], device=valid.device)
            valid = valid & (ends > cut)
            scores = scores.masked_fill(~valid[:, None], float("-inf"))
        top = ranked(scores)[..., : min(c.method.k, keys.shape[2])]  # (B, Hq, k)
        hits = valid.gather(1, top.flatten(1)) & c.voting[:, None]  # (B, Hq*k) only real thoughts, voting rows
        c.tally(top.flatten(1), hits.float())

    def _rebuild(self, cut: int = 0):
        """Gather this layer's active context per row from the buffer, loading zoomed thoughts' detail back; positions
        before `cut` (what a sliding-window layer's queries can no longer see) are left out."""
        c = self.cache
        rows_k, rows_v, rows_p, rows_r = [], [], [], []
        for b, row in enumerate(c.rows):
            if b not in c.rebuilding:  # this row's zoom set and tail did not move: its buffer stays as it is
                p = self.pos[b]
                slots = ((p >= 0) & (p >= cut)).nonzero().squeeze(-1)
                rows_k.append(self.keys[b, :, slots]), rows_v.append(self.values[b, :, slots])
                rows_p.append(p[slots]), rows_r.append(self.received[b, slots])
                continue
            wanted = torch.zeros(self.seen, dtype=torch.bool, device=self.device)
            for s, e in row.keep + [(c.tail_start[b], self.seen)]:
                wanted[s:e] = True
            for t, sp in enumerate(self.summary_pos[b]):
                wanted[sp] = True
            for t in row.zoom:
                s, e = row.thoughts[t]
                wanted[s:e] = True
            wanted[:cut] = False
            p = self.pos[b]
            slots = (p >= 0).nonzero().squeeze(-1)
            slots = slots[wanted[p[slots]]]
            ks, vs, ps, rs = [self.keys[b, :, slots]], [self.values[b, :, slots]], [p[slots]], [self.received[b, slots]]
            missing = wanted.clone()
            missing[p[p >= 0]] = False
            for t in row.zoom:
                s, e = row.thoughts[t]
                need = missing[s:e].nonzero().squeeze(-1)
                if need.numel():
                    hk, hv = self._load(b, t)
                    ks.append(hk[:, need]), vs.append(hv[:, need]), ps.append(need + s)
                    rs.append(torch.zeros(need.numel(), device=self.device))
            pos = torch.cat(ps)
            order = pos.argsort()
            rows_k.append(torch.cat(ks, 1)[:, order]), rows_v.append(torch.cat(vs, 1)[:, order])
            rows_p.append(pos[order]), rows_r.append(torch.cat(rs)[order])
        width = max(p.numel() for p in rows_p)
        self.keys = self.keys.new_zeros(self.batch, self.kv_heads, width, self.head_dim)
        self.values = torch.zeros_like(self.keys)
        self.pos = torch.full((self.batch, width), -1, dtype=torch.long, device=self.device)
        self.received = torch.zeros(self.batch, width, device=self.device)
        for b in range(self.batch):  # left-pad each row so the newest tokens line up at the end
            n = rows_p[b].numel()
            self.keys[b, :, width - n:], self.values[b, :, width - n:] = rows_k[b], rows_v[b]
            self.pos[b, width - n:], self.received[b, width - n:] = rows_p[b], rows_r[b]
        self.version = c.version

    def memory(self) -> dict[str, int]:
        device = tensor_bytes(self.keys, self.values, self.pos, self.received)
        device += sum(tensor_bytes(*ix) for ix in self.index) + (tensor_bytes(*self.stacked) if self.stacked else 0)
        return {"device": device, "host": self.host_bytes}


class ZoomRCache(KVCache):
    """Cache-level state shared by the layers: segmentation (on_step), the vote tally, the zoom sets."""

    def __init__(self, method, layers: int, zoom: bool = True, keep_detail: bool = True, coder=None, sparsity=0,
                 ropes=None, windows=None):
        self.zoom_enabled, self.keep_detail = zoom, keep_detail
        self.detail = getattr(method, "detail", "host")  # how the detail tier stores a thought
        self.content_index = method.index_space == "content"
        self.coder, self.sparsity = coder, sparsity  # per layer (D_k, D_v, G_k, G_v, key mean) for detail=fadkv
        self.method_pick_attention = method.pick == "attention"
        self.strings, self.ids = parse_boundary(method.boundary)
        self.rows: list[Row] = []
        self.version, self.seen = 0, 0
        self.finishing: list[tuple[int, int]] = []  # (row, thought) finalized during the current forward
        self.next_finishing: list[tuple[int, int]] = []
        self.voting = self.next_voting = self.votes = None  # (B,) bool rows voting in this / the next forward
        self.running = None  # (B, T) decayed vote tally (decay > 0)
        self.any_voting = self.next_any = False
        self.tail_start: list[int] = []
        self.rebuilding: set[int] = set()  # rows whose buffer the current version rebuilds
        self.overhead_s, self.steps, self.selections, self.rebuilds = 0.0, 0, 0, 0
        self.last_zoom: list[list[int]] = []
        ropes = ropes or [None] * layers  # per layer Rope, for index_space=content and pick=novel
        windows = windows or [None] * layers  # per layer sliding window
        super().__init__([ZoomRLayer(self, i, ropes[i], windows[i]) for i in range(layers)], method)

    def offload(self, x: torch.Tensor) -> torch.Tensor:
        """A copy of x off the compute device: pinned CPU memory with a non-blocking copy on CUDA."""
        if x.device.type != "cuda":
            return x.clone()
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        return host.copy_(x, non_blocking=True)

    def on_step(self, token_ids, texts):
        """The token about to be fed (position self.seen) may end a thought and/or be a selection point."""
        if not self.rows:
            return
        m, pos = self.method, self.seen
        for b, row in enumerate(self.rows):
            delta, tok = texts[b], int(token_ids[b])
            before = row.text
            row.text += delta
            row.char_pos.append((pos, len(row.text)))
            length = pos + 1 - row.cur
            ends = False
            if m.summary_mode == "generated" and row.summary_start is None and m.begin_marker in row.text:
                at = row.text.index(m.begin_marker)
                row.summary_start = next(p for p, ce in row.char_pos if ce > at)
            if row.summary_start is not None:
                ends = m.end_marker in row.text[row.text.index(m.begin_marker) + len(m.begin_marker):]
                span = (row.summary_start, pos + 1) if ends else None
                detail_end = row.summary_start
            else:
                tail = row.text[-(len(delta) + max(map(len, self.strings), default=1) - 1):] if delta else ""
                ends = length >= m.min_thought and (tok in self.ids or any(s in tail for s in self.strings))
                ends, span, detail_end = ends or length >= m.max_thought, None, pos + 1
            if ends:
                row.thoughts.append((row.cur, max(detail_end, row.cur + 1)))
                row.spans.append(span)
                self.next_finishing.append((b, len(row.thoughts) - 1))
                row.cur, row.text, row.char_pos, row.summary_start = pos + 1, "", [], None
            sentence = bool(_SENTENCE_END.search(before[-1:] + delta))
            vote = m.select == "token" or ends or (m.select == "sentence" and sentence)
            self.next_voting[b] = vote and self.zoom_enabled
            self.next_any |= vote and self.zoom_enabled

    def begin_forward(self, mask, q_len: int, batch: int, device):
        """Layer 0, before attending: settle the previous forward's votes, plan a rebuild, start this forward."""
        t0 = time.perf_counter()
        past = self.seen
        if not self.rows:
            pad = leading_padding(mask, batch, device).tolist()
            self.rows = [Row(p, q_len) for p in pad]
            self.voting = torch.zeros(batch, dtype=torch.bool, device=device)
            self.next_voting = torch.zeros_like(self.voting)
            self.last_zoom = [[] for _ in range(batch)]
        elif q_len > 1:  # more input (a chat turn): the open thought ends, the new tokens are kept in full
            for b, row in enumerate(self.rows):
                if row.cur < past:
                    row.thoughts.append((row.cur, past)), row.spans.append(None)
                    self.next_finishing.append((b, len(row.thoughts) - 1))
                row.keep.append((past, past + q_len))
                row.cur = past + q_len
        changed = self._select()
        self.seen = past + q_len
        # The tail keeps the last `window` tokens, every unfinished thought, and everything not yet finalized.
        need = []
        for b, row in enumerate(self.rows):
            opens = [row.thoughts[t][0] for rb, t in self.next_finishing if rb == b]
            need.append(min([row.cur, max(self.seen - self.method.window, 0)] + opens))
        # A row's buffer is rebuilt when its zoom set changed or its tail moved a quarter window, each row on its own
        # schedule, so a row of a batch keeps exactly what it would keep alone.
        moved = [b for b, (n, r) in enumerate(zip(need, self.rows))
                 if b in changed or n - r.tail_from >= max(self.method.window // 4, 1)]
        if not self.tail_start:
            self.tail_start = [r.tail_from for r in self.rows]
        if moved:
            self.version += 1
            self.rebuilds += 1
            self.rebuilding = set(moved)
            for b in moved:
                self.tail_start[b] = self.rows[b].tail_from = need[b]
        self.finishing, self.next_finishing = self.next_finishing, []
        self.voting, self.next_voting = self.next_voting, torch.zeros_like(self.next_voting)
        self.any_voting = self.next_any
        self.next_any = False
        self.votes = None
        self.steps += q_len == 1
        self.overhead_s += time.perf_counter() - t0

    def tally(self, choices: torch.Tensor, weights: torch.Tensor):
        """choices (B, n) thought indices, weights (B, n): add the votes of one layer."""
        n = max(len(r.thoughts) for r in self.rows)
        if self.votes is None:
            self.votes = torch.zeros(len(self.rows), n, device=choices.device)
        self.votes.scatter_add_(1, choices, weights)

    def _select(self) -> set[int]:
        """Zoom set of every row that voted in the last forward: the c most-voted thoughts. Returns the rows whose
        zoom set changed."""
        changed: set[int] = set()
        if self.votes is None:
            return changed
        decay = self.method.decay
        if decay > 0:  # votes of earlier selection points carry over, fading: the zoom set follows a whole question
            old = self.running if self.running is not None else self.votes.new_zeros(len(self.rows), 0)
            grown = self.votes.new_zeros(self.votes.shape)
            grown[:, : old.shape[1]] = old
            cast = self.votes.sum(1, keepdim=True) > 0
            self.running = torch.where(cast, decay * grown + self.votes, grown)
        for b, row in enumerate(self.rows):
            v = self.votes[b]
            if v.sum() <= 0:
                continue
            if decay > 0:
                v = self.running[b]
            top = ranked(v)[: self.method.c]  # the c most-voted, ties to the earlier thought
            zoom = sorted(int(i) for i in top if v[i] > 0)
            self.selections += 1
            self.last_zoom[b] = zoom
            if zoom != row.zoom:
                row.zoom = zoom
                changed.add(b)
        return changed

    def stats(self) -> dict:
        mem = self.memory()
        return {
            "thoughts_indexed": [len(r.thoughts) for r in self.rows],
            "zoomed_thoughts": self.last_zoom,
            "selections": self.selections,
            "rebuilds": self.rebuilds,
            "device_bytes": mem["on_device"],
            "host_bytes": mem["host"],
            "selection_ms_per_token": round(1000 * self.overhead_s / max(self.steps, 1), 3),
        }


@dataclass
class ThoughtOptions(Method):
    """Options shared by zoomr and sumr: segmentation, summaries and the recent tail (not a method by itself)."""

    keeps_prompt = True

    summary_mode: str = "pooled"
    pick: str = "norm"
    r: int = 4
    window: int = 128
    boundary: str = "\\n\\n"
    min_thought: int = 8
    max_thought: int = 128
    begin_marker: str = "<|begin_of_summary|>"
    end_marker: str = "<|end_of_summary|>"

    def __post_init__(self):
        check_choice("summary_mode", self.summary_mode, ("pooled", "generated"))
        check_choice("pick", self.pick, ("norm", "attention", "even", "novel"))
        check_positive(r=self.r, window=self.window, min_thought=self.min_thought)
        if self.max_thought < self.min_thought:
            raise ValueError(f"max_thought ({self.max_thought}) must be >= min_thought ({self.min_thought})")
        if not self.begin_marker or not self.end_marker:
            raise ValueError("begin_marker and end_marker must be non-empty")
        parse_boundary(self.boundary)

    @classmethod
    def from_options(cls, opts: dict[str, str]) -> "Method":
        """`--opt summary=...` is accepted for `summary_mode` (`summary` is the method's description)."""
        opts = dict(opts)
        if "summary" in opts:
            opts["summary_mode"] = opts.pop("summary")
        return super().from_options(opts)


@dataclass
class ZoomR(ThoughtOptions):
    """ZoomR (Yang et al., ACL 2026): summaries as a coarse index, zoom-in to the full KV of the c most-voted thoughts."""

    name = "zoomr"
    summary = "thoughts indexed by summaries; zoom-in to the most-voted thoughts' full KV; detail off the device"
    test_options = {"window": "8", "r": "2", "min_thought": "4", "max_thought": "8"}
    lossless_options = {"window": "100000"}
    pick: str = "novel"
    r: int = 8
    k: int = 2
    c: int = 2
    select: str = "token"
    decay: float = 0.8
    detail: str = "int8"
    index: str = "mean"
    index_space: str = "content"
    index_norm: str = "centered"

    def __post_init__(self):
        super().__post_init__()
        check_choice("index", self.index, ("mean", "max"))
        check_choice("index_norm", self.index_norm, ("none", "centered"))
        check_choice("index_space", self.index_space, ("rotated", "content"))
        check_choice("select", self.select, ("sentence", "thought", "token"))
        check_choice("detail", self.detail, ("int8", "host", "fadkv"))
        check_positive(k=self.k, c=self.c)
        if not 0 <= self.decay < 1:
            raise ValueError(f"decay must be in [0, 1), got {self.decay}")

    @property
    def needs_dictionary(self) -> bool:
        return self.detail == "fadkv"

    def make_cache(self, model, dictionaries=None) -> KVCache:
        layers, _, _ = model_layout(model)
        ropes = None
        if self.index_space == "content" or self.pick == "novel":
            ropes = layer_ropes(model, f"{self.name} index_space=content and pick=novel")
        windows = attention_windows(model, self.name)
        if self.detail != "fadkv":
            return ZoomRCache(self, layers, ropes=ropes, windows=windows)
        from kvzip.methods.fadkv import _prepare

        if dictionaries is None:
            raise UserError(f"method '{self.name}' with detail=fadkv needs a dictionary trained for this model, and "
                            "none was given")
        trained = dictionaries.meta.get("keys", "post-rope")
        if trained != "post-rope":
            raise UserError(f"method '{self.name}' with detail=fadkv codes post-rope keys; this dictionary was trained "
                            f"on {trained} keys: use a dictionary trained on post-rope keys")
        sparsity = int(dictionaries.meta.get("sparsity", 8))  # the sparsity the dictionary was trained for
        return ZoomRCache(self, layers, coder=_prepare(dictionaries, model.device), sparsity=sparsity, ropes=ropes,
                          windows=windows)
