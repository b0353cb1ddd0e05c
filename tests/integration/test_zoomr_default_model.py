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
    proc = run_cli("generate", "--method", "zoomr", "--ignore-eos", "--max-new-tokens", "700", "--dtype", "float32",
                   "--json", PROMPT)  # one dtype on every CPU: bf16 text differs between CPUs, and with it the thoughts
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


def test_a_batch_holds_what_its_rows_hold_alone(default_model):
    """Rows of different lengths in one batch (each zooms in on its own thoughts): the device tier of the batch is the
    sum of its rows' device tiers alone within 5%, at the end and at the peak (the token pool,
    kvzip/methods/thoughts/pool.py). The rows are fed the same tokens both ways (what the batch generated), so that
    they hold the same thoughts."""
    from kvzip import engine
    from kvzip.bench.recall import forced_decode
    from kvzip.methods import get_method

    model, tokenizer, _ = default_model
    questions = ["Natalia sold clips to 48 friends in April and half as many in May. How many in all? Explain.",
                 "A train travels 60 km per hour for 3 hours. How far does it go? Show each step.",
                 "Tom has 3 apples.", "List three prime numbers and say why each is prime, one paragraph each."]
    prompts = [engine.encode(tokenizer, q) for q in questions]
    settings = engine.Settings(max_new_tokens=300, ignore_eos=True)
    cache = get_method("zoomr").make_cache(model)
    forced = [e.token_ids for e in engine.generate(model, tokenizer, prompts, cache, settings)
              if isinstance(e, engine.Result)]

    def device_bytes(rows):
        cache = get_method("zoomr").make_cache(model)
        report = forced_decode(model, tokenizer, cache, [prompts[i] for i in rows], [forced[i] for i in rows])[3]
        return report["kv_bytes_by_tier"]["device"], report["kv_bytes_device_peak"], cache.stats()["thoughts_indexed"]

    final, peak, thoughts = device_bytes(range(len(prompts)))
    alone = [device_bytes([i]) for i in range(len(prompts))]
    assert thoughts == [a[2][0] for a in alone] and min(thoughts) >= 2  # the same thoughts, rows of their own
    assert abs(final / sum(a[0] for a in alone) - 1) < 0.05
    assert peak < 1.05 * sum(a[1] for a in alone)
