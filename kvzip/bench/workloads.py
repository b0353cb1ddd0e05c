"""The bench workloads, each run for one method setting against `full`'s figures from the same run.

- `output` (the quality workload for every method): teacher forcing of a long *output*. After a short chat prompt,
  held-out text (`kvzip.data.evaluation_prose`, disjoint from dictionary calibration) is fed as the model's own
  answer, one token per row per step, through the same hooks as generation (`kvzip.evaluate.teacher_forced`):
  perplexity, top-1 agreement and KL against `full` over every fed position, and KV bytes by tier at the end. Rows
  are separate texts, batched. This is what both papers compress: a cache's cost grows with what the model writes.
- `prompt`: the text prefilled as a *prompt*, then its last positions fed one by one: prompt compression. Methods
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

import re
import statistics
from dataclasses import dataclass, field

from kvzip import engine, evaluate
from kvzip.stats import wilson_interval

OUTPUT_PROMPT = "Work through the following problems and explanations step by step, one paragraph per step."


@dataclass
class Context:
    """What every workload needs: the model, the config, `full`'s reference figures, a progress tick."""

    model: object
    tokenizer: object
    cfg: object
    tick: object = lambda n=1: None
    ref: dict = field(default_factory=dict)  # filled while `full` runs, read by every other setting
    _prose: list | None = None

    def prose(self, n: int, offset: int = 0) -> list[int]:
        """n tokens of held-out prose starting `offset` tokens in (rows use disjoint offsets)."""
        if self._prose is None:
            from kvzip.data import evaluation_prose

            self._prose = self.tokenizer(evaluation_prose(), add_special_tokens=False)["input_ids"]
        if len(self._prose) < offset + n:
            raise ValueError(f"held-out prose has {len(self._prose)} tokens, {offset + n} needed")
        return self._prose[offset : offset + n]

    def chat_prompt(self, text: str) -> list[int]:
        return engine.encode(self.tokenizer, text, raw=self.tokenizer.chat_template is None)


def _headline(by_context: list[dict]) -> dict:
    return {**by_context[-1], "by_context": by_context}


def _forced(ctx: Context, label: str, key, method, dictionaries, prompts, forced) -> dict:
    """One teacher-forced pass; `full`'s pass is kept as the reference under `key` for every later setting."""
    cache = method.make_cache(ctx.model, dictionaries)
    ref = ctx.ref.get(key)
    run = evaluate.teacher_forced(ctx.model, ctx.tokenizer, cache, prompts, forced, reference=ref,
                                  keep_reference=label == "full", on_progress=lambda done, total: ctx.tick(1))
    if label == "full":
        ctx.ref[key] = ref = run.reference
    fed = run.nll.numel() - len(prompts)
    scores = run.scores(ref)
    if label == "full":
        scores["kl"] = 0.0  # the reference itself
    return {**scores, **run.report,
            "decode_tokens_per_s": round(fed / run.decode_s, 3) if run.decode_s > 0 else None, "rows": len(prompts)}


def output(ctx: Context, label: str, method, dictionaries) -> dict:
    cfg, runs = ctx.cfg, []
    prompt = ctx.chat_prompt(OUTPUT_PROMPT)
    longest = max(cfg.output_tokens)
    for length in cfg.output_tokens:
        forced = [ctx.prose(length, row * longest) for row in range(cfg.output_rows)]
        record = _forced(ctx, label, ("output", length), method, dictionaries, [prompt] * cfg.output_rows, forced)
        runs.append({"context": length, "prompt_tokens": len(prompt), **record})
    return _headline(runs)


def prompt(ctx: Context, label: str, method, dictionaries) -> dict:
    cfg, runs = ctx.cfg, []
    for length in cfg.prompt_contexts:
        ids = ctx.prose(length)
        prefix = length - cfg.prompt_positions
        record = _forced(ctx, label, ("prompt", length), method, dictionaries, [ids[:prefix]], [ids[prefix:]])
        runs.append({"context": length, **record})
    return _headline(runs)


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


def _run_generate(ctx: Context, method, dictionaries, prompts: list[list[int]], settings) -> tuple[list, dict, list]:
    """(Results, the batch Summary's stats, seconds of each decode step) of one engine run, ticking per step."""
    cache = method.make_cache(ctx.model, dictionaries)
    results, summary, steps, last = [], {}, [], 0.0
    for event in engine.uninterrupted(engine.generate(ctx.model, ctx.tokenizer, prompts, cache, settings)):
        if isinstance(event, engine.Step):
            if event.step > 0:
                steps.append(event.elapsed_s - last)
                ctx.tick(1)
            last = event.elapsed_s
        elif isinstance(event, engine.Result):
            results.append(event)
        elif isinstance(event, engine.Summary):
            summary = event.stats
    return results, summary, steps


def reasoning(ctx: Context, label: str, method, dictionaries) -> dict:
    from kvzip.data import gsm8k

    cfg = ctx.cfg
    problems = gsm8k("evaluation")[: cfg.reasoning_prompts]
    settings = engine.Settings(max_new_tokens=cfg.reasoning_new_tokens)
    outputs, summaries, steps = [], [], []
    for start in range(0, len(problems), cfg.reasoning_batch):
        chunk = problems[start : start + cfg.reasoning_batch]
        prompts = [ctx.chat_prompt(f"{p['question']}\nSolve it step by step, then give the final number after '####'.")
                   for p in chunk]
        results, summary, times = _run_generate(ctx, method, dictionaries, prompts, settings)
        outputs += results
        summaries.append(summary)
        steps += times
    tokens = [r.token_ids for r in outputs]
    if label == "full":
        ctx.ref["reasoning"] = tokens
    pairs = [agreement(f, m) for f, m in zip(ctx.ref["reasoning"], tokens)]
    answers = [parse_answer(r.text) for r in outputs]
    correct = [same_number(a, p["number"]) for a, p in zip(answers, problems)]
    peak = max(summaries, key=lambda s: s["kv_bytes_peak"])  # the batch that held the most
    n = len(correct)
    acc = sum(correct) / n
    return {
        "greedy_agreement": round(sum(a for a, _ in pairs) / len(pairs), 4),
        "greedy_prefix_agreement": round(sum(b for _, b in pairs) / len(pairs), 4),
        "gsm8k_accuracy": round(acc, 4),
        "gsm8k_accuracy_95ci": [round(x, 4) for x in wilson_interval(sum(correct), n)],
        **{k: v for k, v in peak.items() if k.startswith("kv_")},
        "decode_tokens_per_s": round(sum(len(t) for t in tokens) / sum(steps), 3) if steps else None,
        "prompts": n,
        "new_tokens": sum(len(t) for t in tokens),
        "answers": [{"index": p["index"], "expected": p["number"], "parsed": a} for p, a in zip(problems, answers)],
        "method_stats": peak.get("method_stats", {}),
    }


def recall(ctx: Context, label: str, method, dictionaries) -> dict:
    from kvzip.bench.recall import recall_probe

    cfg = ctx.cfg
    out = recall_probe(ctx.model, ctx.tokenizer, method, n_trials=cfg.recall_trials, n_facts=cfg.recall_facts,
                       filler_tokens=cfg.recall_filler, seed=cfg.seed, batch_size=cfg.recall_trials,
                       dictionaries=dictionaries)
    ctx.tick(recall_units(cfg))
    full = out["full_bytes_per_row"]
    ratio = lambda n: round(n / full, 4) if full else None  # noqa: E731
    return {
        **out,
        "kv_bytes_peak": out["total_bytes_per_row"],
        "kv_bytes_device_peak": out["device_bytes_per_row"],
        "kv_bytes_full": full,
        "kv_ratio_vs_full": ratio(out["total_bytes_per_row"]),
        "kv_device_ratio_vs_full": ratio(out["device_bytes_per_row"]),
        # one step feeds one token to every trial row at once: rows / seconds per step
        "decode_tokens_per_s": round(cfg.recall_trials / out["seconds_per_token"], 3) if out["seconds_per_token"] else None,
    }


def _timed(ctx: Context, method, dictionaries, ids: list[int], settings) -> tuple[float, float, dict]:
    """(ttft seconds, decode tok/s as steps over their total time, the Summary's stats) of one generation."""
    _, summary, steps = _run_generate(ctx, method, dictionaries, [ids], settings)
    return summary["ttft_s"], len(steps) / sum(steps), summary


def speed(ctx: Context, label: str, method, dictionaries) -> dict:
    """Each repeat measures the method, then `full` right after it on the same context: the load of a shared machine
    drifts slowly, so the ratio of the adjacent pair is far steadier than either rate alone."""
    cfg = ctx.cfg
    if label == "full":
        ctx.ref["full_method"] = method
    full = ctx.ref["full_method"]
    warm = engine.Settings(max_new_tokens=4, ignore_eos=True)
    for m, d in ((method, dictionaries), (full, None)) if label != "full" else ((method, dictionaries),):
        list(engine.uninterrupted(engine.generate(ctx.model, ctx.tokenizer, [ctx.prose(64)], m.make_cache(ctx.model, d),
                                                  warm)))
    settings = engine.Settings(max_new_tokens=cfg.speed_new_tokens, ignore_eos=True)
    runs = []
    for length in cfg.speed_contexts:
        ids = ctx.prose(length)
        ttfts, rates, ratios, ttft_ratios, summary = [], [], [], [], {}
        for _ in range(cfg.repeats):
            ttft, rate, summary = _timed(ctx, method, dictionaries, ids, settings)
            ttfts.append(ttft)
            rates.append(rate)
            if label != "full":
                full_ttft, full_rate, _ = _timed(ctx, full, None, ids, settings)
                ratios.append(rate / full_rate)
                ttft_ratios.append(ttft / full_ttft)
            ctx.tick(length // 50)
        ttft = statistics.median(ttfts)
        runs.append({"context": length, "ttft_s": round(ttft, 4), "prefill_tokens_per_s": round(length / ttft, 2),
                     "decode_tokens_per_s": round(statistics.median(rates), 3), "repeats": cfg.repeats,
                     "speed_ratio_vs_full": round(statistics.median(ratios), 3) if ratios else 1.0,
                     "paired_speed_ratios": [round(r, 4) for r in ratios],
                     "ttft_ratio_vs_full": round(statistics.median(ttft_ratios), 3) if ttft_ratios else 1.0,
                     **{k: v for k, v in summary.items() if k.startswith("kv_")},
                     "method_stats": summary.get("method_stats", {})})
    return _headline(runs)


def capacity_prompts(ctx: Context, rows: int) -> list[list[int]]:
    """`rows` chat prompts of GSM8K evaluation problems (cycled): the batch the capacity and throughput jobs decode."""
    from kvzip.data import gsm8k

    problems = gsm8k("evaluation")
    return [ctx.chat_prompt(problems[i % len(problems)]["question"] + "\nSolve it step by step.") for i in range(rows)]


def _capacity_probe(ctx: Context, method, dictionaries) -> tuple[engine.Settings, dict]:
    """(the capacity settings, the Summary stats of one row, the longest prompt, generated to the capacity length)."""
    settings = engine.Settings(max_new_tokens=ctx.cfg.capacity_tokens, ignore_eos=True)
    longest = max(capacity_prompts(ctx, ctx.cfg.capacity_max_rows), key=len)  # a batch pads every row to its longest
    _, probe, _ = _run_generate(ctx, method, dictionaries, [longest], settings)
    return settings, probe


CAPACITY_TRIES = 3  # batches measured at most, each sized by the bytes per row of the last one


def capacity(ctx: Context, label: str, method, dictionaries) -> dict:
    """The largest batch whose KV bytes, all tiers, fit the budget, and that batch's aggregate decode tok/s. The budget
    (unless --kv-budget) is what `full`'s batch of FULL_ROWS_IN_BUDGET rows held at its peak. The first batch is
    sized from one row's measured peak (the longest prompt: a conservative guess); each next one from the last batch's own bytes per row (a row in a
    batch can hold more or less than alone: a thought cache zooms on each row's own thoughts), grown while it fits
    with room for another row, shrunk while it overshoots, never to a size already measured."""
    from kvzip.bench.config import FULL_ROWS_IN_BUDGET

    cfg = ctx.cfg
    settings, probe = _capacity_probe(ctx, method, dictionaries)
    per_row, per_row_device = probe["kv_bytes_peak"], probe["kv_bytes_device_peak"]
    # full's own first batch sets the default budget (below); the other settings read it from full's run
    budget = cfg.kv_budget or (None if label == "full" else ctx.ref["capacity_budget"])
    rows = FULL_ROWS_IN_BUDGET if budget is None else max(1, min(cfg.capacity_max_rows, budget // max(per_row, 1)))
    tries, best = [], None  # best: (rows, summary) of the largest batch that fit
    while True:
        _, summary, _ = _run_generate(ctx, method, dictionaries, capacity_prompts(ctx, rows), settings)
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
    return {
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


def recall_units(cfg) -> int:
    return cfg.recall_filler + 60  # the trials are fed as one batch: one step per forced token


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
        _, summary, _ = _run_generate(ctx, full, None, capacity_prompts(ctx, FULL_ROWS_IN_BUDGET), settings)
        ctx.ref["capacity_budget"] = summary["kv_bytes_peak"]
    else:
        RUNNERS[workload](ctx, "full", full, None)


RUNNERS = {"output": output, "prompt": prompt, "reasoning": reasoning, "recall": recall, "speed": speed,
           "capacity": capacity}
