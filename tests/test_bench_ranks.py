"""Fast tier: `kvzip bench` over two torchrun ranks, interrupted and resumed, against one process.

One test, in the order a user lives it, on tiny sizes (the tiny model saved as a folder; full, window and fadkv on
the output, reasoning and speed workloads):
1. one process writes the reference JSON;
2. two ranks start; once the first cell is published, torchrun gets SIGINT (Ctrl-C): the run stops, rank 0 writes
   the JSON of the cells finished so far (interrupted: true) and says how to resume; the pieces folder holds exactly
   those cells, so at most the cells in flight were lost;
3. `--resume` with other settings is refused, one line, before any model loads;
4. the same command with `--resume` on two ranks finishes: the cells of the first launch are in the final JSON as
   they were written (their timing fields too, so they were not run again), the second launch ran exactly the others,
   and every quality and memory figure equals the one-process run's, in the same order and schema.
"""

from __future__ import annotations

import json
import signal

import pytest

import kvzip.models
from kvzip.cli import main
from tests.launch import start_torchrun, torchrun, wait_for
from tests.test_cli import one_line_error

QUALITY = ("ppl", "top1_agreement", "kl", "positions", "greedy_agreement", "greedy_prefix_agreement", "gsm8k_accuracy",
           "kv_bytes_peak", "kv_bytes_device_peak", "kv_bytes_full", "kv_ratio_vs_full", "new_tokens", "prompts")
CELLS = 9  # 3 settings x 3 workloads


def bench_args(model_dir, dict_file, json_path, *extra: str) -> list[str]:
    return ["bench", "--model", str(model_dir), "--dtype", "float32", "--quick", "--methods", "full,window,fadkv",
            "--opt", "window.window=8", "--opt", "window.sinks=2", "--opt", "fadkv.sparsity=4", "--opt",
            "fadkv.buffer=8", "--opt", "fadkv.code_chunk=4", "--opt", "fadkv.sinks=2", "--dict", str(dict_file),
            "--workloads", "output,reasoning,speed", "--output-tokens", "512", "--rows", "2", "--prompts", "2",
            "--new-tokens", "24", "--contexts", "128", "--repeats", "1", "--json", str(json_path), *extra]


def _unpaired(record: dict) -> dict:
    """A record without its ratio to full's unpaired decode rate (added at the merge, from the run's records), at the
    top and in each context's entry."""
    out = {k: v for k, v in record.items() if k != "speed_ratio_vs_full"}
    if "by_context" in out:
        out["by_context"] = [_unpaired(e) for e in out["by_context"]]
    return out


def _same(a: dict, b: dict) -> bool:
    return _unpaired(a) == _unpaired(b)


@pytest.mark.usefixtures("one_thread")
def test_two_rank_bench_interrupted_and_resumed_equals_one_process(capsys, monkeypatch, tmp_path, tiny_model_dir,
                                                                   tiny_dict_file):
    with pytest.raises(SystemExit) as exc:
        main(bench_args(tiny_model_dir, tiny_dict_file, tmp_path / "one.json"))
    assert exc.value.code == 0
    one = json.loads((tmp_path / "one.json").read_text())
    capsys.readouterr()

    out, parts = tmp_path / "two.json", tmp_path / "two.json.parts"
    proc, _ = start_torchrun(2, *bench_args(tiny_model_dir, tiny_dict_file, out))
    wait_for(lambda: any(parts.glob("cell-*.json")) or proc.poll() is not None, what="a first finished cell")
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0
    pieces = {p["cell"]: p for p in (json.loads(f.read_text()) for f in parts.glob("cell-*.json"))}
    interrupted = json.loads(out.read_text())
    assert interrupted["interrupted"] and 0 < len(pieces) < CELLS, sorted(pieces)
    assert "run the same command with --resume to finish" in err
    kept = [pieces[i]["record"] for i in sorted(pieces)]
    assert len(interrupted["results"]) == len(kept) and all(map(_same, interrupted["results"], kept))

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad resume was refused")

    monkeypatch.setattr(kvzip.models, "load_model", refuse)
    line = one_line_error(capsys, *bench_args(tiny_model_dir, tiny_dict_file, out, "--resume", "--new-tokens", "25"))
    assert line.startswith(f"kvzip: error: --resume: {parts} was written with other settings (config differ)")
    monkeypatch.undo()

    got = torchrun(2, *bench_args(tiny_model_dir, tiny_dict_file, out, "--resume"))
    assert got.returncode == 0, got.stderr[-3000:]
    final = json.loads(out.read_text())
    assert not final["interrupted"] and not parts.exists() and final["run"]["earlier_cells"] == len(pieces)
    by_cell = {(r["label"], r["workload"]): r for r in final["results"]}
    for p in pieces.values():  # as written by the first launch: not run again
        assert _same(by_cell[p["label"], p["workload"]], p["record"])
    resumed = [c for r in final["ranks"] for c in r["cells"]]
    assert sorted(resumed) == sorted(set(range(CELLS)) - set(pieces)) and len(final["ranks"]) == 2

    assert [(r["label"], r["workload"]) for r in final["results"]] == [(r["label"], r["workload"]) for r in one["results"]]
    for mine, theirs in zip(final["results"], one["results"]):
        assert set(mine) == set(theirs)
        assert {k: mine.get(k) for k in QUALITY} == {k: theirs.get(k) for k in QUALITY}, (mine["label"], mine["workload"])
    assert set(final) == set(one) and final["skipped"] == one["skipped"] and final["settings"] == one["settings"]
