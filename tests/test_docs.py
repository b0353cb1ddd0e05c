"""Fast tier: the docs stay true to the code's outputs and readable by a newcomer.

- Every results table in README.md and docs/*.md is what `scripts/results_tables.py` generates from the committed
  bench JSON (`--check` passes on the repository), and `--check` does fail once a table is edited by hand (a
  tampered copy in tmp_path), so the first test can fail.
- The generator picks columns from the fields a record holds: ratios against `full` come from the byte fields of
  the newer bench (`kv_bytes_full`) and a device column appears only when some setting keeps a host tier; a
  resumed run's caption says how many of its cells an earlier run measured; a `caption=short` block names only the
  file and commit, and is refused when no block above it gives that file's full caption.
- README.md is a user's page: at most 200 lines, no lab-notebook text (dates, times, "this session", "issue N").
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "results_tables.py"
BLOCK = re.compile(r"<!-- results:[\w.-]+.*?<!-- /results:[\w.-]+ -->", re.DOTALL)


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def copy_docs(dest: Path) -> None:
    """README.md, docs/ and the bench results, laid out as in the repository."""
    shutil.copy(ROOT / "README.md", dest / "README.md")
    shutil.copytree(ROOT / "docs", dest / "docs")
    shutil.copytree(ROOT / "results", dest / "results", ignore=shutil.ignore_patterns("*.parts"))


def test_results_tables_match_the_committed_json():
    out = run("--check")
    assert out.returncode == 0, out.stdout + out.stderr


def test_check_names_a_tampered_block_and_regenerating_restores_it(tmp_path):
    copy_docs(tmp_path)
    assert run("--check", "--root", str(tmp_path)).returncode == 0
    page = tmp_path / "docs" / "results.md"
    original = page.read_text()
    row = re.search(r"<!-- results:full-output .*?\n(\| fadkv \|[^\n]*)", original, re.DOTALL).group(1)
    page.write_text(original.replace(row, row.replace("| fadkv |", "| fadkv (edited) |"), 1))

    out = run("--check", "--root", str(tmp_path))
    assert out.returncode == 1
    assert out.stdout.strip().count("\n") == 0 and "docs/results.md" in out.stdout and "'full-output'" in out.stdout

    assert run("--root", str(tmp_path)).returncode == 0
    assert page.read_text() == original
    assert run("--check", "--root", str(tmp_path)).returncode == 0


def test_a_block_naming_a_missing_file_is_one_line_exit_2(tmp_path):
    (tmp_path / "README.md").write_text("<!-- results:x file=nowhere.json -->\n<!-- /results:x -->\n")
    out = run("--check", "--root", str(tmp_path))
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "nowhere.json" in out.stderr and "Traceback" not in out.stderr


def _record(label, workload, peak, device, full, **fields):
    return {"label": label, "workload": workload, "kv_bytes_peak": peak, "kv_bytes_device_peak": device,
            "kv_bytes_full": full, "kv_bytes_fp16_full": full // 2, **fields}


def test_columns_follow_the_fields_of_a_newer_bench_file(tmp_path):
    data = {
        "command": "kvzip bench --workloads output --json /somewhere/results/new.json",
        "environment": {"commit": "0123456789abcdef", "dtype": "float32", "date": "2027-01-02T03:04:05+00:00"},
        "config": {"workloads": ["output", "prompt"], "output_tokens": [768], "output_rows": 2},
        "settings": [{"label": "full"}, {"label": "zoomr"}],
        "results": [_record("full", "output", 4000, 4000, 4000, top1_agreement=1.0),
                    _record("zoomr", "output", 3000, 1000, 4000, top1_agreement=0.9)],
        "skipped": [{"label": "zoomr", "workload": "prompt", "reason": "keeps the prompt in full by design"}],
        "failed": [], "run": {"id": "77aa01c2b3d4", "earlier_cells": 1},  # resumed
    }
    results = tmp_path / "results"
    results.mkdir(parents=True)
    (results / "new.json").write_text(json.dumps(data))
    readme = tmp_path / "README.md"
    example = "```\n<!-- results:e file=missing.json -->\n<!-- /results:e -->\n```\n"  # syntax shown, not drawn
    short = ("<!-- results:s file=new.json caption=short workload=output columns=top1_agreement -->\n"
             "<!-- /results:s -->\n")
    readme.write_text(short + example)
    out = run("--root", str(tmp_path))  # a short caption with no full one above it
    assert out.returncode == 2 and "caption=short" in out.stderr and out.stderr.strip().count("\n") == 0
    readme.write_text("<!-- results:n file=new.json workload=output -->\n<!-- /results:n -->\n" + short + example)

    assert run("--root", str(tmp_path)).returncode == 0
    text = readme.read_text()
    assert "| method | KV / full | device KV / full | KV / fp16 full |" in text
    assert "| zoomr | 0.750 | 0.250 | 1.500 |" in text and "| full | 1.000 | 1.000 | 2.000 |" in text
    assert "`kvzip bench --workloads output --json results/new.json`" in text  # recorded path, from root
    assert "commit `0123456789ab`" in text
    assert "From `results/new.json`, commit `0123456789ab`: the run named above." in text
    assert "1 of its cells were measured by an earlier run" in text
    assert "Skipped" not in text  # the skip concerns the prompt workload, not this table
    assert text.endswith(example)
    assert run("--check", "--root", str(tmp_path)).returncode == 0


DIARY = [r"this session", r"\bissue \d", r"\bI (believe|think|estimate)\b", r"tried and dropped", r"\btoday\b",
         r"\b20\d\d-\d\d-\d\d\b", r"\b\d{1,2}:\d{2}\b", r"\bearlier session"]


def test_readme_is_a_short_user_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    prose = BLOCK.sub("", text)  # generated blocks state their run's date on purpose
    found = [p for p in DIARY if re.search(p, prose, re.IGNORECASE)]
    assert not found, f"README.md reads like a lab notebook: {found}"
    assert "bash scripts/test.sh" in prose  # the test command CI runs (.ci/run)


def _doc_text() -> str:
    return "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])


def test_results_hold_what_the_docs_cite_and_nothing_else():
    """results/ is data the docs cite: every file there is named by README.md or a page of docs/ (its path from the
    repository root, or, in results/decisions/, its name on docs/decisions.md), and every results/ path they name
    exists. The package ships no results."""
    text, decisions = _doc_text(), (ROOT / "docs" / "decisions.md").read_text()
    files = [p for p in (ROOT / "results").rglob("*") if p.is_file()]
    assert files, "results/ is empty"
    uncited = []
    for p in files:
        rel = p.relative_to(ROOT).as_posix()
        if rel in text or (p.parent.name == "decisions" and re.search(rf"(?<![\w.-]){re.escape(p.name)}", decisions)):
            continue
        if ".parts/" in rel or rel.endswith(".machine"):  # a part's finished cells and its CPU (scripts/full_run.sh)
            continue
        uncited.append(rel)
    assert not uncited, f"files in results/ that no page cites: {uncited}"
    named = set(re.findall(r"(?<![\w/.-])results/[\w./-]+\.(?:json|png)", text))
    assert not [n for n in named if not (ROOT / n).is_file()], "cited results files that do not exist"
    assert not (ROOT / "kvzip" / "bench" / "results").exists(), "bench results live in results/, not in the package"
