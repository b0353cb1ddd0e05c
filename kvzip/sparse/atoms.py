"""The dictionaries a coder reads: one shared set of atoms, or many that each differ from a shared set in a few atoms.

The coders (omp.py, screen.py) touch a dictionary in three ways only: correlations of vectors with every atom, the
vectors of given atoms (residuals), and Gram entries between atoms (the pursuit's orthogonalisation). Both classes
here answer those, for vectors laid out as (G, m, d): group g's m vectors are coded with group g's atoms.

- `Shared`: one dictionary (N, d) with its precomputed Gram matrix; G = 1. Gram entries are read from the matrix.
- `Grouped`: fadkv's case. A group is one row of a batch in one layer's key or value tier: it sees that layer's
  shared atoms with some replaced (fixed-size adaptation) or appended by the row's own overlay. Every group of every
  layer is coded in one call, so a decode step pays a coder's Python and dispatch cost once instead of once per
  layer, kind and row. Correlations are one batched product with the shared atoms and a patch of the overlay
  columns; Gram entries come from the shared Gram matrices except where an overlay atom is involved (a dot product
  of the two vectors), so no per-row N x N Gram is ever formed.
"""

from __future__ import annotations

import torch



class Shared:
    """One dictionary: atoms (N, d) unit-norm rows, gram (N, N) their Gram matrix, both fp32."""

    groups = 1
    correlation_dtype = torch.float32

    def __init__(self, atoms: torch.Tensor, gram: torch.Tensor):
        self.atoms, self.gram = atoms.float(), gram.float()
        self.size = atoms.shape[0]

    def correlations(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x (1, m, d) -> (m, N) correlations with every atom (written into `out` when given)."""
        return torch.mm(x.reshape(-1, x.shape[-1]), self.atoms.T, out=out)

    def lookup(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The atoms as the fused kernels read them (`atom_offsets`): (shared, extra, offsets (1, N))."""
        atoms = self.atoms.contiguous()
        numbers = torch.arange(self.size, device=atoms.device)
        return atoms, atoms.new_zeros(1, atoms.shape[1]), (numbers * atoms.shape[1])[None]

    def reconstruct(self, idx: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
        """Codes idx, coef (M, s) -> vectors (M, d)."""
        return reconstruct(self.atoms, idx, coef)

    def gram_blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The Gram matrix as the fused two-shot kernel reads it: flat, and where the one group's block starts."""
        return self.gram.reshape(-1).contiguous(), torch.zeros(1, dtype=torch.long, device=self.gram.device)

    def pool(self, pool: torch.Tensor | None, m: int) -> "PoolGram":
        """The Gram entries a pursuit needs on candidate pools (M, P) of atom numbers, or on every atom (None) for
        M = m vectors."""
        G = self.gram
        if pool is None:
            return PoolGram(G.diagonal().expand(m, self.size), lambda j: G.index_select(0, j.squeeze(1)), None)
        diag = G.diagonal().index_select(0, pool.reshape(-1)).view(pool.shape)
        return PoolGram(diag, lambda j: gram_entries(G, pool.gather(1, j), pool).squeeze(1),
                        lambda a: gram_entries(G, a, pool))


class Grouped:
    """G = L x B groups: L shared dictionaries atoms (L, N, d) with their Gram matrices grams[slots] (grams: (S, N, N),
    slots (L,)), each seen by B rows through overlays ids (L, B, R) (atom numbers, -1 for a free slot) and vectors
    (L, B, R, d). `size` is the dictionary size a row sees (N, or more where `adapt=append` grew an overlay); atoms
    past N that a row has no vector for are zero. Gram entries between shared atoms are read from `grams`; only
    entries that involve an overlay atom are dot products."""

    def __init__(self, atoms: torch.Tensor, ids: torch.Tensor, vectors: torch.Tensor, size: int, grams: torch.Tensor,
                 slots: torch.Tensor, low: torch.Tensor | None = None):
        L, N, d = atoms.shape
        self.low = low  # the shared atoms in bfloat16 (L, N, d): correlations in bfloat16 when given
        _, B, R = ids.shape
        self.atoms, self.groups, self.size, self.n = atoms.float(), L * B, size, N
        self.ids = ids.reshape(L * B, R)
        self.vectors = vectors.reshape(L * B, R, d).float()
        self.per_layer = B
        dev = atoms.device
        # each group's Gram block, as an offset into grams' flat storage
        self.grams, self.gram_at = grams.reshape(-1), slots.repeat_interleave(B) * N * N  # (G,)
        # Every atom vector a group can see in one table (`table`, made when a PyTorch path first needs it): the shared
        # atoms of all L dictionaries, one zero row, the overlays; `index` (G, size) says which row of it is atom a of
        # group g (rows from `own` on: not shared).
        self._table = None
        self.own = L * N
        base = torch.arange(L, device=dev).repeat_interleave(B)[:, None] * N  # (G, 1) each group's shared block
        cols = torch.arange(size, device=dev)
        index = torch.where(cols < N, base + cols, L * N).expand(self.groups, size).clone()  # past N: the zero row
        if R:
            live = self.ids >= 0
            slots_ = L * N + 1 + torch.arange(self.groups * R, device=dev).view(self.groups, R)
            g = torch.arange(self.groups, device=dev)[:, None].expand(-1, R)
            index[g[live], self.ids[live]] = slots_[live]
        self.index = index
        self.live = (self.ids >= 0).nonzero(as_tuple=True)  # (group, slot) of every live overlay atom
        self._norms = self._lookup = None

    @property
    def correlation_dtype(self) -> torch.dtype:
        return torch.float32 if self.low is None else self.low.dtype

    @property
    def table(self) -> torch.Tensor:
        if self._table is None:
            L, N, d = self.atoms.shape
            self._table = torch.cat([self.atoms.reshape(L * N, d), self.atoms.new_zeros(1, d),
                                     self.vectors.reshape(-1, d)])
        return self._table

    def lookup(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The atoms as the fused kernels read them (`atom_offsets`), with no copy of the shared atoms: (shared
        (L, N, d) as stacked, extra (1 + G·R, d): the zero row then the overlays, offsets (G, size))."""
        if self._lookup is None:  # once: every chunk and shot of a coder call reads the same
            d = self.atoms.shape[2]
            extra = torch.cat([self.atoms.new_zeros(1, d), self.vectors.reshape(-1, d)])
            # a shared atom's offset from its layer and number (atom_offsets' division, not needed here)
            layer = torch.arange(self.atoms.shape[0], device=self.atoms.device).repeat_interleave(self.per_layer)
            cols = torch.arange(self.size, device=layer.device)
            shared_at = layer[:, None] * self.atoms.stride(0) + cols * d  # (G, size)
            self._lookup = (self.atoms, extra, torch.where(self.index < self.own, shared_at, self.own - 1 - self.index))
        return self._lookup

    def _group(self, m: int, device) -> torch.Tensor:
        """The group of each of m = G x per vectors (group-major)."""
        return torch.arange(self.groups, device=device).repeat_interleave(m // self.groups)

    def _rows(self, a: torch.Tensor) -> torch.Tensor:
        """Atom numbers a (M, k) of M = G x m vectors (group-major) -> their rows in `table` (M, k)."""
        return self.index[self._group(a.shape[0], a.device)[:, None], a]

    def correlations(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x (G, m, d) -> (G·m, size): each group's vectors against each of its atoms; in bfloat16 where the
        Grouped has `low` atoms (they only screen pools and rank a pool's first pick: every coefficient and residual
        is computed from the vectors in fp32). Written into `out` (G·m, size) when given, unless appended atoms
        widened the dictionary past N."""
        G, m, d = x.shape
        L, N, B = self.atoms.shape[0], self.n, self.per_layer
        atoms = self.atoms if self.low is None else self.low
        x = x.to(atoms.dtype)
        into = out.view(L, B * m, N) if out is not None and self.size == N else None  # (else a fresh tensor)
        c = torch.bmm(x.reshape(L, B * m, d), atoms.transpose(1, 2), out=into).view(G, m, N)
        if self.size > N:  # appended atoms: zero until an overlay fills them
            c = torch.cat([c, c.new_zeros(G, m, self.size - N)], 2)
        if self.ids.shape[1]:
            over = torch.bmm(x, self.vectors.to(x.dtype).transpose(1, 2))  # (G, m, R)
            g, r = self.live
            c[g, :, self.ids[g, r]] = over[g, :, r]  # each live overlay atom's column
        return c.view(G * m, self.size)

    def reconstruct(self, idx: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
        return reconstruct(self.table, self._rows(idx), coef)

    def gram_blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The shared Gram matrices as the fused two-shot kernel reads them: flat, and where each group's N x N
        block starts (G,)."""
        return self.grams, self.gram_at

    def norms(self) -> torch.Tensor:
        """Squared norms of the table's rows (1 for atoms, 0 for the zero row), computed once."""
        if self._norms is None:
            self._norms = self.table.square().sum(-1)
        return self._norms

    def pool(self, pool: torch.Tensor | None, m: int) -> "PoolGram":
        norms = self.norms()
        if pool is None:  # every atom (OMP): a Gram row is the new atom's correlations with its group's atoms
            diag = norms[self.index].repeat_interleave(m // self.groups, 0)  # (M, size)
            if not self.live[0].numel():  # shared atoms only (Lexico's static dictionary, any prefill without
                return PoolGram(diag, self._gram_rows, None)  # overlays): read Gram rows, no product per step

            def every(j):
                v = self.table[self._rows(j)]  # (M, 1, d)
                return self.correlations(v.view(self.groups, -1, v.shape[-1]))

            return PoolGram(diag, every, None)
        # what every step reads about the pool, found once: its rows in `table`, which are not shared atoms, and
        # where its columns sit in each vector's Gram block
        N = self.n
        group = self._group(pool.shape[0], pool.device)[:, None]  # (M, 1)
        rows = self.index[group, pool]  # (M, P)
        own = rows >= self.own
        columns = self.gram_at[group] + pool.clamp(max=N - 1)  # (M, P) flat offsets of G[0, pool]

        def entries(a):  # atom numbers a (M, k) -> (M, k, P)
            out = self.grams.index_select(0, (columns[:, None, :] + a.clamp(max=N - 1)[:, :, None] * N).reshape(-1))
            out = out.view(*a.shape, pool.shape[1])
            ra = self.index[group, a]
            mixed = (ra >= self.own)[:, :, None] | own[:, None, :]  # an overlay (or zero) atom is involved
            if bool(mixed.any()):
                v, i, j = mixed.nonzero(as_tuple=True)
                out[v, i, j] = (self.table[ra[v, i]] * self.table[rows[v, j]]).sum(-1)
            return out

        return PoolGram(norms[rows], lambda j: entries(pool.gather(1, j)).squeeze(1), entries)

    def _gram_rows(self, j: torch.Tensor) -> torch.Tensor:
        """Atom numbers j (M, 1) of M = G x m vectors (group-major), no overlay atom live -> (M, size): each atom's
        Gram row in its group's block, zero for atoms past N (appended slots hold the zero vector)."""
        N = self.n
        j = j.squeeze(1)
        group = self._group(j.shape[0], j.device)
        out = self.grams.view(-1, N).index_select(0, self.gram_at[group] // N + j.clamp(max=N - 1))
        if self.size > N:
            out = torch.cat([out * (j < N)[:, None], out.new_zeros(out.shape[0], self.size - N)], 1)
        return out


def atom_offsets(rows: torch.Tensor, shared: torch.Tensor, own: int) -> torch.Tensor:
    """Table rows (any shape) -> where the fused kernels find each atom: rows below `own` are shared atoms, stacked
    in `shared` (L, N, d) (any layer stride, rows of d contiguous), and become their element offset from its first
    element (>= 0); the others are row `rows - own` of the extra table and become -1 - that row (< 0)."""
    n, d = shared.shape[-2], shared.shape[-1]
    layer_stride = shared.stride(0) if shared.dim() == 3 else n * d
    shared_at = (rows // n) * layer_stride + (rows % n) * d
    return torch.where(rows < own, shared_at, own - 1 - rows).contiguous()


class PoolGram:
    """Gram entries on M vectors' candidate pools (M, P): `diag` (M, P) each candidate's squared norm, `row(j)` for
    positions j (M, 1) in the pool -> (M, P) that candidate against the pool, `entries(a)` for atom numbers a (M, k)
    -> (M, k, P) those atoms against the pool (None on a pool of every atom, where no caller needs it)."""

    def __init__(self, diag, row, entries):
        self.diag, self.row, self.entries = diag, row, entries


def gram_entries(G: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """G[a[m, i], b[m, j]] for atom numbers a (M, k) and b (M, p): (M, k, p), read from the flat Gram matrix."""
    idx = a.unsqueeze(2) * G.shape[0] + b.unsqueeze(1)        # (M, k, p)
    return G.reshape(-1).index_select(0, idx.reshape(-1)).view(idx.shape)


def reconstruct(D: torch.Tensor, idx: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """Dense vectors (..., d) from codes idx, coef (..., s) over dictionary D (N, d): Σ_j coef[..., j] D[idx[..., j]].

    One fused gather-and-weighted-sum (`embedding_bag`; ~10x faster on CPU than gather, multiply and sum as three
    ops). int16 and int32 codes are used as they are (int32 is accepted; int16 becomes int32), never widened to int64."""
    s = idx.shape[-1]
    bags = idx.reshape(-1, s)
    bags = bags if bags.dtype in (torch.int32, torch.int64) else bags.int()
    table = D.float()
    out = torch.nn.functional.embedding_bag(bags, table, mode="sum", per_sample_weights=coef.reshape(-1, s).float())
    return out.view(*idx.shape[:-1], table.shape[-1])
