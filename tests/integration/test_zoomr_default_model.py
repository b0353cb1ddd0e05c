"""Integration tier for zoomr: `kvzip generate --method zoomr` on the default model with no other flag, and its device
KV staying below the full cache's once a few hundred tokens of reasoning have been generated."""

from __future__ import annotations

import json

from .conftest import run_cli

PROMPT = "A farmer has 12 cows and buys 7 more, then sells 5. Explain step by step, one paragraph per step."


def test_generate_zoomr_with_no_other_flag():
    proc = run_cli("generate", "--method", "zoomr", PROMPT)
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.split()) > 10


def test_zoomr_device_bytes_below_full_and_detail_on_host():
    proc = run_cli("generate", "--method", "zoomr", "--ignore-eos", "--max-new-tokens", "700", "--json", PROMPT)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.strip().splitlines()]
    row, record = lines[0], lines[-1]["summary"]["batches"][0]
    stats = record["method_stats"]
    assert row["new_tokens"] == 700 and stats["thoughts_indexed"][0] >= 5
    # Device bytes (prompt + summaries + zoomed thoughts + tail) against what full holds: at the end, and at the peak;
    # with the int8 detail tier, device and host together hold less than full too.
    assert record["kv_bytes_by_tier"]["device"] < 0.8 * record["kv_bytes_full"]
    assert record["kv_bytes_device_peak"] < record["kv_bytes_full"]
    assert record["kv_bytes_peak"] < record["kv_bytes_full"]
    assert record["kv_bytes_host_peak"] > 0 and stats["host_bytes"] == record["kv_bytes_by_tier"]["host"]
    assert stats["selections"] > 0 and stats["selection_ms_per_token"] > 0
