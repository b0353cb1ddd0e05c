"""Fast tier: the method matrix. Every registered method, at its own small test options, on the tiny random Llama,
through the engine's one loop (`Stream`): the long-output workload holds fewer bytes than `full`; teacher forcing and
`generate` give the same logits for the same tokens; a left-padded batch equals its rows run alone; a budget beyond the
sequence equals `full`. A new method file is covered by every test here without an edit (tests/matrix.py).

That the matrix can fail is itself tested: with the step hook skipped (`cache.on_step` never called, as the old
teacher-forcing loop did), zoomr and sumr never close a thought and fail the bytes check.
"""

from __future__ import annotations

import pytest
import torch

from kvzip import engine, evaluate
from kvzip.engine import Stream
from kvzip.methods.base import TIERS, CacheLayer
from tests.matrix import METHOD_NAMES, lossless_method, needs_dictionary, tiny_method

# Paragraphs of a few sentences: thoughts for zoomr/sumr (they end at a blank line), tokens for everyone else.
TEXT = "".join(f"Step {i}: the tiny model reads a short line. It keeps going.\n\n" for i in range(8))


def _dicts(request, name):
    return request.getfixturevalue("tiny_dictionaries") if needs_dictionary(name) else None


def _rows(tokenizer, steps=160):
    prompts = [tokenizer("Q?")["input_ids"], tokenizer("a longer question, padded less?")["input_ids"]]
    ids = tokenizer(TEXT)["input_ids"][1:]
    return prompts, [ids[:steps], ids[7 : 7 + steps]]


def _forced(model, tokenizer, method, dicts, prompts, forced, reference=None):
    cache = method.make_cache(model, dicts)
    return evaluate.teacher_forced(model, tokenizer, cache, prompts, forced, reference=reference,
                                   keep_reference=reference is None)


@pytest.fixture(scope="module")
def full_run(tiny, tokenizer):
    prompts, forced = _rows(tokenizer)
    return _forced(tiny, tokenizer, tiny_method("full"), None, prompts, forced)


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_long_output_holds_fewer_bytes_than_full(tiny, tokenizer, request, full_run, name):
    prompts, forced = _rows(tokenizer)
    run = _forced(tiny, tokenizer, tiny_method(name), _dicts(request, name), prompts, forced, full_run.reference)
    report = run.report
    assert report["kv_bytes_full"] == full_run.report["kv_bytes_peak"]  # full's bytes for the same tokens
    if name == "full":
        assert report["kv_ratio_vs_full"] == 1.0
    else:
        assert report["kv_bytes_peak"] < report["kv_bytes_full"], report
        assert run.scores(full_run.reference)["top1_agreement"] > 0.5


def test_skipping_the_step_hook_fails_the_bytes_check(tiny, tokenizer, monkeypatch):
    """The check above catches a loop that never calls `cache.on_step`: no thought closes, nothing leaves the tail."""
    prompts, forced = _rows(tokenizer)
    for name in ("zoomr", "sumr"):
        monkeypatch.setattr(type(tiny_method(name).make_cache(tiny)), "on_step", lambda self, ids, texts: None)
        report = _forced(tiny, tokenizer, tiny_method(name), None, prompts, forced).report
        assert report["kv_bytes_peak"] >= report["kv_bytes_full"], (name, report)


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_forced_loop_and_generate_give_the_same_logits(tiny, tokenizer, request, name):
    """generate's greedy tokens, fed back by teacher forcing, are scored from exactly the logits generate saw."""
    dicts = _dicts(request, name)
    prompts = [tokenizer("same logits, please")["input_ids"]]
    events = list(engine.generate(tiny, tokenizer, prompts, tiny_method(name).make_cache(tiny, dicts),
                                  engine.Settings(max_new_tokens=40, ignore_eos=True)))
    tokens = next(e for e in events if isinstance(e, engine.Result)).token_ids
    logits = torch.stack([e.logits[0] for e in events if isinstance(e, engine.Step)])  # (T, V)
    expected = -torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)
    run = _forced(tiny, tokenizer, tiny_method(name), dicts, prompts, [tokens])
    torch.testing.assert_close(run.nll[0], expected, rtol=0, atol=0)


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_batch_equals_its_rows_alone(tiny, tokenizer, request, name):
    dicts = _dicts(request, name)
    prompts, forced = _rows(tokenizer, steps=96)
    batched = _forced(tiny, tokenizer, tiny_method(name), dicts, prompts, forced)
    for row in range(len(prompts)):
        alone = _forced(tiny, tokenizer, tiny_method(name), dicts, prompts[row : row + 1], forced[row : row + 1])
        assert torch.equal(batched.top1[row], alone.top1[0]), (name, row)
        torch.testing.assert_close(batched.nll[row], alone.nll[0], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("name", [n for n in METHOD_NAMES if n != "full"])
def test_budget_beyond_the_sequence_equals_full(tiny, tokenizer, request, full_run, name):
    method = lossless_method(name)
    if method is None:
        pytest.skip(f"{name} has no setting that keeps every token")
    prompts, forced = _rows(tokenizer)
    run = _forced(tiny, tokenizer, method, _dicts(request, name), prompts, forced, full_run.reference)
    assert torch.equal(run.top1, full_run.reference.top1), name
    torch.testing.assert_close(run.nll, full_run.nll, rtol=1e-3, atol=2e-3)


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_every_layer_reports_memory_through_one_protocol(tiny, tokenizer, request, name):
    """Every layer of every method, `full` and the peers included, is a `CacheLayer`: bytes by tier (no tier outside
    TIERS) and, from the one `FullBytes`, what `full` holds for the same tokens."""
    caches = [tiny_method(n).make_cache(tiny, _dicts(request, n)) for n in (name, "full")]
    for cache in caches:
        stream = Stream(tiny, tokenizer, cache)
        with torch.inference_mode():
            stream.prefill([tokenizer("a")["input_ids"], tokenizer("a longer prompt")["input_ids"]])
            for ch in "some output":
                stream.step(torch.tensor(tokenizer(ch)["input_ids"][1:] * 2))
    for layer, full in zip(*(cache.layers for cache in caches)):
        assert isinstance(layer, CacheLayer), type(layer)
        assert set(layer.memory()) <= set(TIERS) and sum(layer.memory().values()) > 0
        assert layer.full_bytes(2) == full.full_bytes(2) == 2 * 2 * 2 * (len("a longer prompt") + 1 + 11) * 16 * 2


def test_a_layer_without_full_bytes_is_not_a_cache_layer():
    class Partial:
        is_initialized, dtype = True, torch.float32

        def memory(self):
            return {}

    assert not isinstance(Partial(), CacheLayer)


def test_stream_calls_the_step_hook_with_each_tokens_text(tiny, tokenizer):
    seen = []
    cache = tiny_method("full").make_cache(tiny)
    cache.on_step = lambda ids, texts: seen.append((ids.tolist(), texts))
    stream = Stream(tiny, tokenizer, cache)
    stream.prefill([tokenizer("ab")["input_ids"]])
    for ch in "xy":
        stream.step(torch.tensor(tokenizer(ch)["input_ids"][1:]))
    assert seen == [([ord("x") + 3], ["x"]), ([ord("y") + 3], ["y"])]
    assert stream.report()["kv_bytes_full"] == stream.report()["kv_bytes_peak"] > 0
