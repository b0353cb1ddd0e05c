"""A thought's end in zoomr's and sumr's caches: after the forward in which thought t of row b ended, every layer keeps
the thought's summary tokens and index key and moves its detail off the device.

`ThoughtCache.after_forward` calls `finalize` for each thought that ended, with its layers and the row's state, and
adds the index keys it returns to its index; layers that share a RoPE, a kind of attention and the thought's slice
are done in one batched pass (`finalize_group`).
"""

from __future__ import annotations

import torch

from kvzip.methods.thoughts.detail import part_bytes, store_layers
from kvzip.methods.thoughts.layer import ThoughtConfig, ThoughtLayer
from kvzip.methods.thoughts.segment import Row
from kvzip.methods.thoughts.summary import pick_summary
from kvzip.rope import unrotate, visible_from


def finalize(layers: list[ThoughtLayer], config: ThoughtConfig, row: Row, b: int, t: int, seen: int,
             q_len: int) -> torch.Tensor | None:
    """Thought t of row b (`row`) ended in the forward that brought the last `q_len` of `seen` tokens (all its
    tokens are in the tail): every layer keeps its summary and moves the thought's detail off the device. Rows are
    right-aligned and end with the tail, sorted, which holds every position from its start on, so in each layer the
    thought is a slice at the end of the row; layers that share a RoPE, a kind of attention and that slice do it in
    one batched pass. (A sliding-window layer may have dropped the thought's first tokens already: it works on what
    it still has.) Returns every layer's index key (L, Hkv, d), or its key bounds (L, Hkv, 2d) with `index=bounds`,
    in layer order when the cache zooms in, else None."""
    start = row.thoughts[t][0]
    groups: dict[tuple, list[ThoughtLayer]] = {}
    for layer in layers:
        first = max(start, visible_from(seen - q_len, layer.sliding))
        groups.setdefault((id(layer.rope), layer.sliding is not None, first, layer.device), []).append(layer)
    index = [finalize_group(config, group, row, b, t, first, sliding, seen)
             for (_, sliding, first, _), group in groups.items()]
    if config.zoom is None:
        return None
    if len(groups) > 1:  # every layer's index key in layer order
        at = torch.tensor([layer.idx for group in groups.values() for layer in group], device=index[0].device)
        stacked = torch.cat([i.to(index[0].device) for i in index])  # a split model: the index lives with layer 0
        index = [torch.empty_like(stacked).index_copy_(0, at, stacked)]
    return index[0]


def finalize_group(config: ThoughtConfig, layers: list[ThoughtLayer], row: Row, b: int, t: int, first: int,
                   sliding: bool, seen: int) -> torch.Tensor | None:
    """`finalize` for `layers`, which hold thought t of row b from position `first` on; returns their index keys
    (L, Hkv, d) when the cache zooms in."""
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
    if config.zoom is not None and config.zoom.index == "bounds":  # each channel's range over the thought's keys
        own = keys[:, :, :n] if n else keys.new_zeros(len(layers), keys.shape[1], 1, keys.shape[3])
        index = torch.cat([own.amin(2), own.amax(2)], -1)  # (L, Hkv, 2d), after the rotation as attention sees them
    elif config.zoom is not None:  # the index key: the summary keys as k_proj wrote them, before the rotation
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
