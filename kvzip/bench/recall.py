"""Recall probe: can a cache still retrieve a fact stated in an early thought after many later thoughts?

The reasoning is teacher-forced (fixed text fed token by token), so the small model's weak reasoning cannot hide what
the cache lost. Each trial: a chat prompt, then an assistant "reasoning" of paragraphs: `n_facts` short facts
("Note 2: the blue box holds the violin. So the blue box holds the violin."; stated twice, which lifts the
model's own recall with a full cache from about 0.69 to 0.75 on 16 trials), then held-out prose paragraphs
(kvzip.data.evaluation_prose, GPQA
explanations and GSM8K solutions) as filler, then a question paragraph ("Back to note 2: the blue box holds the").
The score is likelihood ranking: the trial counts as recalled when the right object is the most likely next token
among the trial's candidate objects (all single tokens; chance is 1/n_facts).

The bench's `recall` workload (`recall`) runs it at each distance of `recall_filler` (tokens of filler between the facts
and the question) with that distance's number of trials, batched `recall_batch` rows at a time; each distance reports
the recall with its 95% Wilson interval and chance. At a budget, F is of `full`'s bytes for a trial's tokens.

Feeding goes through `forced_decode`, a loop over the engine's `Stream` (prefill, then per token `cache.on_step` with
the decoded text and a one-token forward), so thought segmentation runs exactly as in generation; trials are rows of
one left-padded batch of equal forced length.

    from kvzip.bench.recall import recall_probe
    recall_probe(model, tokenizer, get_method("zoomr"), n_trials=8)  # {"recall_accuracy": ..., "mean_rank": ..., ...}
"""

from __future__ import annotations

import random
import time

import torch

from kvzip.engine import Stream, encode, sync
from kvzip.evaluate import forced_logits
from kvzip.stats import wilson_interval

COLORS = ["blue", "red", "green", "yellow", "black", "white", "orange", "purple", "brown", "pink", "grey", "silver"]
OBJECTS = ["apple", "violin", "candle", "tiger", "piano", "lantern", "compass", "river", "hammer", "mirror",
           "pencil", "rabbit", "bottle", "feather", "clock", "ladder", "basket", "helmet", "kettle", "anchor"]
PROMPT = ("Read my notes about the boxes, think them through paragraph by paragraph, "
          "and remember what each box holds: I will ask about one of them at the end.")


@torch.inference_mode()
def forced_decode(model, tokenizer, cache, prompts: list[list[int]], forced: list[list[int]]):
    """Prefill `prompts` (left-padded), then feed `forced` (equal lengths T) one token per step through the engine's
    `Stream` (so `cache.on_step` sees each token's text, as in generation).

    Returns (preds (B, T+1) greedy next token at the prefill and after each fed token, last logits (B, V), seconds
    spent in the decode steps, the stream's memory report).
    """
    stream = Stream(model, tokenizer, cache)
    preds, t0 = [], None
    for _, logits in forced_logits(stream, prompts, forced, through_last=True):
        if t0 is None:  # the prefill's logits: the fed steps start now
            sync(stream.device)
            t0 = time.perf_counter()
        preds.append(logits.argmax(-1))
    sync(stream.device)
    return torch.stack(preds, 1).cpu(), logits.float().cpu(), time.perf_counter() - t0, stream.report()


def _single_token_words(tokenizer, words: list[str]) -> dict[str, int]:
    out = {}
    for w in words:
        ids = tokenizer(" " + w, add_special_tokens=False)["input_ids"]
        if len(ids) == 1:
            out[w] = ids[0]
    return out


def build_trials(tokenizer, n_trials: int, n_facts: int = 4, filler_tokens: int = 600, seed: int = 0) -> list[dict]:
    """Trials of equal forced length: dicts with prompt ids, forced ids, candidate token ids, the answer's index."""
    from kvzip.data import evaluation_prose

    rng = random.Random(seed)
    objects = _single_token_words(tokenizer, OBJECTS)
    if len(objects) < n_facts or len(COLORS) < n_facts:
        raise ValueError(f"n_facts={n_facts} needs that many single-token objects and colours")
    paragraphs = [p for p in evaluation_prose().split("\n\n") if len(p) > 80]
    raw = tokenizer.chat_template is None
    prompt = encode(tokenizer, PROMPT, raw=raw)
    enc = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    trials = []
    for _ in range(n_trials):
        colors = rng.sample(COLORS, n_facts)
        objs = rng.sample(sorted(objects), n_facts)
        answer = rng.randrange(n_facts)
        facts = "".join(f"Note {i + 1}: the {c} box holds the {o}. So the {c} box holds the {o}.\n\n"
                        for i, (c, o) in enumerate(zip(colors, objs)))
        filler = []
        while len(filler) < filler_tokens:
            filler += enc(rng.choice(paragraphs) + "\n\n")
        question = enc(f"\n\nBack to note {answer + 1}: the {colors[answer]} box holds the")
        trials.append({"prompt": prompt, "head": enc(facts), "filler": filler, "question": question,
                       "candidates": [objects[o] for o in objs], "answer": answer})
    length = min(len(t["head"]) + len(t["question"]) for t in trials) + filler_tokens
    for t in trials:  # cut each filler so that every trial has the same forced length
        t["forced"] = t["head"] + t["filler"][: length - len(t["head"]) - len(t["question"])] + t["question"]
    return trials


def recall_probe(model, tokenizer, method, n_trials: int = 8, n_facts: int = 4, filler_tokens: int = 600,
                 seed: int = 0, batch_size: int = 8, dictionaries=None, return_predictions: bool = False,
                 trials: list[dict] | None = None) -> dict:
    """Fraction of trials whose right object is the most likely candidate, feeding the trials through `method`'s cache.

    Also: mean rank of the right object (0 = best), mean log-prob margin over the best wrong candidate, peak device and
    host KV bytes per row, forced length, and decode seconds per fed token. With `return_predictions`, also
    "predictions": (n_trials, T+1) greedy next tokens at every fed position (for top-1 agreement against `full`).
    `trials` (from `build_trials`) replaces the ones the other arguments would build.
    """
    trials = trials if trials is not None else build_trials(tokenizer, n_trials, n_facts, filler_tokens, seed)
    n_trials = len(trials)
    hits, ranks, margins, device, host, full, total, seconds, steps, preds = [], [], [], [], [], [], [], 0.0, 0, []
    timed = True
    for start in range(0, n_trials, batch_size):
        chunk = trials[start : start + batch_size]
        cache = method.make_cache(model, dictionaries)
        timed = not cache.for_scoring() and timed  # a scoring shortcut (the quanto peers) makes the time not theirs
        pred, logits, secs, report = forced_decode(model, tokenizer, cache, [t["prompt"] for t in chunk],
                                              [t["forced"] for t in chunk])
        preds.append(pred)
        seconds, steps = seconds + secs, steps + len(chunk[0]["forced"])
        device.append(report["kv_bytes_device_peak"] / len(chunk))
        host.append(report["kv_bytes_host_peak"] / len(chunk))
        full.append(report["kv_bytes_full"] / len(chunk))
        total.append(report["kv_bytes_peak"] / len(chunk))
        logprobs = logits.log_softmax(-1)
        for row, t in enumerate(chunk):
            scores = logprobs[row, t["candidates"]]  # (n_facts,)
            right = scores[t["answer"]]
            rank = int((scores > right).sum())
            hits.append(rank == 0)
            ranks.append(rank)
            margins.append(float(right - scores[torch.arange(n_facts) != t["answer"]].max()))
    n = len(hits)
    extra = {"predictions": torch.cat(preds)} if return_predictions else {}
    return extra | {
        "recall_accuracy": round(sum(hits) / n, 4),
        "mean_rank": round(sum(ranks) / n, 3),
        "mean_margin": round(sum(margins) / n, 3),
        "chance": round(1 / n_facts, 4),
        "trials": n,
        "forced_tokens": len(trials[0]["forced"]),
        "prompt_tokens": len(trials[0]["prompt"]),
        "device_bytes_per_row": int(sum(device) / len(device)),
        "host_bytes_per_row": int(sum(host) / len(host)),
        "total_bytes_per_row": int(sum(total) / len(total)),
        "full_bytes_per_row": int(sum(full) / len(full)),
        "seconds_per_token": round(seconds / max(steps, 1), 4) if timed else None,
    } | ({} if timed else {"scoring_shortcut": True})


def recall_units(cfg) -> int:
    """Decode steps of the workload: each distance's batches, one step per forced token."""
    return sum(-(-n // cfg.recall_batch) * (filler + 60) for filler, n in zip(cfg.recall_filler, cfg.recall_trials))


def recall(ctx, label: str, method, dictionaries) -> dict:
    """The bench workload: the probe at each distance (module docstring); the headline is the longest distance's."""
    from kvzip.bench.context import budget_fields, headline, resolve

    cfg, runs = ctx.cfg, []
    for filler, n in zip(cfg.recall_filler, cfg.recall_trials):
        trials = build_trials(ctx.tokenizer, n, cfg.recall_facts, filler, cfg.seed)
        m, d, plan = resolve(method, dictionaries, len(trials[0]["prompt"]), len(trials[0]["forced"]))
        out = recall_probe(ctx.model, ctx.tokenizer, m, n_facts=cfg.recall_facts, batch_size=cfg.recall_batch,
                           dictionaries=d, trials=trials)
        ctx.tick(-(-n // cfg.recall_batch) * (filler + 60))
        full = out["full_bytes_per_row"]
        ratio = lambda b: round(b / full, 4) if full else None  # noqa: E731
        hits = round(out["recall_accuracy"] * out["trials"])
        record = {
            "context": filler, **out,
            "recall_95ci": [round(x, 4) for x in wilson_interval(hits, out["trials"])],
            "kv_bytes_peak": out["total_bytes_per_row"],
            "kv_bytes_device_peak": out["device_bytes_per_row"],
            "kv_bytes_full": full,
            "kv_ratio_vs_full": ratio(out["total_bytes_per_row"]),
            "kv_device_ratio_vs_full": ratio(out["device_bytes_per_row"]),
            # one step feeds one token to every row of a batch: rows / seconds per step
            "decode_tokens_per_s": (round(min(n, cfg.recall_batch) / out["seconds_per_token"], 3)
                                    if out["seconds_per_token"] else None),
        }
        runs.append({**record, **budget_fields(method, plan, record)})
    return headline(runs)
