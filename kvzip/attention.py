"""kvzip's attention function, registered with transformers as `attn_implementation="kvzip"`.

A transformers cache layer's `update()` never sees the query, but compressed-domain attention and thought selection
need it. Every kvzip model runs this function instead of SDPA: when the forward call carries a kvzip cache
(`kvzip_cache=...` in the model kwargs, see `KVCache.model_kwargs`) and the layer has an `attend` method, the layer
computes attention itself, handed the cache's `ForwardState` for this forward; otherwise this is exactly transformers' SDPA path, so `model.generate` and the `full` method
stay token-identical to stock transformers.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

ATTN_IMPLEMENTATION = "kvzip"


def kvzip_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query (B, Hq, q, d), key/value as returned by the cache layer's update; returns ((B, q, Hq, d), None)."""
    cache = kwargs.pop("kvzip_cache", None)
    if cache is not None:
        layer = cache.layers[module.layer_idx]
        attend = getattr(layer, "attend", None)
        if attend is not None:
            return attend(module, query, key, value, attention_mask, scaling, cache.state), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


AttentionInterface.register(ATTN_IMPLEMENTATION, kvzip_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


def dense_attention(query, keys, values, mask, scaling, positions=None):
    """Plain attention of `query` over stored dense `keys`/`values`, for cache layers that keep a subset of tokens.

    query (B, Hq, q, d); keys/values (B, Hkv, S, d); `mask` is transformers' 4D boolean mask over the layer's
    *virtual* positions (B, 1, q, kv_len) or None. `positions` (B, S) are the virtual positions of the stored
    tokens of each row, used to gather the mask columns. With mask None and q > 1 the last q stored tokens are the
    new ones and get a causal mask among themselves. Returns (B, q, Hq, d).
    """
    q_len, s = query.shape[2], keys.shape[2]
    decode = decode_path(query)
    attn_mask = None
    if mask is not None:
        attn_mask = mask if positions is None else gather_mask(mask, positions)
    elif 1 < q_len and (q_len < s or decode):  # the decode path has no causal flag: a short prompt gets the mask
        attn_mask = causal_tail(q_len, s, query.device)
    if decode:
        return grouped_attention(query, keys, values, attn_mask, scaling)
    # Only new tokens and no padding (a prompt's own forward): SDPA's causal kernel, 2.8x faster on CPU at 4k tokens
    # than the same mask written out.
    causal = mask is None and 1 < q_len == s
    out = torch.nn.functional.scaled_dot_product_attention(
        query, keys, values, attn_mask=attn_mask, is_causal=causal, scale=scaling,
        enable_gqa=query.shape[1] != keys.shape[1])  # (B, Hq, q, d)
    return out.transpose(1, 2).contiguous()


# A forward of at most this many new tokens (decoding, a short follow-up) attends by `grouped_attention` on CPU.
DECODE_QUERIES = 16


def decode_path(query) -> bool:
    """Whether `grouped_attention` serves this query (B, Hq, q, d): a few new tokens, on CPU. There torch's SDPA
    with `enable_gqa` (what transformers passes when a forward has no mask: every single-stream decode) reads a bf16
    cache at ~2 GB/s, 5x slower than the same kernel with each KV head's query heads stacked as query rows
    (scripts/decode_kernel.py: SmolLM2's 30 layers, batch 8, 1,050 tokens, 104 ms against 21 ms per step).
    On CUDA the SDPA kernels are already fast for decoding and stay in charge."""
    return query.device.type == "cpu" and query.shape[2] <= DECODE_QUERIES


def grouped_attention(query, keys, values, allowed, scaling):
    """Attention of a few queries with each KV head's query heads stacked as rows of one SDPA call, so the cache
    is read once per KV head and SDPA's kernel sees g·q query rows instead of one (transformers does the same for
    one query with a mask, `pack_gqa`; here with or without one, and for q > 1).

    query (B, Hq, q, d); keys, values (B, Hkv, S, d); `allowed` boolean, broadcastable to (B, 1, q, S), or None.
    Scores accumulate in fp32 inside SDPA, as on every other path. Returns (B, q, Hq, d).
    """
    b, hq, q, d = query.shape
    h = keys.shape[1]
    g = hq // h
    qg = query.reshape(b, h, g * q, d)  # query head j*g + i reads KV head j, as SDPA's enable_gqa
    if allowed is not None and q > 1:  # one mask row per query position, repeated for each stacked head
        s = keys.shape[2]
        allowed = allowed.reshape(-1, 1, 1, q, s).expand(-1, 1, g, q, s).reshape(-1, 1, g * q, s)
    out = torch.nn.functional.scaled_dot_product_attention(qg, keys, values, attn_mask=allowed, scale=scaling)
    return out.view(b, hq, q, d).transpose(1, 2).contiguous()


def attention_with_received(query, keys, values, allowed, scaling, chunk: int = 256):
    """Attention, and the attention each stored token receives summed over query heads and queries (what h2o scores
    tokens by), without writing out all the weights: the queries go through `chunk` at a time, so a long prompt's
    forward holds (B, Hq, chunk, S) weights, not (B, Hq, q, S). query (B, Hq, q, d); keys, values (B, Hkv, S, d), each
    KV head shared by Hq / Hkv query heads; `allowed` boolean, broadcastable to (B, Hq, q, S). Returns the output
    (B, q, Hq, d) and the received attention (B, S) fp32; a query that sees nothing (left padding) gives zero weights,
    not NaN, so the next layer stays finite."""
    b, hq, q_len, d = query.shape
    hkv, width = keys.shape[1], keys.shape[2]
    g = hq // hkv  # query heads j*g .. j*g + g - 1 read KV head j: stacked as rows, no copy of the keys per query head
    grouped = query.view(b, hkv, g, q_len, d)
    mask = allowed if allowed.dim() == 4 else allowed[None, None]  # (B or 1, Hq or 1, q or 1, S)
    mask = mask[:, :, None] if mask.shape[1] == 1 else mask.unflatten(1, (hkv, g))  # (B or 1, Hkv or 1, g or 1, ., S)
    received = torch.zeros(b, width, device=query.device)
    outs = []
    for start in range(0, q_len, chunk):
        rows = slice(start, min(start + chunk, q_len))
        n = rows.stop - rows.start
        q = grouped[:, :, :, rows].reshape(b, hkv, g * n, d)
        seen = mask[..., rows, :] if mask.shape[-2] == q_len else mask
        seen = seen.expand(*seen.shape[:2], g, n, width).reshape(seen.shape[0], seen.shape[1], g * n, width)
        w = ((q @ keys.transpose(-1, -2)) * scaling).masked_fill(~seen, float("-inf")).softmax(-1).nan_to_num()
        received += w.sum((1, 2)).float()
        outs.append((w @ values).view(b, hq, n, d))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, 2)
    return out.transpose(1, 2).contiguous(), received


def causal_tail(q_len: int, width: int, device) -> torch.Tensor:
    """(q, width) bool: which of `width` stored tokens each of q new queries sees when there is no padding. The new
    tokens are the last q stored: each sees every token before them and the new ones causally, itself included."""
    allowed = torch.ones(q_len, width, dtype=torch.bool, device=device)
    allowed[:, width - q_len :] = torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril()
    return allowed


def gather_mask(mask, positions):
    """mask (B, 1, q, kv_len) -> (B, 1, q, S): the columns of each row's stored tokens, positions (B, S)."""
    b, _, q, _ = mask.shape
    index = positions.to(mask.device)[:, None, None, :].expand(b, 1, q, positions.shape[-1])
    return mask.gather(-1, index)


def leading_padding(mask, batch: int, device) -> torch.Tensor:
    """(B,) count of left-padding positions, read from the prefill's 4D mask (all zeros when there is no mask): the
    leading positions no query of the row sees. (Not only the last query's row: a sliding-window layer's mask, Gemma
    3's first layer, hides from it all but its window of a long prompt, padding or not.)"""
    if mask is None:
        return torch.zeros(batch, dtype=torch.long, device=device)
    visible = (mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0).any(-2)  # (B, kv_len)
    return (visible.long().cumsum(-1) == 0).sum(-1).to(device)


def gather_tokens(x, index):
    """x (B, H, S, d), index (B, K) -> (B, H, K, d): the same K stored tokens of every head of a row."""
    b, h, _, d = x.shape
    return x.gather(2, index[:, None, :, None].expand(b, h, index.shape[-1], d))
