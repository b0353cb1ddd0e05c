"""Fast tier: kvzip's decode attention (`grouped_attention`) against torch's SDPA, and `full` on kvzip's attention
path against `full` on stock SDPA."""

from __future__ import annotations

import pytest
import torch

from kvzip import evaluate
from kvzip.attention import causal_tail, dense_attention, grouped_attention
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
