"""Integration tier for `kvzip chat` on the default model: three piped turns per compressing method through the CLI,
and the multi-turn cache checked token for token against a full re-templating of the conversation."""

from __future__ import annotations

import json

import pytest

from kvzip import engine
from kvzip.conversation import ChatSession, Turn
from kvzip.methods import METHODS, get_method

from .conftest import run_cli

# Small settings so that three short turns (a few hundred tokens) already compress.
# zoomr keeps every user turn in full by design, so its chat compresses only the answers: answers of a few sentences,
# short thoughts with two summary tokens each, a 16-token tail.
SMALL = {"window": {"window": "64"},
         "zoomr": {"window": "16", "min_thought_tokens": "4", "max_thought_tokens": "16", "summary_tokens": "2"},
         "fadkv": {"buffer": "32", "code_chunk": "16"}}
QUESTIONS = ["What is the capital of France?", "Name three rivers in Europe.", "Which of them is the longest?"]
# zoomr keeps user turns in full and compresses what the model writes: a chat of long answers, as reasoning is.
LONG = ["What is the capital of France? Write a long story about it, in many short paragraphs.",
        "Continue the story with many more paragraphs.", "Finish the story, again in many paragraphs."]


@pytest.mark.parametrize("name", [n for n in SMALL if n in METHODS])
def test_three_turns_through_kvzip_chat_use_less_kv_than_full(name, tmp_path):
    cls = METHODS[name]
    if cls.needs_dictionary:
        from kvzip.dictionary_lookup import dictionary_dir

        if not (dictionary_dir() / "smollm2-135m.safetensors").is_file():
            pytest.skip(f"{name} needs the shipped dictionary, not trained yet")
    opts = [a for k, v in SMALL[name].items() if k in cls.options() for a in ("--opt", f"{k}={v}")]
    saved = tmp_path / "chat.json"
    questions = LONG if cls.keeps_prompt else QUESTIONS
    stdin = "\n".join(questions + [f"/save {saved}", "/quit"]) + "\n"
    proc = run_cli("chat", "--method", name, *opts, "--max-new-tokens", "128", stdin=stdin, timeout=900)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "error:" not in proc.stderr
    assert proc.stderr.count("prompt +") == 3  # one summary line per turn when stdout is not a terminal
    data = json.loads(saved.read_text())
    assert data["method"] == name and [t["user"] for t in data["turns"]] == questions
    assert all(t["assistant"].strip() and t["assistant"] in proc.stdout for t in data["turns"])
    assert "Paris" in data["turns"][0]["assistant"]
    stats = data["stats"]
    assert stats["context_tokens"] > 100
    # Every method holds less than full would for the same tokens, on the device and in all tiers together.
    assert 0 < stats["kv_bytes_device_peak"] <= stats["kv_bytes_peak"] < stats["kv_bytes_full"], stats
    if name == "window":
        assert stats["kv_bytes_final"] == stats["kv_bytes_by_tier"]["device"] and stats["method_stats"]["evicted_tokens"] > 0
    if name == "fadkv":  # most of the conversation is coded: below even an fp16 full cache
        assert stats["method_stats"]["tokens_coded"] > 50 and stats["kv_bytes_final"] < 0.7 * stats["kv_bytes_fp16_full"]


def test_cached_tokens_equal_the_retemplated_conversation(default_model):
    model, tokenizer, _ = default_model
    session = ChatSession(model, tokenizer, get_method("full"), settings=engine.Settings(max_new_tokens=24))
    first = [e for e in session.turn(QUESTIONS[0]) if isinstance(e, Turn)][0]
    assert first.stats["prompt_tokens"] == len(engine.encode(tokenizer, QUESTIONS[0]))  # as `kvzip generate` encodes
    for question in QUESTIONS[1:]:
        turn = [e for e in session.turn(question) if isinstance(e, Turn)][0]
        assert session.cache.get_seq_length() == len(session.ids)
        assert turn.stats["prompt_tokens"] < 40  # only the new turn was prefilled, not the history
    # SmolLM2's template adds a default system prompt to any conversation without one: it must appear once.
    text = tokenizer.apply_chat_template(session.messages + [{"role": "user", "content": "next"}],
                                         add_generation_prompt=True, tokenize=False)
    assert text.count("<|im_start|>system") == 1
    expected = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert expected[: len(session.ids) + len(session.pending)] == session.ids + session.pending
