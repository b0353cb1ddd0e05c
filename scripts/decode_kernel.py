"""Decode-step attention kernels on CPU: torch's SDPA against kvzip's `grouped_attention`, over a whole model's cache.

One query per row (no mask, as a single stream decodes) over --tokens cached keys and values in every one of
--layers layers (distinct tensors, so the cache is read from memory as in a real decode step, not from the CPU's
caches), SmolLM2-135M's shapes by default (9 query heads, 3 KV heads, d=64). Prints milliseconds per step for each
kernel and each one's largest error against a float64 reference, for the dtype asked. Why kvzip stacks query heads
when decoding on CPU: kvzip/attention.py.

    .venv/bin/python scripts/decode_kernel.py --batch 8 --tokens 1050 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1050)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if min(args.batch, args.tokens, args.layers, args.heads, args.kv_heads, args.head_dim, args.repeats) < 1:
        ap.error("every size must be positive")
    if args.heads % args.kv_heads:
        ap.error("--heads must be a multiple of --kv-heads")

    from kvzip.attention import grouped_attention

    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    b, hq, h, s, d = args.batch, args.heads, args.kv_heads, args.tokens, args.head_dim
    scale = d ** -0.5
    query = (2 * torch.randn(b, hq, 1, d)).to(dtype)
    cache = [((2 * torch.randn(b, h, s, d)).to(dtype), torch.randn(b, h, s, d).to(dtype)) for _ in range(args.layers)]

    def sdpa(k, v):  # as transformers calls it for a forward without a mask (a single stream)
        out = torch.nn.functional.scaled_dot_product_attention(query, k, v, scale=scale, enable_gqa=hq != h)
        return out.transpose(1, 2)

    def grouped(k, v):
        return grouped_attention(query, k, v, None, scale)  # no mask: a single stream's forward

    k0, v0 = cache[0]
    rep = hq // h
    ref = ((query.double() @ k0.double().repeat_interleave(rep, 1).transpose(-1, -2)) * scale)
    ref = ref.softmax(-1) @ v0.double().repeat_interleave(rep, 1)
    ref = ref.transpose(1, 2)
    print(f"batch {b} · {s} tokens · {args.layers} layers · {hq}/{h} heads · d {d} · {args.dtype} · "
          f"{torch.get_num_threads()} threads")
    for name, fn in (("sdpa", sdpa), ("grouped", grouped)):
        with torch.inference_mode():
            fn(k0, v0)
            best = float("inf")
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                for k, v in cache:
                    fn(k, v)
                best = min(best, time.perf_counter() - t0)
            err = (fn(k0, v0).double() - ref).abs().max().item()
        print(f"{name:8s} {1000 * best:8.1f} ms per step   max error {err:.4f}")


if __name__ == "__main__":
    main()
