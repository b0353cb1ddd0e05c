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


def novelty(mine: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """Content keys of the thought's tokens (Hkv, n, d) against those before it (Hkv, R, d) -> novelty (n,)."""
    if seen.shape[1] == 0:
        return mine.norm(dim=-1).sum(0)
    cos = torch.nn.functional.normalize(mine, dim=-1) @ torch.nn.functional.normalize(seen, dim=-1).transpose(1, 2)
    return (1 - cos.amax(-1)).sum(0)  # (n,)


def pick_summary(keys: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, before: torch.Tensor, count: int,
                 pick: str, rope=None) -> torch.Tensor:
    """The buffer slots a pooled summary keeps, in buffer order: `count` (at most) of the thought's `slots`.

    keys (Hkv, S, d) and pos (S,) are one row's active buffer; `before` (R,) the slots of the real tokens before
    the thought (what `novel` compares with); `rope` the layer's Rope, for `novel`.
    """
    count = min(count, slots.numel())
    if pick == "novel":
        mine = unrotate(keys[:, slots].float(), pos[slots], rope)  # (Hkv, n, d)
        seen = unrotate(keys[:, before].float(), pos[before], rope)  # (Hkv, R, d)
        score = novelty(mine, seen)
    else:
        score = keys[:, slots].norm(dim=-1).sum(0)
    return slots[ranked(score)[:count].sort().values]
