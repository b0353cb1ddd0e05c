"""Fast tier: fadkv's `zoom` (kvzip/methods/coded/zoom.py) on the tiny models: zooming in on every chunk decodes as
`full` does (the exact detail is read at the right positions, left-padded rows included, keys coded before or after
RoPE, every architecture and sliding window), a layer reads its heaviest chunks exact and the rest from codes,
zooming in on none is fadkv's own attention, the detail is counted off the device and the zoomed tokens on it, and a
device budget plans the codes around the zoomed tokens."""

from __future__ import annotations

import pytest
import torch

from kvzip import evaluate
from kvzip.budget import TOLERANCE
from kvzip.errors import UserError
from kvzip.methods import get_method
from kvzip.methods.coded.attend import coded_attention
from kvzip.methods.coded.forward import CodedState
from kvzip.methods.coded.zoom import zoomed_attention
from kvzip.sparse.dictionary import KVDictionary
from tests.matrix import tiny_method
from tests.test_architectures import FAMILIES, run
from tests.test_budget import LENGTHS, _measure
from tests.test_fadkv import SMALL, dense_keys_values, make_layer, step

TEXT = "Zooming in reads the exact keys and values of the chunks the codes weigh most. " * 3


def _dictionaries(tiny, base, keys: str):
    if keys == "post-rope":
        return base
    meta = {**base.meta, "keys": "pre-rope"}
    return KVDictionary(keys=base.keys, values=base.values, meta=meta,
                        key_mean=torch.randn(tiny.config.num_hidden_layers, 2, 16) * 0.1)


def _forced(tiny, tokenizer, cache, reference=None):
    prompts = [tokenizer("a short one")["input_ids"], tokenizer("a somewhat longer prompt for the second row")["input_ids"]]
    text = tokenizer(TEXT)["input_ids"][:160]
    return evaluate.teacher_forced(tiny, tokenizer, cache, prompts, [text, text[::-1]], reference=reference,
                                   keep_reference=reference is None)


@pytest.mark.parametrize("keys", ["post-rope", "pre-rope"])
def test_zooming_in_on_every_chunk_decodes_as_full(tiny, tokenizer, tiny_dictionaries, keys):
    full = _forced(tiny, tokenizer, get_method("full").make_cache(tiny))
    dictionaries = _dictionaries(tiny, tiny_dictionaries, keys)
    cache = get_method("fadkv", {**SMALL, "zoom": "1000", "zoom_chunk": "8"}).make_cache(tiny, dictionaries)
    run = _forced(tiny, tokenizer, cache, full.reference)
    assert cache.layers[0].coded_pos.shape[1] > 100  # most of the text was coded, and read back exact
    scores = run.scores(full.reference)
    assert scores["top1_agreement"] == 1.0 and scores["kl"] < 1e-6, scores
    # without the zoom the same codes do not decode as full: the exact detail is what made the difference
    plain = _forced(tiny, tokenizer, get_method("fadkv", SMALL).make_cache(tiny, dictionaries), full.reference)
    assert plain.scores(full.reference)["kl"] > 100 * max(scores["kl"], 1e-9)


@pytest.mark.parametrize("keys", ["post-rope", "pre-rope"])
def test_the_heaviest_chunks_are_read_exact_and_the_rest_from_codes(tiny_dictionaries, keys):
    """One layer, fed 60 tokens: zoom 2 of chunks of 8 equals attention over the codes rebuilt densely with the two
    chunks of most coded-attention mass (summed over the query heads) swapped for the keys and values fed; zoom 0
    equals fadkv's own reference path."""
    inv_freq = None if keys == "post-rope" else 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    _, layer = make_layer(tiny_dictionaries, keys=keys, inv_freq=inv_freq, zoom="2", zoom_chunk="8")
    fed = feed_kept(layer, 60)
    query = torch.randn(1, 4, 1, 16, generator=torch.Generator().manual_seed(3))
    state = CodedState.build([layer], None, 1, {})
    inputs = state.of(layer.idx)
    args = (query, None, 0.25, layer.tiers(), layer.key_mean, layer.rope, inputs, layer.detail)
    own = coded_attention(query, None, 0.25, layer.tiers(), layer.key_mean, layer.rope, inputs)
    torch.testing.assert_close(zoomed_attention(*args, 0, 8), own, rtol=1e-5, atol=1e-5)

    keys_, values = dense_keys_values(layer, 0)  # (H, T + S, d): coded tokens, then the dense tier
    positions = torch.cat([layer.coded_pos[0], layer.positions[0]])
    t = layer.coded_pos.shape[1]
    grouped = lambda x: x.repeat_interleave(2, 0)  # noqa: E731  (4 query heads over 2 KV heads)
    w = torch.softmax(query[0] @ grouped(keys_).transpose(-1, -2) * 0.25, -1)  # (Hq, 1, T + S)
    mass = torch.zeros(int(positions.max()) // 8 + 1).index_add_(0, positions[:t] // 8, w[:, 0, :t].sum(0))
    chosen = mass.topk(2).indices
    exact = torch.isin(positions // 8, chosen) & (torch.arange(len(positions)) < t)
    keys_[:, exact], values[:, exact] = fed[0][0][:, positions[exact]], fed[1][0][:, positions[exact]]
    w = torch.softmax(query[0] @ grouped(keys_).transpose(-1, -2) * 0.25, -1)
    expected = (w @ grouped(values)).transpose(0, 1)[None]
    torch.testing.assert_close(zoomed_attention(*args, 2, 8), expected, rtol=1e-4, atol=1e-4)
    assert exact.sum() > 8  # two chunks (the first holds the two sinks, dense)


def feed_kept(layer, steps, heads=2, dim=16):
    """`feed`, keeping what was fed: keys and values (B, H, steps, d) by position."""
    g = torch.Generator().manual_seed(0)
    kept = ([], [])
    for _ in range(steps):
        k, v = torch.randn(1, heads, 1, dim, generator=g), torch.randn(1, heads, 1, dim, generator=g)
        kept[0].append(k)
        kept[1].append(v)
        step(layer, k, v, torch.randn(1, 4, 1, dim, generator=g))
    return tuple(torch.cat(x, 2) for x in kept)


def test_the_detail_is_counted_off_the_device_and_the_zoomed_tokens_on_it(tiny, tokenizer, tiny_dictionaries):
    full = _forced(tiny, tokenizer, get_method("full").make_cache(tiny))
    plain = _forced(tiny, tokenizer, get_method("fadkv", SMALL).make_cache(tiny, tiny_dictionaries), full.reference)
    cache = get_method("fadkv", {**SMALL, "zoom": "2", "zoom_chunk": "8"}).make_cache(tiny, tiny_dictionaries)
    zoomed = _forced(tiny, tokenizer, cache, full.reference)
    # every token's exact K and V off the device: what full holds (its dtype, every position of both rows)
    assert zoomed.report["kv_bytes_host_peak"] == full.report["kv_bytes_peak"]
    layers, heads, dim = tiny.config.num_hidden_layers, 2, 16
    extra = layers * 2 * 2 * heads * 16 * dim * 4  # 2 chunks of 8 tokens, K and V, 2 rows, fp32
    assert zoomed.report["kv_bytes_device_peak"] == plain.report["kv_bytes_device_peak"] + extra


def test_a_device_budget_plans_the_codes_around_the_zoomed_tokens(tiny, tokenizer, tiny_dictionaries):
    options = {"zoom": "2", "zoom_chunk": "8"}
    for length in LENGTHS:
        p, measured = _measure(tiny, tokenizer, tiny_dictionaries, "fadkv", 0.5, length, "device", options)
        assert not p.note and abs(measured / 0.5 - 1) <= TOLERANCE, (length, p, measured)
    p, _ = _measure(tiny, tokenizer, tiny_dictionaries, "fadkv", 0.5, LENGTHS[0], "all", options)
    assert p.note and "count the device tier" in p.note and p.expected > 1


@pytest.mark.parametrize("options, message", [({"zoom": "-1"}, "zoom must be >= 0"),
                                              ({"zoom": "2", "zoom_chunk": "0"}, "zoom_chunk must be positive")])
def test_bad_zoom_options_are_refused(options, message):
    with pytest.raises(UserError, match=message):
        get_method("fadkv", options)


@pytest.mark.parametrize("name", FAMILIES)
def test_zooming_in_on_every_chunk_generates_as_full_on_every_family(name):
    """Every architecture's RoPE (Gemma 3's two bases, Phi-3's partial rotary) and sliding windows (Mistral, Gemma 3:
    a coded token the window no longer shows is never read back): greedy tokens as `full`'s."""
    want, _ = run(name, tiny_method("full"))
    got, cache = run(name, tiny_method("fadkv", zoom="1000", zoom_chunk="8"))
    assert any(layer.coded_pos.shape[1] for layer in cache.layers)
    assert got == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_zooming_in_on_every_chunk_decodes_as_full_on_cuda(tokenizer, tiny_dictionaries):
    """The detail in pinned host memory, the chosen positions read back and their keys and values copied up: fp32 on
    CUDA, every chunk zoomed decodes as full."""
    from tests.conftest import tiny_llama
    from tests.test_engine import _to_cuda

    model = tiny_llama().to("cuda")
    full = _forced(model, tokenizer, get_method("full").make_cache(model))
    cache = get_method("fadkv", {**SMALL, "zoom": "1000", "zoom_chunk": "8"}).make_cache(
        model, _to_cuda(tiny_dictionaries))
    run_ = _forced(model, tokenizer, cache, full.reference)
    assert cache.layers[0].detail.keys.is_pinned()
    scores = run_.scores(full.reference)
    assert scores["top1_agreement"] == 1.0 and scores["kl"] < 1e-5, scores
