"""Fast tier: errors say what is wrong in the terms of the layer that raises them. Library errors name no kvzip flag;
the command line puts its flags in (a device, a dtype, a missing dictionary, a full chat context, a model that cannot
chat), so a user still learns which flag to change. Also: which default dictionary a method gets is the method's to
say (`dictionary_keys`), not read from its option names."""

from __future__ import annotations

import ast
import io
import re
import sys
from pathlib import Path

import pytest
import torch

from kvzip.conversation import ChatSession, ContextFull
from kvzip.cli import app
from kvzip.cli import chat as chat_cli
from kvzip.dictionary_lookup import MissingDictionary, default_dictionary, dictionaries_for
from kvzip.errors import UserError
from kvzip.methods import get_method
from kvzip.models import ModelSource, resolve_device, resolve_dtype
from tests.test_chat import ChatTokenizer, run_turn, session
from tests.test_cli import fake_load, no_model, one_line_error  # noqa: F401  (fixtures)

PACKAGE = Path(__file__).resolve().parent.parent / "kvzip"
# Library modules whose errors still name flags; their owners reword them under issue 18 (then drop them here).
PENDING: set[str] = set()
SOURCE = ModelSource("tiny", "tiny", False)


def kvzip_flags() -> set[str]:
    """Every option name of every kvzip command (`--max-new-tokens`, `--dict`, ...)."""
    import typer

    commands = typer.main.get_command(app).commands.values()
    return {name for c in commands for p in c.params for name in p.opts if name.startswith("--")}


def test_library_errors_name_no_kvzip_flag():
    flags = kvzip_flags()
    pattern = re.compile(r"(?<![\w-])(" + "|".join(sorted(map(re.escape, flags), key=len, reverse=True)) + r")(?![\w-])")
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith("cli/") or relative in PENDING:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and node.exc is not None:
                for part in ast.walk(node.exc):
                    if isinstance(part, ast.Constant) and isinstance(part.value, str) and pattern.search(part.value):
                        found.append(f"{relative}:{node.lineno}: {pattern.search(part.value).group()}")
    assert "--max-new-tokens" in flags and "--dict" in flags
    assert found == []


# -- device and dtype ----------------------------------------------------------------------------------------------

def test_device_and_dtype_errors_in_library_terms():
    with pytest.raises(UserError, match=r"^unknown device 'tpu': use one of auto, cpu, cuda$"):
        resolve_device("tpu")
    with pytest.raises(UserError, match=r"^unknown dtype 'float8': use one of auto, float32, bfloat16, float16$"):
        resolve_dtype("float8", torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="no CUDA GPU is visible to torch: use cpu") as exc:
            resolve_device("cuda")
        assert "--" not in str(exc.value)


@pytest.mark.usefixtures("no_model")
@pytest.mark.parametrize("command", [["generate", "hi"], ["chat"], ["bench"], ["train-dict"]])
def test_cli_names_the_device_and_dtype_flags_before_the_model_loads(capsys, tmp_path, command):
    extra = ["--out", str(tmp_path / "d.safetensors")] if command == ["train-dict"] else []
    line = one_line_error(capsys, *command, *extra, "--device", "tpu")
    assert line == "kvzip: error: --device: unknown device 'tpu': use one of auto, cpu, cuda"
    line = one_line_error(capsys, *command, *extra, "--dtype", "float8")
    assert line.startswith("kvzip: error: --dtype: unknown dtype 'float8'")
    if not torch.cuda.is_available():
        assert "--device: device cuda was asked for" in one_line_error(capsys, *command, *extra, "--device", "cuda")


# -- the default dictionary: the method says which key modes, the CLI says how to make the file ------------------------

class Probe:
    """A dictionary method with the contract: its option `keys` says pre-rope, `dictionary_keys` says otherwise, so
    a lookup that read the option instead of calling the method would take the wrong file."""

    name, needs_dictionary, keys = "probe", True, "pre-rope"

    def __init__(self, modes):
        self.modes = modes

    def dictionary_keys(self):
        return self.modes


def test_default_dictionary_follows_dictionary_keys(tmp_path, monkeypatch):
    monkeypatch.setenv("KVZIP_DICTIONARIES", str(tmp_path))
    (tmp_path / "tiny.safetensors").write_bytes(b"")
    assert default_dictionary(Probe(("post-rope",)), SOURCE) == tmp_path / "tiny.safetensors"
    # The first mode whose file exists; the error names the first mode when none does.
    assert default_dictionary(Probe(("pre-rope", "post-rope")), SOURCE) == tmp_path / "tiny.safetensors"
    with pytest.raises(MissingDictionary) as exc:
        default_dictionary(Probe(("pre-rope",)), SOURCE)
    assert (exc.value.path, exc.value.keys, exc.value.model) == (tmp_path / "tiny-prerope.safetensors", "pre-rope", "tiny")


def test_methods_say_which_key_modes_they_run_on():
    from kvzip.methods import METHODS
    from kvzip.sparse import KEY_MODES

    for name in METHODS:
        method = get_method(name)
        modes = method.dictionary_keys()
        assert bool(modes) == bool(method.needs_dictionary) and set(modes) <= set(KEY_MODES), name
    assert get_method("fadkv").dictionary_keys() == ("pre-rope", "post-rope")  # keys=auto: preferred first
    assert get_method("lexico").dictionary_keys() == ("post-rope", "pre-rope")
    assert get_method("fadkv", {"keys": "post-rope"}).dictionary_keys() == ("post-rope",)
    assert get_method("zoomr", {"detail": "fadkv"}).dictionary_keys() == ("post-rope",)


def test_missing_dictionary_in_library_terms_and_in_flags(tiny, tmp_path, monkeypatch, capsys, fake_load):
    monkeypatch.setenv("KVZIP_DICTIONARIES", str(tmp_path))
    with pytest.raises(MissingDictionary) as exc:
        dictionaries_for(get_method("fadkv"), tiny, SOURCE)
    assert "needs a dictionary" in str(exc.value) and "--" not in str(exc.value)
    wanted = tmp_path / f"tiny{'-prerope' if exc.value.keys == 'pre-rope' else ''}.safetensors"
    line = one_line_error(capsys, "generate", "hi", "--raw", "--method", "fadkv")
    assert line == (f"kvzip: error: method 'fadkv' needs a dictionary and {wanted} does not exist: train one with "
                    f"`kvzip train-dict --model tiny --keys {exc.value.keys} --out {wanted}` or pass --dict")


def test_missing_dictionary_after_method_in_chat_is_worded_with_flags(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVZIP_DICTIONARIES", str(tmp_path))
    monkeypatch.setattr(sys, "stdin", io.StringIO("/method lexico\n/quit\n"))
    s = session(tiny, ChatTokenizer())
    chat_cli.chat_loop(s, lambda m: dictionaries_for(m, tiny, SOURCE), model_name="tiny")
    err = " ".join(capsys.readouterr().err.split())
    assert "error: method 'lexico' needs a dictionary" in err and "`kvzip train-dict --model tiny --keys" in err
    assert "or pass --dict" in err


# -- chat ----------------------------------------------------------------------------------------------------------

def test_context_full_in_session_terms_and_in_flags(tiny, monkeypatch, capsys):
    monkeypatch.setattr(tiny.config, "max_position_embeddings", 60)
    s = session(tiny, ChatTokenizer(), max_new_tokens=20)
    with pytest.raises(ContextFull) as exc:
        run_turn(s, "a message far too long for a context of sixty tokens with twenty to answer")
    assert exc.value.reason == "too_long" and "max_new_tokens" in str(exc.value) and "--" not in str(exc.value)
    monkeypatch.setattr(sys, "stdin", io.StringIO("a message far too long for a context of sixty tokens too\n"))
    chat_cli.chat_loop(s, model_name="tiny")
    assert "shorten it or lower --max-new-tokens" in " ".join(capsys.readouterr().err.split())
    for reason in ("no_room", "evicted_all"):
        line = ContextFull(reason, 60, 30, 40).words(reset="RESET", budget="BUDGET")
        assert ("RESET" in line) == (reason == "no_room") and ("BUDGET" in line) == (reason == "evicted_all")
        assert "--" not in str(ContextFull(reason, 60, 30, 40))


def test_a_model_without_chat_template(tiny, capsys, fake_load):
    from tests.conftest import ByteTokenizer

    with pytest.raises(UserError, match="has no chat template") as exc:
        ChatSession(tiny, ByteTokenizer(), get_method("full"))
    assert "--" not in str(exc.value)
    with pytest.raises(UserError, match="on_full must be one of stop, evict"):
        ChatSession(tiny, ChatTokenizer(), get_method("full"), on_full="drop")
    line = one_line_error(capsys, "chat")
    assert "has no chat template" in line and "`kvzip generate --raw`" in line
    assert "--on-full must be one of" in one_line_error(capsys, "chat", "--on-full", "drop")
