"""`window`: StreamingLLM, attention-sink tokens plus a window of recent tokens; everything else is evicted.

The layer keeps the first `sinks` real tokens of each row (they soak up attention mass whatever their content) and
the last `window` tokens. A prefill attends to the whole prompt, then the cache trims every layer down
(kvzip/methods/evict.py: the score is which tokens stay, the schedule every forward), so memory stops growing once
the window is full. Evicted tokens are gone for good: the baseline every retrieval method has to beat on recall.
On a sliding-window layer (Gemma 3, Mistral) the layer also drops whatever its next query can no longer see, sinks
included: the policy applies within the layer's own window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvzip.attention import leading_padding
from kvzip.methods.base import KVCache, Method, check_positive
from kvzip.methods.evict import EvictCache, EvictLayer
from kvzip.rope import attention_windows


class WindowLayer(EvictLayer):
    ROW_TENSORS = EvictLayer.ROW_TENSORS + ("pad",)

    def __init__(self, sinks: int, window: int, sliding: int | None = None):
        super().__init__(sliding)
        self.sinks, self.window = sinks, window
        self.pad = None  # (B,) left-padding tokens still stored at the front of each row

    def reset(self) -> None:
        super().reset()
        self.pad = None

    def attend(self, module, query, key, value, mask, scaling, state=None):
        if self.pad is None:
            self.pad = leading_padding(mask, self.batch, self.keys.device)
        return super().attend(module, query, key, value, mask, scaling, state)

    def keep_index(self, state):
        """Each row's sinks and the last `window` tokens. The tokens to drop are the first `drop` columns after a
        row's sinks (or, for a row still holding left padding in front, part of that padding): each row's sinks move
        onto the last of them, so a decode step writes `sinks` tokens per row, not the window."""
        keep = self.sinks + self.window
        stored = self.keys.shape[2]
        if stored <= keep:
            return None
        drop = stored - keep
        # Per row: sinks start at the first real token (or earlier when the row holds fewer than `keep` real ones).
        start = torch.minimum(self.pad, torch.full_like(self.pad, drop))  # (B,)
        self.pad = self.pad - start
        sinks = start[:, None] + torch.arange(self.sinks, device=start.device)  # (B, sinks)
        recent = torch.arange(drop + self.sinks, stored, device=start.device).expand(self.batch, self.window)
        return torch.cat([sinks, recent], dim=1)

    def slide(self) -> int:
        drop = super().slide()
        if drop and self.pad is not None:
            self.pad = (self.pad - drop).clamp(min=0)
        return drop


@dataclass
class Window(Method):
    """StreamingLLM (Xiao et al., 2024, arXiv:2309.17453): attention sinks + recent window."""

    name = "window"
    summary = "StreamingLLM: attention-sink tokens + a window of recent tokens, the rest evicted"
    test_options = {"sinks": "2", "window": "8"}
    lossless_options = {"window": "100000"}
    sinks: int = 4
    window: int = 508

    def __post_init__(self):
        check_positive(window=self.window)
        if self.sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {self.sinks}")

    def plan_budget(self, budget, fixed):
        """F buys `budget.dense_tokens` tokens: the sinks (at most an eighth of them) and the window."""
        from kvzip.budget import Plan

        keep = budget.dense_tokens
        sinks = self.sinks if "sinks" in fixed else min(self.sinks, keep // 8)
        if keep - sinks < 1:
            return Plan({}, (sinks + 1) / budget.tokens, f"keeps at least {sinks + 1} tokens")
        return Plan({"sinks": sinks, "window": keep - sinks}, min(keep, budget.tokens) / budget.tokens)

    def make_cache(self, model, dictionaries=None) -> KVCache:
        windows = attention_windows(model, self.name)
        return EvictCache([WindowLayer(self.sinks, self.window, w) for w in windows], self)
