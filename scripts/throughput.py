"""Aggregate decode throughput of a fixed batch, every method against `full` in the same run, as JSON.

The batch job a serving engine is measured on: `--batch` GSM8K prompts generated to `--new-tokens` each with
`--ignore-eos` semantics, greedy. The methods decode in lockstep, one step of each in turn (`full` first), each with
its own cache, and every step is timed on its own: a shared machine whose speed drifts by 10-20% within minutes then
slows every method alike, and the ratios stay paired step by step. Each repeat does it again; the median of the
repeats' ratios is reported, for the whole decode and for its last `--end-steps` steps (the speed at the longest
context, where a smaller cache should pay most), and the last repeat's ratio in each quarter of the decode's steps
(where a method starts to gain or lose). The JSON carries the command, commit and environment like `kvzip
bench`'s, so docs tables can be generated from it (scripts/results_tables.py).

Why it is not the bench's `speed` workload: that one times one row at a given context and pairs each method with a
`full` run made right after it, which is steady for a prompt's decode but not for a batch of 1,024 steps on a machine
whose speed drifts within minutes; here the methods' generators (the engine's `generate`, every hook as in a run)
are interleaved step by step, so each step of a method is paired with `full`'s step at the same length.

    .venv/bin/python scripts/throughput.py --methods full,fadkv,zoomr --batch 8 --new-tokens 1024 \\
        --json results/throughput.json
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
    ap.add_argument("--opt", action="append", default=[],
                    help='a method option, "method.key=value" (repeatable); as in `kvzip bench`, the run keeps stock '
                         '`full` as the reference and adds the optioned method under its own label')
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
    from kvzip.dictionary_lookup import dictionaries_for
    from kvzip.errors import UserError
    from kvzip.files import check_writable, write_atomic
    from kvzip.methods import METHODS
    from kvzip.models import load_model

    try:
        settings = parse_settings(args.methods, args.opt, args.method_set, list(METHODS))  # full first
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
        for name, summary in zip(names, lockstep(engine, model, tokenizer, prompts, methods, dicts, settings,
                                                 args.end_steps)):
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
            # the decode in four quarters of its steps, paired with full's same quarter (the last repeat)
            "speed_ratio_vs_full_by_quarter": [
                round(m / f, 3) if m and f else None for m, f in
                zip(last["decode_tokens_per_s_by_quarter"], runs["full"][-1]["decode_tokens_per_s_by_quarter"])],
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
              f"{args.end_steps} steps {r['decode_tokens_per_s_end']:7.1f} tok/s  {r['end_speed_ratio_vs_full']:.2f}x; "
              f"by quarter {' '.join(f'{q:.2f}x' for q in r['speed_ratio_vs_full_by_quarter'] if q is not None)}")
    if args.json_path:
        write_atomic(args.json_path, json.dumps(data, indent=1) + "\n")
        print(f"wrote {args.json_path}")


def lockstep(engine, model, tokenizer, prompts, methods, dicts, settings, end_steps: int) -> list[dict]:
    """Every method generates the batch, one decode step of each in turn; returns each one's Summary stats with its
    decode tok/s (whole decode and last `end_steps` steps) from the time spent in its own steps only."""
    runs = [engine.generate(model, tokenizer, prompts, m.make_cache(model, d), settings)
            for m, d in zip(methods, dicts)]
    steps: list[list[float]] = [[] for _ in runs]  # seconds of each decode step (the prefill's aside)
    summaries: list[dict | None] = [None] * len(runs)
    live = set(range(len(runs)))
    while live:
        for i in sorted(live):
            t = time.perf_counter()
            for event in runs[i]:  # up to this run's next forward
                if isinstance(event, engine.Step):
                    engine.sync(model.device)
                    if event.step > 0:
                        steps[i].append(time.perf_counter() - t)
                    break
                if isinstance(event, engine.Summary):
                    summaries[i] = event.stats
                    live.discard(i)
                    break
    batch = len(prompts)
    for summary, times in zip(summaries, steps):
        # every row decodes every step (--ignore-eos): each step made `batch` tokens
        summary["decode_s"] = round(sum(times), 4)
        summary["decode_tokens_per_s"] = round(batch * len(times) / sum(times), 2)
        summary["decode_tokens_per_s_end"] = round(batch * end_steps / sum(times[-end_steps:]), 2)
        quarters = [times[len(times) * q // 4 : len(times) * (q + 1) // 4] for q in range(4)]  # where speed changes
        summary["decode_tokens_per_s_by_quarter"] = [round(batch * len(t) / sum(t), 2) if t else None for t in quarters]
    return summaries


if __name__ == "__main__":
    main()
