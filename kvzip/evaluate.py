"""Teacher-forced quality of a cache method against the full cache, on the same tokens.

A prefix is prefilled into the method's cache, then the rest of the text is fed `chunk` tokens at a time (1 = as in
decoding, so decode-time compression is exercised exactly as in generation). At every fed position we keep the log
probabilities of the next token. Against the full cache on the same text this gives: perplexity, top-1 agreement,
and mean KL(full || method). It is the measure that a small model's weak reasoning cannot hide.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvzip.engine import _sync


@dataclass
class Reference:
    """The full cache's view of a text: greedy next tokens and log-probabilities (fp16 to halve memory)."""

    ids: torch.Tensor  # (T,) the text
    prefix: int
    logprobs: torch.Tensor  # (T - prefix, V) next-token log-probs at positions prefix-1 .. T-2
    top1: torch.Tensor  # (T - prefix,)


@torch.inference_mode()
def forced_logprobs(model, ids: torch.Tensor, cache, prefix: int, chunk: int = 1, on_progress=None):
    """Log-probs (T - prefix, V) of each next token, feeding ids[prefix:] through `cache` `chunk` tokens at a time.

    The prefill's last position predicts token `prefix`; every fed chunk predicts the tokens after it.
    Returns (logprobs, memory-after-last-step, seconds spent in forwards after the prefill).
    """
    import time

    device = model.device
    ids = ids.to(device)
    total = ids.shape[0]
    out = []
    kwargs = cache.model_kwargs()
    logits = model(input_ids=ids[None, :prefix], cache=cache, logits_to_keep=1, **kwargs).logits[0, -1:]
    out.append(torch.log_softmax(logits.float(), -1).half())
    _sync(device)
    t0 = time.perf_counter()
    pos = prefix
    while pos < total - 1:
        end = min(pos + chunk, total - 1)
        positions = torch.arange(pos, end, device=device)[None]
        logits = model(input_ids=ids[None, pos:end], position_ids=positions, cache=cache, **kwargs).logits[0]
        out.append(torch.log_softmax(logits.float(), -1).half())
        pos = end
        if on_progress is not None:
            on_progress(end - prefix, total - 1 - prefix)
    _sync(device)
    return torch.cat(out).cpu(), cache.memory(), time.perf_counter() - t0


def reference(model, ids: torch.Tensor, full_cache, prefix: int, chunk: int = 1, on_progress=None) -> Reference:
    logprobs, _, _ = forced_logprobs(model, ids, full_cache, prefix, chunk, on_progress)
    return Reference(ids.cpu(), prefix, logprobs, logprobs.argmax(-1))


def compare(ref: Reference, logprobs: torch.Tensor) -> dict:
    """Perplexity, top-1 agreement with the full cache and mean KL(full || method) over the fed positions."""
    targets = ref.ids[ref.prefix :]  # token predicted at each position
    nll = -logprobs.float().gather(-1, targets[:, None]).squeeze(-1)
    p_full = ref.logprobs.float()
    kl = (p_full.exp() * (p_full - logprobs.float())).sum(-1)
    return {
        "ppl": round(math.exp(nll.mean().item()), 4),
        "top1_agreement": round((logprobs.argmax(-1) == ref.top1).float().mean().item(), 4),
        "kl": round(kl.clamp(min=0).mean().item(), 5),
        "positions": int(targets.shape[0]),
    }
