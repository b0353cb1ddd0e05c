"""FAD-KV screening coder: top-n candidate pools by correlation, coefficients refined by OMP on the pool only.

OMP (omp.py) rescans all N atoms at each of its s steps; at decode time that is the cost FAD-KV removes. Screening
computes the correlations |D x| once, keeps the n most correlated atoms as a candidate pool, and runs the same
correlation-domain Cholesky pursuit as omp.py on the pool: each step gathers the new atom's Gram entries on the pool
from the precomputed Gram matrix, so it touches n entries instead of N (and no n x n sub-Gram is ever formed).

Measured on SmolLM2 keys (layer 10, N=1024, s=8), the atoms OMP picks at steps 4-8 rank in the hundreds by the
initial |D x| (median rank 60-300): no one-shot pool holds them, which is why one-shot screening stays ~25% above
OMP's error whatever the refinement (least squares + keep s largest was worse still, 0.37 vs 0.26 in MEASURED.md).
`shots=2` (default) screens twice: pursue s // 2 atoms on the first pool, form the residual, screen the residual's
correlations for n fresh candidates, and resume the same pursuit (its Cholesky state carried over) for the
remaining steps on the fresh candidates. That is two matmuls and two top-n
selections instead of OMP's s full passes over N. `shots=1` is the plain one-shot FAD-KV coder.

How a pool is picked (`pick`): `top` is the exact top-n by |D x|. On CPU torch's topk costs more than the matmul
that made the correlations, so the default, `champions`, splits the N atoms into n contiguous groups and takes each
group's largest |D x|: one pass of integer max, no sort (see `champions`). It misses a top-n atom only when two
share a group; measured on SmolLM2 KV it costs 1-3% error with dictionaries learned by one-shot screening
(learn.py's `screen1`), for ~1.7x the speed of an exact pool.
"""
from __future__ import annotations

import torch

from kvzip.sparse.omp import as_dictionary, chunks, default_chunk, omp_from_correlations, pack_abs, scratch

SHOTS = (1, 2)
PICKS = ("champions", "top")
# Atoms in the first screening pool unless a caller says otherwise: fadkv's `pool` default, where pools of 8 cost
# 1.09-1.15x OMP's error and larger pools cost time for little gain (docs/fadkv.md, "Why the defaults").
POOL = 16


def top_abs(c: torch.Tensor, n: int, groups: int = 128) -> torch.Tensor:
    """Column numbers (m, n) of the n largest |c| in each row of c (m, N), in no particular order; exact.

    torch's CPU topk costs ~10 ns per element for a small n, more than the matmul that made c. Instead: split the
    columns into `groups` interleaved groups ({g, g + groups, g + 2 groups, ...}: contiguous reductions), take each
    group's largest |c|, keep the n groups with the largest maxima, and run topk on their n * N / groups members
    only. Exact, since each of the n largest entries sits in a group whose maximum is at least the n-th largest
    entry, and at most n groups have such a maximum (ties aside).
    """
    m, N = c.shape
    a = c.abs()                                               # one pass; cheaper than max and -min per group
    if N % groups or groups <= n or N // groups < 2:
        return a.topk(n, dim=1, sorted=False).indices
    gmax = a.view(m, N // groups, groups).amax(dim=1)        # (m, groups) largest |c| of each group
    g = gmax.topk(n, dim=1, sorted=False).indices            # (m, n) the groups holding the n largest
    members = (g.unsqueeze(2) + groups * torch.arange(N // groups, device=c.device)).flatten(1)  # (m, n * N/groups)
    return members.gather(1, a.gather(1, members).topk(n, dim=1, sorted=False).indices)


def champions(c: torch.Tensor, n: int, work: torch.Tensor | None = None) -> torch.Tensor:
    """Column numbers (m, n) of the largest |c| in each of n contiguous column groups of c (m, N), N % n == 0.

    Fast on CPU because it is a single integer max over omp.pack_abs (value and column in one int32; for N=1024 the
    value keeps 13 mantissa bits, ties go to the higher column). `work`: an optional int32 buffer of c's shape to write into
    (reusing one across calls saves fresh pages on CPU).
    """
    m, N = c.shape
    packed = torch.empty_like(c, dtype=torch.int32) if work is None else work
    low = pack_abs(c.float(), packed)
    return (packed.view(m, n, N // n).amax(dim=2) & low).long()   # (m, n)


def pick_pool(c: torch.Tensor, n: int, pick: str, work: torch.Tensor | None = None) -> torch.Tensor:
    """A pool of n atom numbers (m, n) per row of correlations c (m, N): `champions` or the exact `top` n."""
    N = c.shape[1]
    if pick == "champions" and N % n == 0 and N // n >= 2:
        return champions(c, n, work)
    return top_abs(c, n)


def pool_correlations(c: torch.Tensor, pool: torch.Tensor, dic, v: torch.Tensor) -> torch.Tensor:
    """The correlations (m, p) of vectors v (m, d) with their pools' atoms (m, p): read from c (m, N) when it is fp32;
    when it is bfloat16 (atoms.Grouped's `low`), which only screens, dot products in fp32, so that every coefficient
    comes from exact correlations as in the fused pursuit."""
    if c.dtype == torch.float32:
        return c.gather(1, pool)
    return torch.einsum("mpd,md->mp", dic.table[dic._rows(pool)], v.float())


def _pool_omp(c0: torch.Tensor, gram, pool: torch.Tensor, k: int, dic, x: torch.Tensor, **kw):
    """OMP for k steps on each vector x (m, d)'s pool (m, p) of atoms, given full correlations c0 (m, N) and the
    pool's Gram entries (atoms.PoolGram)."""
    i, *rest = omp_from_correlations(pool_correlations(c0, pool, dic, x), gram, k, **kw)  # (m, k) pool positions
    return (pool.gather(1, i), *rest)


def _second_shot(xc, dic, first, a, state, n, pick, packed, out):
    """Screen the residual of the first k atoms for n fresh candidates and resume the pursuit there: returns the
    fresh pool (m, n), its Gram entries, its residual correlations and the resumed state (U0, Linv0, z0). The first
    k atoms stay out of the pool: the resumed pursuit only needs their orthonormalised correlations with the fresh
    atoms (U0)."""
    Li, z = state                                             # (m, k, k) inverse Cholesky factor, (m, k)
    G, per, d = xc.shape
    res = xc.reshape(-1, d) - dic.reconstruct(first, a)       # (m, d) residuals
    c1 = dic.correlations(res.view(G, per, d), out=out)       # (m, N) correlations of the residual (in c0's buffer)
    c1.scatter_(1, first, 0.0)                                # picked atoms are orthogonal to it
    fresh = pick_pool(c1, n, pick, packed)                   # (m, n)
    gram = dic.pool(fresh, res.shape[0])
    g = gram.entries(first)                                   # (m, k, n) Gram entries picked x fresh
    return fresh, gram, pool_correlations(c1, fresh, dic, res), (torch.bmm(Li, g), Li, z)  # (m, n), ..., (m, n), ((m, k, n), ...)


def _fused_chunk(xc: torch.Tensor, dic, s: int, n: int, n2: int, two: bool, pick: str, out=None):
    """One chunk (G, m, d) fp32 through the fused pursuit (kvzip/kernels): the same shots, pools and picks as the
    PyTorch path below, each vector's pursuit in one pass with an explicit residual. With fp32 correlations both
    shots run in one kernel call (torch.ops.kvzip.screen_two_shots), which computes the correlations with every atom
    itself, a block of vectors at a time, and the residual's from the Gram rows of the first shot's atoms instead of
    a second product; with bfloat16 ones (which only screen) the correlations are batched products here, and each
    shot a call of torch.ops.kvzip.screen_pursue. Returns idx, coef (G·m, s) and the residuals x - D c
    (G·m, d)."""
    G, m, d = xc.shape
    x = xc.reshape(G * m, d).contiguous()
    atoms = dic.lookup()
    top = pick == "top"
    none = torch.empty(G * m, 0, dtype=torch.long, device=x.device)
    if two and dic.correlation_dtype == torch.float32:
        return torch.ops.kvzip.screen_two_shots(x, *atoms, *dic.gram_blocks(), m, n, n2, s, top)
    c0 = dic.correlations(xc, out=out).contiguous()
    if not two:
        return torch.ops.kvzip.screen_pursue(x, c0, *atoms, m, none, n, s, top)
    first, _, res = torch.ops.kvzip.screen_pursue(x, c0, *atoms, m, none, n, s // 2, top)
    c1 = dic.correlations(res.view(G, m, d), out=out).contiguous()
    # picked atoms are orthogonal to the residual (an index_put: scatter_ is ~10x slower on bfloat16 here)
    c1[torch.arange(G * m, device=x.device)[:, None], first] = 0.0
    return torch.ops.kvzip.screen_pursue(x, c1, *atoms, m, first, n2, s, top)


@torch.no_grad()
def screen(x: torch.Tensor, D, s: int, n: int = POOL, gram: torch.Tensor | None = None,
           shots: int = 2, pick: str = "champions", n2: int | None = None,
           chunk: int | None = None, fused: bool = False, residuals: bool = False):
    """Code x (M, d) with s atoms of D (N, d, unit-norm rows) chosen from top-n screening pools; or x (G, m, d) with D
    an atoms.Grouped (each group coded with its own atoms, all in one pass).

    Returns idx and coef (x's leading shape, s): idx int64 atom numbers, coef in x.dtype,
    x ≈ (coef.unsqueeze(-1) * D[idx]).sum(-2). `gram` = gram_matrix(D), computed once per dictionary by the caller.
    Computes in fp32. n is clamped to [s, N]. `pick` chooses how pools are formed (module docstring); n2 (default
    2n) is the second shot's pool size. `fused`: each pursuit in the fused CPU kernel (the caller checks that
    kvzip.kernels are available); the same codes but for float rounding on near-ties. `residuals`: also return
    x - D c (x's shape), which the fused pursuit forms anyway.
    """
    if shots not in SHOTS:
        raise ValueError(f"shots must be one of {SHOTS}, got {shots}")
    if pick not in PICKS:
        raise ValueError(f"pick must be one of {PICKS}, got {pick!r}")
    dic, xg = as_dictionary(x, D, gram)
    N = dic.size
    assert 1 <= s <= N, f"sparsity s={s} must be in [1, N={N}]"
    n = min(max(n, s), N)
    n2 = min(max(2 * n if n2 is None else n2, 1), N - s // 2)
    chunk = chunk or default_chunk(x.device, N)  # 2048 vectors on CPU: measured ~10% faster than 512
    parts, rows = chunks(xg, chunk)
    # a (rows, N) correlation buffer and a packed-int buffer reused by every chunk and both shots: fresh 8 MB
    # tensors per chunk cost ~20% of the coding time on CPU (page faults)
    corr = scratch(rows, N, dic.correlation_dtype, x.device)
    packed = None if fused else torch.empty(rows, N, dtype=torch.int32, device=x.device)  # the kernels pack their own
    idx_out, coef_out, res_out = [], [], []
    for part in parts:
        xc = xg[:, part].float()                              # (G, m, d)
        m = xc.shape[0] * xc.shape[1]
        if fused:
            i, a, r = _fused_chunk(xc, dic, s, n, n2, shots == 2 and s >= 2 and n < N, pick, corr[:m])
            idx_out.append(i.view(*xc.shape[:2], s))
            coef_out.append(a.view(*xc.shape[:2], s))
            res_out.append(r.view(xc.shape))
            continue
        c0 = dic.correlations(xc, out=corr[:m])  # (m, N) correlations with every atom
        pool = pick_pool(c0, n, pick, packed[:m])             # (m, n) first candidate pool
        if shots == 2 and s >= 2 and n < N:
            first, a, state = _pool_omp(c0, dic.pool(pool, m), pool, s // 2, dic, xc.reshape(m, -1),
                                        return_state=True)  # (m, s//2)
            pool, gram2, alpha, start = _second_shot(xc, dic, first, a, state, n2, pick, packed[:m], corr[:m])
            pos, a = omp_from_correlations(alpha, gram2, s, start=start)  # steps s//2 .. s-1 on the fresh pool
            i = torch.cat([first, pool.gather(1, pos[:, s // 2:])], 1)   # (m, s)
        else:
            i, a = _pool_omp(c0, dic.pool(pool, m), pool, s, dic, xc.reshape(m, -1))  # (m, s)
        idx_out.append(i.view(*xc.shape[:2], s))
        coef_out.append(a.view(*xc.shape[:2], s))
    idx, coef = torch.cat(idx_out, 1), torch.cat(coef_out, 1).to(x.dtype)
    out = (idx, coef)
    if residuals:
        res = torch.cat(res_out, 1) if fused else xg.float() - dic.reconstruct(
            idx.reshape(-1, s), coef.float().reshape(-1, s)).view(xg.shape)
        out = (idx, coef, res.to(x.dtype))
    return out if x.dim() == 3 else tuple(t[0] for t in out)
