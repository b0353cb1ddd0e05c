"""The layer of zoomr's and sumr's caches, what configures them and what each forward hands a layer.

`ThoughtLayer` keeps one model layer's active buffer (a token pool the rows share, kvzip.methods.thoughts.pool), each
row's summary positions and its thoughts' detail; it stores what it is given and attends. What it needs from beyond
itself arrives in `state`, a `ThoughtState` built by `ThoughtCache.before_forward`: each row's first real position,
whether any row votes this forward, the kernel choice. When a row votes it leaves its last query there
(`state.record`), which the cache reads after the forward for the votes. The cache's work between forwards (rebuilds,
finalizing thoughts, votes: kvzip.methods.thoughts.cache) hands it the rows' thought state as plain data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvzip import kernels
from kvzip.attention import causal_tail, decode_path, gather_mask, grouped_attention
from kvzip.methods.base import DenseLayer, ForwardState, KVLayer, tensor_bytes
from kvzip.methods.thoughts.detail import part_bytes
from kvzip.methods.thoughts.pool import TokenPool
from kvzip.methods.thoughts.segment import Row, Segmentation
from kvzip.rope import visible_from


@dataclass(frozen=True)
class Zoom:
    """How queries choose thoughts to zoom in on (kvzip.methods.thoughts.index)."""

    votes_per_head: int
    zoom_thoughts: int
    select_at: str  # "token": a vote at every step; "thought": at every thought end
    vote_decay: float
    margin: float = 0.0  # a thought in the zoom set counts its tally 1 + margin times (index.Ballot)
    scope: str = "row"  # "row": one zoom set for every layer of a row; "layer": each layer its own
    index: str = "summary"  # "summary": the mean of the summary keys (ThoughtIndex); "bounds": key ranges (BoundsIndex)
    reread: int = 0  # > 0: the votes' top `reread` thoughts a group are chosen among by their keys (thoughts.reread)


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


class ThoughtState(ForwardState):
    """`ForwardState` plus what a thought layer reads: `first_real` (B, 1) each row's first real position (the
    engine's decode mask hides only the positions before it), `voting` whether any row votes in this forward (then
    every layer records its last query (B, Hq, d)), `kernel` the cache's kernel option ("auto" or "torch")."""

    def __init__(self, attention_mask: torch.Tensor | None, new_tokens: int, first_real: torch.Tensor,
                 voting: bool = False, kernel: str = "auto"):
        super().__init__(attention_mask, new_tokens)
        self.first_real, self.voting, self.kernel = first_real, voting, kernel


class ThoughtLayer(DenseLayer):
    """The active buffer, each row's summaries, index keys and detail. The buffer is a pool of tokens the rows share
    (kvzip.methods.thoughts.pool) and, per row, the slots it holds and their positions, `slots` and `positions`
    (B, W): right-aligned, -1 for an empty slot of a shorter row. `rectangle()` gathers the (B, Hkv, W, d) keys and
    values they stand for, for the paths that need one (a prompt, a sliding-window layer, CUDA)."""

    def __init__(self, idx: int, rope=None, sliding: int | None = None, detail_store=None):
        super().__init__(sliding)
        self.idx = idx  # the layer's index in its cache: what it records its query under
        self.rope = rope  # this layer's Rope: content-space index keys and summary_pick=novel
        self.detail_store = detail_store  # where its thoughts' detail goes (kvzip.methods.thoughts.detail), or None

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
        """Attention over the active buffer; `state` is this forward's `ThoughtState` (kvzip's attention function
        always hands one: the cache built it in `before_forward`)."""
        out = self._attention(query, mask, scaling, state)
        if state.voting:  # the votes are cast for all layers at once, after the forward (ThoughtCache.cast_votes)
            state.record(self.idx, query[:, :, -1])
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
        """The pool, slot lists and detail; the index over finished thoughts, kept for all layers at once, is counted
        by the cache (`ThoughtCache.memory`)."""
        return {"device": self.pool.nbytes() + tensor_bytes(self.slots, self.positions), "host": self.host_bytes}

    def _slide(self, rows: list[Row]):
        """Sliding-window layer, after attending: drop what the next query cannot see (the buffer's oldest slots:
        each row is sorted with its padding in front) and the detail of thoughts (of `rows`) that have left the
        window."""
        cut = visible_from(self.seen, self.sliding)
        self.forget(self.positions < cut)
        drop = int((self.positions < 0).sum(1).min())
        if drop:
            self.slots, self.positions = self.slots[:, drop:], self.positions[:, drop:]
        self.pool.release(self.slots)
        for b, row in enumerate(rows):
            for t, stored in enumerate(self.detail[b]):
                if stored is not None and row.thoughts[t][1] <= cut:
                    self.host_bytes -= part_bytes(stored)
                    self.detail[b][t] = None

    def _attention(self, query, mask, scaling, state: ThoughtState):
        """query (B, Hq, q, d) over the active buffer -> (B, q, Hq, d)."""
        if self._fused(query, state.kernel):
            return self._pooled_attention(query, mask, scaling, state.first_real)
        if mask is not None and query.shape[2] == 1 and self.sliding is None:
            # One new token per row on a full-attention layer: the engine's mask hides only each row's left padding,
            # the positions before first_real (an empty slot's -1 among them); no gather of its columns needed.
            m = (self.positions >= state.first_real.to(self.positions.device))[:, None, None, :]
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

    def _fused(self, query, kernel: str) -> bool:
        """Whether one new token's attention runs in the fused CPU kernel on the pool (kvzip/kernels): `kernel=auto`,
        one token on a full-attention layer (a sliding window's mask is the general one), on the CPU, the kernel
        built."""
        if self.kernel_ok is None:  # what does not change from step to step, decided once
            d, group = query.shape[3], query.shape[1] // self.kv_heads
            self.kernel_ok = (self.sliding is None and query.device.type == "cpu" and d % 16 == 0 and d <= 256
                              and group <= 32 and kernels.available())
        return query.shape[2] == 1 and kernel == "auto" and self.kernel_ok

    def _pooled_attention(self, query, mask, scaling, first_real):
        """The fused kernel over each row's slots: a slot counts from the row's first real position (`first_real`
        (B, 1)) on (the engine's decode mask hides only left padding), or from position 0 without a mask (one
        stream)."""
        b, hq, _, d = query.shape
        first = self.first.get(mask is not None)
        if first is None:  # the rows' first real positions do not change after the prompt
            first = self.first[mask is not None] = (first_real.to(self.device).view(b) if mask is not None
                                                    else torch.zeros(b, dtype=torch.long, device=self.device))
        q = (query.float() * scaling).view(b, self.kv_heads, hq // self.kv_heads, d)  # head j*g+i reads KV head j
        out = torch.ops.kvzip.pooled_decode_attention(q.contiguous(), self.pool.keys, self.pool.values, self.slots,
                                                      self.positions, first)
        return out.view(b, 1, hq, d).to(query.dtype)

    def _load(self, b: int, t: int):
        """Thought t of row b back on the device: (K, V) each (Hkv, n, d)."""
        return self.detail_store.load(self.detail[b][t], self.device, self.dtype)

    def visible_thoughts(self, valid: torch.Tensor, rows: list[Row]) -> torch.Tensor:
        """valid (B, T) thoughts of the stacked index (of `rows`) -> those this layer's next query can still see: on a
        sliding-window layer only the thoughts (partly) inside its window."""
        if self.sliding is None:
            return valid
        cut = visible_from(self.seen, self.sliding)
        ends = [[e for _, e in row.thoughts[: valid.shape[1]]] for row in rows]
        ends = torch.tensor([e + [0] * (valid.shape[1] - len(e)) for e in ends], device=valid.device)
        return valid & (ends > cut)
