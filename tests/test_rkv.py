"""Fast tier for rkv: its score on hand-built keys (an older near-copy goes before a unique token with the same
attention, per KV head; mix=1 is attention-only selection), when it compresses and what it keeps in a left-padded
batch, its memory report and its option checks. The matrix (tests/test_matrix.py, tests/test_architectures.py) runs
it on every tiny model: fewer bytes than `full`, a batch equal to its rows alone, `full` at a budget beyond the text.
"""

from __future__ import annotations

import pytest
import torch

from kvzip.engine import Stream
from kvzip.errors import UserError
from kvzip.methods import get_method, rkv
from kvzip.methods.base import tensor_bytes
from kvzip.methods.rkv import RKVLayer


def prefill(layer: RKVLayer, keys, queries, scaling=1.0):
    """Feed one prompt of hand-built keys (values = keys) and queries (B, Hq, T, d) straight into the layer, then
    compress it as the cache does after a prompt's forward."""
    layer.update(keys, keys)
    with torch.inference_mode():
        layer.attend(None, queries, keys, keys, None, scaling)
        layer.evict()
    return layer.positions


def test_an_older_near_copy_is_evicted_before_a_unique_key():
    e = torch.eye(4)
    near = torch.nn.functional.normalize(e[1] + 0.1 * e[2], dim=0)
    head0 = torch.stack([e[0], e[1], e[2], near, e[3]])  # token 1's key comes again, nearly, at token 3
    head1 = torch.stack([e[0], e[2], e[1], e[3], e[0]])  # token 0's key comes again at token 4 (the window)
    keys = torch.stack([head0, head1])[None]  # (1, 2, 5, 4)
    queries = torch.zeros(1, 2, 5, 4)  # head 1's zero query attends to every token alike: equal importance
    queries[0, 0, -1] = e[1]  # head 0's attends to token 1 a little more than to its later near-copy
    layer = RKVLayer(budget=4, window=1, mix=0.1, pool=1)
    positions = prefill(layer, keys, queries)
    # Each head drops its own older copy, head 0's though it gets more attention than the newer one.
    assert positions[0].tolist() == [[0, 2, 3, 4], [1, 2, 3, 4]]
    assert torch.equal(layer.keys[0, 0, 2], near) and layer.evicted == 1


def test_mix_one_keeps_the_tokens_the_window_attends_to_most():
    g = torch.Generator().manual_seed(0)
    keys, queries = torch.randn(1, 2, 12, 8, generator=g), torch.randn(1, 4, 12, 8, generator=g)
    scaling = 8 ** -0.5
    layer = RKVLayer(budget=7, window=3, mix=1.0, pool=1)
    positions = prefill(layer, keys, queries, scaling)
    # The attention of the last 3 queries (positions 9-11, causal), averaged over them and each KV head's 2 query heads.
    logits = queries[:, :, 9:] @ keys.repeat_interleave(2, dim=1).transpose(-1, -2) * scaling  # (1, 4, 3, 12)
    causal = torch.arange(12) <= torch.arange(9, 12)[:, None]
    attn = logits.masked_fill(~causal, float("-inf")).softmax(-1).view(1, 2, 2, 3, 12).mean((2, 3))
    best = attn[..., :9].topk(4, dim=-1).indices.sort(-1).values
    assert positions.tolist() == torch.cat([best, torch.tensor([9, 10, 11]).expand(1, 2, 3)], -1).tolist()
    assert not torch.equal(positions[0, 0], positions[0, 1])  # each head keeps its own tokens
    layer = RKVLayer(budget=7, window=3, mix=0.1, pool=1)  # with redundancy, not the same choice here
    assert not torch.equal(prefill(layer, keys, queries, scaling), positions)


def test_redundancy_in_chunks_equals_one_block(monkeypatch):
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(2, 3, 20, 8, generator=g)
    valid = torch.rand(2, 3, 20, generator=g) > 0.2
    whole = rkv.redundancy(keys, valid, 16)
    monkeypatch.setattr(rkv, "CHUNK", 3)
    torch.testing.assert_close(rkv.redundancy(keys, valid, 16), whole, rtol=1e-5, atol=1e-7)
    assert (whole[..., :16][~valid[..., :16]] == 0).all() and whole.sum(-1).allclose(torch.ones(2, 3))


def test_compresses_after_the_prompt_and_every_buffer_tokens(tiny, tokenizer):
    """Stored tokens: `budget` after the prompt, then one more per step up to budget + buffer - 1, and back. The
    short row of a left-padded batch keeps padding only while it has fewer real tokens than its budget."""
    cache = get_method("rkv", {"budget": "16", "buffer": "8", "window": "4"}).make_cache(tiny)
    stream = Stream(tiny, tokenizer, cache)
    layer = cache.layers[0]
    with torch.inference_mode():
        stream.prefill([tokenizer("Q?")["input_ids"], tokenizer("a longer question, padded less?")["input_ids"]])
        stored = [layer.keys.shape[2]]
        for ch in "twenty more tokens!!":
            stream.step(torch.tensor(tokenizer(ch)["input_ids"][1:] * 2))
            stored.append(layer.keys.shape[2])
    assert stored == [16] + [17, 18, 19, 20, 21, 22, 23, 16] * 2 + [17, 18, 19, 20]
    first = int(layer.first[0])
    assert first == 29 and (layer.positions[0] >= first).all()  # 23 real tokens: no padding left in the short row
    assert layer.queries.shape[2] == 4 and torch.equal(layer.positions[:, :, -4:], torch.arange(48, 52).expand(2, 2, 4))
    assert layer.memory() == {"device": tensor_bytes(layer.keys, layer.values, layer.queries)}
    assert cache.stats()["evicted_tokens"] == layer.evicted == (32 - 16) + 2 * 8


def test_reordered_rows_take_their_observation_queries_along(tiny, tokenizer):
    """Rows swapped just before the step after which they compress (buffer 8: the 8th): 3 of the 4 queries scored
    there (attention only, mix=1) were stored before the swap and must have moved with their rows, or the rows keep
    other tokens than a batch built swapped (the lifecycle test swaps long before one, when the window's queries have
    all been replaced)."""
    text = "".join(f"Line {i}: the tiny model reads a short line.\n\n" for i in range(3))
    prompts = [tokenizer(text[:40])["input_ids"], tokenizer(text[40:80])["input_ids"]]
    forced = torch.tensor(tokenizer(text)["input_ids"][1:21]).view(10, 2)  # (steps, B)

    def run(rows, swap_at=None):
        cache = get_method("rkv", {"budget": "16", "buffer": "8", "window": "4", "mix": "1"}).make_cache(tiny)
        stream = Stream(tiny, tokenizer, cache)
        logits = [stream.prefill([prompts[r] for r in rows])]
        for i, ids in enumerate(forced):
            if i == swap_at:
                swap = torch.tensor([1, 0])
                cache.reorder_cache(swap)
                stream.mask = stream.mask.index_select(0, swap)
                rows = rows[::-1]
            logits.append(stream.step(ids[rows], texts=["", ""]))
        return torch.stack(logits), cache

    with torch.inference_mode():
        got, swapped = run([0, 1], swap_at=7)
        want, built = run([1, 0])
    assert all(torch.equal(a.positions, b.positions) for a, b in zip(swapped.layers, built.layers))
    torch.testing.assert_close(got[8:], want[8:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("opts, error", [
    ({"window": "16"}, "window must be smaller than budget"),
    ({"mix": "1.5"}, r"mix must be in \[0, 1\]"),
    ({"pool": "4"}, "pool must be odd"),
    ({"buffer": "0"}, "buffer must be positive"),
])
def test_options_are_validated(opts, error):
    with pytest.raises(UserError, match=error):
        get_method("rkv", {"budget": "16", **opts})
