"""Fast tier: scripts/zoomr_oracle.py, zoomr's votes replaced by each head's attention mass per thought. The mass must
go to the thought whose detail keys the query points at, per layer under zoom_scope=layer."""

from __future__ import annotations

import torch

from kvzip.methods import get_method
from kvzip.methods.thoughts.segment import Row
from tests.scripts import load_script


def test_oracle_votes_follow_the_attention_over_each_thoughts_detail(tiny):
    """Three thoughts of 4 tokens; thought t's keys all point along direction t. Layer 0's query points along 2,
    layer 1's along 0: the layers' masses pick thoughts 2 and 0 (scope layer); summed (scope row) they tie, and the
    earlier thought wins."""
    eye = torch.eye(16)
    oracle = load_script("zoomr_oracle")
    for scope, want in (("layer", [[2], [0]]), ("row", [[0]])):
        opts = {"zoom_thoughts": "1", "vote_decay": "0", "zoom_margin": "0", "zoom_scope": scope, "detail": "host"}
        cache = get_method("zoomr", opts).make_cache(tiny)
        cache.rows = [Row(0, 4)]
        cache.rows[0].thoughts = [(4 + 4 * t, 8 + 4 * t) for t in range(3)]
        cache.rows[0].zoom, cache.last_zoom = [[] for _ in range(cache.groups)], [[[] for _ in range(cache.groups)]]
        cache.voting = torch.ones(1, dtype=torch.bool)
        for layer in cache.layers:
            layer.lazy_initialization(torch.zeros(1, 2, 0, 16), torch.zeros(1, 2, 0, 16))
            layer.detail = [[layer.detail_store.store(20 * eye[t].expand(2, 4, 16), torch.zeros(2, 4, 16))
                             for t in range(3)]]
        oracle.oracle_votes(cache, {0: eye[2].expand(1, 4, 16), 1: eye[0].expand(1, 4, 16)})
        assert cache._select() and cache.rows[0].zoom == want
