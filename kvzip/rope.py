"""RoPE turned back (and forth) outside the model: for zoomr's content-space index and fadkv's pre-RoPE keys."""

from __future__ import annotations

import torch

from kvzip.errors import UserError


def angles(pos: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (..., d/2) of the RoPE angles pos * inv_freq[i] at positions pos (...)."""
    ang = pos.float()[..., None] * inv_freq.float()
    return ang.cos(), ang.sin()


def to_pairs(x: torch.Tensor) -> torch.Tensor:
    """x (..., d) with channels reordered so that each RoPE pair (i, i + d/2) sits side by side. Viewed as d/2
    complex numbers, a vector in this order turns by one complex product with `phasors` (on CPU ~3x faster than
    `turn`'s four ops), and dot products between two vectors in the same order are unchanged."""
    return x.unflatten(-1, (2, x.shape[-1] // 2)).transpose(-1, -2).flatten(-2)


def from_pairs(x: torch.Tensor) -> torch.Tensor:
    """The inverse of `to_pairs`: back to the model's channel order."""
    return x.unflatten(-1, (x.shape[-1] // 2, 2)).transpose(-1, -2).flatten(-2)


def turn_pairs(x: torch.Tensor, turns: torch.Tensor) -> torch.Tensor:
    """Turn x (..., d), fp32 contiguous and in `to_pairs` order, in place by `phasors` (..., d/2); returns x."""
    torch.view_as_complex(x.view(*x.shape[:-1], x.shape[-1] // 2, 2)).mul_(turns)
    return x


def phasors(pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """exp(i · pos · inv_freq) (..., d/2) complex64: the RoPE turn at positions pos (...), for vectors in `to_pairs`
    order (the conjugate turns back)."""
    return torch.complex(*angles(pos, inv_freq))


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
