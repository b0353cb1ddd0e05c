"""`full`: the uncompressed reference cache.

Stores every key and value like transformers' DynamicLayer and leaves attention to the stock SDPA path, so greedy
output is token-identical to `model.generate`. Every other method is measured against it. A sliding-window layer
(Gemma 3, Mistral) keeps its last window - 1 tokens, as transformers' own cache does (DynamicSlidingWindowLayer):
a full cache of such a model holds no more than that either.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from kvzip.methods.base import KVCache, Method, tensor_bytes
from kvzip.rope import attention_windows


class FullLayer(DynamicLayer):
    """DynamicLayer plus the memory report kvzip's engine reads."""

    def lazy_initialization(self, key_states, value_states):
        super().lazy_initialization(key_states, value_states)
        self.dtype = key_states.dtype

    def memory(self) -> dict[str, int]:
        return {"device": tensor_bytes(self.keys, self.values)}

    def full_bytes(self, element_size: int) -> int:
        if self.keys is None or self.keys.dim() != 4:
            return 0
        return 2 * self.keys[..., 0].numel() * self.keys.shape[-1] * element_size


class FullSlidingLayer(FullLayer, DynamicSlidingWindowLayer):
    """DynamicSlidingWindowLayer (keeps the last window - 1 tokens) with FullLayer's memory report."""


@dataclass
class Full(Method):
    name = "full"
    summary = "uncompressed cache, the reference (token-identical to transformers greedy)"

    def make_cache(self, model, dictionaries=None) -> KVCache:
        windows = attention_windows(model)
        return KVCache([FullLayer() if w is None else FullSlidingLayer(sliding_window=w) for w in windows], self)

