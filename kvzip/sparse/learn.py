"""Dictionary learning for KV vectors: alternate sparse coding and a MOD least-squares dictionary update.

One dictionary per layer and per kind (keys or values), shared by the layer's KV heads, is learned from captured
KV vectors. Each iteration codes every training vector with a coder (`omp`, `screen` or `screen1`), then refits all
atoms at once by MOD: D = (CᵀC + λI)⁻¹ CᵀX, where C is the sparse code matrix. Which coder sits in the loop matters
for screening: learned with the one-shot coder (`screen1`, train-dict's default), the atoms are shaped so that the
first screen's pool already holds the right ones, and the cache's two-shot coder then comes closest to OMP (SmolLM2
layers 0/10/20, two-shot with 16 + 16 champion pools: 1.08-1.10x OMP's error, against 1.09-1.17x when learned with
the exact two-shot coder in the loop; README, issue 3).
CᵀC and CᵀX are accumulated by scatter-add from the (idx, coef) codes, so the dense (M, N) code matrix is never
formed. Atoms are renormalised to unit norm. Atoms used by too few vectors are replaced with the normalised
residuals of the worst-represented vectors, so the dictionary spends atoms where the error is.

MOD rather than K-SVD: one (N, N) solve per iteration instead of N sequential rank-1 updates, which matters for the
15-minute budget of `kvzip train-dict` on a 2-core CPU (N=1024, s=8, 16k vectors, 8 iterations: ~7 s per
dictionary on one loaded core). K-SVD was not measured against it.
"""
from __future__ import annotations

from typing import Callable

import torch

from kvzip.sparse import CODERS
from kvzip.sparse.omp import gram_matrix, omp, reconstruct
from kvzip.sparse.screen import POOL, screen

Progress = Callable[[int, int, dict], None]
# Norms are clamped to this before dividing by them: a zero vector then has error 0 and a zero atom stays finite.
TINY_NORM = 1e-12
# An atom whose least-squares refit has a norm below this carries nothing: it is replaced like an unused one.
DEAD_NORM = 1e-8


def relative_error(X: torch.Tensor, D: torch.Tensor, idx: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """||x - D c|| / ||x|| per row of X (M, d), codes idx, coef (M, s). Returns (M,) fp32; 0 for zero rows."""
    Xf = X.float()
    err = (Xf - reconstruct(D, idx, coef)).norm(dim=1)       # (M,)
    return err / Xf.norm(dim=1).clamp_min(TINY_NORM)


def encode(X: torch.Tensor, D: torch.Tensor, s: int, coder: str = "omp", n: int = POOL,
           gram: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Code X (M, d) with the named coder: `omp`, `screen` (two-shot, champion pools: the cache's default) or
    `screen1` (one-shot, exact top-n pool: the plain FAD-KV coder). Returns idx (M, s), coef (M, s)."""
    if coder not in CODERS:
        raise ValueError(f"unknown coder {coder!r}; allowed: {', '.join(CODERS)}")
    if coder == "omp":
        return omp(X, D, s, gram=gram)
    if coder == "screen1":
        return screen(X, D, s, n=n, gram=gram, shots=1, pick="top")
    return screen(X, D, s, n=n, gram=gram)


def _mod_update(X: torch.Tensor, idx: torch.Tensor, coef: torch.Tensor, N: int, ridge: float) -> torch.Tensor:
    """MOD least squares D = (CᵀC + λI)⁻¹ CᵀX from sparse codes. X (M, d) fp32, idx/coef (M, s). Returns (N, d)."""
    M, s = idx.shape
    d = X.shape[1]
    A = X.new_zeros(N * N)
    pair = (idx.unsqueeze(2) * N + idx.unsqueeze(1)).reshape(-1)        # (M*s*s,) flat (a, b) positions
    A.index_add_(0, pair, (coef.unsqueeze(2) * coef.unsqueeze(1)).reshape(-1))
    A = A.view(N, N)                                                     # (N, N) = CᵀC
    B = X.new_zeros(N, d)
    B.index_add_(0, idx.reshape(-1), (coef.unsqueeze(2) * X.unsqueeze(1)).reshape(-1, d))  # (N, d) = CᵀX
    lam = ridge * A.diagonal().mean().clamp_min(TINY_NORM)
    return torch.linalg.solve(A + lam * torch.eye(N, dtype=A.dtype, device=A.device), B)  # (N, d)


@torch.no_grad()
def learn_dictionary(X: torch.Tensor, n_atoms: int, s: int, iters: int, coder: str = "omp", n: int = POOL,
                     seed: int = 0, progress: Progress | None = None, min_use: int = 2,
                     ridge: float = 1e-4) -> torch.Tensor:
    """Learn N = n_atoms unit-norm atoms (N, d) for the rows of X (M, d).

    Initial atoms are distinct training vectors chosen with `seed` (deterministic given seed, device and threads).
    Each of `iters` iterations codes X with `coder`, refits by MOD, and replaces atoms used by fewer than `min_use`
    vectors with the normalised residuals of the worst-represented vectors. `progress(step, iters, info)` is called
    after each iteration with info = {"error": mean relative error before the update, "replaced": atoms replaced}.
    Returns D in fp32 on X's device.
    """
    if coder not in CODERS:
        raise ValueError(f"unknown coder {coder!r}; allowed: {', '.join(CODERS)}")
    assert X.dim() == 2, f"X must be (M, d), got {tuple(X.shape)}"
    Xf = X.float()
    M, d = Xf.shape
    norms = Xf.norm(dim=1)
    Xf = Xf[norms > 0]                                                   # zero rows carry nothing to learn
    M = Xf.shape[0]
    assert M >= n_atoms, f"need at least n_atoms={n_atoms} nonzero training vectors, got {M}"
    g = torch.Generator(device="cpu").manual_seed(seed)
    pick = torch.randperm(M, generator=g)[:n_atoms].to(Xf.device)
    D = Xf[pick] / Xf[pick].norm(dim=1, keepdim=True)                    # (N, d)
    for it in range(iters):
        G = gram_matrix(D)                                               # once per dictionary version
        idx, coef = encode(Xf, D, s, coder=coder, n=n, gram=G)           # (M, s), (M, s)
        resid = Xf - reconstruct(D, idx, coef)                           # (M, d)
        rel = resid.norm(dim=1) / Xf.norm(dim=1)                         # (M,)
        newD = _mod_update(Xf, idx, coef.float(), n_atoms, ridge)        # (N, d)
        use = torch.bincount(idx.reshape(-1), minlength=n_atoms)         # (N,)
        nrm = newD.norm(dim=1)
        dead = ((use < min_use) | (nrm < DEAD_NORM)).nonzero().squeeze(1)  # (r,)
        newD = newD / nrm.clamp_min(TINY_NORM).unsqueeze(1)
        if dead.numel():
            worst = rel.topk(min(dead.numel(), M)).indices               # (r,) worst-represented vectors
            r = resid[worst]
            r = r / r.norm(dim=1, keepdim=True).clamp_min(TINY_NORM)
            newD[dead[:worst.numel()]] = r
        D = newD
        if progress is not None:
            progress(it + 1, iters, {"error": rel.mean().item(), "replaced": int(dead.numel())})
    return D


def subsample(X: torch.Tensor, m: int, seed: int = 0) -> torch.Tensor:
    """At most m rows of X (M, d), chosen uniformly without replacement with `seed`. Returns (min(m, M), d)."""
    if X.shape[0] <= m:
        return X
    g = torch.Generator(device="cpu").manual_seed(seed)
    return X[torch.randperm(X.shape[0], generator=g)[:m].to(X.device)]
