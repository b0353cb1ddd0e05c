"""The cache of zoomr and sumr: per row, the prompt, every thought's summary, the zoomed thoughts and the recent tail.

Active context on the device, per row = the prompt (kept in full; it holds the attention sinks) + every finished
thought's summary + (zoomr) the zoomed thoughts' full K/V, loaded back from the detail tier + the recent tail (the
last `window` tokens and the whole unfinished thought). Rows of a left-padded batch have their own thoughts; each
layer keeps its tokens in one pool the rows share and each row lists its slots (kvzip.methods.thoughts.pool), so a
shorter row costs nothing for the longest. A row's buffer is rebuilt when its zoom set changes or, every quarter
window of decode steps, when its tail has moved: every such row at the same steps, which a row counts alike alone
and in a batch, so a row of a batch keeps exactly what it would keep alone.

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

from kvzip import kernels
from kvzip.attention import causal_tail, decode_path, gather_mask, grouped_attention
from kvzip.methods.base import DenseLayer, KVCache, KVLayer, tensor_bytes
from kvzip.methods.thoughts.detail import part_bytes
from kvzip.methods.thoughts.finalize import finalize
from kvzip.methods.thoughts.index import Ballot, ThoughtIndex, head_votes
from kvzip.methods.thoughts.pool import TokenPool
from kvzip.methods.thoughts.rebuild import rebuild_rows
from kvzip.methods.thoughts.segment import Row, Segmentation
from kvzip.rope import unrotate, visible_from


@dataclass(frozen=True)
class Zoom:
    """How queries choose thoughts to zoom in on (kvzip.methods.thoughts.index)."""

    votes_per_head: int
    zoom_thoughts: int
    select_at: str  # "token": a vote at every step; "thought": at every thought end
    vote_decay: float
    margin: float = 0.0  # a thought in the zoom set counts its tally 1 + margin times (index.Ballot)


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
    kernel: str = "auto"  # auto: one new token's attention in the fused CPU kernel where it runs; torch: never

    def __post_init__(self):
        assert self.zoom is None or self.detail is not None, "zooming in needs a detail tier to load thoughts from"


class ThoughtLayer(DenseLayer):
    """The active buffer, each row's summaries, index keys and detail. The buffer is a pool of tokens the rows share
    (kvzip.methods.thoughts.pool) and, per row, the slots it holds and their positions, `slots` and `positions`
    (B, W): right-aligned, -1 for an empty slot of a shorter row. `rectangle()` gathers the (B, Hkv, W, d) keys and
    values they stand for, for the paths that need one (a prompt, a sliding-window layer, CUDA)."""

    def __init__(self, cache: "ThoughtCache", idx: int, rope=None, sliding: int | None = None):
        super().__init__(sliding)
        self.cache, self.idx = cache, idx
        self.rope = rope  # this layer's Rope: content-space index keys and summary_pick=novel
        self.detail_store = None if cache.config.detail is None else cache.config.detail[idx]

    def lazy_initialization(self, key_states, value_states):
        KVLayer.lazy_initialization(self, key_states, value_states)
        b, h, _, d = key_states.shape
        self.pool = TokenPool(h, d, key_states.dtype, self.device)
        self.slots = torch.zeros(b, 0, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(b, 0, dtype=torch.long, device=self.device)
        self.buffers = {}  # DenseLayer's buffers behind `slots` and `positions`
        self.lengths = [0] * self.batch  # per row, its slots in use: the last ones of the buffer
        self.summary_pos = [[] for _ in range(self.batch)]  # per row, per thought: (r,) positions kept on device
        self.summary_all = [self.positions.new_zeros(0) for _ in range(self.batch)]  # per row, all of them at once
        self.detail = [[] for _ in range(self.batch)]  # per row, per thought: K and V parts off the device
        self.host_bytes = 0
        self.kernel_ok = None  # whether this layer's decode can run in the fused kernel (`_fused`), once known
        self.first = {}  # masked or not -> (B,) the first position a row's decode query sees, on this layer's device

    # rows, summaries, index keys and detail are per-row state beyond keys and values: reordering rows is refused
    ROW_TENSORS = ()

    def attend(self, module, query, key, value, mask, scaling, state=None):
        out = self._attention(query, mask, scaling)
        if self.cache.any_voting:  # the votes are cast for all layers at once, after the forward
            self.cache.queries.append((self, query[:, :, -1]))
        return out

    def rectangle(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (B, Hkv, W, d) of every row's slots, gathered from the pool (an empty slot reads as slot 0:
        `positions` masks it), for the paths that need a rectangle."""
        k, v = self.pool.gather(self.slots)  # (Hkv, B, W, d)
        return k.transpose(0, 1), v.transpose(0, 1)

    def row_tokens(self, b: int, start: int = 0, stop: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (Hkv, n, d) of row b's slots [start:stop) (an empty slot reads as slot 0: mask it)."""
        return self.pool.gather(self.slots[b, start:stop])

    def forget(self, gone: torch.Tensor) -> None:
        """Empty the slots where `gone` (B, W) is true."""
        self.positions = self.positions.masked_fill(gone, -1)
        self.slots = self.slots.masked_fill(gone, -1)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[2]
        self.extend("slots", self.pool.add(key_states, value_states))
        self.extend("positions", self.new_positions(q))
        self.seen += q
        self.lengths = [n + q for n in self.lengths]  # every row's stored tokens (right-aligned)
        return key_states, value_states  # attention reads the pool (`attend`)

    def memory(self) -> dict[str, int]:
        device = self.pool.nbytes() + tensor_bytes(self.slots, self.positions)
        if self.cache.index is not None:  # the index over finished thoughts is kept for all layers at once
            device += self.cache.index.layer_bytes()
        return {"device": device, "host": self.host_bytes}

    def _slide(self):
        """Sliding-window layer, after attending: drop what the next query cannot see (the buffer's oldest slots:
        each row is sorted with its padding in front) and the detail of thoughts that have left the window."""
        cut = visible_from(self.seen, self.sliding)
        self.forget(self.positions < cut)
        drop = int((self.positions < 0).sum(1).min())
        if drop:
            self.slots, self.positions = self.slots[:, drop:], self.positions[:, drop:]
        self.pool.release(self.slots)
        for b, row in enumerate(self.cache.rows):
            for t, stored in enumerate(self.detail[b]):
                if stored is not None and row.thoughts[t][1] <= cut:
                    self.host_bytes -= part_bytes(stored)
                    self.detail[b][t] = None

    def _attention(self, query, mask, scaling):
        """query (B, Hq, q, d) over the active buffer -> (B, q, Hq, d)."""
        if self._fused(query):
            return self._pooled_attention(query, mask, scaling)
        if mask is not None and query.shape[2] == 1 and self.sliding is None:
            # One new token per row on a full-attention layer: the engine's mask hides only each row's left padding,
            # the positions before first_real (an empty slot's -1 among them); no gather of its columns needed.
            m = (self.positions >= self.cache.first_real.to(self.positions.device))[:, None, None, :]
        elif mask is not None:
            m = gather_mask(mask, self.positions.clamp(min=0)) & (self.positions >= 0)[:, None, None, :]
        else:
            m = (self.positions >= 0)[:, None, None, :] & causal_tail(query.shape[2], self.slots.shape[1], query.device)
        keys, values = self.rectangle()
        if decode_path(query):
            return grouped_attention(query, keys, values, m, scaling)
        out = torch.nn.functional.scaled_dot_product_attention(
            query, keys, values, attn_mask=m, scale=scaling, enable_gqa=query.shape[1] != self.kv_heads)
        return out.transpose(1, 2).contiguous()

    def _fused(self, query) -> bool:
        """Whether one new token's attention runs in the fused CPU kernel on the pool (kvzip/kernels): `kernel=auto`,
        one token on a full-attention layer (a sliding window's mask is the general one), on the CPU, the kernel
        built."""
        if self.kernel_ok is None:  # what does not change from step to step, decided once
            d, group = query.shape[3], query.shape[1] // self.kv_heads
            self.kernel_ok = (self.sliding is None and query.device.type == "cpu" and d % 16 == 0 and d <= 256
                              and group <= 32 and self.cache.config.kernel == "auto" and kernels.available())
        return query.shape[2] == 1 and self.kernel_ok

    def _pooled_attention(self, query, mask, scaling):
        """The fused kernel over each row's slots: a slot counts from the row's first real position on (the engine's
        decode mask hides only left padding), or from position 0 without a mask (one stream)."""
        b, hq, _, d = query.shape
        first = self.first.get(mask is not None)
        if first is None:  # the rows' first real positions do not change after the prompt
            first = self.first[mask is not None] = (self.cache.first_real.to(self.device).view(b) if mask is not None
                                                    else torch.zeros(b, dtype=torch.long, device=self.device))
        q = (query.float() * scaling).view(b, self.kv_heads, hq // self.kv_heads, d)  # head j*g+i reads KV head j
        out = torch.ops.kvzip.pooled_decode_attention(q.contiguous(), self.pool.keys, self.pool.values, self.slots,
                                                      self.positions, first)
        return out.view(b, 1, hq, d).to(query.dtype)

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


class ThoughtCache(KVCache):
    """Cache-level state shared by the layers: segmentation (on_step), the ballot, the zoom sets, the rebuilds."""

    def __init__(self, method, config: ThoughtConfig, ropes: list, windows: list):
        self.config = config
        self._fresh()
        super().__init__([ThoughtLayer(self, i, ropes[i], windows[i]) for i in range(len(windows))], method)

    def _fresh(self):
        """The cache-level state before the first forward."""
        config = self.config
        self.rows: list[Row] = []
        self.seen, self.q_len = 0, 0
        self.finishing: list[tuple[int, int]] = []  # (row, thought) finalized during the current forward
        self.next_finishing: list[tuple[int, int]] = []
        self.voting = self.next_voting = None  # (B,) bool rows voting in this / the next forward
        self.any_voting = self.next_any = False
        self.ballot = None if config.zoom is None else Ballot(config.zoom.zoom_thoughts, config.zoom.vote_decay,
                                                                 config.zoom.margin)
        self.tail_start: list[int] = []
        self.zoomed: list[set[int]] = []  # per row, the zoom set its buffers were last gathered for
        self.overhead_s, self.steps, self.rebuilds = 0.0, 0, 0
        self.last_zoom: list[list[int]] = []
        self.queries: list = []  # (layer, its last query (B, Hq, d)) of the current forward, for cast_votes
        self.index: ThoughtIndex | None = None  # every layer's index keys over the finished thoughts (zoom only)

    def reset(self):
        self._fresh()
        super().reset()

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

    def before_forward(self, attention_mask, new_tokens: int):
        """Before the forward: settle the previous forward's votes, rebuild the rows whose zoom set or tail moved (every
        layer receives this forward's tokens after its rebuild, so the tail stays at the end), start this forward."""
        super().before_forward(attention_mask, new_tokens)
        t0 = time.perf_counter()
        past, q_len, device = self.seen, new_tokens, attention_mask.device
        if not self.rows:
            batch = attention_mask.shape[0]
            pad = (attention_mask.cumsum(-1) == 0).sum(-1).tolist()  # each row's left padding
            self.rows = [Row(p, q_len) for p in pad]
            self.first_real = torch.tensor(pad, device=device)[:, None]  # (B, 1) each row's first real position
            self.voting = torch.zeros(batch, dtype=torch.bool, device=device)
            self.next_voting = torch.zeros_like(self.voting)
            self.last_zoom = [[] for _ in range(batch)]
            self.zoomed = [set() for _ in range(batch)]
            self.index = None if self.config.zoom is None else ThoughtIndex(batch)
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
        # A tail moves once it is a quarter window behind, and while decoding only every quarter window of steps, all
        # rows at once: a row's schedule stays its own (decode steps count alike alone and in a batch), and one rebuild
        # serves every row that moved instead of one each.
        quarter = max(window // 4, 1)
        due = q_len == 1 and self.steps % quarter == 0
        moved = [b for b, (n, r) in enumerate(zip(need, self.rows))
                 if b in changed or (n - r.tail_from >= quarter if q_len > 1 else due and n > r.tail_from)]
        if not self.tail_start:
            self.tail_start = [r.tail_from for r in self.rows]
        if moved:
            self.rebuilds += 1
            for b in moved:
                self.tail_start[b] = self.rows[b].tail_from = need[b]
            rebuild_rows(self, moved)
            for b in moved:
                self.zoomed[b] = set(self.rows[b].zoom)
        self.finishing, self.next_finishing = self.next_finishing, []
        self.voting, self.next_voting = self.next_voting, torch.zeros_like(self.next_voting)
        self.any_voting, self.next_any = self.next_any, False
        self.steps += q_len == 1
        self.overhead_s += time.perf_counter() - t0

    def after_forward(self):
        """After the last layer has attended: the thoughts that ended in this forward are finalized in every layer,
        the votes cast, and sliding-window layers drop what their next query cannot see."""
        t0 = time.perf_counter()
        for b, t in self.finishing:
            finalize(self, b, t)
        if self.any_voting:
            self.cast_votes()
        for layer in self.layers:
            if layer.sliding is not None:
                layer._slide()
        self.overhead_s += time.perf_counter() - t0

    def cast_votes(self):
        """After the last layer has attended: the query heads of every layer (`queries`, gathered during the
        forward) vote for their best thoughts, all layers in one batched product, each query turned back by its
        layer's RoPE (content against content); the votes land in the ballot."""
        queries, self.queries = self.queries, []
        layers = [layer for layer, _ in queries]
        if self.index.width == 0:  # no row has finished a thought yet
            return
        keys, valid = self.index.keys(), self.index.valid()  # (L, B, Hkv, T, d), (B, T)
        if len(layers) < len(self.layers):
            keys = keys[[layer.idx for layer in layers]]
        valid = torch.stack([layer.visible_thoughts(valid) for layer in layers])  # (L, B, T)
        q = torch.stack([q.to(keys.device) for _, q in queries])  # (L, B, Hq, d), with the index (a split model)
        pos = layers[0].positions[:, -1]  # (B,) the newest token's position, the same in every layer
        content = torch.empty_like(q)
        for rope in {id(layer.rope): layer.rope for layer in layers}.values():
            at = [i for i, layer in enumerate(layers) if layer.rope is rope]
            content[at] = unrotate(q[at].transpose(1, 2), pos, rope).transpose(1, 2)  # (Lr, Hq, B, d) turned
        top = head_votes(content.float(), keys, valid, self.config.zoom.votes_per_head)  # (L, B, Hq, k)
        hits = valid.gather(2, top.flatten(2)) & self.voting[None, :, None]  # only real thoughts, voting rows
        self.ballot.add(top.transpose(0, 1).flatten(1), hits.transpose(0, 1).flatten(1).float(),
                        max(len(r.thoughts) for r in self.rows))

    def _select(self) -> set[int]:
        """Apply the zoom sets the last forward's votes chose; returns the rows whose zoom set changed."""
        changed: set[int] = set()
        if self.ballot is None:
            return changed
        for b, zoom in self.ballot.select([row.zoom for row in self.rows]).items():
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
