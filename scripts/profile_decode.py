"""Where a decode step's time goes, per method: torch.profiler over a few steps after a prefill, summarised.

Prints, for each method, the mean step time and the operators with the most self time (CPU; CUDA too on a GPU), so a
regression or a hot spot shows as a line, not a trace file. Batch and context are the user's; timing is only
meaningful on a quiet machine, compare methods within one run.

    .venv/bin/python scripts/profile_decode.py --methods full,fadkv,zoomr --batch 8 --context 1024 --steps 16
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--methods", default="full,window,fadkv,zoomr")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024, help="tokens generated before the profiled steps")
    ap.add_argument("--steps", type=int, default=16, help="profiled decode steps")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    if min(args.batch, args.context, args.steps, args.top) < 1:
        ap.error("--batch, --context, --steps and --top must be positive")

    from kvzip import engine
    from kvzip.data import evaluation_prose
    from kvzip.dictionary_lookup import dictionaries_for
    from kvzip.errors import UserError
    from kvzip.methods import get_method
    from kvzip.models import load_model

    try:
        methods = [get_method(m.strip()) for m in args.methods.split(",") if m.strip()]
        model, tokenizer, source = load_model(args.model, args.device, args.dtype)
        dicts = {m.name: dictionaries_for(m, model, source) for m in methods}
    except UserError as exc:
        print(f"profile_decode: error: {exc}", file=sys.stderr)
        sys.exit(2)
    prose = tokenizer(evaluation_prose(), add_special_tokens=False)["input_ids"]
    prompt = engine.encode(tokenizer, "Work through these problems step by step.",
                           raw=tokenizer.chat_template is None)  # a base model (Gemma 3 270M) has no template
    forced = [prose[r * args.context : (r + 1) * args.context] for r in range(args.batch)]
    activities = [torch.profiler.ProfilerActivity.CPU]
    if model.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    print(f"{source.name} · {model.device} · {model.dtype} · batch {args.batch} · context {args.context} "
          f"· {torch.get_num_threads()} threads")
    for method in methods:
        cache = method.make_cache(model, dicts[method.name])
        stream = engine.Stream(model, tokenizer, cache)
        with torch.inference_mode():
            stream.prefill([prompt] * args.batch)
            table = torch.tensor(forced)
            for j in range(args.context):  # the long output, through the step hooks, up to the profiled point
                stream.step(table[:, j])
            tokens = table[:, -1]
            engine.sync(model.device)
            t0 = time.perf_counter()
            for _ in range(args.steps):  # timed without the profiler's overhead
                tokens = stream.step(tokens).argmax(-1)
            engine.sync(model.device)
            step_ms = 1000 * (time.perf_counter() - t0) / args.steps
            with torch.profiler.profile(activities=activities) as prof:
                for _ in range(args.steps):
                    tokens = stream.step(tokens).argmax(-1)
        report = stream.report()
        print(f"\n== {method.name}: {step_ms:.1f} ms/step ({args.batch * 1000 / step_ms:.1f} tok/s), "
              f"KV {report['kv_ratio_vs_full']:.3f}x full (device {report['kv_device_ratio_vs_full']:.3f}x)")
        sort = "self_cuda_time_total" if model.device.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=args.top, max_name_column_width=48))


if __name__ == "__main__":
    main()
