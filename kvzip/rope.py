"""RoPE turned back (and forth) outside the model: for zoomr's content-space index and fadkv's pre-RoPE keys."""

from __future__ import annotations

import torch

from kvzip.errors import UserError


def angles(pos: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (..., d/2) of the RoPE angles pos * inv_freq[i] at positions pos (...)."""
    ang = pos.float()[..., None] * inv_freq.float()
    return ang.cos(), ang.sin()


def turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama-style rotary on fp32 x (..., d): channel i pairs with i + d/2 and each pair turns by the angle whose cos
    and sin (..., d/2) are given (negate sin to turn back). Written half by half, no concatenated copies."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = x.new_empty(*torch.broadcast_shapes(x.shape[:-1], cos.shape[:-1]), x.shape[-1])
    torch.mul(x1, cos, out=out[..., :half]).addcmul_(x2, sin, value=-1.0)
    torch.mul(x2, cos, out=out[..., half:]).addcmul_(x1, sin)
    return out


def unrotate(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Undo RoPE: x (..., n, d) rotated at positions pos (n,) (or x (B, ..., d) with pos (B,)) back to its content.

    Turning back by the same angle gives the vector as the projection wrote it, so dot products no longer depend on
    the two positions.
    """
    cos, sin = angles(pos, inv_freq)
    return turn(x.float(), cos, -sin).to(x.dtype)


def rotate(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Apply RoPE at positions pos: the inverse of `unrotate`."""
    cos, sin = angles(pos, inv_freq)
    return turn(x.float(), cos, sin).to(x.dtype)


def rope_frequencies(model, what: str = "zoomr index_space=content and pick=novel") -> torch.Tensor:
    """The model's RoPE inverse frequencies (d/2,); UserError (naming `what` needs them) for a model without plain RoPE."""
    rotary = getattr(getattr(model, "model", model), "rotary_emb", None)
    inv_freq = getattr(rotary, "inv_freq", None)
    if inv_freq is None or getattr(rotary, "attention_scaling", 1.0) != 1.0:
        raise UserError(f"{what} needs a model with plain RoPE (a rotary_emb with inv_freq)")
    return inv_freq
