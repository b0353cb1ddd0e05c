"""Fast tier: `generate --output` is resumable and safe, and its user errors come before the model.

- Ctrl-C in the second of three batches (raised inside the engine, as a real one lands): exit 130 and one line saying
  how to resume; the output is not written, the first batch is kept in OUTPUT.parts and the interrupted batch is not
  (none of its rows are written as finished). Then: the same command without --resume is refused; --resume with
  other settings or at another commit is refused, naming what differs, before any model loads; --resume finishes,
  equal to an uninterrupted run, generating only the two missing batches; a second --resume has nothing to do.
- A rank killed mid-run under torchrun (SIGKILL, so it writes nothing more), then the same command with --resume on
  three ranks: every row exactly once, equal to one process's rows. "None generated twice" is checked by counts: the
  batches left by the killed run are in the output unchanged and marked with that run's id, and the resumed run's
  ranks generated exactly the rows that were missing, no more.
- Bad paths: --output naming the --input file (today's bug: the prompts replaced by results), --output -, --resume
  without --output.
"""

from __future__ import annotations

import json
import os
import signal

import pytest

import kvzip.engine
import kvzip.models
import kvzip.runs
from kvzip.cli import main
from kvzip.models import ModelSource
from tests.conftest import ByteTokenizer
from tests.launch import jsonl, rank_pids, start_torchrun, torchrun, wait_for, write_prompts
from tests.test_cli import no_model, one_line_error, run  # noqa: F401  (a fixture)

ARGS = ["--raw", "--batch-size", "2", "--max-new-tokens", "3", "--ignore-eos", "--dtype", "float32"]


@pytest.fixture
def loads(monkeypatch, tiny):
    """The tiny model for `generate`, counting how often it was loaded."""
    count = []

    def load(*args, **kwargs):
        count.append(args)
        return tiny, ByteTokenizer(), ModelSource("tiny", "tiny", False)

    monkeypatch.setattr(kvzip.models, "load_model", load)
    return count


@pytest.mark.usefixtures("one_thread")
def test_ctrl_c_keeps_finished_batches_and_resume_finishes_the_same_job(capsys, tmp_path, monkeypatch, loads):
    prompts = write_prompts(tmp_path / "in.jsonl", 5)  # batches: rows 0-1, 2-3, 4
    out, parts = tmp_path / "out.jsonl", tmp_path / "out.jsonl.parts"
    command = ["generate", "--input", str(prompts), "--output", str(out), *ARGS]
    assert run(capsys, *command[:3], "--output", str(tmp_path / "ref.jsonl"), *ARGS)[0] == 0
    real_sample, calls = kvzip.engine.sample, []

    def sample(*args):  # three samples per batch (prefill, two steps): the 5th is a decode step of the second batch
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real_sample(*args)

    monkeypatch.setattr(kvzip.engine, "sample", sample)
    code, _, err = run(capsys, *command)
    monkeypatch.setattr(kvzip.engine, "sample", real_sample)
    assert code == 130 and err.strip().splitlines()[-1] == (
        f"kvzip: interrupted: 1 of 3 batches are finished in {parts} (the batch in flight is not kept); run the same "
        "command with --resume to finish")
    assert not out.exists() and sorted(p.name for p in parts.iterdir()) == ["batch-000000.json", "run.json"]
    first_run = json.loads((parts / "run.json").read_text())["run"]
    kept = json.loads((parts / "batch-000000.json").read_text())
    assert [r["index"] for r in kept["rows"]] == [0, 1] and kept["run"] == first_run
    assert all(r["finish_reason"] == "length" for r in kept["rows"])

    n = len(loads)
    assert "holds an unfinished run: pass --resume" in one_line_error(capsys, *command)
    line = one_line_error(capsys, *command, "--resume", "--max-new-tokens", "4")
    assert line == (f"kvzip: error: --resume: {parts} was written with other settings (max_new_tokens differ): rerun "
                    "with the same settings, or start over without resuming")
    recorded, real_commit = json.loads((parts / "run.json").read_text())["commit"], kvzip.runs.commit
    monkeypatch.setattr(kvzip.runs, "commit", lambda: "0123abc")
    assert f"was written at commit {recorded}, this is 0123abc" in one_line_error(capsys, *command, "--resume")
    monkeypatch.setattr(kvzip.runs, "commit", real_commit)
    assert len(loads) == n  # every refusal came before the model

    code, _, err = run(capsys, *command, "--resume")
    assert code == 0, err
    *rows, summary = jsonl(out)
    assert rows == jsonl(tmp_path / "ref.jsonl")[:-1] and not parts.exists()
    summary = summary["summary"]
    assert summary["totals"]["earlier_rows"] == 2 and summary["totals"]["generated_rows"] == 3
    assert [b["run"] for b in summary["batches"]][0] == first_run != summary["run"]["id"]
    assert [b["run"] for b in summary["batches"]][1:] == [summary["run"]["id"]] * 2

    n = len(loads)
    code, _, err = run(capsys, *command, "--resume")
    assert code == 0 and "nothing to generate" in err and len(loads) == n
    assert "max_new_tokens differ" in one_line_error(capsys, *command, "--resume", "--max-new-tokens", "5")


@pytest.mark.usefixtures("one_thread", "loads")
def test_ctrl_c_without_output_shows_the_finished_batches(capsys, tmp_path, monkeypatch):
    prompts = write_prompts(tmp_path / "in.jsonl", 3)
    real_sample, calls = kvzip.engine.sample, []

    def sample(*args):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real_sample(*args)

    monkeypatch.setattr(kvzip.engine, "sample", sample)
    code, out, err = run(capsys, "generate", "--input", str(prompts), *ARGS)
    assert code == 130 and err.strip().splitlines()[-1] == "kvzip: interrupted"
    assert ">>> prompt 0: " in out and ">>> prompt 1: " in out and ">>> prompt 2" not in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


@pytest.mark.usefixtures("no_model")
def test_output_paths_that_cannot_work(capsys, tmp_path):
    prompts = write_prompts(tmp_path / "in.jsonl", 2)
    before = prompts.read_text()
    line = one_line_error(capsys, "generate", "--input", str(prompts), "--output", str(tmp_path / "." / "in.jsonl"))
    assert "is the --input file: the results would replace the prompts" in line and prompts.read_text() == before
    assert "not on standard output" in one_line_error(capsys, "generate", "--input", str(prompts), "--output", "-")
    assert "--resume continues the job that writes --output" in one_line_error(capsys, "generate", "hi", "--resume")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


@pytest.mark.usefixtures("one_thread")
def test_a_killed_rank_then_resume_writes_every_row_once(tmp_path, tiny_model_dir):
    prompts = write_prompts(tmp_path / "in.jsonl", 17)
    out, parts = tmp_path / "out.jsonl", tmp_path / "out.jsonl.parts"
    command = lambda path: ["generate", "--model", str(tiny_model_dir), "--dtype", "float32", "--input",  # noqa: E731
                            str(prompts), "--output", str(path), "--batch-size", "1", "--max-new-tokens", "40",
                            "--ignore-eos"]
    with pytest.raises(SystemExit):
        main(command(tmp_path / "ref.jsonl"))
    reference = jsonl(tmp_path / "ref.jsonl")[:-1]
    args = command(out)

    proc, marker = start_torchrun(2, *args)
    pieces = lambda: [json.loads(p.read_text()) for p in parts.glob("batch-*.json")]  # noqa: E731
    wait_for(lambda: any(p["rank"] == 1 for p in pieces()) or proc.poll() is not None, what="a batch from rank 1")
    pids = rank_pids(marker)
    assert proc.poll() is None and 1 in pids, "the run ended before rank 1 could be killed"
    os.kill(pids[1], signal.SIGKILL)
    proc.communicate(timeout=300)
    assert proc.returncode != 0 and not out.exists()
    left = {p["batch"]: p for p in pieces()}  # every piece is whole JSON: none half-written under its name
    first_run = json.loads((parts / "run.json").read_text())["run"]
    assert 0 < len(left) < 17 and {p["run"] for p in left.values()} == {first_run}, sorted(left)

    got = torchrun(3, *args, "--resume")
    assert got.returncode == 0, got.stderr[-3000:]
    *rows, summary = jsonl(out)
    assert rows == reference and not parts.exists()
    summary = summary["summary"]
    earlier = [b["first_row"] for b in summary["batches"] if b["run"] == first_run]
    assert earlier == sorted(left) and all(rows[k] == {key: v for key, v in left[k]["rows"][0].items() if key != "index"}
                                           for k in left)
    assert {b["run"] for b in summary["batches"] if b["first_row"] not in left} == {summary["run"]["id"]}
    totals = summary["totals"]
    assert totals["earlier_rows"] == len(left) and totals["generated_rows"] == 17 - len(left) == sum(
        r["rows"] for r in summary["ranks"]) and totals["world_size"] == 3


def test_the_pieces_folder_holds_whole_pieces_and_one_job(tmp_path):
    from kvzip.batches import merge
    from kvzip.errors import UserError
    from kvzip.runs import Parts, check_same_job

    parts = Parts(tmp_path / "out.jsonl.parts")
    parts.begin({"k": 1}, "abc", "run1")
    parts.write("batch-000001", {"batch": 1, "rows": [{"index": 1, "x": 1}], "stats": {"b": 1}})
    (parts.folder / ".batch-000002.json.x1.tmp.json").write_text('{"batch": 2, "ro')  # a killed writer's leftover
    assert parts.finished() == ["batch-000001"]
    parts.begin({"k": 2}, "def", "run2")  # a resume: the first job's record stays, the leftover goes
    assert sorted(p.name for p in parts.folder.iterdir()) == ["batch-000001.json", "run.json"]
    record = parts.record()
    assert record["settings"] == {"k": 1} and record["runs"] == ["run1", "run2"] and record["run"] == "run2"
    check_same_job(record, {"k": 1}, "abc", "here")
    with pytest.raises(UserError, match=r"^here was written with other settings \(k, z differ\)"):
        check_same_job(record, {"k": 2, "z": 0}, "abc", "here")
    with pytest.raises(UserError, match="^here was written at commit abc, this is def"):
        check_same_job(record, {"k": 1}, "def", "here")
    parts.check_visible("run2")
    with pytest.raises(UserError, match="is not the folder rank 0 wrote"):
        parts.check_visible("run3")

    piece = lambda k: {"batch": k, "rows": [{"index": k, "x": k}], "stats": {"b": k}}  # noqa: E731
    assert merge([piece(1), piece(0)], 2) == ([{"x": 0}, {"x": 1}], [{"b": 0}, {"b": 1}])
    with pytest.raises(ValueError, match="batch 1 was generated twice"):
        merge([piece(1), piece(0), piece(1)], 2)
    with pytest.raises(ValueError, match=r"batches \[1\] are missing"):
        merge([piece(0)], 2)
    stale = Parts(tmp_path / "new.parts")  # a folder with pieces but no record of a job: a new job keeps nothing
    stale.folder.mkdir()
    (stale.folder / "batch-000000.json").write_text("{}")
    stale.begin({"k": 1}, "abc", "r")
    assert stale.finished() == []
