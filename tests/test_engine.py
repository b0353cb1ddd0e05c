"""Fast tier: the engine and the method contract on a tiny random Llama."""

from __future__ import annotations

import pytest
import torch

from kvzip import engine
from kvzip.errors import UserError
from kvzip.methods import METHODS, get_method
from tests.matrix import tiny_options


def run(model, tok, prompts, method, settings, dictionaries=None):
    cache = method.make_cache(model, dictionaries)
    events = list(engine.generate(model, tok, prompts, cache, settings))
    results = [e for e in events if isinstance(e, engine.Result)]
    return results, events, cache


def prompt(tok, text):
    return tok(text)["input_ids"]


@pytest.mark.parametrize("name", list(METHODS))
def test_every_method_prefills_decodes_and_reports_memory(tiny, tokenizer, request, name):
    method = get_method(name, tiny_options(name))
    dicts = request.getfixturevalue("tiny_dictionaries") if method.needs_dictionary else None
    results, events, cache = run(tiny, tokenizer, [prompt(tokenizer, "hello there, tiny model " * 3)], method,
                                 engine.Settings(max_new_tokens=24, ignore_eos=True), dicts)
    assert len(results) == 1 and len(results[0].token_ids) == 24
    assert results[0].stats == {"prompt_tokens": results[0].prompt_tokens, "new_tokens": 24}  # the row's own figures
    stats = events[-1].stats  # the batch's Summary
    assert stats["kv_bytes_peak"] > 0 and stats["kv_bytes_fp16_full"] > 0 and stats["kv_bytes_full"] > 0
    assert set(stats["kv_bytes_by_tier"]) == {"device", "codes", "dictionary", "host"}
    assert cache.get_seq_length() == results[0].prompt_tokens + 23  # the last sampled token is never fed
    steps = [e for e in events if isinstance(e, engine.Step)]
    assert len(steps) == 24 and steps[-1].memory["total"] > 0


def test_full_is_token_identical_to_transformers_greedy(tiny, tokenizer):
    ids = prompt(tokenizer, "The quick brown fox")
    results, _, _ = run(tiny, tokenizer, [ids], get_method("full"), engine.Settings(max_new_tokens=20))
    reference = tiny.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)[0, len(ids):].tolist()
    if results[0].finish_reason == "eos":  # transformers keeps the end-of-sequence token, kvzip does not emit it
        reference = reference[:-1]
    assert results[0].token_ids == reference


@pytest.mark.parametrize("name", ["full", "window"])
def test_left_padded_batch_equals_one_by_one(tiny, tokenizer, name):
    method = get_method(name, tiny_options(name))
    prompts = [prompt(tokenizer, "a"), prompt(tokenizer, "a much longer prompt here"), prompt(tokenizer, "mid size")]
    settings = engine.Settings(max_new_tokens=12, ignore_eos=True)
    batched, _, _ = run(tiny, tokenizer, prompts, method, settings)
    for p, res in zip(prompts, batched):
        single, _, _ = run(tiny, tokenizer, [p], method, settings)
        assert res.token_ids == single[0].token_ids


def test_seeded_sampling_is_reproducible_and_seed_matters(tiny, tokenizer):
    ids = prompt(tokenizer, "sampling")
    settings = lambda seed: engine.Settings(max_new_tokens=16, temperature=1.0, top_p=0.95, top_k=50, seed=seed, ignore_eos=True)  # noqa: E731
    a, _, _ = run(tiny, tokenizer, [ids], get_method("full"), settings(7))
    b, _, _ = run(tiny, tokenizer, [ids], get_method("full"), settings(7))
    c, _, _ = run(tiny, tokenizer, [ids], get_method("full"), settings(8))
    assert a[0].token_ids == b[0].token_ids
    assert a[0].token_ids != c[0].token_ids


def test_window_memory_stops_growing(tiny, tokenizer):
    method = get_method("window", {"sinks": "2", "window": "8"})
    _, events, _ = run(tiny, tokenizer, [prompt(tokenizer, "x" * 20)], method, engine.Settings(max_new_tokens=30, ignore_eos=True))
    totals = [e.memory["total"] for e in events if isinstance(e, engine.Step)]
    assert len(set(totals[1:])) == 1  # constant after the first trim
    full_bytes = [e.memory["full_same_dtype"] for e in events if isinstance(e, engine.Step)]
    assert full_bytes[-1] > full_bytes[1]


def test_stop_string_and_max_tokens(tiny, tokenizer):
    ids = prompt(tokenizer, "stop test")
    results, _, _ = run(tiny, tokenizer, [ids], get_method("full"), engine.Settings(max_new_tokens=5, ignore_eos=True))
    assert results[0].finish_reason == "length" and len(results[0].token_ids) == 5
    text = results[0].text
    if text:
        stopped, _, _ = run(tiny, tokenizer, [ids], get_method("full"),
                            engine.Settings(max_new_tokens=5, ignore_eos=True, stop=(text[-1],)))
        assert stopped[0].finish_reason == "stop" and text[-1] not in stopped[0].text


def test_method_options_are_validated():
    with pytest.raises(UserError, match="unknown method 'nope'"):
        get_method("nope")
    with pytest.raises(UserError, match="has no option 'size'.*window"):
        get_method("window", {"size": "3"})
    with pytest.raises(UserError, match="not a valid int"):
        get_method("window", {"window": "big"})
    with pytest.raises(UserError, match="window must be positive"):
        get_method("window", {"window": "0"})


def test_prompt_longer_than_context_is_a_user_error(tiny, tokenizer):
    ids = [5] * 4000
    with pytest.raises(UserError, match="exceeds the model's context"):
        run(tiny, tokenizer, [ids], get_method("full"), engine.Settings(max_new_tokens=200))


def _to_cuda(dictionaries):
    import dataclasses

    moved = {f.name: getattr(dictionaries, f.name) for f in dataclasses.fields(dictionaries) if f.init}
    return type(dictionaries)(**{k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in moved.items()})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(METHODS))
def test_every_method_runs_on_cuda_in_bf16(tokenizer, request, name):
    from tests.conftest import tiny_llama

    model = tiny_llama().to("cuda", torch.bfloat16)
    method = get_method(name, tiny_options(name))
    dicts = _to_cuda(request.getfixturevalue("tiny_dictionaries")) if method.needs_dictionary else None
    prompts = [prompt(tokenizer, "hello there, tiny model " * 3), prompt(tokenizer, "short one")]
    results, _, cache = run(model, tokenizer, prompts, method, engine.Settings(max_new_tokens=24, ignore_eos=True), dicts)
    assert [len(r.token_ids) for r in results] == [24, 24]
    summary = [e for e in engine.generate(model, tokenizer, prompts, method.make_cache(model, dicts),
                                          engine.Settings(max_new_tokens=4, ignore_eos=True))][-1]
    assert summary.stats["kv_bytes_peak"] > 0 and summary.stats["cuda_max_memory_allocated"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_full_on_cuda_is_token_identical_to_transformers_greedy(tokenizer):
    from tests.conftest import tiny_llama

    model = tiny_llama().to("cuda")
    ids = prompt(tokenizer, "The quick brown fox")
    results, _, _ = run(model, tokenizer, [ids], get_method("full"), engine.Settings(max_new_tokens=20, ignore_eos=True))
    reference = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=20, do_sample=False,
                               min_new_tokens=20)[0, len(ids):].tolist()
    assert results[0].token_ids == reference


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_hf_fp8_saturates_values_beyond_the_frozen_scale(device):
    from kvzip.methods.peers import PeerFp8Layer

    layer = PeerFp8Layer()
    small = torch.ones(1, 2, 4, 8, device=device)
    layer.update(small, small)
    keys, values = layer.update(10 * small[:, :, :1], -10 * small[:, :, :1])  # 10x the prefill's range
    assert torch.isfinite(keys).all() and torch.isfinite(values).all()
    assert keys[:, :, -1].max().item() == pytest.approx(1.0) and values[:, :, -1].min().item() == pytest.approx(-1.0)


@pytest.mark.parametrize("name,options", [("hf-fp8", {}), ("hf-int4", {"q_group_size": 16, "residual_length": 8}),
                                          ("hf-int2", {"q_group_size": 16, "residual_length": 5})])
def test_peers_scoring_shortcut_changes_no_number(tiny, tokenizer, name, options):
    """`for_scoring` keeps the peers' dequantized copies between the steps that change them: every logit and the
    memory report stay what the stock layers give, through the residual's flushes (quanto) and appends (fp8)."""
    from kvzip.evaluate import teacher_forced

    method = get_method(name, options)
    prompts = [prompt(tokenizer, "Facts: the key is blue."), prompt(tokenizer, "Hi")]
    forced = [[(7 * j + r) % 250 + 3 for j in range(40)] for r in range(2)]
    runs = []
    for shortcut in (False, True):
        cache = method.make_cache(tiny)
        assert cache.for_scoring() if shortcut else True
        runs.append(teacher_forced(tiny, tokenizer, cache, prompts, forced, keep_reference=True))
    stock, kept = runs
    assert torch.equal(stock.nll, kept.nll) and torch.equal(stock.reference.top_logprobs, kept.reference.top_logprobs)
    assert stock.report["kv_bytes_peak"] == kept.report["kv_bytes_peak"] > 0
