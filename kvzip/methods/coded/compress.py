"""Coding a fadkv or lexico cache's due tokens: which dense tokens each row codes now, the vectors as the
dictionaries hold them, one coder pass for every layer, kind and row, and the codes stored in each layer.

The cache runs `compress` after a prompt's forward and after every `code_chunk`-th decode step since it
(`FadkvCache.after_forward`), once every layer has attended: a layer's coding only changes what its next forward
reads, so coding all layers together at the end of a forward is exact, and no layer does cache-wide work inside the
model's forward. Each time every row codes all its tokens beyond its sinks and buffer. The
schedule counts decode steps, which a row has the same of alone and in a batch, so a row codes as if it ran alone,
and the rows of a batch code together whatever their prompts' lengths (one coder pass per event, and from a row's
second event on the same `code_chunk` tokens per row: `push_codes`' lockstep case).
"""

from __future__ import annotations

import time
import typing

import torch

from kvzip import kernels
from kvzip.attention import gather_tokens
from kvzip.methods.coded.coding import CodingStats, code_kinds, left_holed, share_atom_use
from kvzip.rope import phasors, to_pairs, turn_pairs
from kvzip.sparse.coded_attention import quantize

if typing.TYPE_CHECKING:
    from kvzip.methods.coded.layer import FadkvLayer


def real_tokens(layer: "FadkvLayer") -> torch.Tensor:
    """(B, S) which of the layer's dense tokens are real: holes (-1) and left padding are not."""
    pad = layer.pad if layer.pad is not None else torch.zeros(layer.batch, dtype=torch.long, device=layer.keys.device)
    return layer.positions >= pad[:, None]


class Plan(list):
    """Per row, (the dense columns it codes now, those it keeps): `due_columns`. Layers whose dense tokens sit at the
    same positions (every layer of a model without sliding windows) share one plan, and with it the index tensors
    built from it (`once`), made for the first of them."""

    def __init__(self, columns):
        super().__init__(columns)
        self.memo: dict = {}

    def once(self, key, make):
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]


def due_columns(layer: "FadkvLayer", counts: list[int]) -> Plan | None:
    """Which dense columns each row codes now and which it keeps: all beyond the row's sinks and buffer. counts:
    each row's real dense tokens (`real_tokens`, read for every layer at once). Left padding is neither coded nor
    kept. None when no row codes."""
    due = []
    for n in counts:
        sinks = min(layer.cfg.sinks, n)
        due.append((sinks, max(n - sinks - layer.cfg.buffer, 0)))
    if not any(codeable for _, codeable in due):
        return None
    columns, real = [], real_tokens(layer)
    for b, (sinks, codeable) in enumerate(due):
        cols = real[b].nonzero().squeeze(-1)
        columns.append((cols[sinks : sinks + codeable], torch.cat([cols[:sinks], cols[sinks + codeable :]])))
    return Plan(columns)


def same_tokens(layer: "FadkvLayer", other: "FadkvLayer") -> bool:
    """Whether two layers' dense tiers hold the same positions with the same padding (so one plan serves both)."""
    pads = layer.pad is other.pad or (layer.pad is not None and other.pad is not None and torch.equal(layer.pad,
                                                                                                       other.pad))
    return (layer.cfg is other.cfg and pads and layer.positions.shape == other.positions.shape
            and torch.equal(layer.positions, other.positions))


def coding_vectors(layer: "FadkvLayer", plan: Plan, rows: torch.Tensor,
                   width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The keys and values the plan codes, as the dictionaries hold them: (B', H, width, d) fp32 each for rows
    (B',), each row's right-aligned after zero filler, and which entries are real (B', width). Keys are centred
    (key mean removed) and, for pre-RoPE dictionaries, turned back to how k_proj wrote them, in pair order. All rows
    in one gather."""
    index, real = plan.once(("code", width), lambda: left_holed([plan[b][0] for b in rows.tolist()], width))
    # (B', width) each
    every = len(rows) == layer.batch
    keys, values, positions = ((t if every else t.index_select(0, rows)) for t in (layer.keys, layer.values,
                                                                                    layer.positions))
    keys = gather_tokens(keys, index).float()
    if layer.rope is not None:
        turns = plan.once(("turns", id(layer.rope)), lambda: phasors(positions.gather(1, index), layer.rope,
                                                                     inverse=True))
        keys = turn_pairs(to_pairs(keys, layer.rope.dim), turns[:, None])
    if layer.key_mean is not None:
        keys -= layer.key_mean[:, None, :]
    values = gather_tokens(values, index).float()
    filler = ~real[:, None, :, None]
    return keys.masked_fill_(filler, 0.0), values.masked_fill_(filler, 0.0), real


def store_codes(layer: "FadkvLayer", plan: Plan, codes: list[tuple]) -> None:
    """Keep the codes (idx, stored, scale (B, H, width, s or 1) for keys, then values: the atom numbers in the
    tier's dtype, the coefficients as `quantize` stores them) of the plan's tokens and drop those
    tokens from the dense tier. Rows stay rectangular by holes (position -1, masked) at the front of each tier."""
    push_codes(layer, plan, codes)
    width = layer.positions.shape[1]
    index, valid, span = plan.once("keep", lambda: kept_columns(plan, width))
    drop = width - index.shape[1]
    layer.positions = layer.positions.gather(1, index).masked_fill(~valid, -1)
    if span is not None:
        stray, lo, hi = span
        move = stray[:, None, lo:hi, None]
        for old in (layer.keys, layer.values):
            part = old[:, :, drop + lo : drop + hi]
            part.copy_(torch.where(move, gather_tokens(old, index[:, lo:hi]), part))
    layer.drop("keys", drop)  # the kept columns now end each row: the buffers start `drop` columns later
    layer.drop("values", drop)


def kept_columns(plan: Plan, width: int):
    """Each row's kept columns right-aligned (index (B, S'), valid), and the span of new columns that holds the kept
    columns not already where they end up: (stray (B, S'), lo, hi), or None. The tier loses its first `drop` columns
    as a view; a kept column already in place (a row's recent tokens; every column of a row that coded nothing) is
    not touched, only the others (a row's sinks, which move up to its buffer) are gathered, all rows at once."""
    index, valid = left_holed([keep for _, keep in plan])
    stray = valid & (index != torch.arange(width - index.shape[1], width, device=index.device))
    cols = stray.any(0).nonzero().squeeze(-1)
    return index, valid, (stray, int(cols[0]), int(cols[-1]) + 1) if len(cols) else None


def push_codes(layer: "FadkvLayer", plan: Plan, codes: list[tuple]) -> None:
    """The plan's new codes after each row's coded tokens. The coded tier keeps every row right-aligned, holes in
    front, as wide as its fullest row: a row that codes c tokens moves its own codes c columns to the left (into its
    holes) and writes the new ones at the end, so the rows that coded nothing are not touched; the tier widens (into
    spare room in front, `DenseLayer.prepend`) only when a row outgrows it. Rows that code the same count move
    together. When every row codes the same count (rows in lockstep, the usual batch) the new codes are appended
    into spare room behind the tier (`DenseLayer.extend`) and nothing moves: the event costs its new codes, not the
    tier's length."""
    counts = [len(code) for code, _ in plan]
    real = (layer.coded_pos >= 0).sum(1).tolist()
    width = layer.coded_pos.shape[1]
    need = max(n + c for n, c in zip(real, counts))
    names = ["coded_pos"] + [f"{kind}.codes.{part}" for kind in ("coded_keys", "coded_values")
                             for part in ("idx", "stored", "scale")]
    new_pos = plan.once("positions", lambda: holed(layer.positions, [code for code, _ in plan]))  # (B, c_max)
    fresh = [new_pos] + [x for code in codes for x in code]
    if len(set(counts)) == 1:  # every row codes c (rows in lockstep): the new codes are appended, nothing moves
        c = counts[0]
        for name, new in zip(names, fresh):
            x = layer._get(name)
            if x is not None:
                dim = layer._token_axis(x)
                x = layer.extend(name, new.narrow(dim, new.shape[dim] - c, c).to(x.dtype))
                layer._set(name, x.narrow(dim, width + c - need, need))  # holes no row needs any more
        return
    if need > width:
        for name in names:
            if layer._get(name) is not None:
                layer.prepend(name, need - width, -1 if name == "coded_pos" else 0)
        width = need
    for c in sorted(set(counts) - {0}):
        rows = torch.tensor([b for b, n in enumerate(counts) if n == c], device=new_pos.device)
        for name, new in zip(names, fresh):
            x = layer._get(name)
            if x is None:
                continue
            dim = layer._token_axis(x)
            moved = x.index_select(0, rows).narrow(dim, c, width - c)
            x[rows] = torch.cat([moved, new.index_select(0, rows).narrow(dim, new.shape[dim] - c, c).to(x.dtype)], dim)


def holed(pos: torch.Tensor, cols: list[torch.Tensor]) -> torch.Tensor:
    """Positions (B, width) of each row's chosen columns, -1 for the holes in front of a shorter row."""
    index, valid = left_holed(cols)
    return pos.gather(1, index).masked_fill(~valid, -1)


# the most vectors (per kind, over layers, rows and heads) built for one coder call: a decode step of every layer
# (30 x 8 x 96 for SmolLM2 at batch 8) fits; a long prompt's prefill is coded a few layers at a time
MAX_VECTORS = 1 << 16


def compress(layers: list["FadkvLayer"], stats: CodingStats) -> None:
    """Code the due tokens of all `layers` (`due_columns`) in as few coder calls as MAX_VECTORS allows: keys and
    values of every layer and row together when their sparsity is the same. Each layer then stores its codes."""
    if not layers:
        return
    first = layers[0].keys.device  # one read back for every layer (a device map spreads them over several devices)
    counts = torch.stack([real_tokens(layer).sum(1).to(first) for layer in layers]).tolist()
    plans, last = [], None
    for layer, n in zip(layers, counts):
        plan = last[1] if last is not None and same_tokens(layer, last[0]) else due_columns(layer, n)
        last = layer, plan
        if plan is not None:
            plans.append((layer, plan))
    if not plans:
        return
    cfg = layers[0].cfg
    if cfg.kernel == "auto" and first.type == "cpu":
        kernels.available()  # the first call builds the kernels (a minute): not coding time in the stats
    t0 = time.perf_counter()
    share_atom_use([kind for layer in layers for kind in layer.kinds])
    batch = layers[0].batch
    rows = [b for b in range(batch) if any(len(plan[b][0]) for _, plan in plans)]
    width = max(len(plan[b][0]) for _, plan in plans for b in rows)
    row_index = torch.tensor(rows, device=layers[0].keys.device)
    per_layer = len(rows) * layers[0].kv_heads * width
    step = max(1, MAX_VECTORS // per_layer)
    # a model computing in bfloat16 screens in it too (coding.dictionaries); OMP's coefficients come from its
    # correlations, so lexico's stay fp32
    low = layers[0].dtype == torch.bfloat16 and cfg.coder == "screen"
    for start in range(0, len(plans), step):
        part = plans[start : start + step]
        built = [coding_vectors(layer, plan, row_index, width) for layer, plan in part]  # (keys, values, real) per layer
        kinds = [kind for layer, _ in part for kind in layer.kinds]  # keys, values of each layer
        x = [v for keys, values, _ in built for v in (keys, values)]  # (B', H, width, d) each
        real = [r[:, None, :].expand(-1, x[0].shape[1], -1) for _, _, r in built for _ in (0, 1)]
        codes = [None] * len(kinds)
        calls = [range(len(kinds))] if len({kind.sparsity for kind in kinds}) == 1 else [range(0, len(kinds), 2),
                                                                                          range(1, len(kinds), 2)]
        for call in calls:
            xs = torch.stack([x[i] for i in call]).flatten(2, 3)  # (L, B', H·width, d)
            rs = torch.stack([real[i] for i in call]).flatten(2, 3)
            idx, coef = code_kinds([kinds[i] for i in call], row_index, xs, rs, cfg, stats, part[0][0].seen, low)
            stored = (kinds[call[0]].stored_numbers(idx), *quantize(coef, cfg.coef_format))  # every kind at once
            for j, i in enumerate(call):
                codes[i] = tuple(None if t is None else _full_rows(t[j], row_index, batch, width) for t in stored)
        for n, (layer, plan) in enumerate(part):
            store_codes(layer, plan, codes[2 * n : 2 * n + 2])
    stats.seconds += time.perf_counter() - t0


def _full_rows(codes: torch.Tensor, rows: torch.Tensor, batch: int, width: int) -> torch.Tensor:
    """codes (B', H·width, s) of rows (B',) -> (B, H, width, s), zero (holes) in the rows that coded nothing."""
    if len(rows) == batch:  # every row coded (rows are distinct)
        return codes.view(batch, -1, width, codes.shape[-1])
    out = codes.new_zeros(batch, codes.shape[1] // width, width, codes.shape[-1])
    out[rows] = codes.view(len(rows), -1, width, codes.shape[-1])
    return out
