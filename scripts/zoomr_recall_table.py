"""Recall table for zoomr and its baselines at one device budget (kvzip.bench.recall), with top-1 agreement vs full.

    OMP_NUM_THREADS=1 python scripts/zoomr_recall_table.py TRIALS FILLER SEED   # e.g. 8 400 5

`full` is scored with one forward per trial (a full cache fed token by token gives the same logits). zoomr runs with
window=32, max_thought=48 so that the facts lie outside every method's budget; `window` and `h2o` get zoomr's peak
device tokens per row; `sumr` gets a window enlarged by about two zoomed thoughts. Prints a markdown table row by row.
"""
import sys
import time

import torch

torch.set_num_threads(1)
from kvzip.models import load_model
from kvzip.methods import get_method
from kvzip.bench.recall import recall_probe, build_trials
m,t,_=load_model()
N, FILL, SEED = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
per_token = 2 * 30 * 3 * 64 * 4
# full: one forward per trial (a full cache fed token by token gives the same logits; checked on seed 0: same recall)
t0 = time.time()
preds, hits = [], 0
for x in build_trials(t, N, 4, FILL, SEED):
    with torch.no_grad():
        lg = m(torch.tensor([x["prompt"] + x["forced"]])).logits[0, len(x["prompt"]) - 1:]
    preds.append(lg.argmax(-1)); hits += int(lg[-1, x["candidates"]].argmax()) == x["answer"]
ref = torch.stack(preds)
print("| method | options | recall | mean rank | margin | peak device KB/row | host KB/row | top-1 vs full | s/token |", flush=True)
print(f"| full | one forward | {hits / N} | | | {(len(x['prompt']) + len(x['forced'])) * per_token // 1024} | 0 | 1.000 | | wall={time.time()-t0:.0f}s", flush=True)
def go(name, opts):
    t0 = time.time()
    r = recall_probe(m, t, get_method(name, opts), n_trials=N, filler_tokens=FILL, seed=SEED, batch_size=N, return_predictions=True)
    agree = (r["predictions"][:, :-1] == ref[:, :-1]).float().mean().item()
    print(f"| {name} | {opts} | {r['recall_accuracy']} | {r['mean_rank']} | {r['mean_margin']} | {r['device_bytes_per_row']//1024} | {r['host_bytes_per_row']//1024} | {agree:.3f} | {r['seconds_per_token']} |  forced={r['forced_tokens']} prompt={r['prompt_tokens']} wall={time.time()-t0:.0f}s", flush=True)
    return r
zo = {"window": "32", "max_thought": "48"}
z = go("zoomr", zo)
go("zoomr", {**zo, "pick": "novel", "select": "token", "decay": "0.8", "index_space": "content"})
d = round(z["device_bytes_per_row"] / per_token)
go("window", {"sinks": "4", "window": str(d - 4)})
go("sumr", {"window": "128", "max_thought": "48"})
go("sumr", {"window": "128", "max_thought": "48", "pick": "novel"})
go("zoomr", {**zo, "pick": "attention"})
go("zoomr", {**zo, "pick": "even"})
go("h2o", {"heavy": str(d // 2), "window": str(d - d // 2)})
