"""The bench's `reasoning` workload: greedy generation on GSM8K evaluation problems through the engine, scored by
greedy agreement with `full` and by accuracy (meaningful only for a model that can solve GSM8K).

At a memory budget (`--budgets`), F is of each problem's full cache: its prompt and the tokens `full` generated for
it. Problems are batched by `full`'s length (rows of one batch share one cache and one plan), each batch planned for
its longest prompt and the median of its rows' full lengths, so that every method compresses before it answers. The
measured ratio is the batches' peak bytes over `full`'s bytes for the same tokens, summed.
"""

from __future__ import annotations

import re
import statistics

from kvzip import engine
from kvzip.bench.context import Budgeted, Context, resolve, run_generate
from kvzip.budget import mark
from kvzip.stats import wilson_interval

INSTRUCTION = "\nSolve it step by step, then give the final number after '####'."
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def parse_answer(text: str) -> str | None:
    """The final answer of a GSM8K-style solution: the number after `####`, else the last number in the text."""
    if "####" in text:
        found = _NUMBER.findall(text.rsplit("####", 1)[-1])[:1]
    else:
        found = _NUMBER.findall(text)[-1:]
    return found[0].replace(",", "") if found else None


def same_number(a: str | None, b: str) -> bool:
    try:
        return a is not None and abs(float(a) - float(b)) < 1e-6
    except ValueError:
        return False


def agreement(full: list[int], other: list[int]) -> tuple[float, float]:
    """(positional agreement over max length, common-prefix length over full's length)."""
    n = max(len(full), len(other))
    if n == 0:
        return 1.0, 1.0
    same = sum(a == b for a, b in zip(full, other))
    prefix = next((i for i, (a, b) in enumerate(zip(full, other)) if a != b), min(len(full), len(other)))
    return same / n, (prefix / len(full) if full else float(not other))


def _batches(ctx: Context, method, n: int) -> list[list[int]]:
    """Problem indices, batch by batch: in order, or, at a budget, sorted by the length `full` generated."""
    order = list(range(n))
    if isinstance(method, Budgeted):
        order.sort(key=lambda i: len(ctx.ref["reasoning"][i]))
    size = ctx.cfg.reasoning_batch
    return [order[i : i + size] for i in range(0, n, size)]


def reasoning(ctx: Context, label: str, method, dictionaries) -> dict:
    from kvzip.data import gsm8k

    cfg = ctx.cfg
    problems = gsm8k("evaluation")[: cfg.reasoning_prompts]
    prompts = [ctx.chat_prompt(p["question"] + INSTRUCTION) for p in problems]
    settings = engine.Settings(max_new_tokens=cfg.reasoning_new_tokens)
    outputs, summaries, steps, plans = [None] * len(problems), [], [], []
    for rows in _batches(ctx, method, len(problems)):
        full_new = [len(ctx.ref["reasoning"][i]) for i in rows] if "reasoning" in ctx.ref else [cfg.reasoning_new_tokens]
        m, d, plan = resolve(method, dictionaries, max(len(prompts[i]) for i in rows), int(statistics.median(full_new)))
        results, summary, times = run_generate(ctx, m, d, [prompts[i] for i in rows], settings)
        for i, r in zip(rows, results):
            outputs[i] = r
        summaries.append(summary)
        steps += times
        if plan is not None:
            plans.append({"problems": len(rows), **plan.describe()})
    tokens = [r.token_ids for r in outputs]
    if label == "full":
        ctx.ref["reasoning"] = tokens
    pairs = [agreement(f, m) for f, m in zip(ctx.ref["reasoning"], tokens)]
    answers = [parse_answer(r.text) for r in outputs]
    correct = [same_number(a, p["number"]) for a, p in zip(answers, problems)]
    peak = max(summaries, key=lambda s: s["kv_bytes_peak"])  # the batch that held the most
    n = len(correct)
    record = {
        "greedy_agreement": round(sum(a for a, _ in pairs) / len(pairs), 4),
        "greedy_prefix_agreement": round(sum(b for _, b in pairs) / len(pairs), 4),
        "gsm8k_accuracy": round(sum(correct) / n, 4),
        "gsm8k_accuracy_95ci": [round(x, 4) for x in wilson_interval(sum(correct), n)],
        **{k: v for k, v in peak.items() if k.startswith("kv_")},
        "decode_tokens_per_s": round(sum(len(t) for t in tokens) / sum(steps), 3) if steps else None,
        "prompts": n,
        "new_tokens": sum(len(t) for t in tokens),
        "answers": [{"index": p["index"], "expected": p["number"], "parsed": a} for p, a in zip(problems, answers)],
        "method_stats": peak.get("method_stats", {}),
    }
    if isinstance(method, Budgeted):
        tier = "kv_bytes_device_peak" if method.tier == "device" else "kv_bytes_peak"
        measured = round(sum(s[tier] for s in summaries) / max(sum(s["kv_bytes_full"] for s in summaries), 1), 4)
        notes = "; ".join(dict.fromkeys(p["note"] for p in plans if p["note"]))
        record.update(budget=method.fraction, budget_tier=method.tier, budget_plan=plans, budget_ratio=measured,
                      budget_mark=mark(method.fraction, measured, notes))
    return record
