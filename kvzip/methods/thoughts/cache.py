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
neither, so it builds no index and drops a thought's other tokens once they leave the tail. The layers, the config
and what a layer is handed each forward (`ThoughtState`) are kvzip.methods.thoughts.layer; the cache's work between
forwards hands `finalize` and `rebuild_rows` its layers and rows' state as arguments, never itself.

Models with more than one kind of layer (Gemma 3's sliding-window and global layers): each layer turns keys back by
its own RoPE (kvzip.rope), and a sliding-window layer applies all of the above within its window only: its active
context drops whatever its next query can no longer see, its detail of a thought goes once the thought has left the
window, and it votes only for thoughts still (partly) inside the window.
"""

from __future__ import annotations

import time

import torch

from kvzip.methods.base import KVCache
from kvzip.methods.thoughts.finalize import finalize
from kvzip.methods.thoughts.index import Ballot, BoundsIndex, RowIndex, ThoughtIndex, bound_votes, head_votes
from kvzip.methods.thoughts.layer import ThoughtConfig, ThoughtLayer, ThoughtState
from kvzip.methods.thoughts.rebuild import rebuild_rows
from kvzip.methods.thoughts.reread import reread_votes
from kvzip.methods.thoughts.segment import Row
from kvzip.rope import unrotate


class ThoughtCache(KVCache):
    """Cache-level state: segmentation (on_step), the ballot, the zoom sets, the rebuilds. Its layers never see it:
    before every forward it hands them a `ThoughtState` (`state`), and reads their queries back from it after."""

    def __init__(self, method, config: ThoughtConfig, ropes: list, windows: list):
        self.config = config
        # zoom groups: one zoom set a row shares over its layers, or one a layer (`Zoom.scope`, index.Ballot)
        self.groups = 1 if config.zoom is None or config.zoom.scope == "row" else len(windows)
        self._fresh()
        details = config.detail or [None] * len(windows)
        super().__init__([ThoughtLayer(i, ropes[i], windows[i], details[i]) for i in range(len(windows))], method)

    def _fresh(self):
        """The cache-level state before the first forward."""
        config = self.config
        self.rows: list[Row] = []
        self.seen, self.q_len = 0, 0
        self.finishing: list[tuple[int, int]] = []  # (row, thought) finalized during the current forward
        self.next_finishing: list[tuple[int, int]] = []
        self.voting = self.next_voting = None  # (B,) bool rows voting in this / the next forward
        self.any_voting = self.next_any = False
        zoom = config.zoom
        self.ballot = None if zoom is None else Ballot(zoom.zoom_thoughts, zoom.vote_decay, zoom.margin, self.groups)
        self.tail_start: list[int] = []
        self.zoomed: list[list[set[int]]] = []  # per row and zoom group, the set its buffers were last gathered for
        self.overhead_s, self.steps, self.rebuilds = 0.0, 0, 0
        self.last_zoom: list[list[list[int]]] = []
        self.index: RowIndex | None = None  # every layer's index over the finished thoughts (zoom only)

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
        layer receives this forward's tokens after its rebuild, so the tail stays at the end), start this forward:
        `state`, what every layer is handed (a `ThoughtState`)."""
        t0 = time.perf_counter()
        past, q_len, device = self.seen, new_tokens, attention_mask.device
        if not self.rows:
            batch = attention_mask.shape[0]
            pad = (attention_mask.cumsum(-1) == 0).sum(-1).tolist()  # each row's left padding
            self.rows = [Row(p, q_len) for p in pad]
            for row in self.rows:
                row.zoom = [[] for _ in range(self.groups)]
            self.first_real = torch.tensor(pad, device=device)[:, None]  # (B, 1) each row's first real position
            self.voting = torch.zeros(batch, dtype=torch.bool, device=device)
            self.next_voting = torch.zeros_like(self.voting)
            self.last_zoom = [[[] for _ in range(self.groups)] for _ in range(batch)]
            self.zoomed = [[set() for _ in range(self.groups)] for _ in range(batch)]
            zoom = self.config.zoom
            self.index = None if zoom is None else (BoundsIndex if zoom.index == "bounds" else ThoughtIndex)(batch)
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
            rebuild_rows(self.layers, self.rows, moved, self.seen, self.q_len, self.tail_start, self.zoomed)
            for b in moved:
                self.zoomed[b] = [set(z) for z in self.rows[b].zoom]
        self.finishing, self.next_finishing = self.next_finishing, []
        self.voting, self.next_voting = self.next_voting, torch.zeros_like(self.next_voting)
        self.any_voting, self.next_any = self.next_any, False
        self.steps += q_len == 1
        self.state = ThoughtState(attention_mask, new_tokens, self.first_real, self.any_voting, self.config.kernel)
        self.overhead_s += time.perf_counter() - t0

    def after_forward(self):
        """After the last layer has attended: the thoughts that ended in this forward are finalized in every layer,
        the votes cast, and sliding-window layers drop what their next query cannot see."""
        t0 = time.perf_counter()
        for b, t in self.finishing:
            key = finalize(self.layers, self.config, self.rows[b], b, t, self.seen, self.q_len)
            if key is not None:
                self.index.add(b, key)
        if self.any_voting:
            self.cast_votes(self.state.records)
        for layer in self.layers:
            if layer.sliding is not None:
                layer._slide(self.rows)
        self.overhead_s += time.perf_counter() - t0

    def cast_votes(self, queries: dict[int, torch.Tensor]):
        """After the last layer has attended: the query heads of every layer (`queries`: layer index -> its last query
        (B, Hq, d), what the layers recorded in this forward's state) vote for their best thoughts, all layers in one
        batched product, each query turned back by its layer's RoPE (content against content); the votes land in the
        ballot."""
        layers = [self.layers[i] for i in queries]
        if self.index.width == 0:  # no row has finished a thought yet
            return
        keys, valid = self.index.keys(), self.index.valid()  # (L, B, Hkv, T, d), (B, T)
        if len(layers) < len(self.layers):
            keys = keys[[layer.idx for layer in layers]]
        valid = torch.stack([layer.visible_thoughts(valid, self.rows) for layer in layers])  # (L, B, T)
        q = torch.stack([q.to(keys.device) for q in queries.values()])  # (L, B, Hq, d), with the index (a split model)
        zoom = self.config.zoom
        if zoom.index == "bounds":  # key ranges after RoPE: the query as it attended
            self._tally(layers, bound_votes(q.float(), keys, valid, zoom.votes_per_head), valid)
        else:
            pos = layers[0].positions[:, -1]  # (B,) the newest token's position, the same in every layer
            content = torch.empty_like(q)
            for rope in {id(layer.rope): layer.rope for layer in layers}.values():
                at = [i for i, layer in enumerate(layers) if layer.rope is rope]
                content[at] = unrotate(q[at].transpose(1, 2), pos, rope).transpose(1, 2)  # (Lr, Hq, B, d) turned
            self._tally(layers, head_votes(content.float(), keys, valid, zoom.votes_per_head), valid)
        if zoom.reread and self.ballot.votes is not None:  # the candidates' own keys choose among them
            self.ballot.votes = reread_votes(self.layers, queries, self.ballot.votes, self.voting.tolist(),
                                             zoom.reread)

    def _tally(self, layers: list, top: torch.Tensor, valid: torch.Tensor) -> None:
        """Each voting layer's heads' choices `top` (L, B, Hq, k) of the thoughts marked `valid` (L, B, T) into the
        ballot: one group for the row, or one a layer."""
        hits = valid.gather(2, top.flatten(2)) & self.voting[None, :, None]  # only real thoughts, voting rows
        top, hits = top.flatten(2), hits.float()  # (L, B, Hq k): each layer's votes
        if self.groups == 1:  # one consensus over heads and layers
            top, hits = top.transpose(0, 1).flatten(1)[None], hits.transpose(0, 1).flatten(1)[None]
        elif len(layers) < len(self.layers):  # a layer that cast no vote (a sliding one past every thought) adds none
            at = torch.tensor([layer.idx for layer in layers], device=top.device)
            top = top.new_zeros(len(self.layers), *top.shape[1:]).index_copy_(0, at, top)
            hits = hits.new_zeros(len(self.layers), *hits.shape[1:]).index_copy_(0, at, hits)
        self.ballot.add(top, hits, max(len(r.thoughts) for r in self.rows))

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

    def memory(self) -> dict[str, int]:
        """The layers' bytes, and on the device the index over finished thoughts (one share per layer)."""
        total = super().memory()
        if self.index is not None:
            extra = self.index.layer_bytes() * sum(layer.is_initialized for layer in self.layers)
            for key in ("device", "total", "on_device"):
                total[key] += extra
        return total

    def stats(self) -> dict:
        mem = self.memory()
        return {
            "thoughts_indexed": [len(r.thoughts) for r in self.rows],
            "zoomed_thoughts": [z[0] if self.groups == 1 else z for z in self.last_zoom],  # a list a row (or a layer)
            "selections": 0 if self.ballot is None else self.ballot.selections,
            "rebuilds": self.rebuilds,
            "device_bytes": mem["on_device"],
            "host_bytes": mem["host"],
            "selection_ms_per_token": round(1000 * self.overhead_s / max(self.steps, 1), 3),
        }
