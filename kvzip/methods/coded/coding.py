"""Coding a layer's new vectors with each row's dictionary, and FAD-KV's fixed-size dictionary adaptation.

Each row codes its own vectors (a row's dictionary is the shared one patched by its overlay), with screening
(FAD-KV) or OMP (Lexico). With adaptation on, a vector whose relative residual ||x - Dc|| / ||x|| exceeds
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

from kvzip.methods.coded.state import CodedKind
from kvzip.sparse.omp import omp, reconstruct
from kvzip.sparse.screen import screen

if typing.TYPE_CHECKING:
    from kvzip.methods.fadkv import Fadkv

ADAPT = ("fixed", "append", "none")
NORM_EPS = 1e-8  # floor of a vector's norm in relative errors and normalised residuals: an all-zero padding key


def code(options: "Fadkv", x: torch.Tensor, atoms: torch.Tensor, gram: torch.Tensor, sparsity: int):
    """x (M, d) -> idx, coef (M, s) over atoms (N, d) with their Gram (N, N), by the options' coder."""
    if options.coder == "omp":
        return omp(x, atoms, sparsity, gram=gram)
    return screen(x, atoms, sparsity, n=options.screen_pool, gram=gram, shots=options.screen_shots,
                  pick=options.screen_pick)


@dataclass
class CodingStats:
    """A layer's running totals: vectors coded, the sum of their relative residuals, atoms placed, seconds coding."""

    vectors: int = 0
    residual_sum: float = 0.0
    replaced: int = 0
    seconds: float = 0.0


def relative_error(x, atoms, idx, coef) -> torch.Tensor:
    """||x - D c|| / ||x|| per row of x (M, d) for codes idx, coef (M, s) over atoms (N, d)."""
    return (x - reconstruct(atoms, idx, coef)).norm(dim=-1) / x.norm(dim=-1).clamp(min=NORM_EPS)


def code_rows(kind: CodedKind, xs: list[torch.Tensor], width: int, options: "Fadkv", stats: CodingStats, now: int):
    """xs: per row (H, m_b, d) fp32 -> idx, coef (B, H, width, s), each row's codes after holes (atom 0,
    coefficient 0) that fill it to `width`. Adapts each row's dictionary when asked; holes are never coded."""
    s = kind.sparsity
    h, d = xs[0].shape[0], xs[0].shape[-1]
    out_idx = torch.zeros(len(xs), h, width, s, dtype=torch.long, device=xs[0].device)
    out_coef = torch.zeros(len(xs), h, width, s, device=xs[0].device)
    for row, x in enumerate(xs):
        m = x.shape[1]
        if m == 0:
            continue
        flat = x.reshape(h * m, d)
        atoms, gram = kind.row_dictionary(row)
        idx, coef = code(options, flat, atoms, gram, s)
        err = relative_error(flat, atoms, idx, coef)
        if options.adapt != "none":
            idx, coef, err = adapt(kind, row, flat, atoms, idx, coef, err, options, stats)
        stats.residual_sum += float(err.sum())
        stats.vectors += flat.shape[0]
        kind.count(row, idx, now)
        out_idx[row, :, width - m :] = idx.view(h, m, -1)
        out_coef[row, :, width - m :] = coef.view(h, m, -1)
    return out_idx, out_coef


def adapt(kind: CodedKind, row: int, x, atoms, idx, coef, err, options: "Fadkv", stats: CodingStats):
    """Turn the residuals of the worst-coded vectors x (M, d) into atoms of the row's overlay (replacing inactive
    ones, or appended), then re-code those vectors. Returns idx, coef and the relative errors err (M,), updated
    where vectors were re-coded."""
    bad = (err > options.adapt_threshold).nonzero().flatten()
    if len(bad) == 0:
        return idx, coef, err
    bad = bad[err[bad].argsort(descending=True)][: options.max_new_atoms]
    res = x[bad] - reconstruct(atoms, idx[bad], coef[bad])  # (nb, d)
    placed = 0
    n_tot = kind.n_total()
    counts = torch.zeros(n_tot, dtype=torch.long, device=x.device)
    counts[: kind.refcount.shape[1]] += kind.refcount[row][:n_tot]
    counts.scatter_add_(0, idx.reshape(-1), torch.ones_like(idx.reshape(-1)))
    last = torch.full((n_tot,), -1, dtype=torch.long, device=x.device)
    last[: kind.last_used.shape[1]] = kind.last_used[row][:n_tot]
    for i in range(len(bad)):
        if options.adapt == "fixed":
            free = (counts == 0).nonzero().flatten()
            if len(free) == 0:
                break
            atom = int(free[last[free].argmin()])
        else:
            atom = kind.n_total()
            counts = torch.cat([counts, counts.new_zeros(1)])
            last = torch.cat([last, last.new_full((1,), -1)])
        kind.overlay.put(row, atom, res[i] / res[i].norm().clamp(min=NORM_EPS))
        counts[atom] = 1  # reserved: the next bad vector must not take it
        stats.replaced += 1
        placed += 1
    if placed == 0:  # no inactive atom to replace: re-coding would give the same codes
        return idx, coef, err
    atoms, gram = kind.row_dictionary(row)
    new_idx, new_coef = code(options, x[bad], atoms, gram, kind.sparsity)
    idx, coef, err = idx.clone(), coef.clone(), err.clone()
    idx[bad], coef[bad] = new_idx, new_coef
    err[bad] = relative_error(x[bad], atoms, new_idx, new_coef)  # other codes use no replaced atom
    return idx, coef, err



def left_holed(cols: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row column lists -> (index (B, width), valid (B, width)): each row's columns right-aligned, holes in front
    (index 0, not valid), width the longest row's."""
    width = max(len(c) for c in cols)
    device = cols[0].device
    index = torch.zeros(len(cols), width, dtype=torch.long, device=device)
    valid = torch.zeros(len(cols), width, dtype=torch.bool, device=device)
    for b, c in enumerate(cols):
        if len(c):
            index[b, width - len(c) :] = c
            valid[b, width - len(c) :] = True
    return index, valid
