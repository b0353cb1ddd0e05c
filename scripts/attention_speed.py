"""One layer's decode-step attention on fadkv codes against dense attention over the same number of tokens.

Why a script: the model-level decode ratio (`kvzip bench --workloads speed`) mixes attention with the MLPs, the
coding of each chunk and the machine's load; this isolates the part that compressed-domain attention changes.
A `FadkvLayer` of the default model's shipped dictionaries (layer 10) is filled with --tokens random keys and values
(the cost does not depend on what the codes hold) and coded, then one query at a time is timed through
`FadkvLayer.attend`, best of --repeats, for pre-RoPE keys (the default dictionary) and post-RoPE keys, by the
fused CPU kernel (kvzip/kernels, `kernel=auto`) and by the PyTorch reference (`kernel=torch`); dense is kvzip's
grouped decode kernel (`kvzip.attention.grouped_attention`, SDPA with each KV head's query heads stacked) over fp32
keys and values of the same length (3 KV heads, 9 query heads, d=64, as SmolLM2-135M), for --batch rows. Threads:
OMP_NUM_THREADS (default 1).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/attention_speed.py --tokens 8192
    OMP_NUM_THREADS=2 .venv/bin/python scripts/attention_speed.py --tokens 1024 --batch 8 --json speed.json

`--json` writes the timings with the commit and CPU (atomically), for a decisions-page figure.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch


def best_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--layer", type=int, default=10)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--opt", action="append", default=[], help="fadkv option key=value, repeatable")
    ap.add_argument("--json", help="write the timings here")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    from kvzip import dictionary_lookup, kernels
    from kvzip.cli.flags import parse_opts
    from kvzip.errors import UserError
    from kvzip.attention import grouped_attention
    from kvzip.methods import get_method
    from kvzip.methods.coded.coding import CodingStats
    from kvzip.methods.coded.compress import compress
    from kvzip.methods.coded.forward import CodedState
    from kvzip.methods.fadkv import FadkvLayer
    from kvzip.sparse.dictionary import KVDictionary, prepare_layers

    try:  # a bad --opt is one line, like the CLI's
        opts = parse_opts(args.opt)
        get_method("fadkv", opts)
    except UserError as e:
        ap.error(str(e))

    gen = torch.Generator().manual_seed(0)
    heads, q_heads, d, t, b = 3, 9, 64, args.tokens, args.batch
    keys, values = torch.randn(b, heads, t, d, generator=gen), torch.randn(b, heads, t, d, generator=gen)
    query = torch.randn(b, q_heads, 1, d, generator=gen)
    inv_freq = 1.0 / (100000.0 ** (torch.arange(0, d, 2).float() / d))  # SmolLM2's RoPE base
    dense = best_ms(lambda: grouped_attention(query, keys, values, None, d ** -0.5), args.repeats)
    print(f"{t} tokens x {b} rows, one layer, {torch.get_num_threads()} threads; dense fp32 (grouped): {dense:.2f} ms")
    rows = [{"path": "dense fp32 (grouped)", "ms": round(dense, 3)}]
    for label, stem, mode in (("pre-RoPE keys (default)", "smollm2-135m-prerope", "pre-rope"),
                              ("post-RoPE keys", "smollm2-135m", "post-rope")):
        dictionaries = KVDictionary.load(dictionary_lookup.dictionary_dir() / f"{stem}.safetensors")
        for kernel in ("auto", "torch"):
            method = get_method("fadkv", {"keys": mode, "kernel": kernel, **opts})
            paired = mode == "pre-rope"
            layer = FadkvLayer(method, prepare_layers(dictionaries, "cpu", paired=paired)[args.layer],
                               rope=inv_freq if paired else None)
            layer.update(keys, values)
            compress([layer], CodingStats())
            if kernel == "auto" and not layer.fused():
                print(f"fadkv {label}: no fused kernel here ({kernels.status()})")
                continue
            state = CodedState.build([layer], None, 1, {})  # built once a forward, before it: not timed
            coded = best_ms(lambda: layer.attend(None, query, None, None, None, d ** -0.5, state), args.repeats)
            path = f"fadkv {label}, {'fused kernel' if kernel == 'auto' else 'PyTorch path'}"
            print(f"{path}: {coded:.2f} ms ({coded / dense:.2f}x dense), {layer.coded_pos.shape[1]} tokens coded")
            rows.append({"path": path, "ms": round(coded, 3), "vs_dense": round(coded / dense, 3)})
    if args.json:
        from kvzip.bench.runner import _cpu_model
        import json

        from kvzip.files import write_atomic
        from kvzip.runs import commit

        record = {"command": "scripts/attention_speed.py " + " ".join(sys.argv[1:]), "commit": commit(),
                  "cpu": _cpu_model(), "threads": torch.get_num_threads(), "tokens": t, "rows": b, "options": opts,
                  "timings": rows}
        write_atomic(args.json, json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
