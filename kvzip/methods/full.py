"""`full`: the uncompressed reference cache.

Stores every key and value like transformers' DynamicLayer and leaves attention to the stock SDPA path, so greedy
output is token-identical to `model.generate`. Every other method is measured against it. `attention=kvzip` keeps
the same tokens but attends as kvzip's compressed methods do (kvzip.attention.dense_attention: query heads stacked
per KV head when decoding on CPU), so a speed ratio can be read apart from the attention kernel. A sliding-window layer
(Gemma 3, Mistral) keeps its last window - 1 tokens, as transformers' own cache does (DynamicSlidingWindowLayer):
a full cache of such a model holds no more than that either.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from kvzip.attention import dense_attention
from kvzip.methods.base import DenseLayer, FullBytes, KVCache, Method, check_choice, record_shape, tensor_bytes
from kvzip.rope import attention_windows


class FullLayer(FullBytes, DynamicLayer):
    """DynamicLayer plus the memory report kvzip's engine reads."""

    def lazy_initialization(self, key_states, value_states):
        super().lazy_initialization(key_states, value_states)
        record_shape(self, key_states)

    def memory(self) -> dict[str, int]:
        return {"device": tensor_bytes(self.keys, self.values)}


class FullSlidingLayer(FullLayer, DynamicSlidingWindowLayer):
    """DynamicSlidingWindowLayer (keeps the last window - 1 tokens) with FullLayer's memory report."""

    def __init__(self, sliding_window: int):
        super().__init__(sliding_window=sliding_window)
        self.sliding = sliding_window


class KvzipAttentionLayer(DenseLayer):
    """Every token kept, attention by kvzip's own path (`Full(attention="kvzip")`)."""

    def attend(self, module, query, key, value, mask, scaling, state=None):
        return dense_attention(query, key, value, mask, scaling)


@dataclass
class Full(Method):
    name = "full"
    summary = "uncompressed cache, the reference (token-identical to transformers greedy)"
    attention: str = "sdpa"  # "kvzip": the same cache attended by kvzip's decode path (module docstring)

    def __post_init__(self):
        check_choice("attention", self.attention, ("sdpa", "kvzip"))

    def plan_budget(self, budget, fixed):
        from kvzip.budget import Plan

        return Plan({}, 1.0, "" if budget.fraction == 1 else "full keeps every token")

    def make_cache(self, model, dictionaries=None) -> KVCache:
        windows = attention_windows(model)
        dense = FullLayer if self.attention == "sdpa" else KvzipAttentionLayer
        return KVCache([dense() if w is None else FullSlidingLayer(sliding_window=w) for w in windows], self)

