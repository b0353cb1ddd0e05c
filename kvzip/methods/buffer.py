"""`Buffer`: one per-token tensor of a dense tier in a preallocated storage, written by index.

A `torch.cat` of the whole cache at every step costs a fresh allocation and a copy of everything kept, ~5 ms per layer
and tensor at 4k tokens of batch 8 on CPU (more than the attention that reads it). A buffer keeps spare slots around
the stored tokens along the token axis instead: appending writes after them, prepending before them, and eviction
compacts them where they are. The storage grows (one copy) only when the room on that side is used up.
"""

from __future__ import annotations

import torch


class Buffer:
    """Tokens `start : start + length` of `storage` along `axis` are the tensor a layer holds (`view()`); the other
    slots are spare room. `last` is the view handed out last: a layer whose attribute is no longer it has replaced
    the tensor (a gather, a rebuild) and adopts the new one in a new buffer."""

    def __init__(self, tensor: torch.Tensor, axis: int, spare: int = 16):
        self.storage, self.axis, self.spare = tensor, axis, spare
        self.start, self.length = 0, tensor.shape[axis]
        self.last = tensor

    def view(self) -> torch.Tensor:
        self.last = self.storage.narrow(self.axis, self.start, self.length)
        return self.last

    def _grow(self, before: int, after: int) -> None:
        """New storage with `before` free slots, the stored tokens, then `after` free slots."""
        shape = list(self.storage.shape)
        shape[self.axis] = before + self.length + after
        storage = self.storage.new_empty(shape)
        storage.narrow(self.axis, before, self.length).copy_(self.view())
        self.storage, self.start = storage, before

    def _room(self) -> int:
        return max(self.spare, self.length // 16)

    def append(self, new: torch.Tensor) -> torch.Tensor:
        """`new` written after the stored tokens; when the room behind them is used up, new storage holds the stored
        tokens, the new ones and `spare` or 1/16 more slots."""
        q = new.shape[self.axis]
        if self.start + self.length + q > self.storage.shape[self.axis]:
            self._grow(0, q + self._room())
        self.storage.narrow(self.axis, self.start + self.length, q).copy_(new)
        self.length += q
        return self.view()

    def prepend(self, count: int, fill) -> torch.Tensor:
        """`count` slots set to `fill` put in front of the stored tokens; when the room before them is too small, new
        storage keeps `spare` or 1/16 free on both sides (a buffer that widens on the left, as zoomr's does when a
        rebuilt row outgrows it, then stays in place for the appends that follow)."""
        if self.start < count:
            room = self._room()
            self._grow(count + room, room)
        self.start -= count
        self.length += count
        self.storage.narrow(self.axis, self.start, count).fill_(fill)
        return self.view()

    def drop(self, count: int) -> torch.Tensor:
        """The first `count` stored tokens dropped: the view starts later, nothing moves."""
        self.start += count
        self.length -= count
        return self.view()

    @staticmethod
    def moves(index: torch.Tensor, length: int) -> tuple:
        """What `keep(index)` writes in a buffer of `length` tokens: the rows (and heads) and target slots whose token
        changes, and the slots their tokens come from. Finding them reads a count back to the host, which is why
        eviction runs after the forward; tensors that keep the same tokens share one."""
        k = index.shape[-1]
        at = (index != torch.arange(length - k, length, device=index.device)).nonzero(as_tuple=True)
        return at[:-1], at[-1] + length - k, index[at]

    def keep(self, index: torch.Tensor, moves: tuple | None = None) -> torch.Tensor:
        """Keep the stored tokens `index` (B, K) (the same tokens in every head of a row) or (B, H, K) (per head), in
        that order, compacted in place: they become the last K slots of the view, which then starts S - K later. Only
        the slots whose token changes are written (`moves`), from copies read first: sources and targets may
        overlap."""
        rows, target, source = self.moves(index, self.length) if moves is None else moves
        lead = rows + (slice(None),) * (self.axis - len(rows))
        view = self.view()
        view[lead + (target,)] = view[lead + (source,)]
        return self.drop(self.length - index.shape[-1])
