"""Learn a model's KVDictionary from captured KV vectors: per layer one key and one value dictionary, plus held-out error.

This is the tensor half of `kvzip train-dict` (the CLI captures the vectors and shows progress). Per layer:
keys have their per-(layer, KV head) mean m removed before coding, since the mean holds most of a key's energy
(~59% for SmolLM2) and the coder does better on what is left. The mean is stored as `key_mean`. Post-RoPE,
q·(k + m) = q·k + q·m shifts every score of a query by the same constant, which softmax ignores, so a cache may drop
it; pre-RoPE the rotation R_t makes q·R_t m depend on the position t, so it is added back before rotating. Values
are coded as they are (a constant added to every value would shift the attention output). A random subsample of at most `samples` training vectors per layer and kind is used for learning (the
learning cost is linear in it; 16k vectors is where the previous measurements stopped improving much). The held-out
error is measured with the coder and sparsity the cache will use (`heldout_coder`), on atoms rounded to the dtype the file stores
(what a loader will see), both against the coded (centred) key and against the raw key's norm: the second is the
number that matters for attention, and the honest one to compare centred with uncentred coding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kvzip.sparse.learn import TINY_NORM, encode, learn_dictionary, relative_error, subsample
from kvzip.sparse.omp import gram_matrix
from kvzip.sparse.screen import POOL

Progress = Callable[[int, int, dict], None]
KINDS = ("keys", "values")


@dataclass
class Trained:
    """Atoms (L, N, d) in fp32, key mean (L, Hkv, d), held-out errors per layer."""

    keys: torch.Tensor
    values: torch.Tensor
    key_mean: torch.Tensor
    key_error: list[float]          # ||k_c - D c|| / ||k_c||, k_c the centred key
    key_error_vs_raw: list[float]   # ||k_c - D c|| / ||k||
    value_error: list[float]


def heldout_coder(coder: str) -> str:
    """The coder the held-out error is measured with, for a dictionary learned with `coder` in the loop: the one
    the cache uses (fadkv's two-shot `screen` after either screening coder, lexico's `omp` after `omp`)."""
    return "omp" if coder == "omp" else "screen"


def heldout_error(X: torch.Tensor, raw: torch.Tensor, D: torch.Tensor, s: int, coder: str, n: int = POOL):
    """Mean relative error of coding X (M, d) with D (N, d): (vs ||X||, vs ||raw||). Returns two floats."""
    idx, coef = encode(X.float(), D, s, coder=coder, n=n, gram=gram_matrix(D))   # (M, s), (M, s)
    rel = relative_error(X, D, idx, coef)                                          # (M,)
    vs_raw = rel * X.float().norm(dim=1) / raw.float().norm(dim=1).clamp_min(TINY_NORM)
    return rel.mean().item(), vs_raw.mean().item()


@torch.no_grad()
def train_dictionaries(train_keys: list[torch.Tensor], train_values: list[torch.Tensor],
                       held_keys: list[torch.Tensor], held_values: list[torch.Tensor], heads: int,
                       atoms: int, s: int, iters: int, coder: str = "screen1", samples: int = 16384,
                       heldout_samples: int = 4096, seed: int = 0, store_dtype: torch.dtype = torch.float16,
                       progress: Progress | None = None) -> Trained:
    """Learn per-layer key and value dictionaries from rows (M, d) of each layer (token-major, `heads` per token).

    progress(step, total, info) after every learning iteration; total = layers * 2 * iters, info has layer, kind,
    iteration, error (training error before the update).
    """
    L = len(train_keys)
    d = train_keys[0].shape[1]
    total = L * len(KINDS) * iters
    out = {k: [] for k in ("keys", "values", "mean", "kerr", "kraw", "verr")}
    for layer in range(L):
        Kt = train_keys[layer].float().view(-1, heads, d)                          # (T, Hkv, d)
        mean = Kt.mean(0)                                                          # (Hkv, d)
        Kh = held_keys[layer].float().view(-1, heads, d)                           # (Th, Hkv, d)
        data = {
            "keys": ((Kt - mean).reshape(-1, d), (Kh - mean).reshape(-1, d), Kh.reshape(-1, d)),
            "values": (train_values[layer].float(), held_values[layer].float(), held_values[layer].float()),
        }
        for k_i, kind in enumerate(KINDS):
            X, H, H_raw = data[kind]
            done = (layer * len(KINDS) + k_i) * iters

            def step(it, _iters, info, done=done, kind=kind):
                if progress is not None:
                    progress(done + it, total, {**info, "layer": layer, "kind": kind, "iteration": it})

            D = learn_dictionary(subsample(X, samples, seed + layer), atoms, s, iters, coder=coder, seed=seed,
                                 progress=step)                                    # (N, d)
            D = D.to(store_dtype).float()                                          # what a loader will see
            pick = torch.randperm(H.shape[0], generator=torch.Generator().manual_seed(seed))[:heldout_samples]
            err, err_raw = heldout_error(H[pick], H_raw[pick], D, s, heldout_coder(coder))
            out[kind].append(D)
            if kind == "keys":
                out["mean"].append(mean)
                out["kerr"].append(err)
                out["kraw"].append(err_raw)
            else:
                out["verr"].append(err)
    return Trained(torch.stack(out["keys"]), torch.stack(out["values"]), torch.stack(out["mean"]),
                   out["kerr"], out["kraw"], out["verr"])
