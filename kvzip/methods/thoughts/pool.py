"""One layer's dense tokens for all rows of a batch: a pool of token slots the rows share.

A thought cache's rows hold different counts of tokens (each zooms in on its own thoughts, its unfinished thought is
its own length). Kept as one (B, Hkv, W, d) rectangle, every row pays for the widest one: 1.22x the slots in use at
batch 8 x 512 (docs/decisions.md). Here keys and values live once in a pool (Hkv, N, d), and each row lists the
slots it holds in order, `ThoughtLayer.slots` (B, W), -1 where a shorter row has nothing: the padding costs one
integer per slot instead of a key and a value per head. A rebuild rewrites a row's list and loads only the tokens
that come back from the detail tier; nothing else moves.

Free slots are the pool's spare room, as `DenseLayer.SPARE` is a dense tier's: a rebuild's dropped tokens free their
slots for the next tokens, and the pool grows (by an eighth at least) only when none are left. `used` counts the
slots rows hold, what `memory()` reports.
"""

from __future__ import annotations

import torch


class TokenPool:
    """Keys and values (Hkv, N, d) of one layer, and which slots are free (`free[:spare]`). Heads first: the fused
    kernel streams each head's slots front to back."""

    GROW = 64  # slots at least per growth (or an eighth of the pool)

    def __init__(self, heads: int, dim: int, dtype: torch.dtype, device):
        self.keys = torch.zeros(heads, 0, dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.free = torch.zeros(0, dtype=torch.long, device=device)
        self.spare = 0

    @property
    def size(self) -> int:
        return self.keys.shape[1]

    @property
    def used(self) -> int:
        return self.size - self.spare

    def nbytes(self) -> int:
        """The bytes of the slots in use, keys and values."""
        return 2 * self.used * self.keys.shape[0] * self.keys.shape[2] * self.keys.element_size()

    def take(self, n: int) -> torch.Tensor:
        """n free slots (n,), growing the pool when fewer are left."""
        if n > self.spare:
            self._grow(n - self.spare + max(self.GROW, self.size // 8))
        self.spare -= n
        return self.free[self.spare : self.spare + n]

    def put(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write keys and values (Hkv, n, d) into `slots` (n,)."""
        self.keys.index_copy_(1, slots, keys.to(self.keys.dtype))
        self.values.index_copy_(1, slots, values.to(self.values.dtype))

    def add(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """New tokens (B, Hkv, q, d) into free slots; returns their slots (B, q)."""
        b, h, q, d = keys.shape
        slots = self.take(b * q)
        self.put(slots, keys.transpose(0, 1).reshape(h, b * q, d), values.transpose(0, 1).reshape(h, b * q, d))
        return slots.view(b, q)

    def release(self, held: torch.Tensor) -> None:
        """Every slot not in `held` (any shape, -1 for nothing) is free again."""
        used = torch.zeros(self.size + 1, dtype=torch.bool, device=self.keys.device)
        used[held.flatten()] = True  # -1 lands on the extra last entry
        self.free = (~used[: self.size]).nonzero().squeeze(1)
        self.spare = self.free.numel()

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (Hkv, ..., d) of `slots` (...); an empty slot (-1) reads slot 0, for the caller to mask."""
        at = slots.clamp(min=0)
        return self.keys[:, at], self.values[:, at]

    def _grow(self, extra: int) -> None:
        n = self.size
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros(old.shape[0], n + extra, old.shape[2])  # zeros: a masked slot never holds a NaN
            new[:, :n] = old
            setattr(self, name, new)
        fresh = torch.arange(n, n + extra, device=self.keys.device)
        self.free = torch.cat([self.free[: self.spare], fresh.flip(0)])
        self.spare += extra
