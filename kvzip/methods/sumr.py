"""`sumr`: the summaries-only baseline of ZoomR: every finished thought keeps its summary on the device, never zooms in.

Same segmentation, summaries and recent tail as `zoomr` (kvzip/methods/zoomr.py) but no votes, no zoom-in and no
detail tier: a thought's other tokens are dropped once it leaves the recent window. The paper's "summaries without
zoom-in" row; comparing it with `zoomr` at the same device budget measures what zoom-in retrieval buys.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass

from kvzip.methods.base import KVCache, Method, check_choice, check_positive, model_layout
from kvzip.methods.zoomr import ZoomRCache, parse_boundary


@dataclass
class SumR(Method):
    """Summaries of past thoughts + prompt + recent window; no zoom-in (ZoomR's ablation)."""

    name = "sumr"
    summary = "summaries of past thoughts + prompt + recent window, never zooms in (ZoomR baseline)"
    k: typing.ClassVar[int] = 0
    c: typing.ClassVar[int] = 0
    select: typing.ClassVar[str] = "thought"
    summary_mode: str = "pooled"
    pick: str = "norm"
    r: int = 4
    window: int = 128
    boundary: str = "\\n\\n"
    min_thought: int = 8
    max_thought: int = 128
    begin_marker: str = "<|begin_of_summary|>"
    end_marker: str = "<|end_of_summary|>"

    def __post_init__(self):
        check_choice("summary_mode", self.summary_mode, ("pooled", "generated"))
        check_choice("pick", self.pick, ("norm", "attention", "even"))
        check_positive(r=self.r, window=self.window, min_thought=self.min_thought)
        if self.max_thought < self.min_thought:
            raise ValueError(f"max_thought ({self.max_thought}) must be >= min_thought ({self.min_thought})")
        if not self.begin_marker or not self.end_marker:
            raise ValueError("begin_marker and end_marker must be non-empty")
        parse_boundary(self.boundary)

    @classmethod
    def from_options(cls, opts: dict[str, str]) -> "Method":
        """`--opt summary=...` is accepted for `summary_mode` (`summary` is the method's description)."""
        opts = dict(opts)
        if "summary" in opts:
            opts["summary_mode"] = opts.pop("summary")
        return super().from_options(opts)

    def make_cache(self, model, dictionaries=None) -> KVCache:
        layers, _, _ = model_layout(model)
        return ZoomRCache(self, layers, zoom=False, keep_detail=False)
