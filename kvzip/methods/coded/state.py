"""One kind's coded tier in one cache layer (keys or values): codes, the dictionary each row sees, atom use.

A layer codes keys and values alike, each over its own dictionary, so everything here exists once per kind:
- the shared dictionary, N unit-norm atoms (N, d) and their Gram matrix (N, N), fp32, never written;
- `codes`: per coded token of every row and KV head, s atom numbers and coefficients (`Codes`);
- `overlay`: each row's replaced (fixed-size adaptation) or appended atoms, atom number -> vector, so batched rows
  never see each other's atoms and the shared dictionary stays untouched;
- `refcount` and `last_used` (B, Ntot): how many live codes of a row use each atom and when it was last used; an atom
  with no live code may be replaced, the least recently used first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvzip.methods.base import tensor_bytes
from kvzip.sparse import attention as coded

OVERLAY_ID_BYTES = 8  # the int64 atom number stored with each overlay vector


class Overlay:
    """One sequence-batch's replaced or appended atoms for one dictionary: ids (B, R) (-1 = free), vectors (B, R, d)."""

    def __init__(self, batch: int, dim: int, device):
        self.ids = torch.full((batch, 0), -1, dtype=torch.long, device=device)
        self.vectors = torch.zeros(batch, 0, dim, device=device)

    def put(self, row: int, atom: int, vector: torch.Tensor) -> None:
        hit = (self.ids[row] == atom).nonzero()
        if len(hit) == 0:
            hit = (self.ids[row] == -1).nonzero()
        if len(hit) == 0:  # no free slot in this row: widen every row by one
            batch, _, dim = self.vectors.shape
            self.ids = torch.cat([self.ids, self.ids.new_full((batch, 1), -1)], 1)
            self.vectors = torch.cat([self.vectors, self.vectors.new_zeros(batch, 1, dim)], 1)
            slot = self.ids.shape[1] - 1
        else:
            slot = int(hit[0])
        self.ids[row, slot] = atom
        self.vectors[row, slot] = vector

    def bytes(self) -> int:
        used = int((self.ids >= 0).sum())
        return used * (self.vectors.shape[-1] * self.vectors.element_size() + OVERLAY_ID_BYTES)


@dataclass
class Codes:
    """Coded tokens: idx (B, H, T, s) atom numbers (int16, or int32 for very large dictionaries), stored (B, H, T, s)
    coefficients in the layer's coefficient format, scale (B, H, T, 1) fp16 per vector (None for fp16 coefficients)."""

    idx: torch.Tensor
    stored: torch.Tensor
    scale: torch.Tensor | None

    def append(self, idx: torch.Tensor, coef: torch.Tensor, coef_format: str) -> None:
        """New codes (B, H, T', s) after the old ones, coefficients stored as `coef_format` says."""
        stored, scale = coded.quantize(coef, coef_format)
        self.idx = torch.cat([self.idx, idx.to(self.idx.dtype)], 2)
        self.stored = torch.cat([self.stored, stored], 2)
        self.scale = None if scale is None else torch.cat([self.scale, scale], 2)

    def gather(self, index: torch.Tensor) -> None:
        """Per row, the coded tokens at `index` (B, T'), e.g. each row's real ones right-aligned; the caller marks
        the filler entries as holes by position, so their contents are never read."""
        def pick(x):
            return x.gather(2, index[:, None, :, None].expand(x.shape[0], x.shape[1], index.shape[1], x.shape[3]))

        self.idx, self.stored = pick(self.idx), pick(self.stored)
        self.scale = None if self.scale is None else pick(self.scale)

    def keep(self, columns: torch.Tensor) -> None:
        """Only the coded tokens at `columns` (T',) stay."""
        self.idx, self.stored = self.idx.index_select(2, columns), self.stored.index_select(2, columns)
        self.scale = None if self.scale is None else self.scale.index_select(2, columns)

    def coefficients(self) -> torch.Tensor:
        """(B, H, T, s) fp32."""
        return coded.dequantize(self.stored, self.scale)

    def bytes(self) -> int:
        return tensor_bytes(self.idx, self.stored, self.scale)


class CodedKind:
    """One kind's coded tier (module docstring). atoms (N, d), gram (N, N): the shared dictionary, fp32."""

    def __init__(self, atoms: torch.Tensor, gram: torch.Tensor, sparsity: int, coef_format: str, batch: int,
                 heads: int):
        self.atoms, self.gram, self.sparsity = atoms, gram, sparsity
        self.n_atoms, dim = atoms.shape
        dev = atoms.device
        idx_dtype = torch.int16 if self.n_atoms + 4096 < 32767 else torch.int32
        stored, scale = coded.quantize(torch.zeros(batch, heads, 0, sparsity, device=dev), coef_format)
        self.codes = Codes(torch.zeros(batch, heads, 0, sparsity, dtype=idx_dtype, device=dev), stored, scale)
        self.overlay = Overlay(batch, dim, dev)
        self.refcount = torch.zeros(batch, self.n_atoms, dtype=torch.long, device=dev)
        self.last_used = torch.full((batch, self.n_atoms), -1, dtype=torch.long, device=dev)

    def bytes(self) -> dict[str, int]:
        return {"codes": self.codes.bytes(), "dictionary": self.overlay.bytes()}

    def n_total(self) -> int:
        """The dictionary size the rows see: N, or more where `adapt=append` grew an overlay past it."""
        ov = self.overlay
        return max(self.n_atoms, int(ov.ids.max()) + 1 if ov.ids.numel() else 0)

    def row_dictionary(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (Ntot, d) atoms and Gram this row codes with: the shared ones, patched by the row's overlay."""
        ov = self.overlay
        live = ov.ids[row] >= 0
        if not bool(live.any()):
            return self.atoms, self.gram
        ids, vecs = ov.ids[row][live], ov.vectors[row][live]
        n_tot = max(self.n_atoms, int(ids.max()) + 1)
        if n_tot == self.n_atoms:  # adapt=fixed: replaced atoms only, so copies of the shared tensors are patched
            atoms, gram = self.atoms.clone(), self.gram.clone()
        else:
            atoms = torch.cat([self.atoms, self.atoms.new_zeros(n_tot - self.n_atoms, self.atoms.shape[1])])
            gram = torch.zeros(n_tot, n_tot, device=self.gram.device)
            gram[: self.n_atoms, : self.n_atoms] = self.gram
        atoms[ids] = vecs
        rows = atoms[ids] @ atoms.T  # (R, Ntot)
        gram[ids] = rows
        gram[:, ids] = rows.T
        return atoms, gram

    def count(self, row: int, idx: torch.Tensor, now: int) -> None:
        """New codes idx (..., s) of `row` at step `now`: each atom they use gains a live code."""
        n_tot = self.n_total()
        self.refcount, self.last_used = _widen(self.refcount, n_tot, 0), _widen(self.last_used, n_tot, -1)
        flat = idx.reshape(-1)
        self.refcount[row].scatter_add_(0, flat, torch.ones_like(flat))
        self.last_used[row, flat] = now

    def forget(self, gone: torch.Tensor) -> None:
        """Coded tokens gone (B, T) (out of a sliding window): the atoms their codes used lose a live code."""
        for row in range(gone.shape[0]):
            used = self.codes.idx[row][:, gone[row]].reshape(-1).long()
            self.refcount[row].scatter_add_(0, used, -torch.ones_like(used))

    # ---- the atoms in attention --------------------------------------------------------------------------------
    def atom_scores(self, qg: torch.Tensor) -> torch.Tensor:
        """qg (B, H, G, d) -> q·atom for every atom this sequence sees, plus a spare zero column (B, H, G, Ntot+1)."""
        ov = self.overlay
        n_tot = self.n_total()
        qd = qg @ self.atoms.T  # (B, H, G, N)
        pad = qd.new_zeros(*qd.shape[:-1], n_tot + 1 - self.n_atoms)
        qd = torch.cat([qd, pad], -1)
        if ov.ids.shape[1]:
            ids = torch.where(ov.ids >= 0, ov.ids, n_tot)  # free slots write the spare column
            q_ov = torch.einsum("bhgd,brd->bhgr", qg, ov.vectors)  # (B, H, G, R)
            qd.scatter_(-1, ids[:, None, None, :].expand_as(q_ov), q_ov)
            qd[..., n_tot] = 0
        return qd

    def values_from_atoms(self, w_atoms: torch.Tensor) -> torch.Tensor:
        """w_atoms (B, H, G, Ntot+1) -> Σ weight·atom (B, H, G, d), overlay atoms replacing their base atoms."""
        ov = self.overlay
        if ov.ids.shape[1] == 0:
            return w_atoms[..., : self.n_atoms] @ self.atoms
        ids = torch.where(ov.ids >= 0, ov.ids, self.n_total())[:, None, None, :].expand(*w_atoms.shape[:-1], -1)
        w_ov = w_atoms.gather(-1, ids)  # (B, H, G, R)
        w_base = w_atoms.scatter(-1, ids, 0.0)
        return w_base[..., : self.n_atoms] @ self.atoms + torch.einsum("bhgr,brd->bhgd", w_ov, ov.vectors)

    def atom_table(self, batch: int) -> torch.Tensor:
        """(B, Ntot + 1, d): the atoms each row sees, the shared dictionary patched by the row's overlay, and a spare
        last row."""
        ov = self.overlay
        n_tot = self.n_total()
        table = torch.cat([self.atoms, self.atoms.new_zeros(n_tot - self.n_atoms + 1, self.atoms.shape[1])])
        table = table.expand(batch, -1, -1)
        if not ov.ids.shape[1]:
            return table
        ids = torch.where(ov.ids >= 0, ov.ids, n_tot)  # free slots write the spare last row
        return table.scatter(1, ids[..., None].expand_as(ov.vectors), ov.vectors)


def _widen(table: torch.Tensor, width: int, fill: int) -> torch.Tensor:
    """table (B, n) with columns of `fill` appended up to `width`."""
    if table.shape[1] >= width:
        return table
    return torch.cat([table, table.new_full((table.shape[0], width - table.shape[1]), fill)], 1)
