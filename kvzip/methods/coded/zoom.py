"""Zoom on codes (fadkv's `zoom` option): the codes are the index, and the chunks they weigh most come back exact.

ZoomR's multi-granularity retrieval over FAD-KV's codes. Every old token stays coded on the device, as fadkv keeps
it, and every token's exact key and value (after RoPE, as attention reads them) also go to a detail tier off the
device (`HostDetail`: pinned host memory on CUDA, a plain copy on the CPU). At each decode step a layer scores its
coded tokens as fadkv does, sums the softmax weights per chunk of `zoom_chunk` positions over its query heads, and,
for each row, attends to its `zoom` heaviest chunks on their exact keys and values instead of their codes: their coded
columns are masked and the exact ones join the same softmax. The chunks come back for the step and go; the device
holds the codes, the dense sinks and buffer, and one step's `zoom x zoom_chunk` tokens (counted on the device tier).

The codes make a better index than zoomr's summary tokens (which keep a few tokens of each thought): every token
keeps a code, so the chunk a query needs is found, and the chunks not zoomed still answer through their codes. At a
device budget of 0.25 of a 2,048-token output (4 rows, 75 key positions, docs/decisions.md) `zoom=4` scored key top-1
0.960 and key KL 0.015, where fadkv alone scored 0.800 and 0.124 and window 0.760 and 0.214.

The choice is made within the step, from this step's query: on a GPU that is one read of the chosen positions back to
the host a layer and step (the one value this path reads back; the widths come from the detail's length, a Python
number), and a host-to-device copy of the chosen keys and values.
"""

from __future__ import annotations

import torch

from kvzip.methods.base import tensor_bytes
from kvzip.methods.coded.attend import LayerInputs, Tiers, allowed_tokens, coded_key_scores, coded_value_sum
from kvzip.rope import Rope


class HostDetail:
    """Every token's exact keys and values (B, H, P, d), column p holding position p, off the compute device; the
    store doubles when full."""

    def __init__(self):
        self.keys = self.values = None
        self.length = 0

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The next positions' keys and values (B, H, n, d), as the layer was handed them."""
        n = keys.shape[2]
        if self.keys is None or self.length + n > self.keys.shape[2]:
            width = max(2 * (self.length + n), 1024)
            pinned = keys.device.type == "cuda"
            grown = [torch.empty(*x.shape[:2], width, x.shape[3], dtype=x.dtype, pin_memory=pinned)
                     for x in (keys, values)]
            if self.keys is not None:
                for new, old in zip(grown, (self.keys, self.values)):
                    new[:, :, : self.length] = old[:, :, : self.length]
            self.keys, self.values = grown
        for store, x in zip((self.keys, self.values), (keys, values)):
            store[:, :, self.length : self.length + n].copy_(x, non_blocking=True)
        self.length += n

    def gather(self, positions: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (B, H, Z, d) at `positions` (B, Z), on `device` (a position past the store reads its last
        column: the caller masks it)."""
        at = positions.to(self.keys.device).clamp(0, self.length - 1)
        b, h, _, d = self.keys.shape
        at = at[:, None, :, None].expand(b, h, at.shape[1], d)
        return tuple(x.gather(2, at).to(device, non_blocking=True) for x in (self.keys, self.values))

    def bytes(self) -> int:
        """What the stored positions hold (the store's spare columns are not counted)."""
        if self.keys is None:
            return 0
        return tensor_bytes(self.keys[:, :, : self.length], self.values[:, :, : self.length])


def zoomed_attention(query, mask, scaling, tiers: Tiers, key_mean: torch.Tensor | None, rope: Rope | None,
                     inputs: LayerInputs, detail: HostDetail, zoom: int, chunk: int) -> torch.Tensor:
    """One decode query (B, Hq, 1, d) -> (B, 1, Hq, d): fadkv's attention over the coded and dense tiers, with each
    row's `zoom` chunks of `chunk` positions that the coded attention weighs most read exact from `detail`."""
    b, hq, _, d = query.shape
    t, h = tiers.coded_pos.shape[1], tiers.keys.shape[1]
    qg = query.float().reshape(b, h, hq // h, d) * scaling  # query heads grouped under their KV head
    dense_scores = qg @ tiers.keys.float().transpose(-1, -2)  # (B, H, G, S)
    coded_scores = coded_key_scores(qg, tiers.coded_keys, key_mean, rope, inputs)  # (B, H, G, T)
    pos = tiers.coded_pos  # (B, T), -1 a hole
    allowed = allowed_tokens(mask, torch.cat([pos, tiers.positions], 1), 1, t + tiers.positions.shape[1],
                             query.device)[:, None]  # (B, 1, 1, T + S)
    seen = allowed[:, 0, 0, :t]  # the coded columns this query may see

    # the chunks: softmax weights of the coded tokens summed per chunk over the layer's query heads
    w = torch.softmax(torch.cat([coded_scores, dense_scores], -1).masked_fill(~allowed, float("-inf")), -1)
    chunk_of = pos.clamp(min=0) // chunk
    mass = w[..., :t].nan_to_num(0.0).sum((1, 2)) * seen  # (B, T)
    per = mass.new_zeros(b, detail.length // chunk + 1).scatter_add_(1, chunk_of, mass)  # no read of the positions
    top = per.topk(min(zoom, per.shape[1]), dim=1).indices  # (B, k)

    # each chosen chunk's positions, and the coded column each one is at (-1: not coded, or not visible)
    column = pos.new_full((b, detail.length + chunk + 1), -1)
    column.scatter_(1, pos.clamp(min=0), torch.where(pos >= 0, torch.arange(t, device=pos.device), -1))
    zpos = (top[:, :, None] * chunk + torch.arange(chunk, device=pos.device)).flatten(1)  # (B, Z)
    zcol = column.gather(1, zpos)
    zoomed = (zcol >= 0) & seen.gather(1, zcol.clamp(min=0))
    hidden = torch.zeros_like(seen)
    rows = torch.arange(b, device=pos.device)[:, None].expand_as(zcol)
    hidden[rows[zoomed], zcol[zoomed]] = True

    exact_k, exact_v = (x.float() for x in detail.gather(zpos, query.device))  # (B, H, Z, d)
    zoomed_scores = (qg @ exact_k.transpose(-1, -2)).masked_fill(~zoomed[:, None, None], float("-inf"))
    scores = torch.cat([coded_scores.masked_fill((hidden | ~seen)[:, None, None], float("-inf")), zoomed_scores,
                        dense_scores.masked_fill(~allowed[..., t:], float("-inf"))], -1)
    w = torch.softmax(scores, -1).nan_to_num(0.0)  # a left-padding query sees nothing: zero weights, not NaN
    z = zpos.shape[1]
    out = w[..., t + z :] @ tiers.values.float() + w[..., t : t + z] @ exact_v + coded_value_sum(w[..., :t],
                                                                                               tiers.coded_values)
    return out.reshape(b, hq, 1, d).transpose(1, 2).to(query.dtype).contiguous()
