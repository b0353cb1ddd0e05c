"""Coding new vectors with each row's dictionary, and FAD-KV's fixed-size dictionary adaptation.

Each row codes its own vectors (a row's dictionary is its layer's shared one patched by the row's overlay), with
screening (FAD-KV) or OMP (Lexico). The vectors of every layer, kind and row due at a step are coded in one pass
(`code_kinds`, over kvzip.sparse.atoms.Grouped dictionaries): the coders' cost per call is Python and dispatch, paid
once instead of 2 x layers x rows times. With adaptation on, a vector whose relative residual ||x - Dc|| / ||x|| exceeds
`adapt_threshold` has its normalised residual placed as an atom, and is re-coded: `adapt=fixed` replaces an inactive
atom (no live code, least recently used), so the dictionary a row sees stays N atoms; `adapt=append` grows it
instead. At most `max_new_atoms` vectors per call (per row, layer and kind) become atoms, the worst-coded first.
`options` is the method's options (`CodedOptions`, what kvzip.methods.fadkv.Fadkv holds): coder, screen_*, adapt,
adapt_threshold, max_new_atoms.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass

import torch

from kvzip import kernels
from kvzip.methods.coded.state import CodedKind
from kvzip.sparse.atoms import Grouped
from kvzip.sparse.omp import omp
from kvzip.sparse.screen import screen

ADAPT = ("fixed", "append", "none")
NORM_EPS = 1e-8  # floor of a vector's norm in relative errors and normalised residuals: an all-zero padding key
# vectors per screening chunk: a decode step's new tokens of every layer, kind and row (30 x 2 x 8 x 96 for SmolLM2
# at batch 8) in a few passes, so a step pays the coder's per-call cost a few times, not once per layer, kind and row
CHUNK = 16384
# On a CPU, at most this many vectors (over rows and heads) of whole kinds are coded per pass (`code_kinds`): where
# their correlations with every atom (4 KB a vector at N = 1,024) are written by one product and read back by the
# pursuit, a slice this size (32 MB of them) stays in the CPU's last-level cache between the two, where a whole
# event's (189 MB at batch 8) goes through memory. Slicing by kinds, not by vectors, keeps each product one kind's
# vectors tall. Measured at batch 8 (an event of 46,080 vectors): 398 ms unsliced, 351 / 333 ms at 4,096 / 8,192.
# The fp32 two-shot kernel computes its correlations itself; slices still measured faster there (256 against 292
# ms an event, alternated in one process): every array a pass makes (vectors, residuals, codes) is smaller.
KIND_SLICE = 8192


class CodedOptions(typing.Protocol):
    """The options a coded cache's layers, coding and compression read (kvzip.methods.fadkv.Fadkv has them all)."""

    sparsity: int
    value_sparsity: int
    coef_format: str
    index_bits: int
    coder: str
    screen_pool: int
    screen_shots: int
    screen_pick: str
    adapt: str
    adapt_threshold: float
    max_new_atoms: int
    buffer: int
    sinks: int
    kernel: str
    zoom: int
    zoom_chunk: int

    def packed_numbers(self, atoms: int) -> bool: ...


def code(options: CodedOptions, x: torch.Tensor, atoms: Grouped, sparsity: int):
    """x (G, m, d) -> idx, coef (G, m, s), group g coded over group g's atoms, by the options' coder (screening's
    pursuit in the fused CPU kernel where `kernel=auto` and it runs, kvzip/kernels), and the residuals x - D c
    (G, m, d)."""
    if options.coder == "omp":
        idx, coef = omp(x, atoms, sparsity)
    else:
        fused = options.kernel == "auto" and x.device.type == "cpu" and kernels.available()
        idx, coef, res = screen(x, atoms, sparsity, n=options.screen_pool, shots=options.screen_shots,
                                pick=options.screen_pick, chunk=CHUNK, fused=fused, residuals=True)
        return idx, coef, res
    rebuilt = atoms.reconstruct(idx.reshape(-1, sparsity), coef.reshape(-1, sparsity)).view(x.shape)
    return idx, coef, x - rebuilt


@dataclass
class CodingStats:
    """Running totals of the layers coded together: vectors coded, the sum of their relative residuals, atoms
    placed, seconds coding."""

    vectors: int = 0
    residual_sum: float = 0.0
    replaced: int = 0
    seconds: float = 0.0


def relative_error(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """||x - D c|| / ||x|| (G, m) for vectors x (G, m, d) and their residuals x - D c."""
    return residual.norm(dim=-1) / x.norm(dim=-1).clamp(min=NORM_EPS)


def dictionaries(kinds: list[CodedKind], rows: torch.Tensor, low: bool = False) -> Grouped:
    """The atoms rows (B',) of each kind see, as one Grouped of len(kinds) x B' groups (kind-major); `low`:
    correlations in bfloat16 (the shared atoms' bfloat16 copy made once per list of kinds)."""
    ov = [kind.overlay for kind in kinds]
    width = max(o.ids.shape[1] for o in ov)
    every = len(rows) == ov[0].ids.shape[0]  # every row (rows are distinct): no row picked out
    ids = torch.stack([_pad(o.ids if every else o.ids[rows], width, -1) for o in ov])  # (L, B', R)
    vectors = torch.stack([_pad(o.vectors if every else o.vectors[rows], width, 0.0) for o in ov])  # (L, B', R, d)
    slots = torch.tensor([kind.gram_slot for kind in kinds], device=rows.device)
    atoms = stacked_atoms(kinds)
    copies = kinds[0].low_atoms
    key = tuple(id(kind) for kind in kinds)
    if low and key not in copies:
        copies[key] = atoms.to(torch.bfloat16)
    return Grouped(atoms, ids, vectors, max(kind.n_total() for kind in kinds), kinds[0].grams, slots,
                   copies[key] if low else None)


def stacked_atoms(kinds: list[CodedKind]) -> torch.Tensor:
    """The kinds' shared atoms as one (L, N, d) tensor: a view when they sit at a constant stride in one allocation
    (kvzip.sparse.dictionary.prepare_layers stacks every layer's keys and values: all of a cache's kinds, or every
    other one), else a stacked copy."""
    atoms = stacked([kind.atoms for kind in kinds])
    return atoms if atoms is not None else torch.stack([kind.atoms for kind in kinds])


def stacked(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """Contiguous tensors of one shape as one (L, ...) view, when they sit at a constant stride in one allocation;
    else None."""
    first = tensors[0]
    if len(tensors) == 1:
        return first[None] if first.is_contiguous() else None
    size, step = first.element_size(), tensors[1].data_ptr() - first.data_ptr()
    base = first.untyped_storage().data_ptr()
    same = all(t.untyped_storage().data_ptr() == base and t.is_contiguous() and t.shape == first.shape
               and t.data_ptr() - first.data_ptr() == i * step for i, t in enumerate(tensors))
    if same and step > 0 and step % size == 0 and step // size >= first.numel():
        return first.as_strided((len(tensors), *first.shape), (step // size, *first.stride()))
    return None


def share_atom_use(kinds: list[CodedKind]) -> None:
    """Every kind's atom counts (`refcount`, `last_used`) as rows of one (K, B, N) tensor each, so that the codes of
    all kinds coded together are counted by one scatter (`count`). Done once per cache (by `compress`, a cache hook);
    a table that `adapt=append` widened is left alone, and its kind counted by itself."""
    for name in ("refcount", "last_used"):
        tables = [getattr(kind, name) for kind in kinds]
        if len({t.shape for t in tables}) == 1 and stacked(tables) is None:
            for kind, table in zip(kinds, torch.stack(tables)):
                setattr(kind, name, table)


def count(kinds: list[CodedKind], rows: torch.Tensor, idx: torch.Tensor, real: torch.Tensor, now: int) -> None:
    """New codes idx (L, B', m, s) of rows (B',), one slice per kind, at step `now`: each atom the `real` (L, B', m)
    ones use gains a live code (CodedKind.count), in one scatter where the kinds' counts are stacked
    (`share_atom_use`) and as wide as every kind's dictionary."""
    use, last = stacked([k.refcount for k in kinds]), stacked([k.last_used for k in kinds])
    n = None if use is None else use.shape[-1]
    if last is None or any(kind.n_total() != n for kind in kinds):
        for kind, i, r in zip(kinds, idx, real):
            kind.count(rows, i, r, now)
        return
    L, b = len(kinds), len(rows)
    flat = torch.where(real[..., None], idx, n).reshape(L, b, -1)  # filler: a spare last column
    counts = torch.cat([use[:, rows], use.new_zeros(L, b, 1)], 2)
    counts.scatter_add_(2, flat, torch.ones_like(flat))
    seen = torch.cat([last[:, rows], last.new_zeros(L, b, 1)], 2)
    seen.scatter_(2, flat, now)
    use[:, rows], last[:, rows] = counts[..., :n], seen[..., :n]


def code_kinds(kinds: list[CodedKind], rows: torch.Tensor, x: torch.Tensor, real: torch.Tensor, options: CodedOptions,
               stats: CodingStats, now: int, low: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Code new vectors x (L, B', m, d) fp32 of rows (B',) for each of L kinds (same sparsity) in one coder pass:
    idx, coef (L, B', m, s). Only `real` (L, B', m) vectors count (the others are zero filler, never stored as
    codes); each row's dictionary adapts when asked, and the atoms the codes use are counted at step `now`.
    `low`: the screening correlations in bfloat16 (`dictionaries`)."""
    L, B, m, d = x.shape
    per = max(1, KIND_SLICE // max(B * m, 1))
    if x.device.type == "cpu" and per < L:  # a few whole kinds per pass (KIND_SLICE)
        parts = [code_kinds(kinds[i : i + per], rows, x[i : i + per], real[i : i + per], options, stats, now, low)
                 for i in range(0, L, per)]
        return torch.cat([idx for idx, _ in parts]), torch.cat([coef for _, coef in parts])
    s = kinds[0].sparsity
    x, real = x.view(L * B, m, d), real.view(L * B, m)
    atoms = dictionaries(kinds, rows, low)
    idx, coef, res = code(options, x, atoms, s)
    err = relative_error(x, res) * real
    if options.adapt != "none":
        idx, coef, err = adapt(kinds, rows, x, real, atoms, idx, coef, res, err, options, stats, low)
    stats.residual_sum += float(err.sum())
    stats.vectors += int(real.sum())
    count(kinds, rows, idx.view(L, B, m, s), real.view(L, B, m), now)
    return idx.view(L, B, m, s), coef.view(L, B, m, s)


def adapt(kinds, rows, x, real, atoms: Grouped, idx, coef, residual, err, options: CodedOptions, stats: CodingStats,
          low: bool = False):
    """Fixed-size adaptation for every group (kind x row) at once: each group's worst-coded real vectors x (G, m, d)
    above the threshold (at most `max_new_atoms`) get their normalised residuals (`residual`, x - D c) placed as atoms
    of the row's overlay (replacing its inactive atoms, least recently used first, or appended), then are re-coded.
    Returns idx, coef and the relative errors err (G, m), updated where vectors were re-coded."""
    G, m, d = x.shape
    k = min(options.max_new_atoms, m)
    worst, pos = err.topk(k, dim=1)  # (G, k), worst first: filler vectors have error 0
    bad = worst > options.adapt_threshold
    if not bool(bad.any()):
        return idx, coef, err
    size = atoms.size
    if options.adapt == "fixed":
        counts = _tables(kinds, "refcount", rows, size, 0).view(G, size)
        counts.scatter_add_(1, idx.view(G, -1), real[..., None].expand_as(idx).reshape(G, -1).long())
        new_atoms, free = least_recent_unused(counts, _tables(kinds, "last_used", rows, size, -1).view(G, size), k)
    else:  # append: numbers past every row's dictionary
        new_atoms = size + torch.arange(k, device=x.device).expand(G, k)
        free = torch.ones_like(bad)
    place = bad & free  # both are prefixes: the i-th worst vector takes the i-th free atom, until either runs out
    if not bool(place.any()):
        return idx, coef, err
    g = torch.arange(G, device=x.device)[:, None]
    xb, res = x[g, pos], residual[g, pos]  # (G, k, d)
    vectors = res / res.norm(dim=-1, keepdim=True).clamp(min=NORM_EPS)
    b = len(rows)
    for i, kind in enumerate(kinds):
        part = slice(i * b, (i + 1) * b)
        kind.overlay.put(rows, new_atoms[part], vectors[part], place[part])
    stats.replaced += int(place.sum())
    recode = bad & place.any(1, keepdim=True)  # a group that placed an atom re-codes all its bad vectors
    atoms = dictionaries(kinds, rows, low)
    new_idx, new_coef, new_res = code(options, xb, atoms, kinds[0].sparsity)
    new_err = relative_error(xb, new_res)
    idx, coef, err = idx.clone(), coef.clone(), err.clone()
    gg, kk = recode.nonzero(as_tuple=True)
    idx[gg, pos[gg, kk]], coef[gg, pos[gg, kk]] = new_idx[gg, kk], new_coef[gg, kk]
    err[gg, pos[gg, kk]] = new_err[gg, kk]  # other codes use no replaced atom
    return idx, coef, err


def least_recent_unused(counts: torch.Tensor, last: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Live-code counts and last-used steps (G, size) -> the k atoms each group replaces first (G, k) and whether
    each is free (no live code uses it): unused atoms, the least recently used first, then the lowest number. Each
    key is unique, so the k smallest (`topk`) are the first k of a stable sort, without sorting every atom."""
    never, size = 1 << 40, counts.shape[1]
    key = torch.where(counts == 0, last, never) * size + torch.arange(size, device=counts.device)
    first = key.topk(k, dim=1, largest=False)
    return first.indices, first.values < never * size


def _tables(kinds: list[CodedKind], name: str, rows: torch.Tensor, width: int, fill: int) -> torch.Tensor:
    """The kinds' `name` tables (refcount or last_used) of rows (B',), as (L, B', width), `fill` past a table's end."""
    joint = stacked([getattr(kind, name) for kind in kinds])
    if joint is not None and joint.shape[-1] == width:
        return joint[:, rows]
    return torch.stack([_pad(getattr(kind, name)[rows], width, fill) for kind in kinds])


def _pad(table: torch.Tensor, width: int, fill) -> torch.Tensor:
    """table (B, n, ...) with entries of `fill` appended along dim 1 up to `width`."""
    if table.shape[1] >= width:
        return table
    return torch.cat([table, table.new_full((table.shape[0], width - table.shape[1], *table.shape[2:]), fill)], 1)


def left_holed(cols: list[torch.Tensor], width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row column lists -> (index (B, width), valid (B, width)): each row's columns right-aligned, holes in front
    (index 0, not valid), width the longest row's unless given."""
    lengths = [len(c) for c in cols]
    width = max(lengths) if width is None else width
    device = cols[0].device
    index = torch.zeros(len(cols), width, dtype=torch.long, device=device)
    valid = torch.arange(width, device=device) >= width - torch.tensor(lengths, device=device)[:, None]
    if any(lengths):  # every row's columns in one write: valid's True entries, row by row, are theirs in order
        index[valid] = torch.cat(cols).to(torch.long)
    return index, valid
