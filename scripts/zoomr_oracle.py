"""zoomr with an oracle's zoom choice: how far better thought selection alone could take zoomr at a budget.

Runs the kvzip command (`bench` and its arguments pass through) with zoomr's votes replaced: instead of its query
heads scoring the summary index, each head's real attention over every finished thought's detail keys (as the detail
tier holds them) is summed per thought, and those masses are the votes. Everything else is zoomr's own: the tail,
the summaries, the zoom count and scope, the one-step lag (the votes of one forward choose the zoom set of the next),
the memory. A zoomr cell run this way scores what a chooser of thoughts that reads the real attention would, under
zoomr's memory layout; if it stays below another method at the same budget, a better vote alone does not close the
gap, and the layout is what stops zoomr.
Run with `vote_decay=0,zoom_margin=0` so that only this step's attention chooses. Default model only (no
sliding-window layers: a model that has them is refused). A research tool: slow (every step reads every thought).

`--shortlist M` before the command reads the real attention over M thoughts only: zoomr's own votes over its summary
index (per layer under `zoom_scope=layer`) name each group's M most-voted thoughts, and the attention mass over those
thoughts' detail keys alone chooses among them. It measures a zoomr that rereads the details of a short list, the
summary index finding candidates and the details ranking them: how much of the oracle's gain a practical reread keeps.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/zoomr_oracle.py [--shortlist 8] bench --budgets 0.25 \\
        --budget-tier device --workloads output --output-tokens 2048 --rows 4 --methods full \\
        --method-set zoomr:vote_decay=0,zoom_margin=0 --dtype bfloat16 --json /tmp/oracle.json
"""

from __future__ import annotations

import sys

import torch

from kvzip.methods.thoughts import cache as thought_cache
from kvzip.methods.thoughts.reread import shortlist as short_list

summary_votes = thought_cache.ThoughtCache.cast_votes
SHORTLIST: int | None = None  # --shortlist M: the attention reread over each group's M most-voted thoughts only


class Seen:
    """One layer's and row's detail keys of every finished thought, decoded once: keys (Hkv, N, d) and thought ids."""

    def __init__(self):
        self.keys, self.ids, self.count = None, None, 0

    def extend(self, layer, b: int, thoughts: int) -> None:
        for t in range(self.count, thoughts):
            stored = layer.detail[b][t]
            k, _ = layer.detail_store.load(stored, layer.device, torch.float32)
            ids = torch.full((k.shape[1],), t, dtype=torch.long, device=k.device)
            self.keys = k if self.keys is None else torch.cat([self.keys, k], 1)
            self.ids = ids if self.ids is None else torch.cat([self.ids, ids])
        self.count = thoughts


def oracle_votes(self, queries: dict[int, torch.Tensor]) -> None:
    """Stands in for ThoughtCache.cast_votes: each voting row's attention mass per thought, per layer (`queries`:
    layer index -> its last query (B, Hq, d), after RoPE as the layer attended with it)."""
    if any(layer.sliding is not None for layer in self.layers):
        raise SystemExit("zoomr_oracle.py: models with sliding-window layers are not covered")
    if not hasattr(self, "oracle"):
        self.oracle = {}
    width = max(len(r.thoughts) for r in self.rows)
    if width == 0:
        return
    groups = self.ballot.groups
    keep = shortlist(self, queries, width) if SHORTLIST else None  # (G, B, T): the thoughts the reread may choose
    votes = torch.zeros(groups, len(self.rows), width)
    for i, q in queries.items():
        layer = self.layers[i]
        hq, d = q.shape[1], q.shape[2]
        for b, row in enumerate(self.rows):
            if not bool(self.voting[b]) or not row.thoughts:
                continue
            seen = self.oracle.setdefault((i, b), Seen())
            seen.extend(layer, b, len(row.thoughts))
            grouped = q[b].float().view(layer.kv_heads, hq // layer.kv_heads, d)
            logits = grouped @ seen.keys.transpose(-1, -2) / d**0.5  # (Hkv, g, N)
            if keep is not None:  # attention over the short list's keys only, as a reread of those details would see
                logits = logits.masked_fill(~keep[0 if groups == 1 else i, b, seen.ids], float("-inf"))
            mass = logits.softmax(-1).reshape(hq, -1).sum(0)  # (N,) over the heads
            votes[0 if groups == 1 else i, b].index_add_(0, seen.ids, mass.nan_to_num())
    self.ballot.add(torch.arange(width).expand(groups, len(self.rows), width), votes, width)


def shortlist(self, queries: dict[int, torch.Tensor], width: int) -> torch.Tensor:
    """zoomr's own votes over its index, closed into a (G, B, T) mask of each group's SHORTLIST most-voted thoughts;
    the ballot is left as it was."""
    before, self.ballot.votes = self.ballot.votes, None
    summary_votes(self, queries)
    tally, self.ballot.votes = self.ballot.votes, before
    keep = torch.zeros(self.ballot.groups, len(self.rows), width, dtype=torch.bool)
    if tally is None:
        return keep
    for g, rows in enumerate(short_list(tally[..., :width].cpu(), SHORTLIST)):
        for b, thoughts in enumerate(rows):
            keep[g, b, thoughts] = True
    return keep


if __name__ == "__main__":
    if sys.argv[1:2] == ["--shortlist"]:
        SHORTLIST = int(sys.argv[2])
        del sys.argv[1:3]
    thought_cache.ThoughtCache.cast_votes = oracle_votes
    from kvzip.cli import main

    main()
