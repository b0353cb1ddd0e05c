"""Fast tier for the eviction skeleton (kvzip/methods/evict.py) and the dense tier's buffers (kvzip/methods/buffer.py).

Every registered method whose cache is an `EvictCache` (built with its `test_options`, tests/matrix.py) is run step by
step in a left-padded batch: eviction runs after the model's forward, never inside it, keeps exactly the tokens its
score names, in that order, in the same storage, and a decode step allocates no new room but every `SPARE` or so
tokens. A new scorer is covered without editing this file.
"""

from __future__ import annotations

import pytest
import torch

from kvzip import engine
from kvzip.methods.buffer import Buffer
from kvzip.methods.evict import EvictCache, fill_holes
from tests.matrix import METHOD_NAMES, needs_dictionary, tiny_method


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
