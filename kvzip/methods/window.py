"""`window`: StreamingLLM, attention-sink tokens plus a window of recent tokens; everything else is evicted.

The layer keeps the first `sinks` real tokens of each row (they soak up attention mass whatever their content) and
the last `window` tokens. A prefill attends to the whole prompt, then the layer trims down, so memory stops growing
once the window is full. Evicted tokens are gone for good: the baseline every retrieval method has to beat on recall.
On a sliding-window layer (Gemma 3, Mistral) the layer also drops whatever its next query can no longer see, sinks
included: the policy applies within the layer's own window.

The skeleton the scored eviction baselines share: `WindowLayer` (the dense cache, each row's padding, the slide of a
sliding-window layer, the evicted count) and `top_and_recent` (keep the best-scored older tokens and the newest ones).
h2o and rkv differ only in their score and in when they evict (kvzip/methods/h2o.py, kvzip/methods/rkv.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvzip.attention import dense_attention, gather_tokens, leading_padding
from kvzip.methods.base import DenseLayer, KVCache, Method, check_positive
from kvzip.rope import attention_windows, visible_from


class WindowLayer(DenseLayer):
    ROW_TENSORS = DenseLayer.ROW_TENSORS + ("pad",)

    def __init__(self, sinks: int, window: int, sliding: int | None = None):
        super().__init__(sliding)
        self.sinks, self.window = sinks, window
        self.evicted = 0
        self.pad = None  # (B,) left-padding tokens still stored at the front of each row

    def reset(self) -> None:
        super().reset()
        self.evicted, self.pad = 0, None

    def attend(self, module, query, key, value, mask, scaling, state=None):
        if self.pad is None:
            self.pad = leading_padding(mask, self.batch, self.keys.device)
        out = dense_attention(query, key, value, mask, scaling, positions=self.positions)
        self._evict()
        self._slide()
        return out

    def _slide(self) -> int:
        """On a sliding-window layer, drop the stored tokens the next query cannot see: each row's oldest (rows stay
        sorted by position). A row whose sinks sit later keeps up to `sinks` more, hidden by the model's mask.
        Positions may be one set per row (B, S) or one per KV head (B, H, S, rkv's): the columns go where every row
        (and head) can spare them. Returns how many columns went."""
        if self.sliding is None:
            return 0
        drop = int((self.positions < visible_from(self.seen, self.sliding)).sum(-1).min())
        if drop:
            self.keys, self.values = self.keys[:, :, drop:], self.values[:, :, drop:]
            self.positions = self.positions[..., drop:]
            if self.pad is not None:
                self.pad = (self.pad - drop).clamp(min=0)
            self.evicted += drop
        return drop

    def _evict(self):
        """Keep each row's sinks and the last `window` tokens. The tokens to drop are the first `drop` columns after a
        row's sinks (or, for a row still holding left padding in front, part of that padding): each row's sinks move
        forward onto the first of them and the stored tensors start `drop` columns later, a view of the same room. A
        decode step copies `sinks` tokens per row, not the window, and allocates nothing until the room's spare end
        is used up (kvzip.methods.base.DenseLayer.extend)."""
        keep = self.sinks + self.window
        stored = self.keys.shape[2]
        if stored <= keep:
            return
        drop = stored - keep
        # Per row: sinks start at the first real token (or earlier when the row holds fewer than `keep` real ones).
        start = torch.minimum(self.pad, torch.full_like(self.pad, drop))  # (B,)
        if self.sinks:
            sink_idx = start[:, None] + torch.arange(self.sinks, device=start.device)  # (B, sinks)
            for name in ("keys", "values"):  # gathered first: the source and the target may overlap
                getattr(self, name)[:, :, drop : drop + self.sinks] = gather_tokens(getattr(self, name), sink_idx)
            self.positions[:, drop : drop + self.sinks] = self.positions.gather(1, sink_idx)
        self.keys, self.values = self.keys[:, :, drop:], self.values[:, :, drop:]
        self.positions = self.positions[:, drop:]
        self.pad = self.pad - start
        self.evicted += drop

def top_and_recent(score: torch.Tensor, top: int, recent: int) -> torch.Tensor:
    """score (..., S - recent) of the stored tokens but the `recent` newest, -inf where a token must not be kept ->
    index (..., top + recent) of the tokens to keep: the `top` best-scored, in stored order, then the newest. The
    leading dims are (B,) for one token set per row or (B, H) for one per KV head."""
    best = score.topk(top, dim=-1).indices.sort(-1).values
    stored = score.shape[-1] + recent
    newest = torch.arange(stored - recent, stored, device=score.device).expand(*score.shape[:-1], recent)
    return torch.cat([best, newest], dim=-1)


class WindowCache(KVCache):
    def stats(self) -> dict:
        return {"evicted_tokens": self.layers[0].evicted if self.layers[0].is_initialized else 0}


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
        return WindowCache([WindowLayer(self.sinks, self.window, w) for w in windows], self)
