"""Key preprocessing that attention math allows, as pure functions (measured in the dictionary's RESULTS table).

- Per-head key mean. Post-RoPE: q·(k + m) = q·k + q·m shifts every score of a query by the same constant, which
  softmax ignores, so the mean can be dropped for good. Pre-RoPE: the rotation R_t makes q·R_t m depend on the
  position t, so the mean is NOT free to drop there; it is a stored offset added back before rotating. Either way
  the coder sees centred keys, which carry far less energy (the mean holds ~59% of SmolLM2's key energy).
  Never for values: a constant added to every value shifts the attention output.
- Per-channel key scale: q·k = (q * c)·(k / c) for any positive c, so keys may be coded in a rescaled space and
  the query multiplied by c. Post-RoPE only when c is equal within each RoPE pair; pre-RoPE it is undone before
  rotating.
"""
from __future__ import annotations

import torch


def key_mean(K: torch.Tensor) -> torch.Tensor:
    """Per-head mean of keys K (Hkv, T, d). Returns (Hkv, d) fp32."""
    assert K.dim() == 3, f"K must be (Hkv, T, d), got {tuple(K.shape)}"
    return K.float().mean(dim=1)                              # (Hkv, d)


def center(K: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """K (Hkv, T, d) minus the per-head mean (Hkv, d). Returns (Hkv, T, d) in K's dtype."""
    return (K.float() - mean.float().unsqueeze(1)).to(K.dtype)


def uncenter(K: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """Inverse of `center`: (Hkv, T, d) + (Hkv, d)."""
    return (K.float() + mean.float().unsqueeze(1)).to(K.dtype)


def channel_scale(K: torch.Tensor, rope_pairs: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Per-channel RMS of keys K (Hkv, T, d) over heads and tokens, normalised to geometric mean 1. Returns (d,).

    With rope_pairs, channels i and i + d/2 (rotated together by RoPE in the HF llama layout) share one scale, so
    the scaling commutes with the rotation.
    """
    d = K.shape[-1]
    ms = K.float().pow(2).reshape(-1, d).mean(0)              # (d,)
    if rope_pairs:
        half = ms.view(2, d // 2).mean(0)                     # (d/2,)
        ms = torch.cat([half, half])
    c = (ms + eps).sqrt()
    return c / c.log().mean().exp()
