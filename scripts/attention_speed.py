"""One layer's decode-step attention on fadkv codes against dense attention over the same number of tokens.

Why a script: the model-level decode ratio (`kvzip bench --workloads speed`) mixes attention with the MLPs, the
coding of each chunk and the machine's load; this isolates the part that compressed-domain attention changes.
A `FadkvLayer` of the default model's shipped dictionaries (layer 10) is filled with --tokens random keys and values
(the cost does not depend on what the codes hold) and coded, then one query at a time is timed through
`FadkvLayer._attention`, best of --repeats, for pre-RoPE keys (the default dictionary) and post-RoPE keys; dense
is `scaled_dot_product_attention` over fp32 keys and values of the same length (3 KV heads, 9 query heads, d=64, as
SmolLM2-135M). One thread (set OMP_NUM_THREADS=1).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/attention_speed.py --tokens 8192
"""

from __future__ import annotations

import argparse
import os
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
    ap.add_argument("--opt", action="append", default=[], help="fadkv option key=value, repeatable")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    from kvzip import dictfiles
    from kvzip.cli.options import parse_opts
    from kvzip.errors import UserError
    from kvzip.methods import get_method
    from kvzip.methods.fadkv import FadkvLayer
    from kvzip.sparse.dictionary import KVDictionary, prepare_layers

    try:  # a bad --opt is one line, like the CLI's
        opts = parse_opts(args.opt)
        get_method("fadkv", opts)
    except UserError as e:
        ap.error(str(e))

    gen = torch.Generator().manual_seed(0)
    heads, q_heads, d, t = 3, 9, 64, args.tokens
    keys, values = torch.randn(1, heads, t, d, generator=gen), torch.randn(1, heads, t, d, generator=gen)
    query = torch.randn(1, q_heads, 1, d, generator=gen)
    inv_freq = 1.0 / (100000.0 ** (torch.arange(0, d, 2).float() / d))  # SmolLM2's RoPE base
    dense = best_ms(lambda: torch.nn.functional.scaled_dot_product_attention(query, keys, values, enable_gqa=True),
                    args.repeats)
    print(f"{t} tokens, one layer, one thread; dense SDPA fp32: {dense:.2f} ms")
    for label, stem, mode in (("pre-RoPE keys (default)", "smollm2-135m-prerope", "pre-rope"),
                              ("post-RoPE keys", "smollm2-135m", "post-rope")):
        dictionaries = KVDictionary.load(dictfiles.dictionary_dir() / f"{stem}.safetensors")
        method = get_method("fadkv", {"keys": mode, **opts})
        paired = mode == "pre-rope"
        layer = FadkvLayer(method, prepare_layers(dictionaries, "cpu", paired=paired)[args.layer],
                           rope=inv_freq if paired else None)
        layer.update(keys, values)
        layer._compress(prefill=True)
        coded = best_ms(lambda: layer._attention(query, None, d ** -0.5), args.repeats)
        print(f"fadkv {label}: {coded:.2f} ms ({coded / dense:.2f}x dense), {layer.coded_pos.shape[1]} tokens coded")


if __name__ == "__main__":
    main()
