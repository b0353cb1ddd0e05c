"""Teacher-forced quality of a cache method against `full`, on the same tokens, through the engine's `Stream`.

A short prompt is prefilled, then a fixed reference text is fed as if it were the model's own output, one token per
row per step, through the same hooks as generation (`cache.on_step` sees the decoded text, so a method that cuts the
output into thoughts does so exactly as when it generates). At every fed position we score the next token:
perplexity of the reference text, top-1 agreement with `full`, and KL(full || method). Rows of a batch are separate
texts of equal length. It is the measure a small model's weak reasoning cannot hide.

Key tokens (LongPPL, Fang et al., ICLR 2025): most next tokens of a long text are predicted by the last few hundred
tokens alone, so an average over every position hides what a cache lost of the distant past. `key_positions` picks
the positions where it matters: `full`'s log-probability of the true token beats a short-context reference's (the
bench runs a 256-token window with 4 sinks, `SHORT_REFERENCE`) by more than `KEY_GAIN` nats, and `full` itself gives
that token at least `KEY_FLOOR`. `Forced.scores` reports top-1, KL and perplexity on those positions beside the rest.

KL is taken over `full`'s `REFERENCE_TOP` most likely tokens plus one bucket for the rest of the vocabulary, so a
reference keeps a few hundred bytes per position instead of the whole distribution (8k positions x 49k vocab would be
800 MB a row). Merging tokens into a bucket can only lower a KL, so this is a slight, consistent underestimate.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from kvzip.engine import Stream, sync

REFERENCE_TOP = 64  # tokens of full's distribution kept per position for the KL
KEY_GAIN, KEY_FLOOR = 2.0, -2.0  # nats: LongPPL's thresholds (module docstring)
SHORT_REFERENCE = {"sinks": "4", "window": "256"}  # the short context key positions are found against (`window`)


def key_positions(full_nll: torch.Tensor, short_nll: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: where `full`'s log-probability of the true token (-full_nll) exceeds the short reference's by more
    than KEY_GAIN and is at least KEY_FLOOR."""
    return (short_nll - full_nll > KEY_GAIN) & (-full_nll >= KEY_FLOOR)


@dataclass
class Reference:
    """`full`'s view of the fed positions: greedy token and its top tokens with their log-probabilities."""

    top1: torch.Tensor  # (B, T) long
    top_ids: torch.Tensor  # (B, T, K) long
    top_logprobs: torch.Tensor  # (B, T, K) float32


@dataclass
class Forced:
    """What one teacher-forced pass measured: per-position scores (B, T) and the stream's memory report."""

    nll: torch.Tensor  # negative log-likelihood of each reference token
    top1: torch.Tensor  # the method's greedy token at each position
    kl: torch.Tensor | None  # KL(full || method) when a reference was given
    reference: Reference | None  # the pass's own top tokens, kept when asked (the `full` pass)
    report: dict
    decode_s: float  # seconds spent in the fed steps (after the prefill)

    def scores(self, ref: Reference, key: torch.Tensor | None = None) -> dict:
        """Perplexity, top-1 agreement with `ref` and mean KL over every fed position of every row; with `key`
        (B, T) bool, the same over the key positions (`key_*`, None where there are none)."""
        same = (self.top1 == ref.top1).float()
        out = {
            "ppl": round(math.exp(self.nll.mean().item()), 4),
            "top1_agreement": round(same.mean().item(), 4),
            "positions": int(self.nll.numel()),
        }
        if self.kl is not None:
            out["kl"] = round(self.kl.mean().item(), 5)
        if key is not None:
            n = int(key.sum())
            out["key_positions"] = n
            out["key_top1_agreement"] = round(same[key].mean().item(), 4) if n else None
            out["key_ppl"] = round(math.exp(self.nll[key].mean().item()), 4) if n else None
            out["key_kl"] = round(self.kl[key].mean().item(), 5) if n and self.kl is not None else None
        return out


def _coarse_kl(ref: Reference, j: int, logprobs: torch.Tensor) -> torch.Tensor:
    """KL(full || method) at position j over full's top tokens plus one bucket for the rest; logprobs (B, V)."""
    p_top = ref.top_logprobs[:, j].to(logprobs.device)  # (B, K)
    q_top = logprobs.gather(-1, ref.top_ids[:, j].to(logprobs.device))  # (B, K)
    rest = lambda lp: torch.log1p(-lp.exp().sum(-1).clamp(max=1 - 1e-6))  # noqa: E731  log of the mass outside
    p_rest, q_rest = rest(p_top), rest(q_top)
    kl = (p_top.exp() * (p_top - q_top)).sum(-1) + p_rest.exp() * (p_rest - q_rest)
    return kl.clamp(min=0)


def forced_logits(stream: Stream, prompts: list[list[int]], forced: list[list[int]], through_last: bool = False):
    """The one forced-feeding loop: prefill `prompts` (left-padded) on the engine's `stream`, then feed `forced` (B rows
    of equal length T) one token per step, each with its text to `cache.on_step` as in generation. Yields (j, logits
    (B, V)): the logits that predict forced[:, j], the prefill's for j = 0; with `through_last`, also j = T, after
    the last forced token."""
    steps = len(forced[0])
    if any(len(f) != steps for f in forced):
        raise ValueError("forced continuations must all have the same length")
    table = torch.tensor(forced)  # (B, T) on the CPU: each step's tokens go to the device with the step
    logits = stream.prefill(prompts)
    for j in range(steps + int(through_last)):
        yield j, logits
        if j + 1 < steps or (through_last and j < steps):
            logits = stream.step(table[:, j])


@torch.inference_mode()
def teacher_forced(model, tokenizer, cache, prompts: list[list[int]], forced: list[list[int]],
                   reference: Reference | None = None, keep_reference: bool = False, on_progress=None) -> Forced:
    """Prefill `prompts` (left-padded), then feed `forced` (B rows of equal length T) one token per step.

    Position j scores forced[:, j] from the logits before it (the prefill's for j = 0). With `reference`, also the
    KL against it; `keep_reference` keeps this pass's own top tokens (for the `full` pass). on_progress(done, T).
    """
    steps = len(forced[0])
    stream = Stream(model, tokenizer, cache)
    table = torch.tensor(forced)  # (B, T): the targets
    nll, top1, kl, top_ids, top_lp = [], [], [], [], []
    t0 = None
    for j, logits in forced_logits(stream, prompts, forced):
        if t0 is None:  # the prefill's logits: the fed steps start now
            sync(stream.device)
            t0 = time.perf_counter()
        logprobs = torch.log_softmax(logits.float(), -1)  # (B, V)
        target = table[:, j].to(logprobs.device)
        nll.append(-logprobs.gather(-1, target[:, None]).squeeze(-1).cpu())
        top1.append(logprobs.argmax(-1).cpu())
        if reference is not None:
            kl.append(_coarse_kl(reference, j, logprobs).cpu())
        if keep_reference:
            top = logprobs.topk(REFERENCE_TOP, dim=-1)
            top_ids.append(top.indices.cpu())
            top_lp.append(top.values.cpu())
        if on_progress is not None:
            on_progress(j + 1, steps)
    sync(stream.device)
    decode_s = time.perf_counter() - t0
    ref = Reference(torch.stack(top1, 1), torch.stack(top_ids, 1), torch.stack(top_lp, 1)) if keep_reference else None
    return Forced(torch.stack(nll, 1), torch.stack(top1, 1), torch.stack(kl, 1) if kl else None, ref,
                  stream.report(), decode_s)
