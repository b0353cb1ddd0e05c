"""Fast tier for the eviction skeleton (kvzip/methods/evict.py) and the dense tier's buffers (kvzip/methods/buffer.py).

Every registered method whose cache is an `EvictCache` (built with its `test_options`, tests/matrix.py) is run step by
step in a left-padded batch: eviction runs after the model's forward, never inside it, keeps exactly the tokens its
score names, in that order, in the same storage, and a decode step allocates no new room but every `SPARE` or so
tokens. A new scorer is covered without editing this file. Then window's and h2o's own rules, step by step.
"""

from __future__ import annotations

import pytest
import torch

from kvzip import engine
from kvzip.methods import get_method
from kvzip.methods.buffer import Buffer
from kvzip.methods.evict import EvictCache, fill_holes
from tests.matrix import METHOD_NAMES, needs_dictionary, tiny_method
from tests.test_zoomr import feed


def gather(x: torch.Tensor, index: torch.Tensor, axis: int) -> torch.Tensor:
    """x's tokens `index` (B, K) or (B, H, K) along `axis`, the same for every head when the index has none."""
    if index.dim() == 2 and x.dim() == 4:
        index = index[:, None]
    index = index.reshape(*index.shape, *[1] * (x.dim() - axis - 1))
    return x.gather(axis, index.expand(*x.shape[:axis], index.shape[axis], *x.shape[axis + 1 :]))


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_eviction_keeps_the_scored_tokens_in_place_after_the_forward(tiny, tokenizer, request, name):
    dicts = request.getfixturevalue("tiny_dictionaries") if needs_dictionary(name) else None
    cache = tiny_method(name).make_cache(tiny, dicts)
    if not isinstance(cache, EvictCache):
        pytest.skip(f"{name} does not evict through the skeleton")
    inside, checked, grown = [False], [0], [0]
    pre = tiny.register_forward_pre_hook(lambda *a: inside.__setitem__(0, True))
    post = tiny.register_forward_hook(lambda *a: inside.__setitem__(0, False))

    def watch(layer):
        score, evict = layer.keep_index, layer.evict
        chosen = []

        def keep_index(state):
            chosen.append(score(state))
            return chosen[-1]

        def checked_evict(state=None):
            assert not inside[0], "eviction ran inside the model's forward"
            before = {n: layer._get(n).clone() for n in layer.EVICTED}
            storage = {n: layer._get(n).untyped_storage().data_ptr() for n in layer.EVICTED}
            evict(state)
            if chosen[-1] is None:
                return
            for n in layer.EVICTED:
                after = layer._get(n)
                axis = layer._token_axis(after)
                assert torch.equal(after, gather(before[n], chosen[-1], axis)), n
                assert after.untyped_storage().data_ptr() == storage[n], f"{n} was copied, not compacted in place"
            checked[0] += 1

        layer.keep_index, layer.evict = keep_index, checked_evict

    for layer in cache.layers:
        watch(layer)
    stream = engine.Stream(tiny, tokenizer, cache)
    prompts = [tokenizer("Q?")["input_ids"], tokenizer("a longer prompt, so that the first row is padded")["input_ids"]]
    try:
        with torch.inference_mode():
            stream.prefill(prompts)
            for step in range(24):
                storage = [la.keys.untyped_storage().data_ptr() for la in cache.layers]
                stream.step(torch.tensor([5, 9]) + step, ["x", "x"])
                grown[0] += sum(la.keys.untyped_storage().data_ptr() != s for la, s in zip(cache.layers, storage))
    finally:
        pre.remove()
        post.remove()
    assert checked[0] > len(cache.layers), f"{name} never evicted under its test_options"
    # Room for SPARE (16) more tokens at each allocation: 24 steps need at most two per layer, never one per step.
    assert grown[0] <= 2 * len(cache.layers)


def test_buffer_appends_prepends_keeps_and_drops_by_index():
    b = Buffer(torch.zeros(2, 0), axis=1, spare=4)
    x = torch.arange(20.0).view(2, 10)
    assert torch.equal(b.append(x), x) and b.storage.shape[1] == 14
    room = b.storage
    index = torch.tensor([[0, 1, 5, 8, 9], [2, 4, 6, 8, 9]])
    assert torch.equal(b.keep(index), x.gather(1, index)) and b.storage is room and b.start == 5
    assert torch.equal(b.drop(1), x.gather(1, index)[:, 1:])
    assert b.prepend(3, -1)[:, :3].eq(-1).all() and b.storage is room  # there was room in front
    wide = b.prepend(4, -2)  # no more room in front: new storage with spare on both sides
    assert b.storage is not room and wide.shape[1] == 11 and b.start == 4
    assert torch.equal(wide[:, 7:], x.gather(1, index)[:, 1:])
    per_head = Buffer(torch.arange(2 * 3 * 6 * 2.0).view(2, 3, 6, 2), axis=2)
    before = per_head.view().clone()
    index = torch.tensor([[[0, 1, 5], [2, 3, 4], [3, 4, 5]], [[1, 4, 5], [0, 2, 5], [3, 4, 5]]])
    assert torch.equal(per_head.keep(index), gather(before, index, 2))


def test_fill_holes_moves_the_front_tokens_into_the_holes():
    index = torch.tensor([[0, 1, 2, 3, 5], [1, 2, 3, 4, 5], [0, 2, 3, 4, 5]])
    assert fill_holes(index, 6).tolist() == [[1, 2, 3, 0, 5], [1, 2, 3, 4, 5], [0, 2, 3, 4, 5]]
    assert fill_holes(torch.tensor([[0, 2, 4, 5]]), 6).tolist() == [[2, 0, 4, 5]]


def test_a_replaced_attribute_is_adopted_anew(tiny):
    from kvzip.methods.base import DenseLayer

    layer = DenseLayer()
    k = torch.randn(1, 2, 3, 4)
    layer.update(k, k)
    layer.keys = layer.keys[:, :, 1:].clone()  # a rebuild: no longer the buffer's view
    layer.values = layer.values[:, :, 1:].clone()
    layer.positions = layer.positions[:, 1:].clone()
    new = torch.randn(1, 2, 1, 4)
    keys, _ = layer.update(new, new)
    assert torch.equal(keys, torch.cat([k[:, :, 1:], new], 2)) and layer.positions.tolist() == [[1, 2, 3]]


def test_h2o_keeps_heavy_hitters_and_window(tiny, tokenizer):
    cache, _, _, _ = feed(tiny, tokenizer, get_method("h2o", {"heavy": "5", "window": "7"}), "prompt", "x" * 30)
    layer = cache.layers[0]
    assert layer.keys.shape[2] == 12 and layer.positions[0, -7:].tolist() == list(range(layer.seen - 7, layer.seen))


def test_window_keeps_each_rows_sinks_and_last_tokens_as_stored(tiny, tokenizer):
    """window in a left-padded batch, step by step: layer 0 holds exactly the columns the StreamingLLM rule keeps (each
    row's `sinks` from its first real token, or the padding it still holds, then the last `window`), in that order;
    layer 0's keys depend only on token and position, so full's layer 0 is the reference."""
    sinks, window = 2, 5
    prompts = [tokenizer("a")["input_ids"], tokenizer("a much longer prompt here")["input_ids"]]
    streams = {name: engine.Stream(tiny, tokenizer, get_method(name, opts).make_cache(tiny))
               for name, opts in (("full", {}), ("window", {"sinks": str(sinks), "window": str(window)}))}
    width = max(len(p) for p in prompts)
    pad = [width - len(p) for p in prompts]
    cols = [list(range(width)) for _ in prompts]  # per row, the original columns the rule keeps, in order
    tokens = torch.tensor([5, 9])
    with torch.inference_mode():
        for stream in streams.values():
            stream.prefill(prompts)
        for step in range(24):
            for stream in streams.values():
                stream.step(tokens + step, ["x", "x"])
            for b in range(2):  # the rule, one row at a time
                cols[b].append(width + step)
                drop = len(cols[b]) - sinks - window
                if drop > 0:
                    start = min(pad[b], drop)
                    cols[b] = cols[b][start : start + sinks] + cols[b][-window:]
                    pad[b] -= start
            layer, ref = streams["window"].cache.layers[0], streams["full"].cache.layers[0]
            for b in range(2):
                assert torch.equal(layer.keys[b], ref.keys[b][:, cols[b]])
                assert torch.equal(layer.values[b], ref.values[b][:, cols[b]])


def test_h2o_drops_a_decode_steps_token_in_place_as_a_gather_would(tiny, tokenizer):
    """h2o's decode step copies a row's first column onto the one token it evicts (`fill_holes`) instead of keeping
    every kept token in stored order: per row the same positions, with the same keys, values and scores, as the
    stored-order eviction it replaces, step by step in a left-padded batch (the order of the heavy hitters may differ;
    the recent window stays last, in order)."""

    def in_stored_order(layer):
        score = layer.keep_index

        def keep_index(state):
            index = score(state)
            return None if index is None else index.sort(-1).values
        return keep_index

    def by_position(layer, b):  # row b's columns by position, then by key (left padding shares position 0)
        first = layer.keys[b, 0, :, 0].argsort(stable=True)
        return first[layer.positions[b, first].argsort(stable=True)]

    prompts = [tokenizer("a")["input_ids"], tokenizer("a much longer prompt here")["input_ids"]]
    streams = [engine.Stream(tiny, tokenizer, get_method("h2o", {"heavy": "4", "window": "3"}).make_cache(tiny))
               for _ in range(2)]
    for layer in streams[1].cache.layers:
        layer.keep_index = in_stored_order(layer)
    with torch.inference_mode():
        for stream in streams:
            stream.prefill(prompts)
        for step in range(20):
            for stream in streams:
                stream.step(torch.tensor([5, 9]) + step, ["x", "x"])
            fast, ref = (stream.cache.layers[0] for stream in streams)
            assert torch.equal(fast.positions[:, -3:], ref.positions[:, -3:])
            for b in range(2):
                order = [by_position(layer, b) for layer in (fast, ref)]
                assert torch.equal(fast.positions[b, order[0]], ref.positions[b, order[1]])
                assert torch.equal(fast.keys[b][:, order[0]], ref.keys[b][:, order[1]])
                assert torch.equal(fast.values[b][:, order[0]], ref.values[b][:, order[1]])
                torch.testing.assert_close(fast.score[b, order[0]], ref.score[b, order[1]])
