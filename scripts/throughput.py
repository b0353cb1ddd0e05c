"""Aggregate decode throughput of a fixed batch, every method against `full` in the same run, as JSON.

The batch job a serving engine is measured on: `--batch` GSM8K prompts generated to `--new-tokens` each with
`--ignore-eos` semantics, greedy. Each repeat runs every method once in turn, `full` first, so each method's ratio is
paired with the `full` run of its own repeat (a shared CPU's load drifts slowly); the median of the paired ratios is
reported, for the whole decode and for its last `--end-steps` steps (the speed at the longest context, where a
smaller cache should pay most). The JSON carries the command, commit and environment like `kvzip bench`'s, so docs
tables can be generated from it (scripts/results_tables.py).

    .venv/bin/python scripts/throughput.py --methods full,fadkv,zoomr --batch 8 --new-tokens 1024 \\
        --json kvzip/bench/results/throughput_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--methods", default="full,fadkv,zoomr")
    ap.add_argument("--method-set", action="append", default=[],
                    help='one more setting, "method:key=value,...", e.g. "full:attention=kvzip" (repeatable)')
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--end-steps", type=int, default=256, help="decode steps at the end timed on their own")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", dest="json_path", default=None)
    args = ap.parse_args()
    if min(args.batch, args.new_tokens, args.repeats, args.end_steps) < 1:
        ap.error("--batch, --new-tokens, --repeats and --end-steps must be positive")
    if args.end_steps >= args.new_tokens:
        ap.error("--end-steps must be fewer than --new-tokens")

    from kvzip import engine
    from kvzip.bench.config import BenchConfig, parse_settings
    from kvzip.bench.runner import environment
    from kvzip.bench.workloads import Context, capacity_prompts
    from kvzip.dictfiles import dictionaries_for
    from kvzip.errors import UserError
    from kvzip.files import check_writable, write_atomic
    from kvzip.methods import METHODS
    from kvzip.models import load_model

    try:
        settings = parse_settings(args.methods, None, args.method_set, list(METHODS))  # full first
        names = [s.label for s in settings]
        if args.json_path:
            check_writable(args.json_path)
        methods = [s.build() for s in settings]
        model, tokenizer, source = load_model(args.model, args.device, args.dtype)
        dicts = [dictionaries_for(m, model, source) for m in methods]
    except UserError as exc:
        print(f"throughput: error: {exc}", file=sys.stderr)
        sys.exit(2)
    prompts = capacity_prompts(Context(model, tokenizer, BenchConfig()), args.batch)
    settings = engine.Settings(max_new_tokens=args.new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for repeat in range(args.repeats):
        for name, method, d in zip(names, methods, dicts):
            elapsed, summary = [], None
            for e in engine.generate(model, tokenizer, prompts, method.make_cache(model, d), settings):
                if isinstance(e, engine.Step):
                    elapsed.append(e.elapsed_s)
                elif isinstance(e, engine.Summary):
                    summary = e.stats
            # every row decodes every step (--ignore-eos): the last end_steps steps made batch tokens each
            summary["decode_tokens_per_s_end"] = round(
                args.batch * args.end_steps / (elapsed[-1] - elapsed[-1 - args.end_steps]), 2)
            runs[name].append(summary)
            print(f"repeat {repeat + 1}: {name:8s} {summary['decode_tokens_per_s']:7.1f} tok/s "
                  f"(last {args.end_steps} steps {summary['decode_tokens_per_s_end']:7.1f}) "
                  f"KV {summary['kv_ratio_vs_full']:.3f}x full (device {summary['kv_device_ratio_vs_full']:.3f}x)",
                  flush=True)
    results = []
    for name, method in zip(names, methods):
        paired = lambda key: [m[key] / f[key] for m, f in zip(runs[name], runs["full"])]  # noqa: E731
        ratios, end = paired("decode_tokens_per_s"), paired("decode_tokens_per_s_end")
        last = runs[name][-1]
        results.append({
            "label": name, "method": method.name, "workload": "throughput", "rows": args.batch,
            "new_tokens_per_row": args.new_tokens,
            "decode_tokens_per_s": round(statistics.median(r["decode_tokens_per_s"] for r in runs[name]), 2),
            "speed_ratio_vs_full": round(statistics.median(ratios), 3), "paired_speed_ratios": [round(r, 4) for r in ratios],
            "end_steps": args.end_steps,
            "decode_tokens_per_s_end": round(statistics.median(r["decode_tokens_per_s_end"] for r in runs[name]), 2),
            "end_speed_ratio_vs_full": round(statistics.median(end), 3),
            **{k: v for k, v in last.items() if k.startswith("kv_")},
            "method_stats": last.get("method_stats", {}),
        })
    data = {
        "command": "python scripts/throughput.py " + " ".join(sys.argv[1:]),
        "config": vars(args), "environment": environment(model, source),
        "settings": [{"label": n, "method": m.name, "options": m.describe()["options"]}
                     for n, m in zip(names, methods)],
        "results": results, "skipped": [], "failed": [], "wall_s": round(time.perf_counter() - t0, 1),
    }
    for r in results:
        print(f"{r['label']:8s} {r['decode_tokens_per_s']:7.1f} tok/s  {r['speed_ratio_vs_full']:.2f}x full; last "
              f"{args.end_steps} steps {r['decode_tokens_per_s_end']:7.1f} tok/s  {r['end_speed_ratio_vs_full']:.2f}x")
    if args.json_path:
        write_atomic(args.json_path, json.dumps(data, indent=1) + "\n")
        print(f"wrote {args.json_path}")


if __name__ == "__main__":
    main()
