"""The eviction skeleton window, h2o and rkv share: a method is its score and its schedule.

- The score is the layer's `keep_index(state)`: which stored tokens stay, as an index (B, K) for one token set per
  row or (B, H, K) for one per KV head, in the order they are kept (None keeps everything). window keeps each row's
  sinks and its newest tokens, h2o the tokens that received the most attention and the newest, rkv per head the
  tokens its recent queries attend to that later keys do not repeat.
- The schedule is the cache's `every`: `EvictCache.after_forward` evicts in every layer after a prompt and after
  every `every` decoded tokens (1 for window and h2o, rkv's `buffer`), counted from the prompt, so that a row evicts
  at the same steps alone or in a left-padded batch.

A layer's forward only stores its new tokens and attends (by default `dense_attention` over the kept tokens with
their positions); what its score needs from the forward it keeps itself (h2o's received attention, rkv's recent
queries). Eviction runs once every layer has attended, and the forward's queries have seen every token stored
before it and its own: the tokens attended are those of an eviction inside `attend`, right after attention.
Eviction compacts each per-token tensor (`EVICTED`) in place (`DenseLayer.keep`): only the slots whose token changes
are written. After it a sliding-window layer drops what its next query cannot see (`slide`), sinks included.
"""

from __future__ import annotations

import typing

import torch

from kvzip.attention import dense_attention
from kvzip.methods.base import DenseLayer, ForwardState, KVCache
from kvzip.rope import visible_from


class EvictLayer(DenseLayer):
    """A dense layer whose tokens a score evicts. Subclasses implement `keep_index`."""

    EVICTED: typing.ClassVar[tuple[str, ...]] = ("keys", "values", "positions")  # what an eviction compacts

    def __init__(self, sliding: int | None = None):
        super().__init__(sliding)
        self.evicted = 0  # tokens evicted or slid out so far

    def reset(self) -> None:
        super().reset()
        self.evicted = 0

    def attend(self, module, query, key, value, mask, scaling, state=None):
        return dense_attention(query, self.keys, self.values, mask, scaling, positions=self.positions)

    def keep_index(self, state: ForwardState | None) -> torch.Tensor | None:
        """The score: the stored tokens to keep, (B, K) or (B, H, K), in the order they are kept; None keeps all."""
        raise NotImplementedError

    def evict(self, state: ForwardState | None = None) -> None:
        """Keep what `keep_index` says, every per-token tensor alike, in place."""
        index = self.keep_index(state)
        if index is None:
            return
        self.evicted += self.keys.shape[2] - index.shape[-1]
        self.keep(self.EVICTED, index)

    def slide(self) -> int:
        """On a sliding-window layer, drop the stored tokens the next query cannot see: each row's oldest (rows stay
        sorted by position). A row whose sinks sit later keeps up to `sinks` more, hidden by the model's mask.
        Positions may be one set per row (B, S) or one per KV head (B, H, S): the columns go where every row (and
        head) can spare them. Returns how many columns went."""
        if self.sliding is None:
            return 0
        drop = int((self.positions < visible_from(self.seen, self.sliding)).sum(-1).min())
        if drop:
            for name in self.EVICTED:
                self.drop(name, drop)
            self.evicted += drop
        return drop


def top_and_recent(score: torch.Tensor, top: int, recent: int) -> torch.Tensor:
    """score (..., S - recent) of the stored tokens but the `recent` newest, -inf where a token must not be kept ->
    index (..., top + recent) of the tokens to keep: the `top` best-scored, in stored order, then the newest. The
    leading dims are (B,) for one token set per row or (B, H) for one per KV head."""
    best = score.topk(top, dim=-1).indices.sort(-1).values
    stored = score.shape[-1] + recent
    newest = torch.arange(stored - recent, stored, device=score.device).expand(*score.shape[:-1], recent)
    return torch.cat([best, newest], dim=-1)


def fill_holes(index: torch.Tensor, stored: int) -> torch.Tensor:
    """index (..., K) of the tokens to keep among `stored` -> the same tokens in the order that moves fewest: the
    view starts m = stored - K columns later and each kept token of the first m columns fills a hole left after them
    (in order); every other token stays where it is. For a method whose attention does not need stored order."""
    m = stored - index.shape[-1]
    kept = torch.zeros(*index.shape[:-1], stored, dtype=torch.bool, device=index.device).scatter_(-1, index, True)
    order = torch.arange(m, stored, device=index.device).expand_as(index).clone()
    front = torch.arange(m, device=index.device).expand(*index.shape[:-1], m)
    return order.masked_scatter_(~kept[..., m:], front[kept[..., :m]])


class EvictCache(KVCache):
    """Evicts in every layer after a prompt's forward and once `every` tokens have been decoded since the last
    eviction; sliding-window layers drop what their next query cannot see after every forward."""

    def __init__(self, layers: list[EvictLayer], method, every: int = 1):
        super().__init__(layers, method)
        self.every = every
        self.since, self.fed, self.prompt = 0, 0, False

    def before_forward(self, attention_mask, new_tokens: int) -> None:
        super().before_forward(attention_mask, new_tokens)
        # A prompt: more than one token, or a cache's first forward (a one-token prompt alone is one in a batch too).
        self.fed, self.prompt = new_tokens, new_tokens > 1 or not self.layers[0].is_initialized

    def after_forward(self) -> None:
        self.since += self.fed
        due = self.prompt or self.since >= self.every
        for layer in self.layers:
            if due:
                layer.evict(self.state)
            layer.slide()
        if due:
            self.since = 0

    def reset(self) -> None:
        super().reset()
        self.since = 0

    def stats(self) -> dict:
        return {"evicted_tokens": self.layers[0].evicted if self.layers[0].is_initialized else 0}
