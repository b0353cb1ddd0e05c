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
from kvzip.rope import as_rope, phasors, to_pairs, turn_pairs

SUMMARY_SOURCES = ("pooled", "generated")
SUMMARY_PICKS = ("norm", "novel")


def novelty(mine: torch.Tensor, seen: torch.Tensor, valid: torch.Tensor | None = None,
            seen_unit: bool = False) -> torch.Tensor:
    """Content keys of the thought's tokens (L, Hkv, n, d) against those before it (L, Hkv, R, d), of which `valid`
    (L, R) are real (default all) -> novelty (L, n). L is layers done at once (any leading dims work). `seen_unit`:
    `seen` is already of unit length (or zero), so it is not normalized again."""
    if seen.shape[-2] == 0:
        return mine.norm(dim=-1).sum(-2)
    unit = torch.nn.functional.normalize
    cos = unit(mine, dim=-1) @ (seen if seen_unit else unit(seen, dim=-1)).transpose(-1, -2)
    if valid is not None:
        cos = cos.masked_fill(~valid[..., None, None, :], float("-inf"))
    score = (1 - cos.amax(-1)).sum(-2)  # (L, n)
    if valid is None:
        return score
    return torch.where(valid.any(-1, keepdim=True), score, mine.norm(dim=-1).sum(-2))


def pick_summary(mine: torch.Tensor, pos: torch.Tensor, count: int, pick: str, rope=None, before=None,
                 before_pos=None, valid=None) -> torch.Tensor:
    """Which of a thought's tokens a pooled summary keeps, in each of L layers sharing `rope`: indices (L, count at
    most) into the thought, ascending.

    mine (L, Hkv, n, d): the thought's keys as the cache holds them, at positions pos (n,). For `novel`, before
    (L, Hkv, R, d) at before_pos (L, R), of which valid (L, R) are real: the tokens on the device before the
    thought, padded to the most any layer has.
    """
    count = min(count, mine.shape[-2])
    if pick == "novel":
        score = novelty(_content(mine, pos, rope), _content(before, before_pos[:, None], rope, unit=True), valid,
                        seen_unit=True)
    else:
        score = mine.norm(dim=-1).sum(-2)
    return ranked(score)[..., :count].sort(-1).values


def _content(keys: torch.Tensor, pos: torch.Tensor, rope, unit: bool = False) -> torch.Tensor:
    """Keys (..., n, d) at positions pos with RoPE undone, fp32, channels in `to_pairs` order (cosines do not depend
    on the order), scaled to unit length in place when `unit`. One complex product per pair and no second copy:
    this runs over every key before a thought, in every layer, at each thought's end."""
    rope = as_rope(rope)
    x = turn_pairs(to_pairs(keys.float(), rope.dim).contiguous(), phasors(pos, rope, inverse=True))
    return x.div_(x.norm(dim=-1, keepdim=True).clamp_min_(1e-12)) if unit else x
