"""zoomr's reread (`zoom_reread=M`): the summary votes name candidates, the candidates' own keys choose among them.

The summary index scores a thought by one mean key; a query that matches one token of a thought and not the rest
sees that token averaged away. With a reread, each zoom group's M most-voted thoughts of this forward are read back
from the detail tier (their keys only, one thought at a time, nothing kept), every query head of each layer attends
over those keys as it would over the thoughts zoomed in, and the attention mass each thought receives, summed over
the group's heads (and layers, under `zoom_scope=row`), replaces the votes. The zoom set is then chosen from the
masses as from votes (decay, margin, ties: kvzip.methods.thoughts.index.Ballot).

At a device budget of 0.25 of a 2,048-token output (docs/decisions.md) a reread of 8 under `zoom_scope=layer` kept
most of what an oracle that reads every thought's keys gains over the summary votes. Its cost is the read: M thoughts'
keys a layer a voting row a step, from host memory on a GPU.
"""

from __future__ import annotations

import torch

from kvzip.methods.thoughts.index import ranked


def shortlist(votes: torch.Tensor, m: int) -> list[list[list[int]]]:
    """votes (G, B, T) -> per group and row its `m` most-voted thoughts that got any vote, best first."""
    top = ranked(votes)[..., :m]
    got = votes.gather(2, top) > 0
    top, got = top.tolist(), got.tolist()
    return [[[t for t, ok in zip(top[g][b], got[g][b]) if ok] for b in range(votes.shape[1])]
            for g in range(votes.shape[0])]


def reread_votes(layers: list, queries: dict[int, torch.Tensor], votes: torch.Tensor, voting: list[bool],
                 m: int) -> torch.Tensor:
    """The summary votes `votes` (G, B, T) of one forward -> the attention masses (G, B, T) that replace them.
    `layers` the cache's layers, `queries` layer index -> its last query (B, Hq, d) after RoPE, as it attended;
    `voting` which rows cast votes. G is 1 (one zoom set a row) or the layer count (one a layer)."""
    groups = votes.shape[0]
    short = shortlist(votes, m)
    masses = torch.zeros_like(votes)
    for i, q in queries.items():
        layer, g = layers[i], 0 if groups == 1 else i
        for b, candidates in enumerate(short[g]):
            if not voting[b]:
                continue
            stored = [(t, layer.detail[b][t]) for t in candidates if t < len(layer.detail[b])]
            stored = [(t, s) for t, s in stored if s is not None]  # a sliding layer frees what it cannot see
            if not stored:
                continue
            keys = [layer.detail_store.load_keys(s, q.device, torch.float32) for _, s in stored]  # (Hkv, n, d) each
            ids = torch.cat([torch.full((k.shape[1],), t, device=q.device) for (t, _), k in zip(stored, keys)])
            hq, d = q.shape[1:]
            grouped = q[b].float().view(layer.kv_heads, hq // layer.kv_heads, d)  # head j*g+i reads KV head j
            weights = (grouped @ torch.cat(keys, 1).transpose(-1, -2) / d**0.5).softmax(-1)  # (Hkv, g, N)
            masses[g, b].index_add_(0, ids.to(masses.device), weights.reshape(hq, -1).sum(0).to(masses.device))
    return masses
