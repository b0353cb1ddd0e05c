"""`rkv`: R-KV (Cai et al., 2025, arXiv:2505.24133, "R-KV: Redundancy-aware KV Cache Compression for Reasoning
Models"): every `buffer` decoded tokens, each KV head keeps the `budget` tokens that its recent queries attend to and
that later tokens do not repeat; the rest are evicted.

A compression scores every stored token but the observation window (the `window` newest, always kept) per KV head:
importance is the attention it gets from the window's queries (kept in the layer, softmax over what each saw,
averaged over those queries and the query heads of the KV head, max-pooled over `pool` neighbours); redundancy is
how closely a later token's key repeats its key (the largest cosine similarity with the keys after it, as a softmax
over the candidates so that both terms are distributions). The score is mix * importance - (1 - mix) * redundancy; the
best `budget - window` stay with the window. Each head keeps its own tokens, the same count, so the batch stays a
dense (B, H, S, d) tensor with positions (B, H, S). A layer's forward only attends and keeps its queries; the eviction
skeleton (kvzip/methods/evict.py) compresses every layer after every prompt (the prompt is evictable like any token:
one budget for the whole cache) and after every `buffer` decoded tokens. Padding and what a sliding-window layer's
next query cannot see are never candidates. Defaults and why: docs/rkv.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvzip.attention import causal_tail, dense_attention, leading_padding
from kvzip.methods.base import KVCache, Method, check_positive, tensor_bytes
from kvzip.methods.evict import EvictCache, EvictLayer, top_and_recent
from kvzip.rope import attention_windows, visible_from

CHUNK = 1024  # candidates whose similarities are held at once: a 32k-token prompt's would take 4 GiB per head


def importance(queries, keys, allowed, scaling):
    """queries (B, Hq, w, d) the observation window; keys (B, H, S, d); allowed (B, H, w, S) which keys each query
    sees -> (B, H, S): the attention each stored token gets, averaged over the window's queries that see anything
    (a left-padding query sees nothing) and over the query heads of its KV head."""
    b, hq, w, d = queries.shape
    h, s = keys.shape[1], keys.shape[2]
    g = hq // h
    logits = (queries.float().reshape(b, h, g * w, d) @ keys.float().transpose(-1, -2)) * scaling  # (B, H, g*w, S)
    logits = logits.view(b, h, g, w, s).masked_fill(~allowed[:, :, None], float("-inf"))
    weights = logits.softmax(-1).nan_to_num()  # (B, H, g, w, S)
    real = allowed.any(-1).sum(-1).clamp(min=1)  # (B, H) queries that see anything
    return weights.sum((2, 3)) / (g * real)[..., None]


def redundancy(keys, valid, old):
    """keys (B, H, S, d) in stored (position) order, valid (B, H, S) -> (B, H, old): for each of the first `old` tokens
    the largest cosine similarity of its key with a later valid token's key (a near-copy further on makes it
    redundant, the newest copy is not), as a softmax over the valid ones; 0 where not valid."""
    unit = F.normalize(keys.float(), dim=-1)
    s = keys.shape[2]
    repeat = []
    for start in range(0, old, CHUNK):
        rows = torch.arange(start, min(start + CHUNK, old), device=keys.device)
        later = torch.arange(s, device=keys.device) > rows[:, None]  # (rows, S)
        sim = unit[:, :, rows] @ unit.transpose(-1, -2)  # (B, H, rows, S)
        sim = sim.masked_fill(~(later & valid[:, :, None, :]), float("-inf"))
        repeat.append(sim.amax(-1).clamp(min=-1.0))  # a token with no later valid one counts as unrepeated
    repeat = torch.cat(repeat, dim=-1)  # (B, H, old)
    return repeat.masked_fill(~valid[..., :old], float("-inf")).softmax(-1).nan_to_num()


def rkv_score(importance, redundancy, valid, mix: float, pool: int):
    """(B, H, n) each: mix * importance (max-pooled over `pool` stored neighbours) - (1 - mix) * redundancy; -inf
    where not valid. Max pooling: padding's zero importance never lowers a real neighbour's."""
    if pool > 1:
        b, h, n = importance.shape
        importance = F.max_pool1d(importance.reshape(b * h, 1, n), pool, stride=1, padding=pool // 2).view(b, h, n)
    return (mix * importance - (1 - mix) * redundancy).masked_fill(~valid, float("-inf"))


def per_head_attention(query, keys, values, allowed, scaling):
    """Attention when each KV head holds its own tokens: query (B, Hq, q, d); keys, values (B, H, S, d); allowed
    (B, H, q, S), (q, S) or None. Each KV head's query heads are stacked as query rows (as `grouped_attention`), so
    that the mask can differ by head. Returns (B, q, Hq, d)."""
    b, hq, q, d = query.shape
    h, s = keys.shape[1], keys.shape[2]
    g = hq // h
    if allowed is not None and q > 1:  # one mask row per query position, repeated for each stacked head
        allowed = allowed.expand(b, h, q, s)[:, :, None].expand(b, h, g, q, s).reshape(b, h, g * q, s)
    out = F.scaled_dot_product_attention(query.reshape(b, h, g * q, d), keys, values, attn_mask=allowed, scale=scaling)
    return out.view(b, hq, q, d).transpose(1, 2).contiguous()


class RKVLayer(EvictLayer):
    ROW_TENSORS = EvictLayer.ROW_TENSORS + ("first", "queries")

    def __init__(self, budget: int, window: int, mix: float, pool: int, sliding: int | None = None):
        super().__init__(sliding)
        self.budget, self.window, self.mix, self.pool = budget, window, mix, pool
        self.reset()

    def reset(self) -> None:
        super().reset()
        self.first = None  # (B,) position of each row's first real token, from the first forward's mask
        self.queries = None  # (B, Hq, <= window, d) the observation window's queries
        self.per_head = False  # whether the heads of a row hold different tokens yet

    @staticmethod
    def _token_axis(x: torch.Tensor) -> int:
        return 2  # keys, values, queries (B, H, S, d) and positions (B, H, S)

    def lazy_initialization(self, key_states, value_states):
        super().lazy_initialization(key_states, value_states)
        self.positions = torch.zeros(self.batch, self.kv_heads, 0, dtype=torch.long, device=self.device)

    def new_positions(self, q: int) -> torch.Tensor:
        """(B, H, q): every head keeps its own tokens, so positions are per head."""
        return torch.arange(self.seen, self.seen + q, device=self.device).expand(self.batch, self.kv_heads, q)

    def attend(self, module, query, key, value, mask, scaling, state=None):
        b, hq, q, d = query.shape
        if self.first is None:
            self.first = leading_padding(mask, self.batch, self.device)
            self.queries = query.new_zeros(b, hq, 0, d)
        if self.per_head:
            out = per_head_attention(query, self.keys, self.values, self._allowed(mask, q), scaling)
        else:  # every head holds the same tokens: the shared path, SDPA's causal kernel for a prompt
            out = dense_attention(query, self.keys, self.values, mask, scaling, positions=self.positions[:, 0])
        self.scaling = scaling
        kept = self.extend("queries", query[:, :, -self.window:]).shape[2]
        if kept > self.window:
            self.drop("queries", kept - self.window)
        return out

    def _allowed(self, mask, q: int):
        """Which stored tokens each new query of each head sees: (B, H, q, S) from the model's mask over virtual
        positions, else (q, S) causal among the new tokens, or None (one query, no mask: everything)."""
        b, h, s = self.positions.shape
        if mask is not None:
            index = self.positions[:, :, None, :].expand(b, h, q, s)
            return mask.expand(b, h, q, mask.shape[-1]).gather(-1, index)
        return causal_tail(q, s, self.device) if q > 1 else None

    def keep_index(self, state):
        """Per KV head the `budget - window` best-scored tokens and the observation window, if it holds more."""
        stored = self.keys.shape[2]
        recent = min(self.window, stored)
        old, top = stored - recent, self.budget - self.window
        if old <= top:
            return None
        self.per_head = True
        return top_and_recent(self._score(old), top, recent)  # (B, H, top + recent)

    def _score(self, old: int) -> torch.Tensor:
        """(B, H, old) the score of every stored token but the observation window."""
        pos = self.positions[:, :, None, :]  # (B, H, 1, S)
        w = self.queries.shape[2]
        at = torch.arange(self.seen - w, self.seen, device=self.device)[:, None]  # (w, 1) the window's positions
        real = pos >= self.first[:, None, None, None]
        allowed = real & (pos <= at)  # (B, H, w, S)
        if self.sliding is not None:
            allowed &= pos > at - self.sliding
        valid = (real & (pos >= visible_from(self.seen, self.sliding)))[:, :, 0]  # (B, H, S)
        imp = importance(self.queries, self.keys, allowed, self.scaling)[..., :old]
        return rkv_score(imp, redundancy(self.keys, valid, old), valid[..., :old], self.mix, self.pool)

    def memory(self) -> dict[str, int]:
        return {"device": tensor_bytes(self.keys, self.values, self.queries)}


@dataclass
class RKV(Method):
    """R-KV: per-head budgeted eviction by recent attention minus key redundancy, every `buffer` tokens."""

    name = "rkv"
    summary = "R-KV: every `buffer` tokens each KV head keeps `budget` tokens by recent attention minus key redundancy"
    test_options = {"budget": "16", "buffer": "8", "window": "4"}
    lossless_options = {"budget": "100000"}
    budget: int = 384
    buffer: int = 128
    window: int = 8
    mix: float = 0.1
    pool: int = 7

    def __post_init__(self):
        check_positive(budget=self.budget, buffer=self.buffer, window=self.window, pool=self.pool)
        if self.window >= self.budget:
            raise ValueError(f"window must be smaller than budget (the budget includes it), got window={self.window}, "
                             f"budget={self.budget}")
        if not 0.0 <= self.mix <= 1.0:
            raise ValueError(f"mix must be in [0, 1] (1: attention only, 0: redundancy only), got {self.mix}")
        if self.pool % 2 == 0:
            raise ValueError(f"pool must be odd (a window centred on each token; 1 turns pooling off), got {self.pool}")

    def plan_budget(self, budget, fixed):
        """A layer holds up to `budget + buffer - 1` tokens (just before a compression) plus its observation window's
        queries: F buys those. The buffer is a quarter of what F buys, at most its default (R-KV's 128)."""
        from kvzip.budget import Plan

        shape, keep = budget.shape, budget.dense_tokens
        queries = self.window * shape.heads / (2 * shape.kv_heads)  # the window's queries, in tokens' K and V bytes
        buffer = self.buffer if "buffer" in fixed else max(1, min(self.buffer, keep // 4))
        kept = int(keep - buffer + 1 - queries)
        if kept <= self.window:
            floor = (self.window + buffer + queries) / budget.tokens
            return Plan({}, floor, f"keeps at least its {self.window}-token window and {buffer}-token buffer")
        held = min(kept + buffer - 1, budget.tokens) + queries
        return Plan({"budget": kept, "buffer": buffer}, held / budget.tokens)

    def make_cache(self, model, dictionaries=None) -> KVCache:
        windows = attention_windows(model, self.name)
        layers = [RKVLayer(self.budget, self.window, self.mix, self.pool, w) for w in windows]
        return EvictCache(layers, self, every=self.buffer)
