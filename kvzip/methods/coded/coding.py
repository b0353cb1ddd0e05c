"""Coding new vectors with each row's dictionary, and FAD-KV's fixed-size dictionary adaptation.

Each row codes its own vectors (a row's dictionary is its layer's shared one patched by the row's overlay), with
screening (FAD-KV) or OMP (Lexico). The vectors of every layer, kind and row due at a step are coded in one pass
(`code_kinds`, over kvzip.sparse.atoms.Grouped dictionaries): the coders' cost per call is Python and dispatch, paid
once instead of 2 x layers x rows times. With adaptation on, a vector whose relative residual ||x - Dc|| / ||x|| exceeds
`adapt_threshold` has its normalised residual placed as an atom, and is re-coded: `adapt=fixed` replaces an inactive
atom (no live code, least recently used), so the dictionary a row sees stays N atoms; `adapt=append` grows it
instead. At most `max_new_atoms` vectors per call (per row, layer and kind) become atoms, the worst-coded first.
`options` is the method's options (kvzip.methods.fadkv.Fadkv): coder, screen_*, adapt, adapt_threshold,
max_new_atoms.
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

if typing.TYPE_CHECKING:
    from kvzip.methods.fadkv import Fadkv

ADAPT = ("fixed", "append", "none")
NORM_EPS = 1e-8  # floor of a vector's norm in relative errors and normalised residuals: an all-zero padding key
# vectors per screening chunk: a decode step's new tokens of every layer, kind and row (30 x 2 x 8 x 96 for SmolLM2
# at batch 8) in a few passes, so a step pays the coder's per-call cost a few times, not once per layer, kind and row
CHUNK = 16384
# On a CPU, at most this many vectors (over rows and heads) of whole kinds are coded per pass (`code_kinds`): their
# correlations with every atom (4 KB a vector at N = 1,024) are written by one product and read back by the pursuit,
# and a slice this size (32 MB of them) stays in the CPU's last-level cache between the two, where a whole event's
# (189 MB at batch 8) goes through memory. Slicing by kinds, not by vectors, keeps each product one kind's vectors
# tall. Measured at batch 8 (an event of 46,080 vectors): 398 ms unsliced, 351 / 333 ms at 4,096 / 8,192.
KIND_SLICE = 8192


def code(options: "Fadkv", x: torch.Tensor, atoms: Grouped, sparsity: int):
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
    ids = torch.stack([_pad(o.ids[rows], width, -1) for o in ov])  # (L, B', R)
    vectors = torch.stack([_pad(o.vectors[rows], width, 0.0) for o in ov])  # (L, B', R, d)
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
    first = kinds[0].atoms
    step = kinds[1].atoms.data_ptr() - first.data_ptr() if len(kinds) > 1 else 0
    same = all(k.atoms.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() and k.atoms.is_contiguous()
               and k.atoms.shape == first.shape and k.atoms.data_ptr() - first.data_ptr() == i * step
               for i, k in enumerate(kinds))
    if same and step >= 0 and step % first.element_size() == 0 and step // first.element_size() >= first.numel():
        return first.as_strided((len(kinds), *first.shape), (step // first.element_size(), first.shape[1], 1))
    return torch.stack([kind.atoms for kind in kinds])


def code_kinds(kinds: list[CodedKind], rows: torch.Tensor, x: torch.Tensor, real: torch.Tensor, options: "Fadkv",
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
    for kind, i, r in zip(kinds, idx.view(L, B, m, s), real.view(L, B, m)):
        kind.count(rows, i, r, now)
    return idx.view(L, B, m, s), coef.view(L, B, m, s)


def adapt(kinds, rows, x, real, atoms: Grouped, idx, coef, residual, err, options: "Fadkv", stats: CodingStats,
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
        counts = torch.stack([_pad(kind.refcount[rows], size, 0) for kind in kinds]).view(G, size)
        counts.scatter_add_(1, idx.view(G, -1), real[..., None].expand_as(idx).reshape(G, -1).long())
        last = torch.stack([_pad(kind.last_used[rows], size, -1) for kind in kinds]).view(G, size)
        never = torch.iinfo(torch.long).max
        order = torch.where(counts == 0, last, never).sort(dim=1, stable=True)  # inactive atoms, least recent first
        new_atoms, free = order.indices[:, :k], order.values[:, :k] < never
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
