"""`sumr`: the summaries-only baseline of ZoomR: every finished thought keeps its summary on the device, never zooms in.

Same segmentation, summaries and recent tail as `zoomr` (kvzip/methods/zoomr.py) but no index, no votes, no zoom-in
and no detail tier: a thought's other tokens are dropped once it leaves the recent window. The paper's "summaries
without zoom-in" row; comparing it with `zoomr` at the same device budget measures what zoom-in retrieval buys.
Its defaults are the first defaults of the shared options (`summary_pick=norm`, `summary_tokens=4`: docs/zoomr.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvzip.methods.base import KVCache, model_layout
from kvzip.methods.thoughts import budget as thought_budget
from kvzip.methods.thoughts.cache import ThoughtCache
from kvzip.methods.zoomr import ThoughtOptions
from kvzip.rope import attention_windows, layer_ropes


@dataclass
class SumR(ThoughtOptions):
    """Summaries of past thoughts + prompt + recent window; no zoom-in (ZoomR's ablation)."""

    name = "sumr"
    summary = "summaries of past thoughts + prompt + recent window, never zooms in (ZoomR baseline)"

    def plan_budget(self, budget, fixed):
        """Its tail and summaries, as zoomr's device tier without zoom (kvzip/methods/thoughts/budget.py)."""
        return thought_budget.plan(self, budget, fixed, zoom=0)

    def make_cache(self, model, dictionaries=None) -> KVCache:
        layers, _, _ = model_layout(model)
        novel = self.summary_pick == "novel"  # the only part of sumr that turns keys back
        ropes = layer_ropes(model, f"{self.name} summary_pick=novel") if novel else [None] * layers
        return ThoughtCache(self, self.thought_config(), ropes, attention_windows(model, self.name))
