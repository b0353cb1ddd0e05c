"""Fast tier for `kvzip chat`: the chat session and the stdin-driven loop on the tiny random Llama.

The byte tokenizer of conftest has no chat template; `ChatTokenizer` (the same ids) adds a small one that, like SmolLM2's, puts a
default system prompt in front of any conversation without one (the trap for "template only the new message"), and
decodes latin-1 (and id 259, which is no byte, as one extra character) so every sampled token survives a
decode/encode round trip.
"""

from __future__ import annotations

import io
import json
import sys

import pytest

from kvzip import engine
from kvzip.conversation import ChatSession, ContextFull, Throughput, Turn
from kvzip.cli import chat as chat_cli
from kvzip.methods import METHODS, get_method



class ChatTokenizer:
    """conftest's ByteTokenizer ids (0 pad, 1 bos, 2 eos, 3.. bytes) plus a chat template."""

    eos_token_id, pad_token_id, eos_token = 2, 0, "<eos>"
    chat_template = "<role>content</role> per message, a default system prompt"

    def __call__(self, text, add_special_tokens=True):
        ids = [259 if c == "\u0100" else ord(c) + 3 for c in text]  # id 259 (no byte) reads as one extra character
        return {"input_ids": ([1] if add_special_tokens else []) + ids}

    def decode(self, ids, skip_special_tokens=True):
        return "".join("\u0100" if i == 259 else chr(i - 3) for i in ids if 3 <= i <= 259)

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=False, **kwargs):
        text = "" if messages[0]["role"] == "system" else "<system>default</system>\n"
        text += "".join(f"<{m['role']}>{m['content']}</{m['role']}>\n" for m in messages)
        text += "<assistant>" if add_generation_prompt else ""
        return self(text, add_special_tokens=False)["input_ids"] if tokenize else text


@pytest.fixture
def chat_tok():
    return ChatTokenizer()


def session(tiny, tok, method="full", opts=None, max_new_tokens=12, **kw):
    return ChatSession(tiny, tok, get_method(method, opts or {}), None,
                       engine.Settings(max_new_tokens=max_new_tokens), **kw)


def run_turn(s, text, **kw) -> Turn:
    return [e for e in s.turn(text, **kw) if isinstance(e, Turn)][-1]


def test_cache_holds_exactly_the_templated_history(tiny, chat_tok):
    s = session(tiny, chat_tok, system="be brief")
    for text in ("hello there", "and again", "third one"):
        turn = run_turn(s, text)
        assert s.cache.get_seq_length() == len(s.ids)
        # What the cache holds (plus the answer token not fed yet) is the re-templated conversation, token for token.
        rendered = chat_tok.apply_chat_template(s.messages + [{"role": "user", "content": "next"}],
                                                add_generation_prompt=True)
        expected = chat_tok(rendered, add_special_tokens=False)["input_ids"]
        assert expected[: len(s.ids) + len(s.pending)] == s.ids + s.pending
        assert turn.stats["context_tokens"] == len(s.ids)
    assert rendered.count("<system>") == 1 and "default" not in rendered


def test_continued_cache_answers_as_a_fresh_prefill_of_the_whole_history(tiny, chat_tok):
    s = session(tiny, chat_tok)
    run_turn(s, "first question")
    second = run_turn(s, "second question")
    ids = chat_tok.apply_chat_template(s.messages[:-1], add_generation_prompt=True, tokenize=True)
    cache = get_method("full").make_cache(tiny)
    fresh = [e for e in engine.generate(tiny, chat_tok, [ids], cache, engine.Settings(max_new_tokens=12))
             if isinstance(e, engine.Result)][0]
    assert chat_tok.decode(fresh.token_ids) == second.assistant
    assert second.stats["prompt_tokens"] < len(ids)  # only the new turn was prefilled


def test_stop_request_keeps_partial_answer_and_cache_consistent(tiny, chat_tok):
    s = session(tiny, chat_tok, max_new_tokens=40)
    steps = []
    turn = run_turn(s, "tell me a long story", should_stop=lambda: steps.append(1) or len(steps) >= 5)
    assert turn.finish_reason == "interrupted"
    assert 0 < len(chat_tok(turn.assistant, add_special_tokens=False)["input_ids"]) < 40
    assert s.pending == [] and s.cache.get_seq_length() == len(s.ids)
    assert s.messages[-1] == {"role": "assistant", "content": turn.assistant}
    run_turn(s, "go on")
    assert s.cache.get_seq_length() == len(s.ids) and len(s.turns) == 2


def test_method_switch_reprefills_the_same_tokens(tiny, chat_tok):
    s = session(tiny, chat_tok)
    run_turn(s, "a first message that is long enough to overflow a small window")
    full_bytes = s.snapshot()["kv_bytes_final"]
    ids, progress = list(s.ids), []
    s.switch(get_method("window", {"sinks": "2", "window": "8"}), progress=lambda d, t: progress.append((d, t)))
    assert s.ids == ids and s.cache.get_seq_length() == len(ids)
    assert progress[-1] == (len(ids), len(ids))
    snap = s.snapshot()
    assert snap["kv_bytes_final"] < full_bytes and snap["method_stats"]["evicted_tokens"] > 0
    assert snap["kv_bytes_full"] == full_bytes and snap["kv_ratio_vs_full"] < 1
    assert snap["kv_bytes_fp16_full"] > 0 and snap["kv_ratio_vs_fp16_full"] < 1
    run_turn(s, "more")
    assert s.cache.get_seq_length() == len(s.ids)


def test_context_full_stop_refuses_and_evict_drops_oldest(tiny, chat_tok, monkeypatch):
    monkeypatch.setattr(tiny.config, "max_position_embeddings", 160)
    s = session(tiny, chat_tok, max_new_tokens=20)
    with pytest.raises(ContextFull, match="context full"):
        for _ in range(10):
            run_turn(s, "a message of some length here")
    turns, ids = len(s.turns), list(s.ids)
    with pytest.raises(ContextFull):
        run_turn(s, "a message of some length here")
    assert len(s.turns) == turns and s.ids == ids  # refused turns leave the session as it was

    e = session(tiny, chat_tok, max_new_tokens=20, on_full="evict")
    notices = [run_turn(e, "a message of some length here").notice for _ in range(8)]
    assert any("evicted the oldest" in n for n in notices)
    assert e.cache.get_seq_length() == len(e.ids) <= 160 and len(e.turns) == 8
    assert len(e.messages) < 16  # evicted exchanges left the model's context (they stay in e.turns)
    messages = list(e.messages)
    with pytest.raises(ContextFull):  # a message that cannot fit even alone: nothing is evicted for it
        run_turn(e, "x " * 200)
    assert e.messages == messages


def test_throughput_recent_and_average():
    meter = Throughput(window_s=1.0)
    for i, t in enumerate([0.5, 0.6, 0.7, 0.8, 2.8, 2.9, 3.0]):
        meter.step(engine.Step(i, 0, {}, t))
    recent, average = meter.rates()
    assert recent == pytest.approx(2 / 0.2) and average == pytest.approx(6 / 2.5)


def test_chat_loop_through_stdin(tiny, chat_tok, tiny_dictionaries, tmp_path, monkeypatch, capsys):
    saved = tmp_path / "chat.json"
    lines = ["hello model", "/bogus", "/method window size=3", "/method nope", "/save", "second message",
             "/method window sinks=2 window=8", "/stats", "third message", f"/save {saved}", "/reset", "/quit",
             "never read"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(lines) + "\n"))
    s = session(tiny, chat_tok)
    chat_cli.chat_loop(s, lambda m: tiny_dictionaries if m.needs_dictionary else None, model_name="tiny")
    out, err = capsys.readouterr()
    assert "you> hello model" in out and "you> third message" in out and "never read" not in out
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: unknown command /bogus; /help lists the commands",
        "error: method 'window' has no option 'size'; its options: sinks (default 4), window (default 508)",
        "error: unknown method 'nope'; use one of: " + ", ".join(METHODS),
        "error: usage: /save FILE",
    ]
    assert "switched: window" in err and "evicted_tokens" in out  # /stats table shows the method's stats
    assert err.count("prompt +") == 3  # one summary line per turn
    data = json.loads(saved.read_text())
    assert data["model"] == "tiny" and data["method"] == "window"
    assert [t["user"] for t in data["turns"]] == ["hello model", "second message", "third message"]
    assert [m["role"] for m in data["messages"]] == ["user", "assistant"] * 3
    assert all(t["assistant"] == m["content"] for t, m in zip(data["turns"], data["messages"][1::2]))
    assert all(t["assistant"] and t["assistant"] in out for t in data["turns"])  # streamed answers in the transcript
    assert data["stats"]["context_tokens"] == data["turns"][-1]["stats"]["context_tokens"] > 0
    assert data["stats"]["kv_bytes_final"] < data["stats"]["kv_bytes_full"]
    assert s.turns == [] and s.cache.get_seq_length() == 0  # /reset ran before /quit
    assert list(tmp_path.iterdir()) == [saved]  # atomic write left no temporary file
