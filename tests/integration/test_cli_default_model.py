"""Integration tier for the command line on the default model: a real `kvzip generate` leaves no process behind, a
model folder holding the real config.json but no tokenizer is one line, bad output paths are refused before the
model loads, `--output` rows carry their own figures, and a wheel built from this tree carries the shipped
dictionaries inside the package (where kvzip.dictionary_lookup finds them once installed)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
import zipfile
from pathlib import Path

from tests.integration.conftest import run_cli
from tests.test_cli import ROW_KEYS, kvzip_processes

ROOT = Path(__file__).resolve().parents[2]


def _one_line(got) -> str:
    lines = got.stderr.strip().splitlines()
    assert got.returncode == 2 and len(lines) == 1 and lines[0].startswith("kvzip: error: "), got.stderr
    return lines[0]


def test_generate_leaves_no_process_behind():
    marker = uuid.uuid4().hex
    script = Path(sys.executable).with_name("kvzip")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "kvzip.cli"]
    got = subprocess.run([*cmd, "generate", "--max-new-tokens", "4", "Hi"], capture_output=True, text=True,
                         timeout=1800, env={**os.environ, "KVZIP_TEST_MARKER": marker})
    assert got.returncode == 0 and got.stdout.strip(), got.stderr
    assert kvzip_processes(f"KVZIP_TEST_MARKER={marker}") == []


def test_model_folder_with_the_real_config_but_no_tokenizer(tmp_path):
    from kvzip.models import _gguf_to_safetensors, resolve_model

    converted = _gguf_to_safetensors(Path(resolve_model("smollm2-135m").path))
    shutil.copy(converted / "config.json", tmp_path / "config.json")
    shutil.copy(converted / "model.safetensors", tmp_path / "model.safetensors")
    line = _one_line(run_cli("generate", "--model", str(tmp_path), "Hi"))
    assert "has a config.json but no tokenizer" in line


def test_bad_paths_are_refused_before_the_model(tmp_path):
    (tmp_path / "d").mkdir()
    assert "--output: " in _one_line(run_cli("generate", "--output", str(tmp_path / "d"), "Hi"))
    assert "--out: " in _one_line(run_cli("train-dict", "--out", str(tmp_path / "d")))
    assert "is a directory" in _one_line(run_cli("generate", "--method", "fadkv", "--dict", str(tmp_path / "d"), "Hi"))
    assert listing(tmp_path) == ["d"] and listing(tmp_path / "d") == []


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_output_rows_and_one_summary(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"prompt": "Name a colour."}\n{"prompt": "What is 2 + 2?"}\n')
    got = run_cli("generate", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"),
                  "--max-new-tokens", "6")
    assert got.returncode == 0, got.stderr
    *rows, last = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(set(r) == ROW_KEYS for r in rows) and rows[0]["tokens"] != rows[1]["tokens"]
    (batch,) = last["summary"]["batches"]
    assert batch["rows"] == 2 and batch["prompt_tokens"] == sum(r["prompt_tokens"] for r in rows)
    assert batch["new_tokens"] == sum(r["new_tokens"] for r in rows)


def test_wheel_carries_the_shipped_dictionaries(tmp_path):
    """Built from a copy of the tree (a build writes build/ and egg-info beside the sources)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("kvzip", "dictionaries"):
        shutil.copytree(ROOT / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    isolation = [] if subprocess.run([sys.executable, "-c", "import setuptools"]).returncode else ["--no-build-isolation"]
    got = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", *isolation, "-w",
                          str(tmp_path / "wheel")], capture_output=True, text=True, timeout=1800)
    assert got.returncode == 0, got.stderr
    (wheel,) = (tmp_path / "wheel").glob("kvzip-*.whl")
    with zipfile.ZipFile(wheel) as z:
        sizes = {i.filename: i.file_size for i in z.infolist()}
    shipped = sorted(p for p in (ROOT / "dictionaries").iterdir() if p.suffix in (".safetensors", ".md"))
    assert shipped, "no shipped dictionaries to check"
    for path in shipped:
        assert sizes.get(f"kvzip/_dictionaries/{path.name}") == path.stat().st_size, path.name
    assert "kvzip/cli/__init__.py" in sizes and not any(name.startswith("kvzip/warm") for name in sizes)
    entry = next(name for name in sizes if name.endswith("entry_points.txt"))
    with zipfile.ZipFile(wheel) as z:
        assert "kvzip = kvzip.cli:main" in z.read(entry).decode()

