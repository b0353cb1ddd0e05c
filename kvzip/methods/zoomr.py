"""`zoomr`: ZoomR (Yang et al., ACL 2026): thoughts indexed by summaries, zoom-in to the few thoughts a query needs.

Reasoning is cut into thoughts while decoding (a paragraph break ends one by default). Each finished thought keeps
a summary on the device: `summary_tokens` of its own tokens (`summary_source=pooled`, training-free) or the tokens
the model wrote between summary markers (`summary_source=generated`). Its index key is the mean of its summary keys
per layer and KV head, RoPE undone, centred over the row's thoughts. Every thought's full K/V (the detail) goes off
the device. At a selection point every query head of every layer votes for its `votes_per_head` best thoughts; the
`zoom_thoughts` most-voted are zoomed in (their detail loaded back) from the next forward on. Algorithm, options and
the measurements behind their defaults: docs/zoomr.md. The machinery is kvzip/methods/thoughts/ (shared with
`sumr`, kvzip/methods/sumr.py); this file holds the options.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvzip.errors import UserError
from kvzip.methods.base import KVCache, Method, check_choice, check_positive, model_layout
from kvzip.methods.fields import KERNELS
from kvzip.methods.thoughts import budget as thought_budget
from kvzip.methods.thoughts.cache import ThoughtCache
from kvzip.methods.thoughts.layer import ThoughtConfig, Zoom
from kvzip.methods.thoughts.detail import DETAILS, CodedDetail, DenseDetail, Int4Detail, Int8Detail
from kvzip.methods.thoughts.segment import Segmentation, parse_boundary
from kvzip.methods.thoughts.summary import SUMMARY_PICKS, SUMMARY_SOURCES
from kvzip.rope import attention_windows, layer_ropes
from kvzip.placement import layer_devices
from kvzip.sparse.dictionary import prepare_for_devices

SELECT_AT = ("token", "thought")
ZOOM_SCOPES = ("row", "layer")
ZOOM_INDEXES = ("summary", "bounds")


@dataclass
class ThoughtOptions(Method):
    """Options shared by zoomr and sumr: segmentation, summaries and the recent tail (not a method by itself)."""

    keeps_prompt = True
    test_options = {"window": "8", "summary_tokens": "2", "min_thought_tokens": "4", "max_thought_tokens": "8"}
    lossless_options = {"window": "100000"}

    summary_source: str = "pooled"
    summary_pick: str = "norm"
    summary_tokens: int = 4
    window: int = 128
    boundary: str = "\\n\\n"
    min_thought_tokens: int = 8
    max_thought_tokens: int = 128
    begin_marker: str = "<|begin_of_summary|>"
    end_marker: str = "<|end_of_summary|>"
    kernel: str = "auto"  # auto: decode attention in the fused CPU kernel over the token pool where it runs; torch: never

    def __post_init__(self):
        check_choice("summary_source", self.summary_source, SUMMARY_SOURCES)
        check_choice("summary_pick", self.summary_pick, SUMMARY_PICKS)
        check_choice("kernel", self.kernel, KERNELS)
        check_positive(summary_tokens=self.summary_tokens, window=self.window,
                       min_thought_tokens=self.min_thought_tokens)
        if self.max_thought_tokens < self.min_thought_tokens:
            raise ValueError(f"max_thought_tokens ({self.max_thought_tokens}) must be >= min_thought_tokens "
                             f"({self.min_thought_tokens})")
        if not self.begin_marker or not self.end_marker:
            raise ValueError("begin_marker and end_marker must be non-empty")
        parse_boundary(self.boundary)

    def thought_config(self, zoom: Zoom | None = None, detail: list | None = None) -> ThoughtConfig:
        strings, ids = parse_boundary(self.boundary)
        segmentation = Segmentation(strings, ids, self.min_thought_tokens, self.max_thought_tokens,
                                    self.summary_source == "generated", self.begin_marker, self.end_marker)
        return ThoughtConfig(segmentation, self.summary_tokens, self.summary_pick, self.window, zoom, detail,
                             self.kernel)


@dataclass
class ZoomR(ThoughtOptions):
    """ZoomR (Yang et al., ACL 2026): summaries as a coarse index, zoom-in to the full KV of the most-voted thoughts."""

    name = "zoomr"
    summary = "thoughts indexed by summaries; zoom-in to the most-voted thoughts' full KV; detail off the device"
    summary_pick: str = "novel"
    summary_tokens: int = 8
    votes_per_head: int = 2
    zoom_thoughts: int = 2
    select_at: str = "token"
    vote_decay: float = 0.8
    zoom_margin: float = 0.25
    zoom_scope: str = "row"  # row: one consensus over every layer's heads (the paper); layer: each layer its own
    zoom_index: str = "summary"  # summary: the mean of the summary keys (the paper); bounds: each thought's key ranges
    zoom_reread: int = 0  # > 0: the votes' top M thoughts are chosen among by their detail keys' attention mass
    detail: str = "int8"
    detail_sparsity: int = 0  # atoms a detail vector with detail=fadkv; 0: as the dictionary was trained

    def __post_init__(self):
        super().__post_init__()
        check_choice("select_at", self.select_at, SELECT_AT)
        check_choice("detail", self.detail, DETAILS)
        check_choice("zoom_scope", self.zoom_scope, ZOOM_SCOPES)
        check_choice("zoom_index", self.zoom_index, ZOOM_INDEXES)
        check_positive(votes_per_head=self.votes_per_head, zoom_thoughts=self.zoom_thoughts)
        if self.zoom_reread < 0:
            raise ValueError(f"zoom_reread must be >= 0 (0: no reread), got {self.zoom_reread}")
        if self.detail_sparsity < 0:
            raise ValueError(f"detail_sparsity must be >= 0 (0: the dictionary's sparsity), got {self.detail_sparsity}")
        if self.detail_sparsity and self.detail != "fadkv":
            raise ValueError("detail_sparsity is the atoms per vector of detail=fadkv; set detail=fadkv with it")
        if not 0 <= self.vote_decay < 1:
            raise ValueError(f"vote_decay must be in [0, 1), got {self.vote_decay}")
        if not self.zoom_margin >= 0:
            raise ValueError(f"zoom_margin must be >= 0, got {self.zoom_margin}")

    @property
    def needs_dictionary(self) -> bool:
        return self.detail == "fadkv"

    def plan_budget(self, budget, fixed):
        """The device tier by its tail, summaries and zoom count; every tier also by the detail format: int8, then
        int4, then fadkv codes of 2 atoms a vector, the smallest, which leave the device the most room
        (kvzip/methods/thoughts/budget.py)."""
        fewest = self.detail_sparsity if "detail_sparsity" in fixed else thought_budget.CODED_DETAIL_SPARSITY
        if "detail" in fixed:
            details = (("fadkv", fewest) if self.detail == "fadkv" else (self.detail, 0),)
        else:
            details = (("int8", 0), ("int4", 0), ("fadkv", fewest))
        return thought_budget.plan(self, budget, fixed, self.zoom_thoughts, details)

    def make_cache(self, model, dictionaries=None) -> KVCache:
        layers, kv_heads, _ = model_layout(model)
        ropes = layer_ropes(model, f"{self.name} (its content-space index)")
        windows = attention_windows(model, self.name)
        if self.detail == "host":
            detail = [DenseDetail()] * layers
        elif self.detail == "int8":
            detail = [Int8Detail()] * layers
        elif self.detail == "int4":
            detail = [Int4Detail()] * layers
        else:
            if dictionaries is None:
                raise UserError(f"method '{self.name}' with detail=fadkv needs a dictionary trained for this model, "
                                "and none was given")
            trained = dictionaries.meta.get("keys", "post-rope")
            if trained != "post-rope":
                raise UserError(f"method '{self.name}' with detail=fadkv codes post-rope keys; this dictionary was "
                                f"trained on {trained} keys: use a dictionary trained on post-rope keys")
            sparsity = self.detail_sparsity or int(dictionaries.meta.get("sparsity", 8))  # 0: as it was trained
            if sparsity > dictionaries.num_atoms:
                raise UserError(f"detail_sparsity {sparsity} exceeds the dictionary's {dictionaries.num_atoms} atoms")
            detail = [CodedDetail(atoms, sparsity, kv_heads)  # each layer codes with atoms on its own device
                      for atoms in prepare_for_devices(dictionaries, layer_devices(model))]
        zoom = Zoom(self.votes_per_head, self.zoom_thoughts, self.select_at, self.vote_decay, self.zoom_margin,
                    self.zoom_scope, self.zoom_index, self.zoom_reread)
        return ThoughtCache(self, self.thought_config(zoom, detail), ropes, windows)
