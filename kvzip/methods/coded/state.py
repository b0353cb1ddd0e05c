"""One kind's coded tier in one cache layer (keys or values): codes, the dictionary each row sees, atom use.

A layer codes keys and values alike, each over its own dictionary, so everything here exists once per kind:
- the shared dictionary, N unit-norm atoms (N, d) and their Gram matrix (N, N), fp32, never written;
- `codes`: per coded token of every row and KV head, s atom numbers and coefficients (`Codes`);
- `overlay`: each row's replaced (fixed-size adaptation) or appended atoms, atom number -> vector (fp16: a unit-norm
  atom loses nothing the 8- or 4-bit coefficients keep), so batched rows never see each other's atoms and the shared
  dictionary stays untouched;
- `refcount` and `last_used` (B, Ntot): how many live codes of a row use each atom and when it was last used; an atom
  with no live code may be replaced, the least recently used first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvzip.methods.base import tensor_bytes
from kvzip.rope import from_pairs
from kvzip.sparse.atoms import atom_offsets
from kvzip.sparse import coded_attention as coded

OVERLAY_ID_BYTES = 8  # the int64 atom number stored with each overlay vector


class Overlay:
    """One sequence-batch's replaced or appended atoms for one dictionary: ids (B, R) (-1 = free), vectors (B, R, d)."""

    def __init__(self, batch: int, dim: int, device):
        self.ids = torch.full((batch, 0), -1, dtype=torch.long, device=device)
        self.vectors = torch.zeros(batch, 0, dim, dtype=torch.float16, device=device)
        self.version = 0  # counts changes, so that tables built from the overlay know when they are stale

    def put(self, rows: torch.Tensor, atoms: torch.Tensor, vectors: torch.Tensor, ok: torch.Tensor) -> None:
        """Place atoms (B', k) with their vectors (B', k, d) in rows (B',) where ok (B', k): an atom already in a row's
        overlay keeps its slot, a new one takes a free slot (every row widened when one runs out). A row's atoms are
        distinct."""
        if not bool(ok.any()):
            return
        self.version += 1
        ids = self.ids[rows]  # (B', R)
        hit = (ids[:, None, :] == atoms[:, :, None]) & ok[..., None]  # (B', k, R)
        new = ok & ~hit.any(-1)
        short = int((new.sum(1) - (ids == -1).sum(1)).max())
        if short > 0:  # widen every row by the most slots any row lacks
            batch, _, dim = self.vectors.shape
            self.ids = torch.cat([self.ids, self.ids.new_full((batch, short), -1)], 1)
            self.vectors = torch.cat([self.vectors, self.vectors.new_zeros(batch, short, dim)], 1)
            ids = self.ids[rows]
            hit = torch.cat([hit, hit.new_zeros(*hit.shape[:2], short)], -1)
        free = ids == -1
        width = ids.shape[1]
        # the r-th new atom of a row takes the row's r-th free slot
        slot_of = torch.full((len(rows), width + 1), width, dtype=torch.long, device=ids.device)
        rank = torch.where(free, free.long().cumsum(1) - 1, width)
        slot_of.scatter_(1, rank, torch.arange(width, device=ids.device).expand(len(rows), width))
        slot = torch.where(new, slot_of.gather(1, (new.long().cumsum(1) - 1).clamp(min=0)), hit.long().argmax(-1))
        r = rows[:, None].expand_as(slot)[ok]
        self.ids[r, slot[ok]] = atoms[ok]
        self.vectors[r, slot[ok]] = vectors[ok].to(self.vectors.dtype)

    def bytes(self) -> int:
        used = int((self.ids >= 0).sum())
        return used * (self.vectors.shape[-1] * self.vectors.element_size() + OVERLAY_ID_BYTES)


@dataclass
class Codes:
    """Coded tokens: idx (B, H, T, s) atom numbers (int16, or int32 for very large dictionaries; or packed in 10 bits,
    (B, H, T, packed_width(s)) uint8: read them with `CodedKind.numbers`), stored (B, H, T, s)
    coefficients in the layer's coefficient format, scale (B, H, T, 1) fp16 per vector (None for fp16 coefficients).
    Views of room with spare columns in front (`kvzip.methods.coded.compress.push_codes`): each token's s entries
    are contiguous, the row and head strides are the room's."""

    idx: torch.Tensor
    stored: torch.Tensor
    scale: torch.Tensor | None

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
    """One kind's coded tier (module docstring). atoms (N, d): the shared dictionary, fp32; its Gram matrix is
    grams[gram_slot] (all layers' Gram matrices in one tensor, kvzip.sparse.dictionary.LayerAtoms)."""

    def __init__(self, atoms: torch.Tensor, grams: torch.Tensor, gram_slot: int, sparsity: int, coef_format: str,
                 batch: int, heads: int, packed: bool = False):
        self.atoms, self.grams, self.gram_slot, self.sparsity = atoms, grams, gram_slot, sparsity
        self.n_atoms, dim = atoms.shape
        dev = atoms.device
        self.packed = packed  # ten-bit numbers: below coded.PACKED_ATOMS only, no appended atoms (the method checks)
        if self.packed:
            idx = torch.zeros(batch, heads, 0, coded.packed_width(sparsity), dtype=torch.uint8, device=dev)
        else:
            idx = torch.zeros(batch, heads, 0, sparsity, device=dev,
                              dtype=torch.int16 if self.n_atoms + 4096 < 32767 else torch.int32)
        stored, scale = coded.quantize(torch.zeros(batch, heads, 0, sparsity, device=dev), coef_format)
        self.codes = Codes(idx, stored, scale)
        self.overlay = Overlay(batch, dim, dev)
        self.refcount = torch.zeros(batch, self.n_atoms, dtype=torch.long, device=dev)
        self.last_used = torch.full((batch, self.n_atoms), -1, dtype=torch.long, device=dev)
        self._lookup: tuple | None = None  # (overlay version, table, index) for the fused kernel
        self._n_total = (-1, self.n_atoms)  # (overlay version, n_total): read back once per overlay change
        self.low_atoms: dict = {}  # bfloat16 copies of stacked shared atoms, by the kinds stacked (coding.dictionaries)

    def bytes(self) -> dict[str, int]:
        return {"codes": self.codes.bytes(), "dictionary": self.overlay.bytes()}

    def numbers(self, idx: torch.Tensor | None = None) -> torch.Tensor:
        """Atom numbers (B, H, T, s) of the codes, or of `idx` (some of their columns), as stored or unpacked."""
        idx = self.codes.idx if idx is None else idx
        return coded.unpack_indices(idx, self.sparsity) if self.packed else idx

    def stored_numbers(self, idx: torch.Tensor) -> torch.Tensor:
        """New atom numbers (..., s) as this kind stores them."""
        return coded.pack_indices(idx) if self.packed else idx.to(self.codes.idx.dtype)

    def n_total(self) -> int:
        """The dictionary size the rows see: N, or more where `adapt=append` grew an overlay past it."""
        ov = self.overlay
        if self._n_total[0] != ov.version:  # the overlay changes in the cache's hooks (coding), never in a forward
            self._n_total = (ov.version, max(self.n_atoms, int(ov.ids.max()) + 1 if ov.ids.numel() else 0))
        return self._n_total[1]

    def count(self, rows: torch.Tensor, idx: torch.Tensor, real: torch.Tensor, now: int) -> None:
        """New codes idx (B', m, s) of rows (B',) at step `now`: each atom the `real` (B', m) ones use gains a live code."""
        n_tot = self.n_total()
        self.refcount, self.last_used = _widen(self.refcount, n_tot, 0), _widen(self.last_used, n_tot, -1)
        flat = torch.where(real[..., None], idx, n_tot).reshape(len(rows), -1)  # filler: a spare last column
        counts = torch.cat([self.refcount[rows], self.refcount.new_zeros(len(rows), 1)], 1)
        counts.scatter_add_(1, flat, torch.ones_like(flat))
        last = torch.cat([self.last_used[rows], self.last_used.new_zeros(len(rows), 1)], 1)
        last.scatter_(1, flat, now)
        self.refcount[rows], self.last_used[rows] = counts[:, :n_tot], last[:, :n_tot]

    def forget(self, gone: torch.Tensor) -> None:
        """Coded tokens gone (B, T) (out of a sliding window): the atoms their codes used lose a live code."""
        for row in range(gone.shape[0]):
            used = self.numbers(self.codes.idx[row : row + 1, :, gone[row]]).reshape(-1).long()
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
            q_ov = torch.einsum("bhgd,brd->bhgr", qg, ov.vectors.float())  # (B, H, G, R)
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
        return w_base[..., : self.n_atoms] @ self.atoms + torch.einsum("bhgr,brd->bhgd", w_ov, ov.vectors.float())

    def lookup(self, rope_dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The atoms each row sees, as the fused kernels read them (kvzip.sparse.atoms.atom_offsets): the shared
        atoms (N, d), an extra table (a zero row for appended numbers no vector fills yet, then every row's overlay
        vectors) and offsets (B, Ntot) int64. With `rope_dim` (pre-RoPE key atoms, kept in `to_pairs` order) the
        atoms are in the model's channel order, as the kernel turns keys. The kernel reads atoms in fp16, which holds
        them exactly (kvzip.sparse.dictionary.prepare_layers rounds them so). Rebuilt only when the overlay changed."""
        ov = self.overlay
        if self._lookup is None or self._lookup[0] != (ov.version, rope_dim):
            n, d = self.atoms.shape
            batch, width = ov.ids.shape
            numbers = torch.arange(self.n_total(), device=self.atoms.device)
            rows = torch.where(numbers < n, numbers, n).expand(batch, -1).clone()  # past N: the zero row
            if width:
                live_rows, slots = (ov.ids >= 0).nonzero(as_tuple=True)
                rows[live_rows, ov.ids[live_rows, slots]] = n + 1 + live_rows * width + slots
            kept = self._lookup[1] if self._lookup is not None and self._lookup[0][1] == rope_dim else None
            shared = kept if kept is not None else self.atoms if rope_dim is None else from_pairs(self.atoms, rope_dim)
            shared = shared.half().contiguous()
            extra = torch.cat([self.atoms.new_zeros(1, d), ov.vectors.reshape(-1, d).float()]).half()
            if rope_dim is not None:
                extra = from_pairs(extra, rope_dim).contiguous()
            self._lookup = ((ov.version, rope_dim), shared, extra, atom_offsets(rows, shared, n))
        return self._lookup[1:]

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
        return table.scatter(1, ids[..., None].expand_as(ov.vectors), ov.vectors.to(table.dtype))


def _widen(table: torch.Tensor, width: int, fill: int) -> torch.Tensor:
    """table (B, n) with columns of `fill` appended up to `width`."""
    if table.shape[1] >= width:
        return table
    return torch.cat([table, table.new_full((table.shape[0], width - table.shape[1]), fill)], 1)
