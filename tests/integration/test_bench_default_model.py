"""Integration tier for `kvzip bench`: the quick run on the default model, every workload, the issue's fields.

The whole `kvzip bench --quick` (8 methods on 2026-11-30) took 12 min on the loaded 2-core dev machine (6.4 min of
CPU time), over the ~8 minute budget of this tier, so this test runs a subset of methods as a user would
(`--methods full,window,hf-fp8,hf-int2`: the reference, an eviction method, two peers) through every workload;
every registered method is run through the engine by tests/test_engine.py and through the bench by
tests/test_bench.py on the tiny model. Checks are relations that hold on SmolLM2 with margin (full agrees with
itself; int2 loses far more top-1 agreement than fp8, as MEASURED.md found), not exact figures.
"""

from __future__ import annotations

import json

from .conftest import run_cli

SUBSET = ("full", "window", "hf-fp8", "hf-int2")


def test_quick_bench_reports_the_issue_fields(tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    proc = run_cli("bench", "--quick", "--methods", ",".join(SUBSET), "--json", str(out), "--plot", str(png), timeout=900,
                   env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert data["config"]["quick"] and not data["failed"]
    ran = {r["label"] for r in data["results"]}
    skipped = {s["label"] for s in data["skipped"]}
    assert ran | skipped == set(SUBSET) and "full" in ran
    for note in data["skipped"]:
        assert note["reason"]
    by = {(r["label"], r["workload"]): r for r in data["results"]}
    for label in ran:
        for workload, fields in {"ppl": ("ppl", "top1_agreement", "kl"), "reasoning": ("greedy_agreement", "gsm8k_accuracy"),
                                 "recall": ("recall_accuracy",), "speed": ("ttft_s",)}.items():
            r = by[label, workload]
            for key in ("method", "options", "kv_bytes_peak", "kv_bytes_device_peak", "kv_ratio_vs_full_fp16",
                        "decode_tokens_per_s", "speed_ratio_vs_full", *fields):
                assert r.get(key) is not None, (label, workload, key)
    assert by["full", "ppl"]["top1_agreement"] == 1.0 and by["full", "reasoning"]["greedy_agreement"] == 1.0
    if ("hf-fp8", "ppl") in by and ("hf-int2", "ppl") in by:
        assert by["hf-int2", "ppl"]["top1_agreement"] < by["hf-fp8", "ppl"]["top1_agreement"] - 0.1
        assert by["hf-int2", "ppl"]["kv_bytes_peak"] < by["hf-fp8", "ppl"]["kv_bytes_peak"]
    # the table names every method that ran
    for label in ran:
        assert label in proc.stdout
