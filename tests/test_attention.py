"""Fast tier: kvzip's decode attention (`grouped_attention`) against torch's SDPA, and `full` on kvzip's attention
path against `full` on stock SDPA."""

from __future__ import annotations

import pytest
import torch

from kvzip import evaluate
from kvzip.attention import attention_with_received, causal_tail, dense_attention, grouped_attention, leading_padding
from kvzip.methods import get_method


def _sdpa(query, keys, values, allowed, scale):
    out = torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=allowed, scale=scale,
                                                           enable_gqa=query.shape[1] != keys.shape[1])
    return out.transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q", [1, 3])
def test_grouped_attention_matches_sdpa(dtype, q):
    torch.manual_seed(0)
    b, hq, h, s, d = 3, 6, 2, 40, 16
    query = torch.randn(b, hq, q, d).to(dtype)
    keys, values = torch.randn(b, h, s, d).to(dtype), torch.randn(b, h, s, d).to(dtype)
    allowed = torch.ones(b, 1, q, s, dtype=torch.bool)
    allowed[0, ..., :7] = False  # a left-padded row
    allowed[..., s - q :] &= torch.ones(q, q, dtype=torch.bool).tril()  # the new tokens see each other causally
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(grouped_attention(query, keys, values, allowed, 0.25).float(),
                               _sdpa(query, keys, values, allowed, 0.25).float(), atol=tol, rtol=tol)


def test_grouped_attention_gives_zero_for_a_query_that_sees_nothing():
    query, keys = torch.randn(1, 2, 1, 8), torch.randn(1, 1, 5, 8)
    out = grouped_attention(query, keys, keys, torch.zeros(1, 1, 1, 5, dtype=torch.bool), 1.0)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("chunk", [4, 5, 64])  # several chunks, a ragged last one, and all queries at once
def test_attention_with_received_matches_sdpa_and_the_summed_weights(chunk):
    torch.manual_seed(0)
    b, hq, h, q, s, d = 2, 6, 2, 17, 24, 8
    query, keys, values = torch.randn(b, hq, q, d), torch.randn(b, h, s, d), torch.randn(b, h, s, d)
    allowed = causal_tail(q, s, "cpu")[None, None].expand(b, 1, q, s).clone()
    allowed[1, ..., :10] = False  # a left-padded row: its first queries see nothing
    out, received = attention_with_received(query, keys, values, allowed, 0.3, chunk=chunk)
    expect = _sdpa(query, keys, values, allowed, 0.3).nan_to_num()
    torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)
    k = keys.repeat_interleave(hq // h, dim=1)
    w = ((query @ k.transpose(-1, -2)) * 0.3).masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num()
    torch.testing.assert_close(received, w.sum((1, 2)), atol=1e-5, rtol=1e-5)
    assert received[1, :10].sum() == 0 and received.dtype == torch.float32


def test_dense_attention_masks_a_short_prompt_causally():
    """A prompt's own forward (no mask, as many queries as keys) is causal on the decode path too."""
    torch.manual_seed(1)
    query, keys, values = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    want = _sdpa(query, keys, values, causal_tail(5, 5, query.device), 0.5)
    torch.testing.assert_close(dense_attention(query, keys, values, None, 0.5), want, atol=1e-5, rtol=1e-5)


def test_full_on_kvzip_attention_equals_full(tiny, tokenizer):
    prompts = [tokenizer("Q?")["input_ids"], tokenizer("a longer question, padded less?")["input_ids"]]
    ids = tokenizer("The tiny model reads a line, then another. " * 6)["input_ids"][1:]
    forced = [ids[:120], ids[5:125]]
    stock = evaluate.teacher_forced(tiny, tokenizer, get_method("full").make_cache(tiny), prompts, forced,
                                    keep_reference=True)
    ours = evaluate.teacher_forced(tiny, tokenizer, get_method("full", {"attention": "kvzip"}).make_cache(tiny),
                                   prompts, forced, reference=stock.reference)
    torch.testing.assert_close(ours.nll, stock.nll, atol=1e-4, rtol=1e-4)
    assert torch.equal(ours.top1, stock.top1)
    assert ours.report["kv_bytes_peak"] == stock.report["kv_bytes_peak"]


def test_dense_layer_appends_into_spare_room_as_cat_would():
    """DenseLayer.update writes new tokens into room allocated beforehand: the stored tensors equal a running cat,
    appends reuse one allocation until it is full, dropping the oldest slots (`DenseLayer.drop`) keeps it, and an
    attribute replaced by a gather (a tensor of its own) is adopted into new room on the next append."""
    from kvzip.methods.base import DenseLayer

    layer = DenseLayer()
    ref_k = torch.zeros(2, 3, 0, 4)
    rooms = set()
    for step in range(40):
        q = 5 if step == 0 else 1
        k = torch.randn(2, 3, q, 4)
        keys, values = layer.update(k, -k)
        ref_k = torch.cat([ref_k, k], 2)
        assert torch.equal(keys, ref_k) and torch.equal(values, -ref_k)
        assert layer.positions.tolist() == [list(range(layer.seen))] * 2
        rooms.add(layer.keys.untyped_storage().data_ptr())
    assert len(rooms) == 3  # room for 21 tokens (5 + 16 spare), then 38, then 55: 44 stored
    room = layer.keys.untyped_storage().data_ptr()
    for name in ("keys", "values", "positions"):
        layer.drop(name, 3)
    layer.update(torch.ones(2, 3, 1, 4), torch.ones(2, 3, 1, 4))
    assert layer.keys.untyped_storage().data_ptr() == room and layer.keys.shape[2] == 42
    assert torch.equal(layer.keys[:, :, :-1], ref_k[:, :, 3:]) and layer.positions[0, -1] == 44
    layer.keys = layer.keys[:, :, [0, 2]]  # a gather: its own tensor
    layer.values, layer.positions = layer.values[:, :, [0, 2]], layer.positions[:, [0, 2]]
    layer.update(torch.zeros(2, 3, 1, 4), torch.zeros(2, 3, 1, 4))
    assert layer.keys.untyped_storage().data_ptr() != room
    assert torch.equal(layer.keys[:, :, :2], ref_k[:, :, [3, 5]]) and layer.positions[0].tolist() == [3, 5, 45]


def test_leading_padding_reads_every_query_row_of_a_sliding_window_mask():
    """Gemma 3's first layer has a sliding window: the last query of a long prompt sees only its window, but only the
    left padding is hidden from every query."""
    q, window = 27, 8
    i, j = torch.arange(q)[:, None], torch.arange(q)[None, :]
    masks = []
    for pad in (0, 3):
        masks.append((j <= i) & (j > i - window) & (j >= pad) & (i >= pad))
    mask = torch.stack(masks)[:, None]  # (B, 1, q, kv) bool
    assert leading_padding(mask, 2, "cpu").tolist() == [0, 3]
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))  # the float form of the same mask
    assert leading_padding(additive, 2, "cpu").tolist() == [0, 3]
