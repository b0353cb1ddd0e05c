"""Recall table for zoomr and its baselines at one device budget (kvzip.bench.recall), with top-1 agreement vs full.

    OMP_NUM_THREADS=1 python scripts/zoomr_recall_table.py TRIALS FILLER SEED   # e.g. 8 400 5

`full` is scored with one forward per trial (a full cache fed token by token gives the same logits). zoomr runs
with window=32, max_thought_tokens=48 so that the facts lie outside every method's budget; `window` and `h2o` get
zoomr's peak device tokens per row; `sumr` gets a window enlarged by about two zoomed thoughts; then zoomr with one
option changed at a time. Prints a markdown table row by row.
"""

from __future__ import annotations

import argparse
import time

import torch

from kvzip.bench.recall import build_trials, recall_probe
from kvzip.methods import get_method
from kvzip.methods.base import model_layout
from kvzip.models import load_model

FACTS = 4  # facts stated per trial, one of them asked for (recall_probe's default)
# zoomr with a small window and short thoughts, so that every fact is outside the window when it is asked for
ZOOMR = {"window": "32", "max_thought_tokens": "48"}
# The zoomr variants after the defaults: (options on top of ZOOMR).
ZOOMR_VARIANTS = [{"summary_pick": "norm"}, {"select_at": "thought", "vote_decay": "0"}, {"zoom_thoughts": "3"},
                  {"zoom_margin": "0"}]
# sumr, the summaries without zooming: its window holds about two of zoomr's zoomed thoughts more.
SUMR = [{"window": "128", "max_thought_tokens": "48"},
        {"window": "128", "max_thought_tokens": "48", "summary_pick": "novel"}]
HEADER = ("| method | options | recall | mean rank | margin | peak device KB/row | host KB/row | top-1 vs full "
          "| s/token |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trials", type=int)
    ap.add_argument("filler", type=int, help="filler tokens between the facts and the question")
    ap.add_argument("seed", type=int)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tokenizer, _ = load_model()
    layers, kv_heads, head_dim = model_layout(model)
    per_token = 2 * layers * kv_heads * head_dim * model.dtype.itemsize  # full's K and V bytes for one token

    t0 = time.time()
    preds, hits = [], 0
    trials = build_trials(tokenizer, args.trials, FACTS, args.filler, args.seed)
    for x in trials:
        with torch.no_grad():
            logits = model(torch.tensor([x["prompt"] + x["forced"]])).logits[0, len(x["prompt"]) - 1:]
        preds.append(logits.argmax(-1))
        hits += int(logits[-1, x["candidates"]].argmax()) == x["answer"]
    ref = torch.stack(preds)
    print(HEADER, flush=True)
    fed = len(trials[-1]["prompt"]) + len(trials[-1]["forced"])
    print(f"| full | one forward | {hits / args.trials} | | | {fed * per_token // 1024} | 0 | 1.000 | | "
          f"wall={time.time() - t0:.0f}s", flush=True)

    def row(name: str, opts: dict) -> dict:
        t0 = time.time()
        r = recall_probe(model, tokenizer, get_method(name, opts), n_trials=args.trials, filler_tokens=args.filler,
                         seed=args.seed, batch_size=args.trials, return_predictions=True)
        agree = (r["predictions"][:, :-1] == ref[:, :-1]).float().mean().item()
        print(f"| {name} | {opts} | {r['recall_accuracy']} | {r['mean_rank']} | {r['mean_margin']} | "
              f"{r['device_bytes_per_row'] // 1024} | {r['host_bytes_per_row'] // 1024} | {agree:.3f} | "
              f"{r['seconds_per_token']} |  forced={r['forced_tokens']} prompt={r['prompt_tokens']} "
              f"wall={time.time() - t0:.0f}s", flush=True)
        return r

    zoomr = row("zoomr", ZOOMR)
    budget = round(zoomr["device_bytes_per_row"] / per_token)  # zoomr's peak device tokens per row
    row("window", {"sinks": "4", "window": str(budget - 4)})
    for opts in SUMR:
        row("sumr", opts)
    for variant in ZOOMR_VARIANTS:
        row("zoomr", {**ZOOMR, **variant})
    row("h2o", {"heavy": str(budget // 2), "window": str(budget - budget // 2)})


if __name__ == "__main__":
    main()
