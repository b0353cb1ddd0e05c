"""RoPE turned back (and forth) outside the model: for zoomr's content-space index and fadkv's pre-RoPE keys."""

from __future__ import annotations

import torch

from kvzip.errors import UserError


def unrotate(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Undo RoPE: x (..., n, d) rotated at positions pos (n,) (or x (B, ..., d) with pos (B,)) back to its content.

    Llama-style rotary pairs channel i with i + d/2 and turns each pair by pos * inv_freq[i]; turning back by the same
    angle gives the vector as the projection wrote it, so dot products no longer depend on the two positions.
    """
    ang = pos.float()[..., None] * inv_freq.float()                       # (..., d/2)
    ang = torch.cat([ang, ang], -1)                                       # (..., d)
    cos, sin = ang.cos(), ang.sin()
    half = x.shape[-1] // 2
    turned = torch.cat([x[..., half:], -x[..., :half]], -1)               # -rotate_half(x)
    return (x.float() * cos + turned.float() * sin).to(x.dtype)


def rotate(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Apply RoPE at positions pos: the inverse of `unrotate` (turning back by -pos is turning forward by pos)."""
    return unrotate(x, -pos, inv_freq)


def rope_frequencies(model, what: str = "zoomr index_space=content and pick=novel") -> torch.Tensor:
    """The model's RoPE inverse frequencies (d/2,); UserError (naming `what` needs them) for a model without plain RoPE."""
    rotary = getattr(getattr(model, "model", model), "rotary_emb", None)
    inv_freq = getattr(rotary, "inv_freq", None)
    if inv_freq is None or getattr(rotary, "attention_scaling", 1.0) != 1.0:
        raise UserError(f"{what} needs a model with plain RoPE (a rotary_emb with inv_freq)")
    return inv_freq
