"""Long greedy generation, `full` then other methods in one process: device vs host KV, decode tok/s ratio, agreement.

    OMP_NUM_THREADS=1 python scripts/zoomr_long.py --tokens 4000 --methods zoomr > long.json

Generates `--tokens` greedy tokens (ignoring end-of-sequence) from one GSM8K evaluation problem with `full`, then with
each method, through kvzip's engine (what `kvzip generate --ignore-eos --max-new-tokens N` runs). Reports per method
the engine's memory figures (the batch Summary: peak device and host KV bytes, full's bytes for the same tokens),
decode tok/s and its ratio to full's, and the free-running greedy agreement with full (tokens equal position by
position, and the first divergence).
"""

from __future__ import annotations

import argparse
import json

import torch

from kvzip import engine
from kvzip.data import gsm8k
from kvzip.methods import get_method
from kvzip.models import load_model

PROMPT = "\nExplain your reasoning step by step, one paragraph per step."  # after the problem: a long answer
# The Summary figures reported per method.
KEYS = ("kv_bytes_device_peak", "kv_bytes_host_peak", "kv_bytes_full", "kv_bytes_fp16_full", "decode_tokens_per_s")


def run(model, tokenizer, ids, method, tokens) -> tuple[list[int], dict]:
    """(the greedy tokens, the batch Summary's figures) of one generation through `method`'s cache."""
    cache = method.make_cache(model)
    settings = engine.Settings(max_new_tokens=tokens, ignore_eos=True)
    result = summary = None
    for event in engine.uninterrupted(engine.generate(model, tokenizer, [ids], cache, settings)):
        if isinstance(event, engine.Result):
            result = event
        elif isinstance(event, engine.Summary):
            summary = event
    return result.token_ids, summary.stats


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--methods", default="zoomr")
    parser.add_argument("--problem", type=int, default=0, help="index into the GSM8K evaluation split")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer, _ = load_model()
    question = gsm8k("evaluation")[args.problem]["question"]
    ids = engine.encode(tokenizer, question + PROMPT)
    ref_ids, ref = run(model, tokenizer, ids, get_method("full"), args.tokens)
    out = {"prompt_tokens": len(ids), "tokens": args.tokens, "full": {k: ref[k] for k in KEYS}}
    for name in args.methods.split(","):
        token_ids, stats = run(model, tokenizer, ids, get_method(name), args.tokens)
        same = [a == b for a, b in zip(token_ids, ref_ids)]
        row = {k: stats[k] for k in KEYS}
        row["device_vs_full"] = round(stats["kv_bytes_device_peak"] / ref["kv_bytes_device_peak"], 4)
        row["tok_s_vs_full"] = round(stats["decode_tokens_per_s"] / ref["decode_tokens_per_s"], 3)
        row["greedy_agreement"] = round(sum(same) / len(same), 4)
        row["first_divergence"] = same.index(False) if False in same else len(same)
        row["method_stats"] = {k: v for k, v in stats["method_stats"].items() if k != "zoomed_thoughts"}
        out[name] = row
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
