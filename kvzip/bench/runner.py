"""Run every setting through every workload, `full` first, and gather the figures into one JSON-ready dict.

A setting that cannot run for a reason the user can fix (a dictionary not shipped yet, `optimum-quanto` missing)
is skipped with a note; a setting that crashes is recorded as failed with its error and the run goes on, so that
one broken method never hides the others' figures. Speed ratios are taken against `full` measured in this run.
"""

from __future__ import annotations

import datetime
import os
import platform
import resource
import time
import traceback

import torch

from kvzip.bench import workloads
from kvzip.bench.config import BenchConfig, Setting
from kvzip.errors import UserError
from kvzip.runs import commit


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _prepare(setting: Setting, model, source, dict_path):
    """(method, dictionaries) or raises UserError explaining why the setting cannot run here."""
    from kvzip.dictfiles import dictionaries_for

    method = setting.build()
    dictionaries = dictionaries_for(method, model, source, dict_path) if method.needs_dictionary else None
    method.make_cache(model, dictionaries)  # a method whose backend is missing says so here
    return method, dictionaries


def _ratios(results: list[dict]) -> None:
    """speed_ratio_vs_full on every record (and per-context entry) that has none yet (speed pairs its own), against
    full's decode tok/s on the same workload and context in this run."""
    full = {r["workload"]: r for r in results if r["label"] == "full"}
    for r in results:
        ref = full.get(r["workload"])
        entries = [r] + r.get("by_context", [])
        for e in entries:
            if "speed_ratio_vs_full" in e:
                continue
            base = ref
            if ref is not None and "context" in e:
                base = next((c for c in ref.get("by_context", []) if c["context"] == e["context"]), None)
            mine, theirs = e.get("decode_tokens_per_s"), base.get("decode_tokens_per_s") if base else None
            e["speed_ratio_vs_full"] = round(mine / theirs, 3) if mine and theirs else None


def _cpu_model() -> str | None:
    """The CPU's model name as Linux reports it (runs on different machines are told apart by it), else None."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def environment(model, source) -> dict:
    return {
        "commit": commit(),
        "model": source.name,
        "model_path": str(getattr(source, "path", "")),
        "device": str(model.device),
        "dtype": str(model.dtype).replace("torch.", ""),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cuda_device": torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else None,
    }


def run_bench(model, tokenizer, source, settings: list[Setting], cfg: BenchConfig, dict_path=None,
              on_progress=None) -> dict:
    """Measure `settings` (full first) on `cfg.workloads`. on_progress(done, total, description) after each step.

    Returns {"config", "environment", "settings", "results", "skipped", "failed", "process", "wall_s",
    "interrupted"}; Ctrl-C stops the run early with the records finished so far and interrupted=True.
    """
    assert settings and settings[0].label == "full", "full must run first: it is every other setting's reference"
    t0 = time.perf_counter()
    cfg = cfg.capped(getattr(model.config, "max_position_embeddings", None))
    env = environment(model, source)
    skipped, failed, results, ready = [], [], [], []
    wanted = list(cfg.workloads)
    for s in settings:
        try:
            ready.append((s, *_prepare(s, model, source, dict_path)))
        except UserError as exc:
            if s.label == "full":
                raise
            skipped.append({"label": s.label, "method": s.name, "reason": str(exc)})

    total = sum(workloads.units(cfg, w) for s, m, _ in ready for w in wanted if not (w == "prompt" and m.keeps_prompt))
    ctx = workloads.Context(model, tokenizer, cfg)
    interrupted = False
    try:
        _measure_all(ready, wanted, cfg, ctx, results, failed, skipped, total, on_progress)
    except KeyboardInterrupt:  # Ctrl-C (or `timeout -s INT`): keep every record finished so far
        interrupted = True
    _ratios(results)
    env["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    process = {"peak_rss_bytes": peak_rss_bytes()}
    if model.device.type == "cuda":
        process["cuda_max_memory_allocated"] = max((r.get("cuda_max_memory_allocated", 0) for r in results), default=0)
    return {
        "config": cfg.describe(),
        "environment": env,
        "settings": [{"label": s.label, "method": s.name, "options": m.describe()["options"]} for s, m, _ in ready],
        "results": results,
        "skipped": skipped,
        "failed": failed,
        "process": process,
        "wall_s": round(time.perf_counter() - t0, 1),
        "interrupted": interrupted,
    }


def _measure_all(ready, wanted, cfg, ctx, results, failed, skipped, total, on_progress) -> None:
    """Every (setting, workload) pair in order, appending to `results` / `failed` / `skipped` as each one ends."""
    model = ctx.model
    done = 0
    for setting, method, dictionaries in ready:
        for w in wanted:
            description = f"{setting.label} · {w}"
            if w == "prompt" and method.keeps_prompt:
                skipped.append({"label": setting.label, "method": setting.name, "workload": w,
                                "reason": "keeps the prompt in full by design: the output workload measures it"})
                continue

            def tick(n=1, description=description):
                nonlocal done
                done += n
                if on_progress is not None:
                    on_progress(min(done, total), total, description)

            ctx.tick = tick
            start_units = done
            tick(0)
            if model.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(model.device)
            started = time.perf_counter()
            try:
                record = workloads.RUNNERS[w](ctx, setting.label, method, dictionaries)
            except Exception as exc:  # a crashing method is reported, never allowed to hide the others
                if setting.label == "full":
                    raise
                failed.append({"label": setting.label, "method": setting.name, "workload": w,
                               "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
                tick(max(workloads.units(cfg, w) - (done - start_units), 0))
                continue
            tick(max(workloads.units(cfg, w) - (done - start_units), 0))
            record = {"label": setting.label, "method": setting.name, "options": method.describe()["options"],
                      "workload": w, **record, "seconds": round(time.perf_counter() - started, 2),
                      "process_peak_rss_bytes": peak_rss_bytes()}
            if model.device.type == "cuda":
                record["cuda_max_memory_allocated"] = torch.cuda.max_memory_allocated(model.device)
            results.append(record)
