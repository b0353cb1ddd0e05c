"""`h2o`: Heavy-Hitter Oracle (Zhang et al., NeurIPS 2023, arXiv:2306.14048): keep the tokens that received the most
attention so far plus a recent window; evict the rest.

Every forward computes attention explicitly to add each stored token's received attention (summed over query heads
and the new queries) to its running score; the prefill scores the prompt with its own causal attention. After each
forward a row keeps its `window` newest tokens and the `heavy` highest-scoring older ones. One token set per layer,
shared by its KV heads (the paper selects per head; a shared set keeps the batch a dense (B, H, S, d) tensor).
On a sliding-window layer the heavy hitters are chosen among the tokens its queries can still see, and the rest go
(kvzip/methods/window.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvzip.attention import attention_with_received, causal_tail, gather_mask, gather_tokens
from kvzip.methods.base import KVCache, Method, check_positive, tensor_bytes
from kvzip.methods.window import WindowCache, WindowLayer, top_and_recent
from kvzip.rope import attention_windows, visible_from


class H2OLayer(WindowLayer):
    ROW_TENSORS = WindowLayer.ROW_TENSORS + ("score",)

    def __init__(self, heavy: int, window: int, sliding: int | None = None):
        super().__init__(sinks=0, window=window, sliding=sliding)
        self.heavy = heavy

    def lazy_initialization(self, key_states, value_states):
        super().lazy_initialization(key_states, value_states)
        self.score = torch.empty(self.batch, 0, device=key_states.device)  # (B, S) attention received

    def update(self, key_states, value_states, *args, **kwargs):
        out = super().update(key_states, value_states)
        self.extend("score", self.score.new_zeros(self.batch, key_states.shape[2]))
        return out

    def attend(self, module, query, key, value, mask, scaling, state=None):
        q_len, s = query.shape[2], self.keys.shape[2]
        if mask is not None:
            m = gather_mask(mask, self.positions)  # (B, 1, q, S)
        else:
            m = causal_tail(q_len, s, query.device)
        out, received = attention_with_received(query, self.keys, self.values, m, scaling)  # (B, q, Hq, d), (B, S)
        self.score += received
        self._evict(mask)
        drop = self._slide()
        self.score = self.score[:, drop:]
        return out

    def _evict(self, mask):
        stored = self.keys.shape[2]
        keep = self.heavy + self.window
        if stored <= keep:
            return
        old = self.score[:, : stored - self.window].clone()  # (B, S - window) candidates for heavy hitters
        if self.sliding is not None:  # tokens out of the layer's window are never heavy hitters
            old = old.masked_fill(self.positions[:, : stored - self.window] < visible_from(self.seen, self.sliding),
                                  float("-inf"))
        if mask is not None:  # padding never counts as a heavy hitter
            real = gather_mask(mask[:, :, -1:], self.positions[:, : stored - self.window])[:, 0, 0]
            old = old.masked_fill(~real, float("-inf"))
        index = top_and_recent(old, self.heavy, self.window)  # (B, keep)
        if stored - keep == 1 and self.sliding is None:  # a decode step: one token goes per row
            self._drop_one(index[:, : self.heavy], stored - self.window)
        else:
            self.keys, self.values = gather_tokens(self.keys, index), gather_tokens(self.values, index)
            self.positions, self.score = self.positions.gather(1, index), self.score.gather(1, index)
        self.evicted += stored - keep

    def _drop_one(self, heavy: torch.Tensor, candidates: int) -> None:
        """Drop each row's one candidate that `heavy` (B, heavy) leaves out: the row's first column is copied onto it
        and the stored tensors start one column later (the same room, nothing allocated). The heavy hitters' order no
        longer follows their positions, which attention does not need (a sliding-window layer's slide does: it takes
        the gather path)."""
        kept = torch.zeros(self.batch, candidates, dtype=torch.bool, device=heavy.device).scatter_(1, heavy, True)
        hole = (~kept).int().argmax(1)  # (B,) the column that goes
        for name in ("keys", "values", "positions", "score"):
            x = getattr(self, name)
            dim = self._token_axis(x)
            at = hole.view(-1, *[1] * (x.dim() - 1)).expand(*x.shape[:dim], 1, *x.shape[dim + 1 :])
            x.scatter_(dim, at, x.narrow(dim, 0, 1).clone())
            setattr(self, name, x.narrow(dim, 1, x.shape[dim] - 1))

    def memory(self) -> dict[str, int]:
        return {"device": tensor_bytes(self.keys, self.values, self.score)}


@dataclass
class H2O(Method):
    """H2O: heavy hitters by accumulated attention + recent window."""

    name = "h2o"
    summary = "H2O: heavy-hitter tokens by accumulated attention + a recent window, the rest evicted"
    test_options = {"heavy": "4", "window": "8"}
    lossless_options = {"heavy": "100000", "window": "100000"}
    heavy: int = 256
    window: int = 256

    def __post_init__(self):
        check_positive(heavy=self.heavy, window=self.window)

    def plan_budget(self, budget, fixed):
        """F buys `budget.dense_tokens` tokens, half heavy hitters and half recent (the defaults' split); each kept
        token also holds its fp32 score, counted in the expected ratio."""
        from kvzip.budget import Plan

        keep, shape = budget.dense_tokens, budget.shape
        score = 4 / (2 * shape.kv_heads * shape.vector_bytes)  # a score per token per layer, against its K and V
        if keep < 2:
            return Plan({}, 2 * (1 + score) / budget.tokens, "keeps at least 2 tokens")
        heavy = keep // 2
        return Plan({"heavy": heavy, "window": keep - heavy}, min(keep, budget.tokens) * (1 + score) / budget.tokens)

    def make_cache(self, model, dictionaries=None) -> KVCache:
        windows = attention_windows(model, self.name)
        return WindowCache([H2OLayer(self.heavy, self.window, w) for w in windows], self)
