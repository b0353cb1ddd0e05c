"""Rebuilding zoomr's and sumr's active rows: which positions each layer keeps after a zoom set or a row's tail moved,
where each comes from (the layer's current slots or a newly zoomed thought's detail), and the writes in place.

`ThoughtCache.before_forward` calls `rebuild_rows` for the rows that moved, before the forward that brings the new
tokens, with its layers and the rows' state as arguments. Layers of one kind of attention are planned together
(`plan_row`: masks over positions for all of them, one read back for the counts); only the gathers and writes
(`write_rows`) are per layer. Rows stay right-aligned, empty slots in front (position -1), the tail last and sorted.
"""

from __future__ import annotations

import torch

from kvzip.methods.thoughts.detail import load_layers
from kvzip.methods.thoughts.layer import ThoughtLayer
from kvzip.methods.thoughts.segment import Row, group_of
from kvzip.rope import visible_from


def rebuild_rows(all_layers: list[ThoughtLayer], rows: list[Row], moved: list[int], seen: int, q_len: int,
                 tail_start: list[int], zoomed: list[list[set[int]]]) -> None:
    """Rebuild the active context of the rows (of `rows`) whose zoom set or tail moved, in every layer at once,
    before the forward that brings the last `q_len` of `seen` tokens. `tail_start` is each row's tail's first position
    and `zoomed` the zoom sets (one, or one a layer) its buffers were last gathered for. Layers of one kind of
    attention are planned together (`plan_row`); only the gathers and writes are per layer. Positions a sliding-window
    layer's queries can no longer see are left out."""
    groups: dict = {}
    for layer in all_layers:
        if layer.is_initialized:  # (all are, after the first forward)
            groups.setdefault((layer.sliding, layer.device), []).append(layer)  # a split model: per device
    for (sliding, _), layers in groups.items():
        cut = visible_from(seen - q_len, sliding)
        if cut:
            for layer in layers:
                layer.forget(layer.positions < cut)
        plans = {b: plan_row(layers, rows[b], b, cut, seen, tail_start[b], zoomed[b]) for b in moved}
        for i, layer in enumerate(layers):
            write_rows(layer, {b: plan[i] for b, plan in plans.items()})


def mark(ranges: list[tuple[int, int]], seen: int, device) -> torch.Tensor:
    """(seen + 1,) each position's index among the tokens of `ranges` [start, end) taken in order, -1 elsewhere."""
    at = torch.full((seen + 1,), -1, dtype=torch.long, device=device)
    offset = 0
    for s, e in ranges:
        at[s:e] = torch.arange(offset, offset + e - s, device=device)
        offset += e - s
    return at


def by_set(sets: list[list[int]], build) -> torch.Tensor:
    """One row a layer, `build(set)` stacked for each layer's set; built once a distinct set (under zoom_scope=row
    every layer has the same one)."""
    built: dict[tuple, torch.Tensor] = {}
    for z in sets:
        if tuple(z) not in built:
            built[tuple(z)] = build(z)
    return torch.stack([built[tuple(z)] for z in sets])


def plan_row(layers: list[ThoughtLayer], row: Row, b: int, cut: int, seen: int, tail_start: int,
             zoomed: list[set[int]]) -> list[tuple]:
    """Row b's active context in each of `layers`: the kept prompt, the tail, the layer's summaries and its zoomed
    thoughts (`Row.zoom_of`), none before `cut`. Per layer: (positions (n,), sources (n,), loaded K and V (Hkv, m, d)
    and where they go, or None), sources indexing the layer's current row followed by the loaded tokens. Order: on a
    full-attention layer the zoomed thoughts' other tokens (neither summary nor tail) come first, then everything else
    by position (attention does not care about order; the tail stays last and sorted). A sliding-window layer keeps
    the whole row by position: it drops what leaves its window from the front. A thought zoomed at the row's last
    gather is whole in the buffer still; only newly zoomed ones are loaded, and of those only what a layer does not
    hold (its own summary tokens it does). All of it is planned as masks over positions (L, seen + 1; the last column
    takes what pads a shorter layer), one read back for the counts."""
    pad = torch.nn.utils.rnn.pad_sequence
    device, count = layers[0].device, len(layers)
    base = torch.zeros(seen + 1, dtype=torch.bool, device=device)
    for s, e in row.keep + [(tail_start, seen)]:
        base[s:e] = True
    zooms = [row.zoom_of(layer.idx) for layer in layers]  # each layer's zoom set (one shared, or its own)
    zoom = by_set(zooms, lambda ts: mark([row.thoughts[t] for t in ts], seen, device) >= 0)  # (L, seen + 1)
    summaries = torch.zeros(count, seen + 1, dtype=torch.bool, device=device).scatter_(
        1, pad([layer.summary_all[b] for layer in layers], batch_first=True, padding_value=seen), True)
    wanted = base | summaries | zoom
    wanted[:, seen] = False
    wanted[:, :cut] = False
    order = None  # by layer, then by position; on full-attention layers zoomed tokens first
    if layers[0].sliding is None and any(zooms):
        order = zoom & ~summaries
        order[:, tail_start:] = False
    held_pos = pad([layer.positions[b] for layer in layers], batch_first=True, padding_value=-1)  # (L, W)
    at = torch.where(held_pos >= 0, held_pos, seen)
    held = torch.zeros_like(wanted).scatter_(1, at, True)
    slot = torch.zeros_like(wanted, dtype=torch.long).scatter_(
        1, at, torch.arange(at.shape[1], device=device).expand_as(at))  # position -> its slot in the row
    keep = wanted & held
    news = [[t for t in z if t not in group_of(zoomed, layer.idx)] for z, layer in zip(zooms, layers)]
    new = any(news)
    if new:  # position -> its index among the layer's loaded tokens, -1 where nothing is loaded
        loaded_at = by_set(news, lambda ts: mark([row.thoughts[t] for t in ts], seen, device))
        load = wanted & ~held & (loaded_at >= 0)
        keep = keep | load
    widths = torch.tensor([layer.positions.shape[1] for layer in layers], device=device)
    kept = keep.sum(1)  # per layer
    if order is None:
        which, pos = keep.nonzero(as_tuple=True)
    else:
        which, pos = torch.cat([keep & order, keep & ~order], 1).nonzero(as_tuple=True)
        pos = pos.remainder(seen + 1)
    src = slot[which, pos]
    if new:
        src = torch.where(held[which, pos], src, widths[which] + loaded_at[which, pos])
    numbers = torch.stack([kept] + ([load.sum(1)] if new else [])).tolist()
    counts = numbers[0]
    loaded = [None] * count
    if new and any(numbers[1]):
        parts = {}  # thought -> {layer's index among `layers`: its (K, V)}, each thought loaded once for its layers
        for t in dict.fromkeys(t for ts in news for t in ts):
            at = [i for i, ts in enumerate(news) if t in ts]
            got = load_layers([layers[i].detail_store for i in at], [layers[i].detail[b][t] for i in at], device,
                              layers[0].dtype)
            parts[t] = dict(zip(at, got))
        # Where the loaded tokens go: their index in the layer's list and among the layer's loaded tokens. Their
        # sources point past the row; the row's gather reads slot 0 for them instead, then they are put in place.
        outside = src >= widths[which]
        from_detail = outside.nonzero().squeeze(1)
        flat, ends = torch.arange(len(which), device=device), kept.cumsum(0)
        into = (flat - (ends - kept)[which])[from_detail].split(numbers[1])
        origin = (src[from_detail] - widths[which[from_detail]]).split(numbers[1])
        src = src.masked_fill(outside, 0)
        loaded = [(torch.cat([parts[t][i][0] for t in news[i]], 1), torch.cat([parts[t][i][1] for t in news[i]], 1),
                   into[i], origin[i]) if numbers[1][i] else None for i in range(count)]
    return list(zip(pos.split(counts), src.split(counts), loaded))


def write_rows(layer: ThoughtLayer, plans: dict) -> None:
    """Rows rebuilt from their plans (`plan_row`: positions, sources, loaded K/V): each
    planned row's slot list is gathered from its current slots, the loaded tokens written into free slots of the
    layer's pool (kvzip.methods.thoughts.pool), and the list written right-aligned, empty slots in front (-1); no
    kept token moves in the pool, and every other row is left as it is. The lists widen only when a row needs more
    slots than they have and lose the columns that are empty in every row; the slots no row holds are freed."""
    rows = {}
    for b, (pos, src, loaded) in plans.items():
        slots = layer.slots[b].index_select(0, src)
        if loaded is not None:  # the loaded tokens in fresh slots
            lk, lv, into, origin = loaded
            fresh = layer.pool.take(len(into))
            layer.pool.put(fresh, lk.index_select(1, origin), lv.index_select(1, origin))
            slots.index_copy_(0, into, fresh)
        rows[b] = slots, pos
    need = max((p.numel() for _, p in rows.values()), default=0)
    width = layer.slots.shape[1]
    if need > width:  # widen on the left (older slots are further left in every row)
        for name in ("slots", "positions"):
            layer.prepend(name, need - width, -1)
        width = need
    for b, (slots, p) in rows.items():
        n = layer.lengths[b] = p.numel()
        layer.slots[b, width - n :] = slots
        layer.slots[b, : width - n] = -1
        layer.positions[b, width - n :] = p
        layer.positions[b, : width - n] = -1
    if layer.sliding is None:  # the columns no row uses lead, rows being right-aligned
        drop = width - max(layer.lengths)
    else:  # positions a sliding window can no longer see were emptied too: count them
        layer.lengths = (layer.positions >= 0).sum(1).tolist()
        drop = int((layer.positions < 0).all(0).long().cumprod(0).sum())
    if drop:
        layer.slots, layer.positions = layer.slots[:, drop:], layer.positions[:, drop:]
    layer.pool.release(layer.slots)
