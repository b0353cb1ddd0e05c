"""Measure held-out dictionary error at several (N, s), and OMP vs screening speed and error, in one run.

Why a script: the README's dictionary table and the choice of the shipped (N, s) come from here, measured on the
real default model in one process so that the timings are comparable. Prints markdown tables (and writes them to
--out if given).

Data: calibration text only (GSM8K calibration problems with their reference solutions, then calibration prose;
no generation, so the script runs in minutes), captured with kvzip.capture in the same key mode the shipped
dictionary uses; the last --holdout of every document is held out. For each (N, s), on each chosen layer, a key
dictionary (per-head mean removed) and a value dictionary are learned exactly as `kvzip train-dict` does
(one-shot screening, `screen1`, in the loop) and the held-out vectors are coded at the same s with OMP, with the
cache's screening coder (two shots, champion pools of 16 then 32), with two shots on exact top-n pools, and
with plain one-shot top-16 screening.
Timing: --timing-vectors held-out vectors per layer, each coder best of 3, one thread (set OMP_NUM_THREADS=1).
The "floor" column times only the first step every screening coder takes (x Dᵀ over all N atoms, then a champion
pool of 16) and codes nothing: no screening coder can beat OMP by more than that column's speed-up.
`--device cuda` learns, codes and times on the GPU (capture stays on the CPU; timings synchronise the device).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/measure_coders.py --out /tmp/coders.md
"""

from __future__ import annotations

import argparse
import time

import torch


def best_of(fn, repeats: int = 3):
    best, out = float("inf"), None
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        out = fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return out, best


def correlate_and_pool(x: torch.Tensor, D: torch.Tensor, n: int = 16) -> None:
    """The first step of every screening coder and nothing more: correlations with all N atoms, a pool of n."""
    from kvzip.sparse.omp import default_chunk
    from kvzip.sparse.screen import pick_pool
    Df, N = D.float(), D.shape[0]
    chunk = default_chunk(x.device, N)                        # the same chunks and reused buffers as screen()
    corr = torch.empty(min(chunk, x.shape[0]), N, device=x.device)
    packed = torch.empty_like(corr, dtype=torch.int32)
    for c in range(0, x.shape[0], chunk):
        xc = x[c:c + chunk]
        pick_pool(torch.mm(xc, Df.T, out=corr[:xc.shape[0]]), n, "champions", packed[:xc.shape[0]])


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=12000)
    ap.add_argument("--holdout", type=float, default=0.3)
    ap.add_argument("--layers", default="0,10,20")
    ap.add_argument("--configs", default="1024x8,1024x4,256x8,256x4", help="NxS list; the first is the shipped one")
    ap.add_argument("--samples", type=int, default=16384)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--keys", default="post-rope", choices=("post-rope", "pre-rope"))
    ap.add_argument("--timing-vectors", type=int, default=10000)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cpu", help="where dictionaries are learned and coders run (cpu or cuda)")
    args = ap.parse_args()
    torch.set_num_threads(int(__import__("os").environ.get("OMP_NUM_THREADS", "1")))

    from kvzip import capture, data
    from kvzip.models import load_model
    from kvzip.sparse.learn import learn_dictionary, relative_error, subsample
    from kvzip.sparse.omp import gram_matrix, omp
    from kvzip.sparse.screen import screen

    t0 = time.perf_counter()
    model, tok, _ = load_model("smollm2-135m", device="cpu")
    gsm = "\n\n".join(f"{p['question']}\n{p['answer']}" for p in data.gsm8k("calibration"))
    docs = capture.text_documents(tok, gsm, args.tokens // 2) + \
        capture.text_documents(tok, data.calibration_prose(), args.tokens - args.tokens // 2)
    train, held = capture.capture_kv(model, docs, keys=args.keys, holdout=args.holdout).split()
    layers = [int(x) for x in args.layers.split(",")]
    configs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
    heads, d = train.heads, train.keys[0].shape[1]
    print(f"captured {train.tokens + held.tokens} tokens ({held.tokens} held out) in {time.perf_counter() - t0:.0f}s",
          flush=True)

    rows, timing = [], []
    for N, s in configs:
        for kind in ("keys", "values"):
            errs, learn_s = {"omp": [], "screen": []}, 0.0
            for layer in layers:
                X, H = (train.keys[layer], held.keys[layer]) if kind == "keys" else (train.values[layer], held.values[layer])
                X, H = X.float().to(args.device), H.float().to(args.device)
                raw = H
                if kind == "keys":
                    mean = X.view(-1, heads, d).mean(0)                                 # (Hkv, d)
                    X = (X.view(-1, heads, d) - mean).reshape(-1, d)
                    H = (H.view(-1, heads, d) - mean).reshape(-1, d)
                t = time.perf_counter()
                D = learn_dictionary(subsample(X, args.samples, layer), N, s, args.iters, coder="screen1").half().float()
                learn_s += time.perf_counter() - t
                G = gram_matrix(D)
                Ht = H[: args.timing_vectors]
                (o_idx, o_coef), t_omp = best_of(lambda: omp(Ht, D, s, gram=G))
                (s_idx, s_coef), t_scr = best_of(lambda: screen(Ht, D, s, gram=G))
                (top_idx, top_coef), t_top = best_of(lambda: screen(Ht, D, s, gram=G, pick="top"))
                (one_idx, one_coef), t_one = best_of(lambda: screen(Ht, D, s, gram=G, shots=1, pick="top"))
                _, t_floor = best_of(lambda: correlate_and_pool(Ht, D))
                e_one = relative_error(Ht, D, one_idx, one_coef).mean().item()
                e_top = relative_error(Ht, D, top_idx, top_coef).mean().item()
                scale = 10000 / Ht.shape[0]
                e_omp = relative_error(Ht, D, o_idx, o_coef)
                e_scr = relative_error(Ht, D, s_idx, s_coef)
                vs_raw = Ht.norm(dim=1) / raw[: args.timing_vectors].norm(dim=1).clamp_min(1e-12)
                errs["omp"].append((e_omp.mean().item(), (e_omp * vs_raw).mean().item()))
                errs["screen"].append((e_scr.mean().item(), (e_scr * vs_raw).mean().item()))
                timing.append((kind, N, s, layer, e_omp.mean().item(), t_omp * scale, e_scr.mean().item(), t_scr * scale,
                               e_top, t_top * scale, e_one, t_one * scale, t_floor * scale))
                print(f"N={N} s={s} {kind} L{layer}: omp {e_omp.mean():.3f} screen {e_scr.mean():.3f} "
                      f"({t_omp * scale:.2f} vs {t_scr * scale:.2f} s/10k)", flush=True)
            m = lambda xs, i: sum(x[i] for x in xs) / len(xs)  # noqa: E731
            rows.append((kind, N, s, m(errs["screen"], 0), m(errs["screen"], 1), m(errs["omp"], 0), m(errs["omp"], 1),
                         learn_s / len(layers)))

    shipped = configs[0]
    lines = [f"Held-out relative error ||x - Dc|| / ||x||, SmolLM2-135M-Instruct, keys {args.keys} with the per-head "
             f"mean removed (\"vs raw\": same error over the uncentred key norm), mean over layers {args.layers}; "
             f"{train.tokens} training / {held.tokens} held-out tokens; learned with one-shot screening in the loop, "
             f"{args.samples} samples, {args.iters} iterations. Shipped: N={shipped[0]}, s={shipped[1]}.", "",
             "| vectors | N | s | screen err | screen err vs raw | OMP err | OMP err vs raw | learn s / dictionary |",
             "|---|---|---|---|---|---|---|---|"]
    for kind, N, s, es, esr, eo, eor, ls in rows:
        mark = " (shipped)" if (N, s) == shipped else ""
        lines.append(f"| {kind} | {N}{mark} | {s} | {es:.3f} | {esr if kind == 'keys' else es:.3f} | {eo:.3f} | "
                     f"{eor if kind == 'keys' else eo:.3f} | {ls:.1f} |")
    lines += ["", f"OMP vs screening at equal s, same dictionary, {args.timing_vectors} held-out vectors per layer, "
                  f"best of 3, {torch.get_num_threads()} thread(s); error (x OMP's) / seconds per 10k vectors "
                  f"(speed-up over OMP). Screening (default): two shots, champion pools of 16 then 32; exact: two "
                  f"shots on exact top-16 and top-32 pools; one-shot: exact top-16 pool, plain FAD-KV; floor: "
                  f"x Dᵀ and a champion pool of 16 only, no coding (seconds per 10k vectors, speed-up over OMP).", "",
              "| vectors | N | s | layer | OMP | screening (default) | exact two-shot | one-shot | floor |",
              "|---|---|---|---|---|---|---|---|---|"]
    for kind, N, s, layer, eo, to, es, ts, et, tt, e1, t1, tf in timing:
        cell = lambda e, t: f"{e:.3f} ({e / eo:.3f}x) / {t:.3f} ({to / t:.1f}x)"  # noqa: E731
        lines.append(f"| {kind} | {N} | {s} | {layer} | {eo:.3f} / {to:.3f} | {cell(es, ts)} | {cell(et, tt)} | "
                     f"{cell(e1, t1)} | {tf:.3f} ({to / tf:.1f}x) |")
    lines += ["", f"total wall time {time.perf_counter() - t0:.0f}s"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
