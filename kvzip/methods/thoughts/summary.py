"""Summaries: which of a finished thought's tokens stay on the device, for every later query to attend to.

With `summary_source=pooled` (training-free, the default) each layer keeps `summary_tokens` of the thought's own
tokens, picked by `summary_pick`:
- `norm`: the largest key norms summed over KV heads (sumr's default; needs no RoPE);
- `novel`: the tokens least like anything already kept before the thought. Per token, 1 - the largest cosine of its
  key with any key on the device from before the thought (prompt, earlier summaries), RoPE undone on both, summed
  over KV heads. Words every note shares ("Note", "box") score low; the thought's own content scores high.
With `summary_source=generated` the summary is the span the model wrote between the markers (kvzip.methods.thoughts
.segment), and nothing is picked.
"""

from __future__ import annotations

import torch

from kvzip.methods.thoughts.index import ranked
from kvzip.rope import unrotate

SUMMARY_SOURCES = ("pooled", "generated")
SUMMARY_PICKS = ("norm", "novel")


def novelty(mine: torch.Tensor, seen: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Content keys of the thought's tokens (..., Hkv, n, d) against those before it (..., Hkv, R, d) -> novelty
    (..., n); a leading dimension is layers scored together, `valid` (..., R) which of `seen` count (all: None)."""
    if seen.shape[-2] == 0:
        return mine.norm(dim=-1).sum(-2)
    cos = torch.nn.functional.normalize(mine, dim=-1) @ torch.nn.functional.normalize(seen, dim=-1).transpose(-1, -2)
    if valid is not None:
        cos = cos.masked_fill(~valid[..., None, None, :], float("-inf"))
    return (1 - cos.amax(-1)).sum(-2)  # (..., n)


def pick_summary(keys: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, before: torch.Tensor, count: int,
                 pick: str, rope=None, valid: torch.Tensor | None = None) -> torch.Tensor:
    """The buffer slots a pooled summary keeps, in buffer order: `count` (at most) of the thought's `slots` (n,).

    keys (..., Hkv, S, d) and pos (..., S) are one row's active buffer, a leading dimension being layers that keep
    their tokens in the same slots (each picks its own); `before` (R,) the slots of the real tokens before the
    thought (what `novel` compares with), `valid` (..., R) those of them that are real in each layer (all: None);
    `rope` the layers' Rope, for `novel`. Returns (..., count) slots.
    """
    count = min(count, slots.numel())
    mine = keys.index_select(-2, slots)  # (..., Hkv, n, d)
    if pick == "novel":
        turned = unrotate(mine.float(), pos.index_select(-1, slots).unsqueeze(-2), rope)  # positions per layer
        seen = unrotate(keys.index_select(-2, before).float(), pos.index_select(-1, before).unsqueeze(-2), rope)
        score = novelty(turned, seen, valid)
    else:
        score = mine.norm(dim=-1).sum(-2)
    return slots[ranked(score)[..., :count].sort().values]
