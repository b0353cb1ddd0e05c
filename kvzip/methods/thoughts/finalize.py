"""A thought's end in zoomr's and sumr's caches: after the forward in which thought t of row b ended, every layer keeps
the thought's summary tokens and index key and moves its detail off the device.

`ThoughtCache.after_forward` calls `finalize` for each thought that ended; layers that share a RoPE, a kind of
attention and the thought's slice are done in one batched pass (`finalize_group`).
"""

from __future__ import annotations

import typing

import torch

from kvzip.methods.thoughts.detail import part_bytes, store_layers
from kvzip.methods.thoughts.summary import pick_summary
from kvzip.rope import unrotate, visible_from

if typing.TYPE_CHECKING:
    from kvzip.methods.thoughts.cache import ThoughtCache, ThoughtLayer


def finalize(cache: "ThoughtCache", b: int, t: int) -> None:
    """Thought t of row b ended in this forward (all its tokens are in the tail): every layer keeps its summary
    and index key and moves the thought's detail off the device. Rows are right-aligned and end with the tail,
    sorted, which holds every position from its start on, so in each layer the thought is a slice at the end of
    the row; layers that share a RoPE, a kind of attention and that slice do it in one batched pass. (A
    sliding-window layer may have dropped the thought's first tokens already: it works on what it still has.)"""
    start = cache.rows[b].thoughts[t][0]
    groups: dict[tuple, list["ThoughtLayer"]] = {}
    for layer in cache.layers:
        first = max(start, visible_from(cache.seen - cache.q_len, layer.sliding))
        groups.setdefault((id(layer.rope), layer.sliding is not None, first, layer.device), []).append(layer)
    index = [finalize_group(cache, layers, b, t, first, sliding) for (_, sliding, first, _), layers in groups.items()]
    if cache.config.zoom is None:
        return
    if len(groups) > 1:  # every layer's index key in layer order
        at = torch.tensor([layer.idx for layers in groups.values() for layer in layers], device=index[0].device)
        stacked = torch.cat([i.to(index[0].device) for i in index])  # a split model: the index lives with layer 0
        index = [torch.empty_like(stacked).index_copy_(0, at, stacked)]
    cache.index.add(b, index[0])


def finalize_group(cache: "ThoughtCache", layers: list, b: int, t: int, first: int,
                   sliding: bool) -> torch.Tensor | None:
    """`finalize` for `layers`, which hold thought t of row b from position `first` on; returns their index keys
    (L, Hkv, d) when the cache zooms in."""
    config, row, seen = cache.config, cache.rows[b], cache.seen
    end, span, m = row.thoughts[t][1], row.spans[t], seen - first
    n = max(end - first, 0)
    novel = span is None and config.summary_pick == "novel"  # compared with the row's real tokens before the thought
    # each layer's row from its first real slot (novel) or the thought's slice at its end: one gather per layer
    tokens = [layer.row_tokens(b, max(layer.slots.shape[1] - (layer.lengths[b] if novel else m), 0))
              for layer in layers]
    keys = torch.stack([k[:, k.shape[1] - m:] for k, _ in tokens])  # (L, Hkv, m, d)
    values = torch.stack([v[:, v.shape[1] - m:] for _, v in tokens])
    device, rope = keys.device, layers[0].rope
    if span is not None:
        keep = torch.arange(max(span[0], first) - first, span[1] - first, device=device).expand(len(layers), -1)
    elif novel:
        widths = [k.shape[1] - m for k, _ in tokens]
        before = keys.new_zeros(len(layers), keys.shape[1], max(widths), keys.shape[3], dtype=torch.float32)
        before_pos = torch.full((len(layers), max(widths)), -1, dtype=torch.long, device=device)
        for i, (layer, (k, _), w) in enumerate(zip(layers, tokens, widths)):  # fp32 as copied: novelty works in fp32
            before[i, :, :w] = k[:, :w]
            before_pos[i, :w] = layer.positions[b, layer.positions.shape[1] - w - m : layer.positions.shape[1] - m]
        keep = pick_summary(keys[:, :, :n], torch.arange(first, first + n, device=device), config.summary_tokens,
                            "novel", rope, before, before_pos, before_pos >= row.keep[0][0])
    else:
        keep = pick_summary(keys[:, :, :n], None, config.summary_tokens, config.summary_pick)
    kept_pos = keep + first  # (L, r)
    index = None
    if config.zoom is not None:  # the index key: the summary keys as k_proj wrote them, before the rotation
        kept = keys[torch.arange(len(layers), device=device)[:, None], :, keep].transpose(1, 2)  # (L, Hkv, r, d)
        index = unrotate(kept, kept_pos[:, None], rope).mean(2) if keep.shape[1] else keys.new_zeros(
            len(layers), keys.shape[1], keys.shape[3])  # (L, Hkv, d)
    detail = None
    if layers[0].detail_store is not None:
        detail = store_layers([layer.detail_store for layer in layers], keys[:, :, :n], values[:, :, :n], sliding)
    for i, layer in enumerate(layers):
        layer.summary_pos[b].append(kept_pos[i])
        layer.summary_all[b] = torch.cat([layer.summary_all[b], kept_pos[i]])
        if detail is not None:
            layer.detail[b].append(detail[i])
            layer.host_bytes += part_bytes(detail[i])
    return index
