"""Each layer's position handling, reproduced outside the model: its RoPE and its sliding window.

zoomr's content-space index and fadkv's pre-RoPE keys turn keys back (and forth) by the rotary embedding, and a
method that evicts or codes tokens must know which tokens a sliding-window layer can still see. Both differ by layer
in the families people run: Gemma 3 has sliding-window layers with their own RoPE base beside global ones, Phi-3
turns only part of each head (`partial_rotary_factor`), yarn scales the turned channels. So everything here is per
layer, read once from the loaded model (`layer_ropes`, `attention_windows`), and anything that cannot be reproduced
is refused in one line naming what the model lacks.

A `Rope` turns channels [0, dim) Llama-style, channel i paired with i + dim/2 (transformers' `rotate_half`), by the
angle pos · inv_freq[i], scaled by `scale`; channels from dim on pass through unturned.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvzip.errors import UserError

# Rope types whose angles are fixed by the loaded inv_freq and attention scaling. "dynamic" and "longrope" recompute
# the frequencies from the current sequence length inside the model's forward, which a cache cannot follow.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")


@dataclass(frozen=True, eq=False)
class Rope:
    """One layer's rotary embedding: inv_freq (dim/2,) and the factor the turned channels are multiplied by."""

    inv_freq: torch.Tensor
    scale: float = 1.0

    @property
    def dim(self) -> int:
        return 2 * self.inv_freq.numel()


def as_rope(rope: Rope | torch.Tensor) -> Rope:
    """A Rope, or a bare inv_freq (dim/2,) taken as an unscaled RoPE over its 2 * len channels."""
    return rope if isinstance(rope, Rope) else Rope(rope)


def angles(pos: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (..., dim/2) of the RoPE angles pos * inv_freq[i] at positions pos (...)."""
    ang = pos.float()[..., None] * inv_freq.float()
    return ang.cos(), ang.sin()


def to_pairs(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """x (..., d) with the first `dim` channels (default all) reordered so that each RoPE pair (i, i + dim/2) sits
    side by side; the rest follow unchanged. Viewed as dim/2 complex numbers, the turned part of a vector in this
    order turns by one complex product with `phasors` (on CPU ~3x faster than `turn`'s four ops), and dot products
    between two vectors in the same order are unchanged."""
    dim = x.shape[-1] if dim is None else dim
    turned = x[..., :dim].unflatten(-1, (2, dim // 2)).transpose(-1, -2).flatten(-2)
    return turned if dim == x.shape[-1] else torch.cat([turned, x[..., dim:]], -1)


def from_pairs(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The inverse of `to_pairs`: back to the model's channel order."""
    dim = x.shape[-1] if dim is None else dim
    turned = x[..., :dim].unflatten(-1, (dim // 2, 2)).transpose(-1, -2).flatten(-2)
    return turned if dim == x.shape[-1] else torch.cat([turned, x[..., dim:]], -1)


def turn_pairs(x: torch.Tensor, turns: torch.Tensor) -> torch.Tensor:
    """Turn x (..., d), fp32 contiguous and in `to_pairs` order, in place by `phasors` (..., dim/2) over its first
    dim = 2 * turns.shape[-1] channels; returns x."""
    dim = 2 * turns.shape[-1]
    torch.view_as_complex(x[..., :dim].unflatten(-1, (dim // 2, 2))).mul_(turns)
    return x


def phasors(pos: torch.Tensor, rope: Rope | torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """scale · exp(i · pos · inv_freq) (..., dim/2) complex64: the layer's RoPE at positions pos (...), for vectors
    in `to_pairs` order; `inverse` gives the turn back, exp(-i · pos · inv_freq) / scale."""
    rope = as_rope(rope)
    cos, sin = angles(pos, rope.inv_freq)
    if inverse:
        return torch.complex(cos, -sin) / rope.scale
    return torch.complex(cos, sin) * rope.scale


def turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama-style rotary on fp32 x (..., d): over the first dim = 2 * cos.shape[-1] channels, channel i pairs with
    i + dim/2 and each pair turns by the angle whose cos and sin (..., dim/2) are given (scaled: any factor in them
    multiplies the turned channels); the other channels are copied. Written half by half, no concatenated copies."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half: 2 * half]
    out = x.new_empty(*torch.broadcast_shapes(x.shape[:-1], cos.shape[:-1]), x.shape[-1])
    torch.mul(x1, cos, out=out[..., :half]).addcmul_(x2, sin, value=-1.0)
    torch.mul(x2, cos, out=out[..., half: 2 * half]).addcmul_(x1, sin)
    if 2 * half < x.shape[-1]:
        out[..., 2 * half:] = x[..., 2 * half:]
    return out


def unrotate(x: torch.Tensor, pos: torch.Tensor, rope: Rope | torch.Tensor) -> torch.Tensor:
    """Undo a layer's RoPE: x (..., n, d) rotated at positions pos (n,) (or x (B, ..., d) with pos (B,)) back to its
    content. Turning back by the same angle (and dividing out the scale) gives the vector as the projection (and
    the model's key norm, where it has one) wrote it, so dot products no longer depend on the two positions."""
    rope = as_rope(rope)
    cos, sin = angles(pos, rope.inv_freq)
    return turn(x.float(), cos / rope.scale, -sin / rope.scale).to(x.dtype)


def rotate(x: torch.Tensor, pos: torch.Tensor, rope: Rope | torch.Tensor) -> torch.Tensor:
    """Apply a layer's RoPE at positions pos: the inverse of `unrotate`."""
    rope = as_rope(rope)
    cos, sin = angles(pos, rope.inv_freq)
    return turn(x.float(), cos * rope.scale, sin * rope.scale).to(x.dtype)


def layer_ropes(model, what: str) -> list[Rope]:
    """Each layer's `Rope` as the loaded model applies it; UserError (saying that `what` needs it) when the model has
    no rotary embedding kvzip can read, or one whose angles depend on the sequence length."""
    cfg = model.config.get_text_config(decoder=True)
    rotary = getattr(getattr(model, "model", model), "rotary_emb", None)
    kinds = getattr(rotary, "rope_type", None)
    ropes, shared = [], {}  # layers of one type share one Rope object (fadkv shares its RoPE tables by it)
    for i in range(cfg.num_hidden_layers):
        if isinstance(kinds, dict):  # one rotary per layer type (Gemma 3: sliding and full attention)
            layer_type = cfg.layer_types[i]
            kind = kinds.get(layer_type)
            inv_freq = getattr(rotary, f"{layer_type}_inv_freq", None)
            scale = getattr(rotary, f"{layer_type}_attention_scaling", 1.0)
        else:
            kind, inv_freq, scale = kinds, getattr(rotary, "inv_freq", None), getattr(rotary, "attention_scaling", 1.0)
        if inv_freq is None or kind is None:
            raise UserError(f"{what} needs a model with rotary position embeddings kvzip can read (model.rotary_emb "
                            f"with inv_freq); {type(model).__name__} has none")
        if kind not in STATIC_ROPE_TYPES:
            raise UserError(f"{what} cannot reproduce this model's RoPE: rope_type '{kind}' changes its angles with the "
                            f"sequence length (supported: {', '.join(STATIC_ROPE_TYPES)})")
        key = (kind, id(inv_freq), float(scale))
        if key not in shared:
            shared[key] = Rope(inv_freq.float(), float(scale))
        ropes.append(shared[key])
    return ropes


def attention_windows(model, what: str | None = None) -> list[int | None]:
    """Each layer's sliding window (tokens a query sees, itself included) or None for full attention, by the rule
    transformers' own cache follows. With `what` (a method that attends itself), layer types other than these two
    (chunked, linear attention) and soft-capped attention logits are refused in one line naming them; without it
    other types count as sliding with their chunk or window size."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    cfg = model.config.get_text_config(decoder=True)
    types, kwargs = get_layer_types_and_kwargs(cfg)
    other = sorted(set(types) - {"full_attention", "sliding_attention"})
    if what is not None and other:
        raise UserError(f"{what} handles full-attention and sliding-window layers; this model also has "
                        f"{', '.join(other)} layers")
    if what is not None and getattr(cfg, "attn_logit_softcapping", None):  # Gemma 2: tanh-capped attention logits
        raise UserError(f"{what} computes attention without logit soft-capping; this model caps its attention "
                        "logits (attn_logit_softcapping)")
    return [kw.get("sliding_window") if t != "full_attention" else None for t, kw in zip(types, kwargs)]


def visible_from(seen: int, window: int | None) -> int:
    """The first position a sliding-window layer's next query can still see after `seen` tokens (0 for full
    attention): the query at position `seen` sees positions p with seen - p < window."""
    return 0 if window is None else max(seen - window + 1, 0)


def full_tokens(seen: int, window: int | None) -> int:
    """Tokens a full cache holds for a layer after `seen` tokens: all of them, or on a sliding-window layer the last
    window - 1 (what transformers' own sliding layer keeps, and all the next query can see)."""
    return seen if window is None else min(seen, window - 1)
