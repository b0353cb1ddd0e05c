"""`h2o`: Heavy-Hitter Oracle (Zhang et al., NeurIPS 2023, arXiv:2306.14048): keep the tokens that received the most
attention so far plus a recent window; evict the rest.

Every forward computes attention explicitly to add each stored token's received attention (summed over query heads
and the new queries) to its running score; the prefill scores the prompt with its own causal attention. After each
forward (the eviction skeleton, kvzip/methods/evict.py) a row keeps its `window` newest tokens and the `heavy`
highest-scoring older ones; a decode step's one evicted token is overwritten by the row's first column (`fill_holes`).
One token set per layer, shared by its KV heads (the paper selects per head; a shared set keeps the batch a dense
(B, H, S, d) tensor).
On a sliding-window layer the heavy hitters are chosen among the tokens its queries can still see, and the rest go
(kvzip/methods/evict.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvzip.attention import attention_with_received, causal_tail, gather_mask
from kvzip.methods.base import KVCache, Method, check_positive, tensor_bytes
from kvzip.methods.evict import EvictCache, EvictLayer, fill_holes, top_and_recent
from kvzip.rope import attention_windows, visible_from


class H2OLayer(EvictLayer):
    ROW_TENSORS = EvictLayer.ROW_TENSORS + ("score",)
    EVICTED = EvictLayer.EVICTED + ("score",)

    def __init__(self, heavy: int, window: int, sliding: int | None = None):
        super().__init__(sliding)
        self.heavy, self.window = heavy, window

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
        return out

    def keep_index(self, state):
        """The `heavy` best-scored tokens but the newest `window`, then those. Padding and what a sliding-window
        layer's next query cannot see are never heavy hitters. A decode step's one evicted token is overwritten by the
        row's first column, whose order attention does not need (a sliding-window layer's slide does: it keeps
        stored order)."""
        stored = self.keys.shape[2]
        keep = self.heavy + self.window
        if stored <= keep:
            return None
        old = self.score[:, : stored - self.window]  # (B, S - window) candidates for heavy hitters
        candidates = self.positions[:, : stored - self.window]
        if self.sliding is not None:  # tokens out of the layer's window are never heavy hitters
            old = old.masked_fill(candidates < visible_from(self.seen, self.sliding), float("-inf"))
        if state is not None and state.attention_mask is not None:  # padding never counts as a heavy hitter
            real = state.attention_mask.to(candidates.device).gather(1, candidates).bool()
            old = old.masked_fill(~real, float("-inf"))
        index = top_and_recent(old, self.heavy, self.window)  # (B, keep)
        if stored - keep == 1 and self.sliding is None:
            index = fill_holes(index, stored)
        return index

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
        return EvictCache([H2OLayer(self.heavy, self.window, w) for w in windows], self)
