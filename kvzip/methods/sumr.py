"""`sumr`: the summaries-only baseline of ZoomR: every finished thought keeps its summary on the device, never zooms in.

Same segmentation, summaries and recent tail as `zoomr` (kvzip/methods/zoomr.py) but no votes, no zoom-in and no
detail tier: a thought's other tokens are dropped once it leaves the recent window. The paper's "summaries without
zoom-in" row; comparing it with `zoomr` at the same device budget measures what zoom-in retrieval buys.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass

from kvzip.methods.base import KVCache, model_layout
from kvzip.methods.zoomr import ThoughtOptions, ZoomRCache
from kvzip.rope import attention_windows, layer_ropes


@dataclass
class SumR(ThoughtOptions):
    """Summaries of past thoughts + prompt + recent window; no zoom-in (ZoomR's ablation)."""

    name = "sumr"
    summary = "summaries of past thoughts + prompt + recent window, never zooms in (ZoomR baseline)"
    test_options = {"window": "8", "r": "2", "min_thought": "4", "max_thought": "8"}
    lossless_options = {"window": "100000"}
    k: typing.ClassVar[int] = 0
    c: typing.ClassVar[int] = 0
    select: typing.ClassVar[str] = "thought"
    decay: typing.ClassVar[float] = 0.0
    index: typing.ClassVar[str] = "mean"  # sumr never votes, so how its index is scored does not matter
    index_space: typing.ClassVar[str] = "rotated"

    def make_cache(self, model, dictionaries=None) -> KVCache:
        layers, _, _ = model_layout(model)
        ropes = layer_ropes(model, f"{self.name} pick=novel") if self.pick == "novel" else None
        return ZoomRCache(self, layers, zoom=False, keep_detail=False, ropes=ropes,
                          windows=attention_windows(model, self.name))
