"""The four bench workloads, each run for one method setting against `full`'s figures from the same run.

- `ppl`: teacher-forced on held-out prose (`kvzip.data.evaluation_prose`, disjoint from dictionary calibration) via
  `kvzip.evaluate`: perplexity, next-token top-1 agreement with `full`, mean KL(full || method), per context length.
- `reasoning`: greedy generation on GSM8K evaluation problems through the engine.
  `greedy_agreement`: positions where the method's token equals `full`'s, over max(len full, len method) (a missing
  token counts as a mismatch), averaged over prompts. Tokens after a first divergence rarely line up again, so this
  is close to `greedy_prefix_agreement`: the common prefix length over `full`'s length. `gsm8k_accuracy`: the answer
  parsed from `#### N`, else the last number, equals the reference (meaningful only for a model that can solve GSM8K).
- `recall`: `kvzip.bench.recall.recall_probe` (facts early, question late, likelihood-ranked), when that module exists.
- `speed`: prefill and decode on prose at each context: time to first token, prefill tok/s, decode tok/s as
  decode steps over their total time (so work a method does every few tokens, such as fadkv coding a chunk or zoomr
  closing a thought, is counted; a median step would hide it), the median over `repeats` runs after a warm-up. Each
  repeat is paired with a `full` run right after it; speed_ratio_vs_full is the median of the paired ratios.

Every workload returns a record dict with kv_bytes_peak, kv_bytes_device_peak, kv_ratio_vs_full_fp16 (peak bytes over
the fp16 full cache's bytes for the same tokens), decode_tokens_per_s and its quality fields. When several contexts
are measured, the headline fields are the longest context's and `by_context` holds each.
"""

from __future__ import annotations

import importlib.util
import re
import statistics
from dataclasses import dataclass, field

import torch

from kvzip import engine, evaluate


@dataclass
class Context:
    """What every workload needs: the model, the config, `full`'s reference figures, a progress tick."""

    model: object
    tokenizer: object
    cfg: object
    tick: object = lambda n=1: None
    ref: dict = field(default_factory=dict)  # filled while `full` runs, read by every other setting
    _prose: list | None = None

    def prose(self, n: int) -> list[int]:
        if self._prose is None:
            from kvzip.data import evaluation_prose

            limit = max((*self.cfg.ppl_contexts, *self.cfg.speed_contexts, 1024)) * 8  # characters, ample for n tokens
            self._prose = self.tokenizer(evaluation_prose()[:limit])["input_ids"]
        if len(self._prose) < n:
            raise ValueError(f"held-out prose has {len(self._prose)} tokens, {n} needed")
        return self._prose[:n]


class Peak:
    """Peak of a cache's memory report over the steps of one measurement."""

    def __init__(self):
        self.total = self.device = self.fp16 = 0
        self.last: dict = {}

    def see(self, mem: dict) -> None:
        self.total = max(self.total, mem.get("total", 0))
        self.device = max(self.device, mem.get("on_device", 0))
        self.fp16 = max(self.fp16, mem.get("fp16_full", 0))
        self.last = mem

    def fields(self) -> dict:
        return {
            "kv_bytes_peak": self.total,
            "kv_bytes_device_peak": self.device,
            "kv_bytes_final": self.last.get("total", 0),
            "kv_bytes_by_tier": {k: self.last.get(k, 0) for k in ("device", "codes", "dictionary", "host")},
            "kv_bytes_fp16_full": self.fp16,
            "kv_ratio_vs_full_fp16": round(self.total / self.fp16, 4) if self.fp16 else None,
        }


def _headline(by_context: list[dict]) -> dict:
    return {**by_context[-1], "by_context": by_context}


def ppl(ctx: Context, label: str, method, dictionaries) -> dict:
    runs = []
    for length in ctx.cfg.ppl_contexts:
        ids = torch.tensor(ctx.prose(length))
        prefix = length - ctx.cfg.ppl_positions
        cache = method.make_cache(ctx.model, dictionaries)
        peak = Peak()

        def on_progress(done, total, cache=cache, peak=peak):
            peak.see(cache.memory())
            ctx.tick(1)

        logprobs, mem, seconds = evaluate.forced_logprobs(ctx.model, ids, cache, prefix, 1, on_progress)
        peak.see(mem)
        if label == "full":
            ctx.ref.setdefault("ppl", {})[length] = evaluate.Reference(ids, prefix, logprobs, logprobs.argmax(-1))
        quality = evaluate.compare(ctx.ref["ppl"][length], logprobs)
        fed = length - 1 - prefix
        runs.append({"context": length, **quality, **peak.fields(),
                     "decode_tokens_per_s": round(fed / seconds, 3) if seconds > 0 else None,
                     "method_stats": cache.stats()})
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


def reasoning(ctx: Context, label: str, method, dictionaries) -> dict:
    from kvzip.data import gsm8k

    problems = gsm8k("evaluation")[: ctx.cfg.reasoning_prompts]
    raw = ctx.tokenizer.chat_template is None
    settings = engine.Settings(max_new_tokens=ctx.cfg.reasoning_new_tokens)
    outputs, steps, peaks, stats = [], [], Peak(), []
    for p in problems:
        prompt = f"{p['question']}\nSolve it step by step, then give the final number after '####'."
        ids = engine.encode(ctx.tokenizer, prompt, raw=raw)
        cache = method.make_cache(ctx.model, dictionaries)
        last, ticks = 0.0, 0
        for event in engine.generate(ctx.model, ctx.tokenizer, [ids], cache, settings):
            if isinstance(event, engine.Step):
                peaks.see(event.memory)
                if event.step > 0:
                    steps.append(event.elapsed_s - last)
                last = event.elapsed_s
                ctx.tick(1)
                ticks += 1
            elif isinstance(event, engine.Result):
                outputs.append(event)
                stats.append(event.stats["method_stats"])
        ctx.tick(max(ctx.cfg.reasoning_new_tokens - ticks, 0))
    tokens = [r.token_ids for r in outputs]
    if label == "full":
        ctx.ref["reasoning"] = tokens
    pairs = [agreement(f, m) for f, m in zip(ctx.ref["reasoning"], tokens)]
    answers = [parse_answer(r.text) for r in outputs]
    correct = [same_number(a, p["number"]) for a, p in zip(answers, problems)]
    return {
        "greedy_agreement": round(sum(a for a, _ in pairs) / len(pairs), 4),
        "greedy_prefix_agreement": round(sum(b for _, b in pairs) / len(pairs), 4),
        "gsm8k_accuracy": round(sum(correct) / len(correct), 4),
        **peaks.fields(),
        "decode_tokens_per_s": round(1 / statistics.median(steps), 3) if steps else None,
        "prompts": len(problems),
        "new_tokens": sum(len(t) for t in tokens),
        "answers": [{"index": p["index"], "expected": p["number"], "parsed": a} for p, a in zip(problems, answers)],
        "method_stats": stats[-1] if stats else {},
    }


def recall_available() -> bool:
    return importlib.util.find_spec("kvzip.bench.recall") is not None


def recall(ctx: Context, label: str, method, dictionaries) -> dict:
    from kvzip.bench.recall import recall_probe
    from kvzip.methods.base import model_layout

    cfg = ctx.cfg
    out = recall_probe(ctx.model, ctx.tokenizer, method, n_trials=cfg.recall_trials, n_facts=cfg.recall_facts,
                       filler_tokens=cfg.recall_filler, seed=cfg.seed, batch_size=cfg.recall_trials,
                       dictionaries=dictionaries)
    ctx.tick(recall_units(cfg))
    layers, heads, head_dim = model_layout(ctx.model)
    tokens = out["prompt_tokens"] + out["forced_tokens"]
    fp16 = 2 * layers * heads * head_dim * 2 * tokens  # per row, as the probe reports its bytes per row
    peak = out["device_bytes_per_row"] + out["host_bytes_per_row"]
    return {
        **out,
        "kv_bytes_peak": peak,
        "kv_bytes_device_peak": out["device_bytes_per_row"],
        "kv_bytes_fp16_full": fp16,
        "kv_ratio_vs_full_fp16": round(peak / fp16, 4),
        # one step feeds one token to every trial row at once: rows / seconds per step
        "decode_tokens_per_s": round(cfg.recall_trials / out["seconds_per_token"], 3) if out["seconds_per_token"] else None,
    }


def _timed_generate(ctx: Context, method, dictionaries, ids: list[int], settings, peak: Peak | None = None):
    """(ttft seconds, decode tok/s as steps / their total time, method stats) of one generation."""
    cache = method.make_cache(ctx.model, dictionaries)
    steps, last, ttft, stats = [], 0.0, 0.0, {}
    for event in engine.generate(ctx.model, ctx.tokenizer, [ids], cache, settings):
        if isinstance(event, engine.Step):
            if peak is not None:
                peak.see(event.memory)
            if event.step > 0:
                steps.append(event.elapsed_s - last)
            last = event.elapsed_s
        elif isinstance(event, engine.Result):
            ttft, stats = event.stats["ttft_s"], event.stats["method_stats"]
    return ttft, len(steps) / sum(steps), stats


def speed(ctx: Context, label: str, method, dictionaries) -> dict:
    """Each repeat measures the method, then `full` right after it on the same context: the load of a shared machine
    drifts slowly, so the ratio of the adjacent pair is far steadier than either rate alone."""
    cfg = ctx.cfg
    if label == "full":
        ctx.ref["full_method"] = method
    full = ctx.ref["full_method"]
    warm = engine.Settings(max_new_tokens=4, ignore_eos=True)
    for m, d in ((method, dictionaries), (full, None)) if label != "full" else ((method, dictionaries),):
        list(engine.generate(ctx.model, ctx.tokenizer, [ctx.prose(64)], m.make_cache(ctx.model, d), warm))
    settings = engine.Settings(max_new_tokens=cfg.speed_new_tokens, ignore_eos=True)
    runs = []
    for length in cfg.speed_contexts:
        ids = ctx.prose(length)
        ttfts, rates, ratios, ttft_ratios, peak, stats = [], [], [], [], Peak(), {}
        for _ in range(cfg.repeats):
            ttft, rate, stats = _timed_generate(ctx, method, dictionaries, ids, settings, peak)
            ttfts.append(ttft)
            rates.append(rate)
            if label != "full":
                full_ttft, full_rate, _ = _timed_generate(ctx, full, None, ids, settings)
                ratios.append(rate / full_rate)
                ttft_ratios.append(ttft / full_ttft)
            ctx.tick(speed_units_one(length, cfg))
        ttft = statistics.median(ttfts)
        runs.append({"context": length, "ttft_s": round(ttft, 4), "prefill_tokens_per_s": round(length / ttft, 2),
                     "decode_tokens_per_s": round(statistics.median(rates), 3), "repeats": cfg.repeats,
                     "speed_ratio_vs_full": round(statistics.median(ratios), 3) if ratios else 1.0,
                     "ttft_ratio_vs_full": round(statistics.median(ttft_ratios), 3) if ttft_ratios else 1.0,
                     **peak.fields(), "method_stats": stats})
    return _headline(runs)


def recall_units(cfg) -> int:
    return cfg.recall_filler + 60  # the trials are fed as one batch: one step per forced token


def speed_units_one(length: int, cfg) -> int:
    return 2 * (length // 50 + cfg.speed_new_tokens)  # the method and its paired full run


def units(cfg, workload: str) -> int:
    """Rough cost of one workload for one setting, in decode-step equivalents: what the progress bar counts."""
    if workload == "ppl":
        return len(cfg.ppl_contexts) * (cfg.ppl_positions - 1)
    if workload == "reasoning":
        return cfg.reasoning_prompts * cfg.reasoning_new_tokens
    if workload == "recall":
        return recall_units(cfg)
    return sum(speed_units_one(c, cfg) for c in cfg.speed_contexts) * cfg.repeats


RUNNERS = {"ppl": ppl, "reasoning": reasoning, "recall": recall, "speed": speed}
