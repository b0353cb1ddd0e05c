"""Fast tier for `kvzip train-dict` on the tiny random Llama: capture shapes, end-to-end training writes a loadable
dictionary with the model's fingerprint and per-layer errors, Ctrl-C writes nothing, and a dictionary for another
model or a corrupt file is one clear line with exit code 2."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from kvzip import capture
from kvzip.cli import main as cli_main
from kvzip.errors import UserError
from kvzip.methods import METHODS
from kvzip.models import ModelSource, model_fingerprint
from kvzip.sparse.dictionary import KVDictionary, make_meta
from tests.conftest import ByteTokenizer, interrupt_at_step, tiny_llama

TEXT = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. " * 8).strip()


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def fake_load(monkeypatch, tiny):
    """`load_model` returning the tiny model, its byte tokenizer and a source named "tiny"."""
    import kvzip.models

    monkeypatch.setattr(kvzip.models, "load_model", lambda *a, **k: (tiny, ByteTokenizer(), ModelSource("tiny", "tiny", False)))
    return tiny


def run_cli(monkeypatch, capsys, *args):
    monkeypatch.setattr(sys, "argv", ["kvzip", *args])
    with pytest.raises(SystemExit) as exc:
        cli_main()
        sys.exit(0)
    captured = capsys.readouterr()
    return exc.value.code, captured.out, captured.err


@pytest.mark.parametrize("keys", ["post-rope", "pre-rope"])
def test_capture_shapes_and_holdout(tiny, keys):
    docs = [list(range(3, 3 + 50)), list(range(10, 10 + 30))]
    got = capture.capture_kv(tiny, docs, keys=keys, chunk=16, holdout=0.1)
    assert got.tokens == 80 and got.heads == 2 and len(got.keys) == len(got.values) == 2
    assert all(k.shape == (160, 16) for k in got.keys + got.values)
    assert int(got.heldout.sum()) == 5 + 3 and got.heldout[45:50].all() and not got.heldout[:45].any()
    train, held = got.split()
    assert train.keys[1].shape == (144, 16) and held.values[0].shape == (16, 16)


def test_ctrl_c_while_answering_calibration_prompts_stops_there(tiny, monkeypatch):
    """The engine catches Ctrl-C mid-batch (it keeps the cut answers for generate and chat); calibration must stop,
    not learn a dictionary from cut answers."""
    calls = interrupt_at_step(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        capture.chat_documents(tiny, ByteTokenizer(), max_tokens=200, batch_size=2, max_new_tokens=6)
    assert len(calls) == 2


def test_post_rope_keys_match_the_cache_and_pre_rope_keys_k_proj(tiny):
    ids = list(range(3, 40))
    post = capture.capture_kv(tiny, [ids], keys="post-rope", chunk=8, store_dtype=torch.float32)
    pre = capture.capture_kv(tiny, [ids], keys="pre-rope", chunk=8, store_dtype=torch.float32)
    from kvzip.methods import get_method

    cache = get_method("full").make_cache(tiny)
    with torch.inference_mode():
        tiny(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
    ref = cache.layers[1].keys[0].transpose(0, 1).reshape(-1, 16)                # (T * Hkv, d)
    assert torch.allclose(post.keys[1], ref, atol=1e-5)
    assert torch.equal(post.values[0], pre.values[0])
    # RoPE is a rotation: same norms, different vectors (except at position 0)
    assert torch.allclose(pre.keys[1].norm(dim=1), post.keys[1].norm(dim=1), atol=1e-4)
    assert not torch.allclose(pre.keys[1][8:], post.keys[1][8:], atol=1e-3)


def test_train_dict_end_to_end(fake_load, monkeypatch, capsys, tmp_path):
    (tmp_path / "a.txt").write_text(TEXT)
    out = tmp_path / "d.safetensors"
    code, stdout, err = run_cli(monkeypatch, capsys, "train-dict", "--text", str(tmp_path / "a.txt"), "--atoms", "32",
                                "--sparsity", "4", "--iters", "2", "--samples", "512", "--out", str(out))
    assert code == 0, err
    d = KVDictionary.load(out)
    d.check_fingerprint(model_fingerprint(fake_load.config))
    assert d.keys.shape == d.values.shape == (2, 32, 16) and d.keys.dtype == torch.float32
    assert d.key_mean.shape == (2, 2, 16)
    assert d.meta["keys"] == "post-rope" and d.meta["sparsity"] == "4" and d.meta["calibration_tokens"] == str(len(TEXT) + 1)
    for name in ("heldout_key_error", "heldout_value_error", "heldout_key_error_vs_raw"):
        errs = json.loads(d.meta[name])
        assert len(errs) == 2 and all(0 < e < 1.5 for e in errs)
    assert "train-dict --text" in d.meta["command"]
    assert "mean" in stdout and "wrote" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "d.safetensors"]


def test_ctrl_c_while_learning_writes_nothing(fake_load, monkeypatch, capsys, tmp_path):
    import kvzip.sparse.train

    calls = {"n": 0}

    def interrupted(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    real = kvzip.sparse.train.learn_dictionary
    monkeypatch.setattr(kvzip.sparse.train, "learn_dictionary", interrupted)
    (tmp_path / "a.txt").write_text(TEXT)
    code, _, err = run_cli(monkeypatch, capsys, "train-dict", "--text", str(tmp_path / "a.txt"), "--atoms", "32",
                           "--iters", "1", "--samples", "512", "--out", str(tmp_path / "d.safetensors"))
    assert code == 130 and calls["n"] == 3
    assert err.strip().splitlines()[-1] == "kvzip: interrupted, no dictionary written"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


def test_train_dict_user_errors(fake_load, monkeypatch, capsys, tmp_path):
    code, _, err = run_cli(monkeypatch, capsys, "train-dict", "--keys", "sideways", "--out", str(tmp_path / "d"))
    assert code == 2 and "--keys must be one of post-rope, pre-rope" in err
    (tmp_path / "a.txt").write_text("tiny")
    code, _, err = run_cli(monkeypatch, capsys, "train-dict", "--text", str(tmp_path / "a.txt"), "--atoms", "64",
                           "--samples", "512", "--out", str(tmp_path / "d"))
    assert code == 2 and "fewer than --atoms 64" in err and len(err.strip().splitlines()) == 1


def _wrong_files(tmp_path, good: KVDictionary) -> dict:
    """Dictionaries for another layer count and another head_dim, a truncated file and a non-safetensors file."""
    files = {}
    other = tiny_llama(layers=3)
    deeper = KVDictionary(torch.randn(3, 32, 16), torch.randn(3, 32, 16),
                          make_meta(model_fingerprint(other.config), 4, "post-rope", "random", 0))
    files["layers"] = tmp_path / "layers.safetensors"
    deeper.save(files["layers"])
    fp = {**good.fingerprint, "head_dim": 32}
    wide = KVDictionary(torch.randn(2, 32, 32), torch.randn(2, 32, 32), make_meta(fp, 4, "post-rope", "random", 0))
    files["head_dim"] = tmp_path / "head_dim.safetensors"
    wide.save(files["head_dim"])
    good.save(tmp_path / "good.safetensors")
    blob = (tmp_path / "good.safetensors").read_bytes()
    files["truncated"] = tmp_path / "truncated.safetensors"
    files["truncated"].write_bytes(blob[: len(blob) // 2])
    files["garbage"] = tmp_path / "garbage.safetensors"
    files["garbage"].write_bytes(b"\x00\x01not a safetensors file at all" * 10)
    return files


EXPECTED = {"layers": "num layers 3", "head_dim": "head dim 32", "truncated": "truncated or not a safetensors",
            "garbage": "truncated or not a safetensors"}


def test_wrong_dictionaries_raise_one_line(tiny, tiny_dictionaries, tmp_path):
    from kvzip.dictionary_lookup import dictionaries_for

    class NeedsDict:
        name, needs_dictionary = "needs-dict", True

    for kind, path in _wrong_files(tmp_path, tiny_dictionaries).items():
        with pytest.raises(UserError) as exc:
            dictionaries_for(NeedsDict(), tiny, ModelSource("tiny", "tiny", False), path)
        assert EXPECTED[kind] in str(exc.value) and "\n" not in str(exc.value), (kind, str(exc.value))
    assert dictionaries_for(NeedsDict(), tiny, ModelSource("tiny", "tiny", False), tmp_path / "good.safetensors")


DICT_METHODS = [name for name, cls in METHODS.items() if cls().needs_dictionary is True]  # default options


@pytest.mark.parametrize("method", DICT_METHODS or [pytest.param("none", marks=pytest.mark.skip("no dictionary method registered"))])
def test_generate_with_a_wrong_dictionary_exits_2(method, fake_load, tiny_dictionaries, monkeypatch, capsys, tmp_path):
    for kind, path in _wrong_files(tmp_path, tiny_dictionaries).items():
        code, _, err = run_cli(monkeypatch, capsys, "generate", "hello", "--raw", "--method", method, "--dict", str(path),
                               "--max-new-tokens", "2")
        assert code == 2, (kind, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kvzip: error:") and EXPECTED[kind] in lines[0], (kind, err)
