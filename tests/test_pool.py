"""Fast tier: zoomr's and sumr's rows share one token pool per layer (kvzip.methods.thoughts.pool), so a row costs a
batch what it holds, not the batch's widest row."""

from __future__ import annotations

import pytest
import torch

from kvzip import engine
from kvzip.methods import get_method
from kvzip.methods.thoughts.pool import TokenPool

OPTS = {"window": "8", "summary_tokens": "2", "min_thought_tokens": "4", "max_thought_tokens": "12"}


def run(model, tokenizer, method, prompts, kernel="auto"):
    cache = get_method(method, {**OPTS, "kernel": kernel}).make_cache(model)
    settings = engine.Settings(max_new_tokens=50, ignore_eos=True)
    results = [e for e in engine.generate(model, tokenizer, prompts, cache, settings) if isinstance(e, engine.Result)]
    return cache, results


@pytest.mark.parametrize("method", ["zoomr", "sumr"])
@pytest.mark.parametrize("kernel", ["auto", "torch"])
def test_a_batch_holds_in_its_pools_what_its_rows_hold_alone(tiny, tokenizer, method, kernel):
    texts = ["Q?", "a longer question, padded less?", "a third one"]
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    batch, results = run(tiny, tokenizer, method, prompts, kernel)
    alone = [run(tiny, tokenizer, method, [p], kernel)[0] for p in prompts]
    assert batch.rebuilds > 0
    for i, layer in enumerate(batch.layers):
        held = layer.slots[layer.slots >= 0]
        assert layer.pool.used == held.numel() == held.unique().numel()  # every slot held once, none leaked
        assert (layer.slots >= 0).sum(1).tolist() == [(c.layers[i].slots >= 0).sum().item() for c in alone]
        assert layer.pool.used == sum(c.layers[i].pool.used for c in alone)
    # the device tier in the batch: the rows' bytes alone plus one slot number and position per padded slot
    tables = sum(16 * layer.slots.numel() for layer in batch.layers)
    alone_bytes = sum(c.memory()["on_device"] - sum(16 * la.slots.numel() for la in c.layers) for c in alone)
    assert batch.memory()["on_device"] == alone_bytes + tables


def test_the_pool_reuses_freed_slots_before_growing():
    pool = TokenPool(2, 16, torch.float32, "cpu")
    first = pool.add(torch.randn(2, 2, 3, 16), torch.randn(2, 2, 3, 16))  # (B, q) slots
    grown = pool.size
    assert pool.used == 6 and grown >= 6
    pool.release(first[:, -1:])  # rows keep only their last token
    assert pool.used == 2
    k = torch.randn(2, 5, 16)  # (Hkv, n, d)
    again = pool.take(5)
    pool.put(again, k, k)
    assert pool.size == grown and not set(again.tolist()) & set(first[:, -1].tolist())
    assert torch.equal(pool.gather(again)[0], k)
