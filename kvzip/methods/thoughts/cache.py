"""The cache of zoomr and sumr: per row, the prompt, every thought's summary, the zoomed thoughts and the recent tail.

Active context on the device, per row = the prompt (kept in full; it holds the attention sinks) + every finished
thought's summary + (zoomr) the zoomed thoughts' full K/V, loaded back from the detail tier + the recent tail (the
last `window` tokens and the whole unfinished thought). Rows of a left-padded batch have their own thoughts; the
device buffer is padded per row (position -1). A row's buffer is rebuilt when its zoom set changes or its tail has
moved by a quarter window, each row on its own schedule, so a row of a batch keeps exactly what it would keep alone.

Zoom-in is applied one step late: layer L attends before layer L+1 has even computed its query, so the consensus of
the votes exists only after the whole forward. Votes cast during one token's forward choose the zoom set from the
next forward on.

`ThoughtConfig` says what a cache does: zoomr zooms in (`zoom`) and keeps a detail tier (`detail`); sumr does
neither, so it builds no index and drops a thought's other tokens once they leave the tail.

Models with more than one kind of layer (Gemma 3's sliding-window and global layers): each layer turns keys back by
its own RoPE (kvzip.rope), and a sliding-window layer applies all of the above within its window only: its active
context drops whatever its next query can no longer see, its detail of a thought goes once the thought has left the
window, and it votes only for thoughts still (partly) inside the window.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvzip.attention import causal_tail, decode_path, gather_mask, grouped_attention, leading_padding
from kvzip.methods.base import DenseLayer, KVCache, tensor_bytes
from kvzip.methods.thoughts.detail import part_bytes, store_layers
from kvzip.methods.thoughts.index import Ballot, head_votes, stack_index
from kvzip.methods.thoughts.segment import Row, Segmentation
from kvzip.methods.thoughts.summary import pick_summary
from kvzip.rope import unrotate, visible_from


@dataclass(frozen=True)
class Zoom:
    """How queries choose thoughts to zoom in on (kvzip.methods.thoughts.index)."""

    votes_per_head: int
    zoom_thoughts: int
    select_at: str  # "token": a vote at every step; "thought": at every thought end
    vote_decay: float


@dataclass(frozen=True)
class ThoughtConfig:
    """What a thought cache does: its segmentation, summaries and tail, and whether it zooms in and keeps a detail
    tier. `detail` is one store per layer (kvzip.methods.thoughts.detail); zooming in needs it."""

    segmentation: Segmentation
    summary_tokens: int
    summary_pick: str
    window: int
    zoom: Zoom | None = None
    detail: list | None = None

    def __post_init__(self):
        assert self.zoom is None or self.detail is not None, "zooming in needs a detail tier to load thoughts from"


class ThoughtLayer(DenseLayer):
    """The active buffer (keys, values, positions: -1 for an empty slot of a shorter row), each row's summaries,
    index keys and detail."""

    def __init__(self, cache: "ThoughtCache", idx: int, rope=None, sliding: int | None = None):
        super().__init__(sliding)
        self.cache, self.idx, self.version = cache, idx, 0
        self.rope = rope  # this layer's Rope: content-space index keys and summary_pick=novel
        self.detail_store = None if cache.config.detail is None else cache.config.detail[idx]

    def lazy_initialization(self, key_states, value_states):
        super().lazy_initialization(key_states, value_states)
        self.summary_pos = [[] for _ in range(self.batch)]  # per row, per thought: (r,) positions kept on device
        self.index = [[] for _ in range(self.batch)]  # per row, per thought: (Hkv, d) index key (zoom only)
        self.index_bytes = 0  # their bytes, kept as they are added: memory() runs after every forward
        self.detail = [[] for _ in range(self.batch)]  # per row, per thought: K and V parts off the device
        self.zoomed = [set() for _ in range(self.batch)]  # per row, the zoom set its buffer was last gathered for
        self.stacked = None  # centred index keys (B, Hkv, T, d) and valid (B, T), built when first needed
        self.host_bytes = 0

    def attend(self, module, query, key, value, mask, scaling):
        c = self.cache
        if self.idx == 0:
            c.begin_forward(mask, query.shape[2], self.batch, self.device)
        t0 = time.perf_counter()
        if self.version != c.version:
            self._rebuild(visible_from(self.seen - query.shape[2], self.sliding))
        c.overhead_s += time.perf_counter() - t0
        out = self._attention(query, mask, scaling)
        if c.any_voting:
            c.queries.append((self, query[:, :, -1]))
        if self.idx == len(c.layers) - 1:
            c.end_forward()
        return out

    def memory(self) -> dict[str, int]:
        device = tensor_bytes(self.keys, self.values, self.positions)
        device += self.index_bytes + (tensor_bytes(*self.stacked) if self.stacked else 0)
        return {"device": device, "host": self.host_bytes}

    def _slide(self):
        """Sliding-window layer, after attending: drop what the next query cannot see (the buffer's oldest slots:
        each row is sorted with its padding in front) and the detail of thoughts that have left the window."""
        cut = visible_from(self.seen, self.sliding)
        self.positions = self.positions.masked_fill(self.positions < cut, -1)
        drop = int((self.positions < 0).sum(1).min())
        if drop:
            self.keys, self.values = self.keys[:, :, drop:], self.values[:, :, drop:]
            self.positions = self.positions[:, drop:]
        for b, row in enumerate(self.cache.rows):
            for t, stored in enumerate(self.detail[b]):
                if stored is not None and row.thoughts[t][1] <= cut:
                    self.host_bytes -= part_bytes(stored)
                    self.detail[b][t] = None

    def _attention(self, query, mask, scaling):
        """query (B, Hq, q, d) over the active buffer -> (B, q, Hq, d)."""
        valid = (self.positions >= 0)[:, None, None, :]  # (B, 1, 1, S)
        if mask is not None:
            m = gather_mask(mask, self.positions.clamp(min=0)) & valid
        else:
            m = valid & causal_tail(query.shape[2], self.keys.shape[2], valid.device)
        if decode_path(query):
            return grouped_attention(query, self.keys, self.values, m, scaling)
        out = torch.nn.functional.scaled_dot_product_attention(
            query, self.keys, self.values, attn_mask=m, scale=scaling, enable_gqa=query.shape[1] != self.kv_heads)
        return out.transpose(1, 2).contiguous()

    def _load(self, b: int, t: int):
        """Thought t of row b back on the device: (K, V) each (Hkv, n, d)."""
        return self.detail_store.load(self.detail[b][t], self.device, self.dtype)

    def visible_thoughts(self, valid: torch.Tensor) -> torch.Tensor:
        """valid (B, T) thoughts of the stacked index -> those this layer's next query can still see: on a
        sliding-window layer only the thoughts (partly) inside its window."""
        if self.sliding is None:
            return valid
        cut = visible_from(self.seen, self.sliding)
        ends = [[e for _, e in row.thoughts[: valid.shape[1]]] for row in self.cache.rows]
        ends = torch.tensor([e + [0] * (valid.shape[1] - len(e)) for e in ends], device=valid.device)
        return valid & (ends > cut)

    def _rebuild(self, cut: int = 0):
        """Rebuild the active context of the rows whose zoom set or tail moved (`cache.rebuilding`), in place: each
        such row is gathered anew (zoomed thoughts' detail loaded back) and written right-aligned into the buffer,
        empty slots in front (position -1); every other row is left as it is. The buffer widens only when a row
        needs more slots than it has and loses the columns that are empty in every row. Positions before `cut` (what
        a sliding-window layer's queries can no longer see) are left out."""
        c = self.cache
        if cut:
            self.positions = self.positions.masked_fill(self.positions < cut, -1)
        rows = {b: self._row_context(b, cut) for b in sorted(c.rebuilding)}
        need = max((p.numel() for _, _, p in rows.values()), default=0)
        width = self.keys.shape[2]
        if need > width:  # widen on the left: older slots are further left in every row
            grow = need - width
            self.keys = torch.cat([self.keys.new_zeros(self.batch, self.kv_heads, grow, self.head_dim), self.keys], 2)
            self.values = torch.cat([self.values.new_zeros(self.batch, self.kv_heads, grow, self.head_dim),
                                     self.values], 2)
            self.positions = torch.cat([self.positions.new_full((self.batch, grow), -1), self.positions], 1)
            width = need
        for b, (k, v, p) in rows.items():
            n = p.numel()
            self.keys[b, :, width - n :], self.values[b, :, width - n :] = k, v
            self.positions[b, width - n :] = p
            self.positions[b, : width - n] = -1
        empty = (self.positions < 0).all(0)  # (S,) columns no row uses; rows are right-aligned, so they lead
        drop = int(empty.long().cumprod(0).sum())
        if drop:
            self.keys, self.values = self.keys[:, :, drop:], self.values[:, :, drop:]
            self.positions = self.positions[:, drop:]
        self.version = c.version

    def _row_context(self, b: int, cut: int):
        """Row b's active context (K, V (Hkv, n, d), positions (n,)), sorted by position: the kept prompt, the tail,
        every summary and the zoomed thoughts, those not in the buffer loaded back from the detail tier. A thought
        that was zoomed at this row's last gather is whole in the buffer still; only newly zoomed ones are loaded."""
        c, row = self.cache, self.cache.rows[b]
        p = self.positions[b]
        wanted = torch.zeros(self.seen, dtype=torch.bool, device=self.device)
        for s, e in row.keep + [(c.tail_start[b], self.seen)] + [row.thoughts[t] for t in row.zoom]:
            wanted[s:e] = True
        if self.summary_pos[b]:
            wanted[torch.cat(self.summary_pos[b])] = True
        if cut:
            wanted[:cut] = False
        live = p >= 0
        slots = (live & wanted[p.clamp(min=0)]).nonzero().squeeze(-1)
        # index_select: 4x faster than the same gather written k[:, slots] (CPU, 300 slots)
        ks, vs, ps = [self.keys[b].index_select(1, slots)], [self.values[b].index_select(1, slots)], [p[slots]]
        new = [t for t in row.zoom if t not in self.zoomed[b]]
        self.zoomed[b] = set(row.zoom)
        if not new:
            return ks[0], vs[0], ps[0]
        missing = wanted.clone()
        missing[p[live]] = False
        for t in new:
            s, e = row.thoughts[t]
            need = missing[s:e].nonzero().squeeze(-1)
            if need.numel():
                hk, hv = self._load(b, t)
                ks.append(hk.index_select(1, need)), vs.append(hv.index_select(1, need)), ps.append(need + s)
        pos = torch.cat(ps)
        order = pos.argsort()
        return torch.cat(ks, 1).index_select(1, order), torch.cat(vs, 1).index_select(1, order), pos[order]


class ThoughtCache(KVCache):
    """Cache-level state shared by the layers: segmentation (on_step), the ballot, the zoom sets, the rebuilds."""

    def __init__(self, method, config: ThoughtConfig, ropes: list, windows: list):
        self.config = config
        self.rows: list[Row] = []
        self.version, self.seen, self.q_len = 0, 0, 0
        self.finishing: list[tuple[int, int]] = []  # (row, thought) finalized during the current forward
        self.next_finishing: list[tuple[int, int]] = []
        self.voting = self.next_voting = None  # (B,) bool rows voting in this / the next forward
        self.any_voting = self.next_any = False
        self.ballot = None if config.zoom is None else Ballot(config.zoom.zoom_thoughts, config.zoom.vote_decay)
        self.tail_start: list[int] = []
        self.rebuilding: set[int] = set()  # rows whose buffer the current version rebuilds
        self.overhead_s, self.steps, self.rebuilds = 0.0, 0, 0
        self.last_zoom: list[list[int]] = []
        self.queries: list = []  # (layer, its last query (B, Hq, d)) of the current forward, for cast_votes
        self.index_keys = None  # every layer's stacked index keys (L, B, Hkv, T, d); layers hold views of it
        super().__init__([ThoughtLayer(self, i, ropes[i], windows[i]) for i in range(len(windows))], method)

    def on_step(self, token_ids, texts):
        """The token about to be fed (position self.seen) may end a thought and/or be a selection point."""
        if not self.rows:
            return
        zoom = self.config.zoom
        for b, row in enumerate(self.rows):
            ends = row.feed(self.config.segmentation, self.seen, texts[b], int(token_ids[b]))
            if ends:
                self.next_finishing.append((b, len(row.thoughts) - 1))
            vote = zoom is not None and (zoom.select_at == "token" or ends)
            self.next_voting[b] = vote
            self.next_any |= vote

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
                if row.take_input(past, q_len):
                    self.next_finishing.append((b, len(row.thoughts) - 1))
        changed = self._select()
        self.seen, self.q_len = past + q_len, q_len
        # The tail keeps the last `window` tokens, every unfinished thought, and everything not yet finalized.
        window = self.config.window
        need = []
        for b, row in enumerate(self.rows):
            opens = [row.thoughts[t][0] for rb, t in self.next_finishing if rb == b]
            need.append(min([row.cur, max(self.seen - window, 0)] + opens))
        moved = [b for b, (n, r) in enumerate(zip(need, self.rows))
                 if b in changed or n - r.tail_from >= max(window // 4, 1)]
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
        self.any_voting, self.next_any = self.next_any, False
        self.steps += q_len == 1
        self.overhead_s += time.perf_counter() - t0

    def end_forward(self):
        """After the last layer has attended: the thoughts that ended in this forward are finalized in every layer,
        the votes cast, and sliding-window layers drop what their next query cannot see."""
        t0 = time.perf_counter()
        for b, t in self.finishing:
            self._finalize(b, t)
        if self.any_voting:
            self.cast_votes()
        for layer in self.layers:
            if layer.sliding is not None:
                layer._slide()
        self.overhead_s += time.perf_counter() - t0

    def _finalize(self, b: int, t: int):
        """Thought t of row b ended in this forward (all its tokens are in the tail): every layer keeps its summary
        and index key and moves the thought's detail off the device. Rows are sorted and right-aligned and the tail
        holds every position from its start on, so in each layer the thought is a slice at the end of the row; layers
        that share a RoPE, a kind of attention and that slice do it in one batched pass. (A sliding-window layer may
        have dropped the thought's first tokens already: it works on what it still has.)"""
        start = self.rows[b].thoughts[t][0]
        groups: dict[tuple, list[ThoughtLayer]] = {}
        for layer in self.layers:
            first = max(start, visible_from(self.seen - self.q_len, layer.sliding))
            groups.setdefault((id(layer.rope), layer.sliding is not None, first), []).append(layer)
        for (_, sliding, first), layers in groups.items():
            self._finalize_group(layers, b, t, first, sliding)

    def _finalize_group(self, layers: list, b: int, t: int, first: int, sliding: bool):
        """_finalize for `layers`, which hold thought t of row b from position `first` on."""
        config, row, seen = self.config, self.rows[b], self.seen
        end, span, m = row.thoughts[t][1], row.spans[t], seen - first
        n = max(end - first, 0)
        keys = torch.stack([layer.keys[b, :, layer.keys.shape[2] - m:] for layer in layers])  # (L, Hkv, m, d)
        values = torch.stack([layer.values[b, :, layer.values.shape[2] - m:] for layer in layers])
        device, rope = keys.device, layers[0].rope
        if span is not None:
            keep = torch.arange(max(span[0], first) - first, span[1] - first, device=device).expand(len(layers), -1)
        elif config.summary_pick == "novel":  # compared with the row's real tokens before the thought
            pad = torch.nn.utils.rnn.pad_sequence
            before = pad([layer.keys[b, :, : layer.keys.shape[2] - m].transpose(0, 1) for layer in layers],
                         batch_first=True).transpose(1, 2)  # (L, Hkv, R, d)
            before_pos = pad([layer.positions[b, : layer.positions.shape[1] - m] for layer in layers],
                             batch_first=True, padding_value=-1)  # (L, R)
            keep = pick_summary(keys[:, :, :n], torch.arange(first, first + n, device=device), config.summary_tokens,
                                "novel", rope, before, before_pos, before_pos >= row.keep[0][0])
        else:
            keep = pick_summary(keys[:, :, :n], None, config.summary_tokens, config.summary_pick)
        kept_pos = keep + first  # (L, r)
        if config.zoom is not None:  # the index key: the summary keys as k_proj wrote them, before the rotation
            kept = keys[torch.arange(len(layers), device=device)[:, None], :, keep].transpose(1, 2)  # (L, Hkv, r, d)
            index = unrotate(kept, kept_pos[:, None], rope).mean(2) if keep.shape[1] else keys.new_zeros(
                len(layers), keys.shape[1], keys.shape[3])  # (L, Hkv, d)
        detail = None
        if layers[0].detail_store is not None:
            detail = store_layers([layer.detail_store for layer in layers], keys[:, :, :n], values[:, :, :n], sliding)
        for i, layer in enumerate(layers):
            layer.summary_pos[b].append(kept_pos[i])
            if config.zoom is not None:
                layer.index[b].append(index[i])
                layer.index_bytes += tensor_bytes(index[i])
                layer.stacked = None
            if detail is not None:
                layer.detail[b].append(detail[i])
                layer.host_bytes += part_bytes(detail[i])

    def cast_votes(self):
        """After the last layer has attended: the query heads of every layer (`queries`, gathered during the
        forward) vote for their best thoughts, all layers in one batched product, each query turned back by its
        layer's RoPE (content against content); the votes land in the ballot."""
        queries, self.queries = self.queries, []
        layers = [layer for layer, _ in queries]
        if self.index_keys is None or any(layer.stacked is None for layer in layers):
            stacks = [stack_index(layer.index, q) for layer, q in queries]
            if stacks[0] is None:  # no row has finished a thought yet
                return
            self.index_keys = torch.stack([keys for keys, _ in stacks])  # (L, B, Hkv, T, d)
            for i, (layer, (_, valid)) in enumerate(zip(layers, stacks)):
                layer.stacked = (self.index_keys[i], valid)  # a view: each layer's memory() counts its part
        valid = torch.stack([layer.visible_thoughts(layer.stacked[1]) for layer in layers])  # (L, B, T)
        q = torch.stack([q for _, q in queries])  # (L, B, Hq, d)
        pos = layers[0].positions[:, -1]  # (B,) the newest token's position, the same in every layer
        content = torch.empty_like(q)
        for rope in {id(layer.rope): layer.rope for layer in layers}.values():
            at = [i for i, layer in enumerate(layers) if layer.rope is rope]
            content[at] = unrotate(q[at].transpose(1, 2), pos, rope).transpose(1, 2)  # (Lr, Hq, B, d) turned
        top = head_votes(content, self.index_keys, valid, self.config.zoom.votes_per_head)  # (L, B, Hq, k)
        hits = valid.gather(2, top.flatten(2)) & self.voting[None, :, None]  # only real thoughts, voting rows
        self.ballot.add(top.transpose(0, 1).flatten(1), hits.transpose(0, 1).flatten(1).float(),
                        max(len(r.thoughts) for r in self.rows))

    def _select(self) -> set[int]:
        """Apply the zoom sets the last forward's votes chose; returns the rows whose zoom set changed."""
        changed: set[int] = set()
        if self.ballot is None:
            return changed
        for b, zoom in self.ballot.select().items():
            self.last_zoom[b] = zoom
            if zoom != self.rows[b].zoom:
                self.rows[b].zoom = zoom
                changed.add(b)
        return changed

    def stats(self) -> dict:
        mem = self.memory()
        return {
            "thoughts_indexed": [len(r.thoughts) for r in self.rows],
            "zoomed_thoughts": self.last_zoom,
            "selections": 0 if self.ballot is None else self.ballot.selections,
            "rebuilds": self.rebuilds,
            "device_bytes": mem["on_device"],
            "host_bytes": mem["host"],
            "selection_ms_per_token": round(1000 * self.overhead_s / max(self.steps, 1), 3),
        }
