"""Fast tier: how zoomr chooses thoughts beyond its summary index. `zoom_index=bounds` (each thought's key ranges) and
scripts/zoomr_oracle.py (each head's attention mass per thought) must both find the thought holding the key the
query points at, per layer under zoom_scope=layer."""

from __future__ import annotations

import torch

from kvzip.methods import get_method
from kvzip.methods.thoughts.index import BoundsIndex, bound_votes
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


def test_bounds_find_the_thought_with_one_matching_key_where_means_average_it_away():
    """Thought 1 holds one key along the query among three opposite ones (its mean points away); thought 0's keys are
    all weakly along the query. The means rank thought 0 first; the bound on the best key's score ranks thought 1."""
    eye = torch.eye(4)
    thoughts = [torch.stack([0.5 * eye[0]] * 4), torch.stack([4 * eye[0], -eye[0], -eye[0], -eye[0]])]  # (n, d)
    index = BoundsIndex(1)
    for k in thoughts:
        index.add(0, torch.cat([k.amin(0), k.amax(0)]).expand(1, 1, 8))  # (L=1, Hkv=1, 2d)
    query = eye[0].expand(1, 1, 1, 4)  # (L, B, Hq, d)
    means = torch.stack([k.mean(0) for k in thoughts])
    assert (means @ eye[0]).argmax() == 0
    assert bound_votes(query, index.keys(), index.valid(), 1).flatten().tolist() == [1]
    bounds = index.keys()[0, 0, 0]  # (T, 2d): the bound equals the best key's score for a one-hot query
    assert torch.equal(bounds[:, 4], torch.tensor([0.5, 4.0])) and index.layer_bytes() == 2 * 8 * 4


def test_bounds_index_zooms_in_through_the_cache(tiny, tokenizer):
    """zoomr with zoom_index=bounds decodes, votes and zooms in on the tiny model, its index counted on the device."""
    from kvzip.bench.recall import forced_decode

    text = "".join(f"thought number {i} says hi.\n\n" for i in range(8)) + "end"
    opts = {"window": "8", "summary_tokens": "2", "min_thought_tokens": "4", "zoom_index": "bounds",
            "zoom_thoughts": "1"}
    cache = get_method("zoomr", opts).make_cache(tiny)
    forced_decode(tiny, tokenizer, cache, [tokenizer("p")["input_ids"]], [tokenizer(text)["input_ids"][1:]])
    assert isinstance(cache.index, BoundsIndex) and cache.index.width == 8
    assert cache.stats()["selections"] > 0 and len(cache.stats()["zoomed_thoughts"][0]) == 1
    layers = sum(layer.is_initialized for layer in cache.layers)
    assert cache.memory()["device"] == sum(layer.memory()["device"] for layer in cache.layers) + \
        cache.index.layer_bytes() * layers


def test_reread_chooses_among_the_summary_votes_short_list_by_the_keys():
    """Three thoughts of 4 tokens, thought t's keys along direction t; the summary votes rank thoughts 1, 2, 0 in both
    layers, and a reread of 2 reads thoughts 1 and 2. Layer 0's query points along 2: the reread moves the choice
    from 1 to 2. Layer 1's query points along 0: thought 0 is off the short list and gets nothing."""
    from kvzip.methods.thoughts.detail import DenseDetail
    from kvzip.methods.thoughts.reread import reread_votes

    eye = torch.eye(16)

    class Layer:
        kv_heads, detail_store = 2, DenseDetail()
        detail = [[DenseDetail().store(20 * eye[t].expand(2, 4, 16), torch.zeros(2, 4, 16)) for t in range(3)]]

    votes = torch.tensor([0.0, 3.0, 2.0]).expand(2, 1, 3)  # (G = 2 layers, B, T)
    masses = reread_votes([Layer(), Layer()], {0: eye[2].expand(1, 4, 16), 1: eye[0].expand(1, 4, 16)}, votes,
                          [True], 2)
    assert masses[0, 0].argmax() == 2 and masses[0, 0, 0] == 0 and masses[0, 0].sum().round() == 4
    assert masses[1, 0, 0] == 0 and masses[1, 0, 1] == masses[1, 0, 2] == 2  # four heads' mass split evenly
    assert reread_votes([Layer(), Layer()], {0: eye[2].expand(1, 4, 16), 1: eye[0].expand(1, 4, 16)}, votes,
                        [False], 2).sum() == 0  # a row that cast no vote gets none


def test_reread_zooms_in_through_the_cache(tiny, tokenizer):
    """zoomr with zoom_reread decodes, votes and zooms in on the tiny model under either scope."""
    from kvzip.bench.recall import forced_decode

    text = "".join(f"thought number {i} says hi.\n\n" for i in range(8)) + "end"
    for scope in ("row", "layer"):
        opts = {"window": "8", "summary_tokens": "2", "min_thought_tokens": "4", "zoom_reread": "3",
                "zoom_thoughts": "1", "zoom_scope": scope}
        cache = get_method("zoomr", opts).make_cache(tiny)
        forced_decode(tiny, tokenizer, cache, [tokenizer("p")["input_ids"]], [tokenizer(text)["input_ids"][1:]])
        zoomed = cache.stats()["zoomed_thoughts"][0]  # the row's zoom set, or each layer's under scope layer
        assert cache.stats()["selections"] > 0
        assert len(zoomed) == 1 if scope == "row" else all(len(z) == 1 for z in zoomed) and len(zoomed) > 1
