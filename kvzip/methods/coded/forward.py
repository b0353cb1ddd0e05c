"""What one forward hands every fadkv or lexico layer: `CodedState`, built once by `FadkvCache.before_forward`.

Per layer that has coded tokens, a `kvzip.methods.coded.attend.LayerInputs`: whether its attention runs in the fused
kernel this forward and what that path needs, computed here once for all the layers that share it rather than by
whichever layer attends first: the rows' first visible positions (one per device; the one read back to the host,
before the forward), RoPE's cos and sin table for the kernel (kept by the cache across forwards, per RoPE and device,
grown by 1,024 positions when outgrown) and RoPE's turns at the coded tokens' positions for the pre-RoPE reference
(per RoPE, window, coded width and device: layers with the same RoPE and window code the same positions).
"""

from __future__ import annotations

import typing

import torch

from kvzip.methods.base import ForwardState
from kvzip.methods.coded.attend import LayerInputs
from kvzip.rope import Rope, angles, phasors

if typing.TYPE_CHECKING:
    from kvzip.methods.coded.layer import FadkvLayer

NOTHING = LayerInputs()  # a layer with nothing coded yet attends over its dense tier and needs no table


class CodedState(ForwardState):
    """`ForwardState` plus `inputs`: layer index -> its `LayerInputs` for this forward (`of(idx)`)."""

    def __init__(self, attention_mask: torch.Tensor | None, new_tokens: int):
        super().__init__(attention_mask, new_tokens)
        self.inputs: dict[int, LayerInputs] = {}

    def of(self, layer_idx: int) -> LayerInputs:
        return self.inputs.get(layer_idx, NOTHING)

    @classmethod
    def build(cls, layers: list["FadkvLayer"], attention_mask: torch.Tensor | None, new_tokens: int,
              rope_tables: dict) -> "CodedState":
        """The state for a forward of `new_tokens` under the 2D mask (B, past + new_tokens), 1 for a visible token.
        `rope_tables` is the cache's (RoPE id, device) -> cos and sin table, grown here when a forward outgrows it."""
        state = cls(attention_mask, new_tokens)
        first: dict[torch.device, torch.Tensor | None] = {}
        turns: dict[tuple, torch.Tensor] = {}
        for layer in layers:
            if not layer.is_initialized or layer.coded_pos.shape[1] == 0:
                continue
            device, rope = layer.keys.device, layer.rope
            if new_tokens == 1 and layer.fused():
                if layer.sliding is None and device not in first:
                    first[device] = first_visible(attention_mask, layer.batch, device)
                cos_sin = None if rope is None else rope_table(rope_tables, rope, layer.seen + new_tokens, device)
                state.inputs[layer.idx] = LayerInputs(True, first.get(device) if layer.sliding is None else None,
                                                      cos_sin, mean=layer.kernel_mean)
            elif rope is not None:
                key = (id(rope), layer.sliding, layer.coded_pos.shape[1], layer.coded_pos.device)
                if key not in turns:
                    turns[key] = phasors(layer.coded_pos, rope)
                state.inputs[layer.idx] = LayerInputs(turns=turns[key])
        return state


def first_visible(attention_mask: torch.Tensor | None, batch: int, device) -> torch.Tensor | None:
    """(B,) each row's first visible position when the 2D mask (B, P) (1 or True: visible; None: every position)
    hides exactly the positions before it (the engine's left padding), so that the kernel can tell what a query sees
    from the tokens' positions; None for any other mask."""
    if attention_mask is None:
        return torch.zeros(batch, dtype=torch.long, device=device)
    seen = attention_mask.bool()
    first = (~seen).long().cumprod(-1).sum(-1)  # hidden positions before the first visible one
    exact = bool((seen == (torch.arange(seen.shape[-1], device=seen.device) >= first[:, None])).all())
    return first.expand(batch).contiguous().to(device) if exact else None


def rope_table(tables: dict, rope: Rope, seen: int, device) -> torch.Tensor:
    """(P, 2, dim/2) fp32: RoPE's scaled cos and sin at every position up to `seen`, kept in `tables` across forwards
    and grown by 1,024 positions when outgrown."""
    key = (id(rope), device)
    table = tables.get(key)
    if table is None or table.shape[0] < seen:
        cos, sin = angles(torch.arange(seen + 1024, device=device), rope.inv_freq)
        table = tables[key] = torch.stack([cos, sin], 1).mul_(rope.scale).contiguous()
    return table
