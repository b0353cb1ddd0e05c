"""Host syncs in the decode forward, per method, on a CUDA device: where the model's forward waits for the GPU.

The engine runs every forward between the cache's `before_forward` and `after_forward` hooks; cache-wide work (which
may read values back to the host) belongs in the hooks, and the model's forward itself should only queue kernels.
This script decodes a batch through the engine's step primitives and turns on `torch.cuda.set_sync_debug_mode("warn")`
inside the model's forward alone (its `forward` wrapped for the checked steps), then apart inside the cache's hooks.
Each synchronising call is counted with the innermost kvzip or transformers frame that made it, so a sync reads as a
line.

    python scripts/sync_check.py --methods full,fadkv,zoomr --batch 2 --context 256 --steps 32 [--json out.json]

Exit code 1 when a method's decode forward synchronised from kvzip's own code (transformers' own syncs are listed but
are not kvzip's to remove); 2 on bad input or no CUDA device.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import traceback
import warnings
from pathlib import Path

import torch

PHASES = ("forward", "hooks")


class SyncLog:
    """Counts the sync warnings torch raises while `phase` is set, keyed by phase and the call site that made them."""

    def __init__(self):
        self.phase: str | None = None
        self.sites: dict[str, collections.Counter] = {p: collections.Counter() for p in PHASES}

    def showwarning(self, message, category, filename, lineno, file=None, line=None):
        if self.phase is None or "synchronizing" not in str(message):
            return
        self.sites[self.phase][_site(traceback.extract_stack()[:-1])] += 1

    def during(self, phase: str, fn):
        def wrapped(*args, **kwargs):
            self.phase = phase
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(0)
                self.phase = None
        return wrapped


def _site(stack) -> str:
    """The innermost frame in kvzip's or transformers' code, as 'package/file.py:line function'."""
    for frame in reversed(stack):
        path = Path(frame.filename)
        for root in ("kvzip", "transformers"):
            if root in path.parts and "scripts" not in path.parts:
                rel = "/".join(path.parts[len(path.parts) - path.parts[::-1].index(root) - 1:])
                return f"{rel}:{frame.lineno} {frame.name}"
    last = stack[-1]
    return f"{Path(last.filename).name}:{last.lineno} {last.name}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--methods", default="all", help="comma-separated, or 'all'")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--context", type=int, default=256, help="tokens fed through decode steps before the checked ones")
    ap.add_argument("--steps", type=int, default=32, help="decode steps checked")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if min(args.batch, args.context, args.steps) < 1:
        ap.error("--batch, --context and --steps must be positive")
    if not torch.cuda.is_available():
        print("sync_check: error: needs a CUDA device (sync debug mode is a CUDA feature)", file=sys.stderr)
        sys.exit(2)

    from kvzip import engine
    from kvzip.data import evaluation_prose
    from kvzip.dictionary_lookup import dictionaries_for
    from kvzip.errors import UserError
    from kvzip.files import check_writable, write_atomic
    from kvzip.methods import METHODS, get_method
    from kvzip.models import load_model

    names = list(METHODS) if args.methods == "all" else [m.strip() for m in args.methods.split(",") if m.strip()]
    try:
        if args.json:
            check_writable(args.json)
        methods = [get_method(m) for m in names]
        model, tokenizer, source = load_model(args.model, "cuda", args.dtype)
        dicts = {m.name: dictionaries_for(m, model, source) for m in methods}
    except UserError as exc:
        print(f"sync_check: error: {exc}", file=sys.stderr)
        sys.exit(2)
    prose = tokenizer(evaluation_prose(), add_special_tokens=False)["input_ids"]
    prompt = engine.encode(tokenizer, "Work through these problems step by step.", raw=tokenizer.chat_template is None)
    forced = torch.tensor([prose[r * args.context:(r + 1) * args.context] for r in range(args.batch)])
    log = SyncLog()
    warnings.showwarning = log.showwarning
    warnings.simplefilter("always")
    report, failed = {}, []
    print(f"{source.name} · {torch.cuda.get_device_name(0)} · {model.dtype} · batch {args.batch} · "
          f"context {args.context} · {args.steps} checked steps")
    for method in methods:
        cache = method.make_cache(model, dicts[method.name])
        stream = engine.Stream(model, tokenizer, cache)
        log.sites = {p: collections.Counter() for p in PHASES}
        with torch.inference_mode():
            stream.prefill([prompt] * args.batch)
            for j in range(args.context):
                stream.step(forced[:, j])
            tokens = forced[:, -1]
            # Only the checked steps run with the debug mode on: the model's forward, then the cache's two hooks.
            model.forward, plain_forward = log.during("forward", model.forward), model.forward
            hooks = {name: getattr(cache, name) for name in ("before_forward", "after_forward")}
            for name, fn in hooks.items():
                setattr(cache, name, log.during("hooks", fn))
            try:
                for _ in range(args.steps):
                    tokens = stream.step(tokens).argmax(-1)
            finally:
                model.forward = plain_forward
                for name, fn in hooks.items():
                    setattr(cache, name, fn)
        own = sum(n for site, n in log.sites["forward"].items() if site.startswith("kvzip/"))
        report[method.name] = {p: dict(log.sites[p].most_common()) for p in PHASES}
        verdict = "no sync in the forward" if not log.sites["forward"] else (
            f"{sum(log.sites['forward'].values())} syncs in the forward ({own} from kvzip)")
        print(f"\n== {method.name}: {verdict}; {sum(log.sites['hooks'].values())} in the hooks "
              f"(over {args.steps} steps)")
        for phase in PHASES:
            for site, n in log.sites[phase].most_common(6):
                print(f"   {phase:7s} {n:5d}  {site}")
        if own:
            failed.append(method.name)
    if args.json:
        write_atomic(args.json, json.dumps({"model": source.name, "batch": args.batch, "context": args.context,
                                            "steps": args.steps, "methods": report}, indent=2))
    print(f"\nsync_check: {'kvzip syncs in the decode forward of ' + ', '.join(failed) if failed else 'passed'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
