"""Fast tier for the command line itself: every bad input is one line `kvzip: error: ...` with exit code 2, found
before any model loads and leaving no file behind; the help is complete at any width and shows every default;
`--output` rows carry only their own figures with the batch figures in one summary; the chat's live region leaves
room for the terminal's "^C"; and no process outlives a `kvzip` command."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from kvzip.cli import app, display, main
from kvzip.errors import UserError
from kvzip.files import check_writable, write_atomic
from kvzip.models import ModelSource
from tests.conftest import ByteTokenizer


@pytest.fixture
def no_model(monkeypatch):
    """Any model load fails the test: the errors below must come before it."""
    import kvzip.models

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad input was caught")

    monkeypatch.setattr(kvzip.models, "load_model", refuse)


@pytest.fixture
def fake_load(monkeypatch, tiny):
    import kvzip.models

    monkeypatch.setattr(kvzip.models, "load_model", lambda *a, **k: (tiny, ByteTokenizer(), ModelSource("tiny", "tiny", False)))


@pytest.fixture
def read_only_dir(tmp_path):
    """A folder where no file can be created: chmod 0555, or /sys where root ignores permission bits."""
    if os.geteuid() == 0:
        yield Path("/sys")
        return
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    yield folder
    folder.chmod(0o755)


def run(capsys, *args) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    captured = capsys.readouterr()
    return exc.value.code, captured.out, captured.err


def one_line_error(capsys, *args) -> str:
    code, _, err = run(capsys, *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("kvzip: error: "), (code, err)
    return lines[0]


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# -- bad inputs: one line, exit 2, before the model, nothing written ---------------------------------------------------

@pytest.mark.usefixtures("no_model")
def test_generate_output_paths_are_checked_first(capsys, tmp_path, read_only_dir):
    (tmp_path / "out").mkdir()
    assert "is a directory" in one_line_error(capsys, "generate", "hi", "--output", str(tmp_path / "out"))
    assert "does not exist" in one_line_error(capsys, "generate", "hi", "--output", str(tmp_path / "no" / "r.jsonl"))
    line = one_line_error(capsys, "generate", "hi", "--output", str(read_only_dir / "r.jsonl"))
    assert line.startswith("kvzip: error: --output: cannot write") and "no file can be created" in line
    assert listing(tmp_path / "out") == [] and "r.jsonl" not in listing(read_only_dir)


@pytest.mark.usefixtures("no_model")
def test_train_dict_output_paths_are_checked_first(capsys, tmp_path, read_only_dir, monkeypatch):
    assert "is a directory" in one_line_error(capsys, "train-dict", "--out", str(tmp_path))
    line = one_line_error(capsys, "train-dict", "--out", str(read_only_dir / "d.safetensors"))
    assert line.startswith("kvzip: error: --out: cannot write")
    model = tmp_path / "m"  # a folder that resolves (config and tokenizer present) without being loaded
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "tokenizer.json").write_text("{}")
    monkeypatch.setenv("KVZIP_DICTIONARIES", str(read_only_dir))
    line = one_line_error(capsys, "train-dict", "--model", str(model))
    assert "default output" in line and "pass --out" in line
    assert listing(tmp_path) == ["m"]


def test_model_folder_without_tokenizer(capsys, tmp_path, monkeypatch):
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("transformers was asked to load the folder")

    for auto in (transformers.AutoTokenizer, transformers.AutoModelForCausalLM):
        monkeypatch.setattr(auto, "from_pretrained", refuse)
    (tmp_path / "config.json").write_text("{}")
    line = one_line_error(capsys, "generate", "hi", "--model", str(tmp_path))
    assert "has a config.json but no tokenizer" in line


@pytest.mark.usefixtures("no_model")
@pytest.mark.parametrize("prompt", ["", "   \n"])
def test_empty_prompt_is_refused(capsys, prompt):
    assert "the prompt is empty" in one_line_error(capsys, "generate", prompt)


@pytest.mark.usefixtures("no_model")
def test_empty_prompt_in_a_jsonl_file_names_its_line(capsys, tmp_path):
    (tmp_path / "in.jsonl").write_text('{"prompt": "fine"}\n{"prompt": " "}\n')
    line = one_line_error(capsys, "generate", "--input", str(tmp_path / "in.jsonl"))
    assert f"{tmp_path / 'in.jsonl'}:2: the prompt is empty" in line


@pytest.mark.usefixtures("no_model")
@pytest.mark.parametrize("command", [["generate", "hi"], ["chat"], ["bench"]])
def test_dict_directory_or_missing_file(capsys, tmp_path, command):
    assert "is a directory, not a dictionary file" in one_line_error(capsys, *command, "--dict", str(tmp_path))
    assert "does not exist" in one_line_error(capsys, *command, "--dict", str(tmp_path / "none.safetensors"))


@pytest.mark.usefixtures("no_model")
def test_dict_with_a_method_that_uses_none(capsys, tmp_path):
    (tmp_path / "d.safetensors").write_bytes(b"x")
    line = one_line_error(capsys, "generate", "hi", "--method", "window", "--dict", str(tmp_path / "d.safetensors"))
    assert "'window' with these options uses none" in line
    line = one_line_error(capsys, "bench", "--methods", "full,window", "--dict", str(tmp_path / "d.safetensors"))
    assert "none of these settings uses one" in line


@pytest.mark.usefixtures("no_model")
@pytest.mark.parametrize("args, message", [
    (["generate", "--bogus", "hi"], "No such option: --bogus"),
    (["generate", "--max-new-tokens", "many", "hi"], "Invalid value for '--max-new-tokens'"),
    (["generate", "--max-new-tokens", "0", "hi"], "--max-new-tokens must be at least 1"),
    (["chat", "--top-p", "0"], "--top-p must be in (0, 1]"),
    (["nope"], "No such command 'nope'"),
    (["bench", "--json", "."], "--json: . is a directory"),
    (["generate", "--budget", "0", "hi"], "--budget takes a fraction of full's KV bytes in (0, 1]"),
    (["generate", "--budget", "2", "hi"], "--budget takes a fraction of full's KV bytes in (0, 1]"),
    (["generate", "--budget", "most", "hi"], "--budget takes a fraction of full's KV bytes in (0, 1]"),
    (["chat", "--budget", "-1"], "--budget takes a fraction of full's KV bytes in (0, 1]"),
    (["generate", "--method", "window", "--opt", "window=8", "--budget", "0.25", "hi"], "the budget sets window"),
])
def test_usage_errors_are_one_line(capsys, args, message, no_model):
    assert message in one_line_error(capsys, *args)


def test_an_input_that_is_not_utf8_is_one_line(capsys, tmp_path, no_model):
    bad = tmp_path / "x.jsonl"
    bad.write_bytes(bytes(range(128, 256)) * 20)
    assert "is not UTF-8 text" in one_line_error(capsys, "generate", "--input", str(bad), "--output",
                                                 str(tmp_path / "o.jsonl"))
    assert listing(tmp_path) == ["x.jsonl"]


@pytest.mark.usefixtures("fake_load", "one_thread")
def test_generate_at_a_budget_says_what_it_became(capsys):
    code, out, err = run(capsys, "generate", "--method", "window", "--budget", "0.25", "--max-new-tokens", "40",
                         "--ignore-eos", "--raw", "Hello there, a prompt of some length.")
    assert code == 0, err
    assert "budget 0.25 of full's KV bytes for" in err and "window with sinks=" in err
    assert "0.25x full" in err or "0.24x full" in err or "0.26x full" in err


def test_check_writable_and_write_atomic_leave_nothing_behind(tmp_path):
    with pytest.raises(UserError, match="is a directory"):
        check_writable(tmp_path)
    write_atomic(tmp_path / "t.json", "{}\n")
    assert listing(tmp_path) == ["t.json"] and (tmp_path / "t.json").read_text() == "{}\n"


def test_a_checkout_finds_the_shipped_dictionaries_through_the_package_link(monkeypatch):
    from kvzip.dictionary_lookup import dictionary_dir

    root = Path(__file__).resolve().parent.parent
    monkeypatch.delenv("KVZIP_DICTIONARIES", raising=False)
    assert (root / "kvzip" / "_dictionaries").is_symlink()
    assert dictionary_dir() == (root / "dictionaries").resolve() and (dictionary_dir() / "MANIFEST.md").is_file()


# -- --output: rows carry their own figures, the batch's figures come once --------------------------------------------

ROW_KEYS = {"prompt", "completion", "finish_reason", "prompt_tokens", "new_tokens", "tokens"}


@pytest.mark.usefixtures("fake_load", "one_thread")
def test_output_rows_carry_only_their_own_figures(capsys, tmp_path):
    prompts = ["one", "a second prompt", "three is longer than both"]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    out = tmp_path / "out.jsonl"
    code, _, err = run(capsys, "generate", "--raw", "--input", str(tmp_path / "in.jsonl"), "--output", str(out),
                       "--batch-size", "2", "--max-new-tokens", "3", "--ignore-eos")
    assert code == 0, err
    *rows, last = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == prompts and all(set(r) == ROW_KEYS for r in rows)
    assert [r["prompt_tokens"] for r in rows] == [len(p) + 1 for p in prompts]  # bos + one id per byte
    summary = last["summary"]
    assert summary["method"] == "full" and summary["model"] == "tiny" and summary["rows"] == 3
    assert [(b["first_row"], b["rows"]) for b in summary["batches"]] == [(0, 2), (2, 1)]
    assert [b["prompt_tokens"] for b in summary["batches"]] == [rows[0]["prompt_tokens"] + rows[1]["prompt_tokens"],
                                                                rows[2]["prompt_tokens"]]
    assert all("kv_bytes_full" in b and "ttft_s" in b for b in summary["batches"])
    code, stdout, _ = run(capsys, "generate", "--raw", "--input", str(tmp_path / "in.jsonl"), "--json",
                          "--max-new-tokens", "3", "--ignore-eos")
    lines = [json.loads(line) for line in stdout.splitlines()]
    assert code == 0 and all(set(r) == ROW_KEYS for r in lines[:-1]) and set(lines[-1]) == {"summary"}


# -- help: complete at any width, every default shown ------------------------------------------------------------------

def _squeeze(text: str) -> str:
    return "".join(text.split())


@pytest.mark.parametrize("command", ["generate", "train-dict", "chat", "bench"])
def test_help_is_complete_in_a_narrow_terminal(capsys, monkeypatch, command):
    import typer

    monkeypatch.setenv("COLUMNS", "40")
    code, out, _ = run(capsys, command, "--help")
    assert code == 0
    params = typer.main.get_command(app).commands[command].params
    for param in params:
        assert _squeeze(param.help) in _squeeze(out), (param.name, param.help)
        if param.default not in (None, False) and not param.is_flag:
            assert _squeeze(f"[default: {param.default}]") in _squeeze(out), param.name
    assert "…" not in out


def test_bench_help_shows_the_defaults_of_the_config(capsys):
    from kvzip.bench import BenchConfig

    full, quick = BenchConfig(), BenchConfig.quick_preset()
    _, out, _ = run(capsys, "bench", "--help")
    for value, quick_value in ((full.reasoning_prompts, quick.reasoning_prompts),
                               (full.reasoning_new_tokens, quick.reasoning_new_tokens),
                               (full.repeats, quick.repeats)):
        assert _squeeze(f"(default {value}; --quick {quick_value})") in _squeeze(out)
    contexts = ",".join(map(str, full.prompt_contexts))
    assert full.prompt_contexts == full.speed_contexts and _squeeze(f"(default {contexts};") in _squeeze(out)
    assert _squeeze(f"--quick {quick.prompt_contexts[0]} for prompt, {quick.speed_contexts[0]} for speed") in _squeeze(out)
    _, out, _ = run(capsys, "generate", "--help")
    assert _squeeze("--seed <int> Seed for reproducible sampling (default: none, unseeded).") in _squeeze(out)


# -- chat: the live region leaves room for the echoed ^C ---------------------------------------------------------------

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\r")


@pytest.mark.parametrize("compact", [True, False])
def test_live_region_leaves_room_for_the_echoed_ctrl_c(monkeypatch, tiny, compact):
    """A full-width last line makes the terminal's "^C" echo wrap, which shifts the region down one line, so the
    clear at the end misses its first line and the partial answer shows twice (seen in a pty, rendered by pyte)."""
    from rich.console import Console

    from tests.test_chat import ChatTokenizer, run_turn, session

    s = session(tiny, ChatTokenizer(), "window", {"sinks": "2", "window": "8"})
    run_turn(s, "a message long enough to fill the window")
    snap = {**s.snapshot(), "method_stats": {"note": "x" * 200}}  # forces a panel as wide as the terminal
    buf = io.StringIO()
    monkeypatch.setattr(display, "out", Console(file=buf, force_terminal=True, width=40, color_system=None))
    monkeypatch.setattr(display, "is_terminal", lambda: True)
    view = display.ChatLive(compact).__enter__()
    view.write("the first line\nthe partial second")
    view.update(lambda: snap, force=True)
    view.__exit__(None, None, None)
    lines = ANSI.sub("\n", buf.getvalue()).splitlines()
    assert max(len(line) for line in lines) <= 40 - len("^C")
    assert "the partial second" in lines


# -- no process outlives the command -----------------------------------------------------------------------------------

def kvzip_processes(marker: str) -> list[str]:
    """Command lines of live processes that mention kvzip and inherited our marker environment variable."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            environ = (proc / "environ").read_bytes()
        except OSError:
            continue
        if b"kvzip" in cmdline and marker.encode() in environ:
            found.append(cmdline.replace(b"\0", b" ").decode(errors="replace"))
    return found


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")
def test_no_process_is_left_after_a_command():
    marker = f"KVZIP_TEST_MARKER={uuid.uuid4().hex}"
    script = Path(sys.executable).with_name("kvzip")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "kvzip.cli"]
    env = {**os.environ, marker.split("=")[0]: marker.split("=")[1]}
    got = subprocess.run([*cmd, "generate", "--batch-size", "0", "hi"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert got.returncode == 2 and got.stderr.startswith("kvzip: error: --batch-size"), got.stderr
    assert kvzip_processes(marker) == []


@pytest.mark.usefixtures("no_model")
def test_bench_names_a_missing_text_package_before_the_model_loads(capsys, monkeypatch):
    import importlib.util

    from kvzip import data

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gensim" else real(name, *a))
    data.long_documents.cache_clear()
    try:
        line = one_line_error(capsys, "bench", "--quick", "--workloads", "output", "--methods", "full,window")
    finally:
        data.long_documents.cache_clear()
    assert "pip install --no-deps gensim" in line
