"""The index over finished thoughts, the votes of the query heads, and the zoom set they choose (zoomr only).

A thought's index key, per layer and KV head, is the mean of its summary keys with RoPE undone (content space:
post-RoPE keys favoured recent thoughts). Before scoring, the keys are centred over the row's thoughts and made unit
length (`ThoughtIndex`). At a selection point every query head of every layer scores the index keys with its query
(turned back the same way) and votes for its `votes_per_head` best thoughts; the `Ballot` sums the votes over heads
and layers, carries earlier ones forward with weight `vote_decay`, and its `zoom_thoughts` most-voted thoughts are
the zoom set, a thought already in it counting its tally `1 + zoom_margin` times (a challenger must beat it by that
margin: two thoughts with near-equal tallies would otherwise swap places every few tokens, and every swap reloads a
thought into every layer). Ties are broken the same way everywhere (`ranked`), so a row chooses in a batch as it
would alone.
"""

from __future__ import annotations

import torch

RANK_QUANTUM = 1e-4  # scores closer than this rank as equal: float noise of a batch's padding must not flip a choice


def ranked(scores: torch.Tensor) -> torch.Tensor:
    """Indices of `scores` (..., n) from highest to lowest, ties (within RANK_QUANTUM) to the lowest index. topk leaves
    ties unordered, and summary picks and votes meet exact ties (a thought repeating earlier text scores 0 throughout)
    and near ties (the same row in another batch computes through other padding): either would make a row choose
    differently in a batch than alone."""
    return torch.sort(torch.round(scores / RANK_QUANTUM), dim=-1, descending=True, stable=True).indices


NORM_EPS = 1e-12  # as torch.nn.functional.normalize's: a key at the mean (a lone thought) centres to zero


class RowIndex:
    """What zoomr's indexes share: each row's count of finished thoughts, rows padded to the most (`width`), which
    entries are real (`valid`), and how much room a growth adds (`room`). Each index gives its `keys()`
    (L, B, Hkv, T, ...)."""

    GROW = 8  # thoughts of room at least per growth (or a quarter more)

    def __init__(self, batch: int):
        self.count = [0] * batch  # per row, its finished thoughts

    @property
    def width(self) -> int:
        return max(self.count)

    def valid(self) -> torch.Tensor:
        """(B, T): which of `keys()` are real thoughts."""
        count = torch.tensor(self.count, device=self.keys().device)
        return torch.arange(self.width, device=count.device) < count[:, None]

    def room(self, n: int) -> int:
        """Thoughts of room after a growth at `n` thoughts."""
        return n + max(self.GROW, n // 4)


class ThoughtIndex(RowIndex):
    """Every layer's index keys over every row's finished thoughts, centred and made unit length as the votes read
    them: `keys()` (L, B, Hkv, T, d), rows padded to the most thoughts, `valid()` (B, T).

    Centring subtracts the mean over each row's real thoughts; unit length stops a long key from winning on its norm
    alone. What every thought's summary shares (the words of the task that recur in each note, the common direction of
    a head's keys) scores the same for all thoughts and only decides which thought wins when the query is about
    nothing in particular: the thought that stated those words first then collects the votes. Removing the mean leaves
    what tells thoughts apart.

    A row's next thought moves its mean, so the raw keys must stay recoverable: the index keeps each row's mean
    (L, B, Hkv, d) and each key's centred length (L, B, Hkv, T) beside the unit keys, and `raw` undoes both. One
    copy of the keys on the device, not a raw list and a centred stack (6 MB of 432 at the capacity workload's 12
    zoomr rows). Every update touches its own row only, so a row scores the same in a batch as alone.
    """

    def __init__(self, batch: int):
        super().__init__(batch)
        self.unit = self.mean = self.norm = None  # (L, B, Hkv, room, d), (L, B, Hkv, d), (L, B, Hkv, room)

    def add(self, b: int, key: torch.Tensor) -> None:
        """Row b's next thought's index key of every layer (L, Hkv, d); the row's keys are centred again."""
        n, key = self.count[b], key.float()  # fp32 whatever the model's dtype: `raw` round trips once per thought
        if self.unit is None or n == self.unit.shape[3]:
            self._grow(key, n)
        raw = torch.cat([self.raw(b), key[:, :, None]], 2)  # (L, Hkv, n + 1, d)
        mean = raw.mean(2, keepdim=True)
        norm = torch.linalg.vector_norm(raw - mean, dim=-1)  # (L, Hkv, n + 1)
        self.unit[:, b, :, : n + 1] = (raw - mean) / norm.clamp(min=NORM_EPS)[..., None]
        self.norm[:, b, :, : n + 1], self.mean[:, b] = norm, mean[:, :, 0]
        self.count[b] = n + 1

    def raw(self, b: int) -> torch.Tensor:
        """Row b's index keys as `add` received them (L, Hkv, n, d), to float rounding."""
        n = self.count[b]
        if self.unit is None:
            return torch.zeros(0)
        return self.unit[:, b, :, :n] * self.norm[:, b, :, :n, None].clamp(min=NORM_EPS) + self.mean[:, b, :, None]

    def keys(self) -> torch.Tensor:
        """The centred unit keys (L, B, Hkv, T, d), T the most thoughts of any row (a view)."""
        return self.unit[:, :, :, : self.width]

    def layer_bytes(self) -> int:
        """One layer's share of the index: its keys, lengths and means for the thoughts held (not the spare room)."""
        if self.unit is None:
            return 0
        _, b, h, _, d = self.unit.shape
        return (b * h * self.width * (d + 1) + b * h * d) * self.unit.element_size() + b * self.width

    def _grow(self, like: torch.Tensor, n: int) -> None:
        layers, heads, d = like.shape
        room = self.room(n)
        old = (self.unit, self.norm)
        self.unit = like.new_zeros(layers, len(self.count), heads, room, d)
        self.norm = like.new_zeros(layers, len(self.count), heads, room)
        if old[0] is None:
            self.mean = like.new_zeros(layers, len(self.count), heads, d)
        else:
            self.unit[:, :, :, :n], self.norm[:, :, :, :n] = old[0], old[1]


class BoundsIndex(RowIndex):
    """`zoom_index=bounds`: each thought's keys summed up per layer and KV head as the lowest and highest value of every
    channel (after RoPE, as attention sees them), `keys()` (L, B, Hkv, T, 2d) lows then highs, in the model's dtype.
    A query q's largest possible score against any key of the thought is sum_i max(q_i lo_i, q_i hi_i) (the bound
    Quest scores pages by): a thought where some key answers the query scores high whatever its other keys hold,
    where the mean of a few summary keys averages that key away."""

    def __init__(self, batch: int):
        super().__init__(batch)
        self.bounds = None  # (L, B, Hkv, room, 2d)

    def add(self, b: int, key: torch.Tensor) -> None:
        """Row b's next thought's bounds of every layer (L, Hkv, 2d)."""
        n = self.count[b]
        if self.bounds is None or n == self.bounds.shape[3]:
            layers, heads, d2 = key.shape
            grown = key.new_zeros(layers, len(self.count), heads, self.room(n), d2)
            if self.bounds is not None:
                grown[:, :, :, :n] = self.bounds
            self.bounds = grown
        self.bounds[:, b, :, n] = key
        self.count[b] = n + 1

    def keys(self) -> torch.Tensor:
        """The lows then highs (L, B, Hkv, T, 2d), T the most thoughts of any row (a view)."""
        return self.bounds[:, :, :, : self.width]

    def layer_bytes(self) -> int:
        """One layer's share of the index: the bounds of the thoughts held (not the spare room)."""
        if self.bounds is None:
            return 0
        _, b, h, _, d2 = self.bounds.shape
        return b * h * self.width * d2 * self.bounds.element_size()


def bound_votes(query: torch.Tensor, bounds: torch.Tensor, valid: torch.Tensor, per_head: int) -> torch.Tensor:
    """`head_votes` over key bounds (..., Hkv, T, 2d) (`BoundsIndex`): each query head's `per_head` thoughts with the
    highest bound on its score, sum_i max(q_i lo_i, q_i hi_i), computed as q+ . hi + q- . lo."""
    *lead, hq, d = query.shape
    hkv, t = bounds.shape[-3], bounds.shape[-2]
    grouped = query.reshape(*lead, hkv, hq // hkv, d)
    lo, hi = bounds[..., :d].to(query.dtype), bounds[..., d:].to(query.dtype)
    scores = grouped.clamp(min=0) @ hi.transpose(-1, -2) + grouped.clamp(max=0) @ lo.transpose(-1, -2)
    scores = scores.reshape(*lead, hq, t).masked_fill(~valid[..., None, :], float("-inf"))
    return ranked(scores)[..., : min(per_head, t)]


def head_votes(query: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, per_head: int) -> torch.Tensor:
    """query (..., Hq, d) against index keys (..., Hkv, T, d) of the thoughts marked valid (..., T) -> each query
    head's `per_head` best thoughts (..., Hq, k), best first (k = per_head, or T when fewer). Leading dims are
    batch-like (rows; layers and rows when a whole forward votes at once); query head j·g + i reads KV head j."""
    *lead, hq, d = query.shape
    hkv, t = keys.shape[-3], keys.shape[-2]
    grouped = query.reshape(*lead, hkv, hq // hkv, d)  # each KV head's query heads side by side
    scores = (grouped @ keys.transpose(-1, -2)).reshape(*lead, hq, t)  # (..., Hq, T)
    scores = scores.masked_fill(~valid[..., None, :], float("-inf"))
    return ranked(scores)[..., : min(per_head, t)]


class Ballot:
    """The vote tally of one forward and the zoom sets it chooses, per zoom group: one group for every layer (the
    paper's consensus: votes summed over heads and layers) or one group a layer (`groups` = the layer count: each
    layer zooms in on what its own heads voted for)."""

    def __init__(self, zoom_thoughts: int, decay: float, margin: float = 0.0, groups: int = 1):
        self.zoom_thoughts, self.decay, self.margin, self.groups = zoom_thoughts, decay, margin, groups
        self.votes: torch.Tensor | None = None  # (G, B, T) votes cast in the current forward
        self.running: torch.Tensor | None = None  # (G, B, T) decayed tally of earlier forwards (decay > 0)
        self.selections = 0

    def add(self, choices: torch.Tensor, weights: torch.Tensor, thoughts: int) -> None:
        """choices (G, B, n) thought indices, weights (G, B, n): votes of each group's heads; `thoughts` the most any
        row has."""
        if self.votes is None:
            self.votes = torch.zeros(self.groups, choices.shape[1], thoughts, device=choices.device)
        self.votes.scatter_add_(2, choices, weights)

    def select(self, current: list[list[list[int]]]) -> dict[int, list[list[int]]]:
        """Close the tally: the zoom sets (per group, sorted thought indices) of every row that cast votes, by row;
        `current` is each row's zoom sets now (their thoughts count `1 + margin` times their tally)."""
        chosen: dict[int, list[list[int]]] = {}
        if self.votes is None:
            return chosen
        votes, self.votes = self.votes, None
        if self.decay > 0:  # earlier selection points' votes carry over, fading: the zoom set follows a whole question
            old = self.running if self.running is not None else votes.new_zeros(*votes.shape[:2], 0)
            grown = votes.new_zeros(votes.shape)
            grown[..., : old.shape[2]] = old
            cast = votes.sum(2, keepdim=True) > 0
            self.running = torch.where(cast, self.decay * grown + votes, grown)
        tally = self.running if self.decay > 0 else votes
        score = tally if self.margin == 0 else tally * (1 + self.margin * self._held(current, tally))
        top = ranked(score)[..., : self.zoom_thoughts]  # (G, B, c) the most-voted, ties to the earlier thought
        # one read back to the host for the whole batch: which rows voted, their top thoughts and those thoughts' tally
        cast, top_ids, top_votes = (votes.sum((0, 2)) > 0).tolist(), top.tolist(), tally.gather(2, top).tolist()
        for b in range(votes.shape[1]):
            if not cast[b]:
                continue
            chosen[b] = [sorted(i for i, v in zip(top_ids[g][b], top_votes[g][b]) if v > 0)
                         for g in range(self.groups)]
            self.selections += 1
        return chosen

    def _held(self, current: list[list[list[int]]], tally: torch.Tensor) -> torch.Tensor:
        """1.0 where a thought is in its row's zoom set of its group (`current`), else 0.0, shaped as `tally` (G, B,
        T): one scatter for the batch, each set padded with a column past the end that is dropped after."""
        t, c = tally.shape[2], self.zoom_thoughts
        at = torch.tensor([[z + [t] * (c - len(z)) for z in sets] for sets in current], device=tally.device)
        at = at.transpose(0, 1).clamp(max=t)  # (G, B, c)
        return tally.new_zeros(*tally.shape[:2], t + 1).scatter_(2, at, 1.0)[..., :t]
