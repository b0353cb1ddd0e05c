"""Run every setting through every workload, `full` first, and gather the figures into one JSON-ready dict.

A setting that cannot run for a reason the user can fix (a dictionary not shipped yet, `optimum-quanto` missing)
is skipped with a note; a setting that crashes is recorded as failed with its error and the run goes on, so that
one broken method never hides the others' figures. Speed ratios are taken against `full` measured in this run.

A process may measure only some of the cells (`kvzip.bench.cells`: a rank of a data-parallel bench, a resumed run),
reporting each as it ends; `merge` builds the one JSON of the run from every cell's piece, whichever process made it.
"""

from __future__ import annotations

import datetime
import os
import platform
import resource
import time
import traceback

import torch

from kvzip.bench import cells as bench_cells
from kvzip.bench import workloads
from kvzip.bench.config import BenchConfig, Setting
from kvzip.bench.context import Budgeted
from kvzip.errors import UserError
from kvzip.runs import commit


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _prepare(setting: Setting, model, source, dict_path, cfg: BenchConfig):
    """(method, dictionaries) or raises UserError explaining why the setting cannot run here. A setting at a budget
    is a `Budgeted` (planned per length by each workload), tried here at a first length."""
    from kvzip.budget import Shape
    from kvzip.dictionary_lookup import dictionaries_for

    method = setting.build()
    load = lambda m: dictionaries_for(m, model, source, dict_path)  # noqa: E731
    if setting.budget is not None:
        budgeted = Budgeted(setting.name, dict(setting.opts), setting.budget, cfg.budget_tier, Shape.of(model), load,
                            method.keeps_prompt)
        first, dictionaries, _ = budgeted.at(64, max(cfg.output_tokens))
        first.make_cache(model, dictionaries)
        return budgeted, None
    dictionaries = load(method) if method.needs_dictionary else None
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
              on_progress=None, share=None, on_cell=None) -> dict:
    """Measure `settings` (full first) on `cfg.workloads`. on_progress(done, total, description) after each step.

    `share(cells)` picks the cells (kvzip.bench.cells.Cell, all of the run's) this process measures, in the order to
    run them (default: every cell, kvzip.bench.cells.execution_order); `full`'s run of a workload whose cell is not
    among them is made first, as the reference the others are measured against. on_cell(cell, outcome) is called as
    each cell ends, outcome {"record": ...} or {"failed": ...}.

    Returns {"config", "environment", "settings", "results", "skipped", "failed", "process", "wall_s",
    "interrupted"} for the cells measured here; Ctrl-C stops the run early with the records finished so far and
    interrupted=True.
    """
    assert settings and settings[0].label == "full", "full must run first: it is every other setting's reference"
    t0 = time.perf_counter()
    cfg = cfg.capped(getattr(model.config, "max_position_embeddings", None))
    env = environment(model, source)
    skipped, failed, results, ready = [], [], [], []
    for s in settings:
        try:
            ready.append((s, *_prepare(s, model, source, dict_path, cfg)))
        except UserError as exc:
            if s.label == "full":
                raise
            skipped.append({"label": s.label, "method": s.name, "reason": str(exc)})
    every, notes = bench_cells.plan(ready, list(cfg.workloads))
    skipped += notes
    mine = share(every) if share is not None else bench_cells.execution_order(every)
    own = {c.workload for c in mine if c.label == "full"}
    refs = [w for w in dict.fromkeys(c.workload for c in mine)
            if w not in own and workloads.needs_reference(cfg, w)]
    reference_runs = list(refs)
    total = sum(workloads.units(cfg, w) for w in [c.workload for c in mine] + refs)
    ctx = workloads.Context(model, tokenizer, cfg)
    interrupted = False
    try:
        _measure_all({s.label: (s, m, d) for s, m, d in ready}, mine, refs, ctx, results, failed, total, on_progress,
                     on_cell)
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
        "reference_runs": reference_runs,  # workloads whose `full` run was made here only as the reference
    }


def _measure_all(ready: dict, mine, refs, ctx, results, failed, total, on_progress, on_cell) -> None:
    """The cells `mine` in order (after `full`'s reference run of each workload in `refs`, before that workload's
    first cell), appending to `results` / `failed` and reporting to on_cell as each one ends."""
    model, cfg = ctx.model, ctx.cfg
    full = ready["full"][1]
    ctx.ref["full_method"] = full  # the speed workload's paired runs
    done = 0
    for cell in mine:
        setting, method, dictionaries = ready[cell.label]
        w = cell.workload

        def tick(n=1, description=f"{setting.label} · {w}"):
            nonlocal done
            done += n
            if on_progress is not None:
                on_progress(min(done, total), total, description)

        if w in refs:
            refs.remove(w)
            start_units = done
            ctx.tick = lambda n=1: tick(n, f"full · {w} (reference)")
            ctx.tick(0)
            workloads.reference(ctx, w, full)
            tick(max(workloads.units(cfg, w) - (done - start_units), 0))
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
            if on_cell is not None:
                on_cell(cell, {"failed": failed[-1]})
            continue
        tick(max(workloads.units(cfg, w) - (done - start_units), 0))
        record = {"label": setting.label, "method": setting.name, "options": method.describe()["options"],
                  "workload": w, **record, "seconds": round(time.perf_counter() - started, 2),
                  "process_peak_rss_bytes": peak_rss_bytes()}
        if model.device.type == "cuda":
            record["cuda_max_memory_allocated"] = torch.cuda.max_memory_allocated(model.device)
        results.append(record)
        if on_cell is not None:
            on_cell(cell, {"record": record})


def merge(data: dict, pieces: dict[int, dict], every: list, ranks: list[dict], run: dict) -> dict:
    """The run's JSON from rank 0's `data` (config, environment, settings, skips) and every finished cell's piece
    (`pieces`: cell index -> {"record"} or {"failed"}), in the order of `every` (the run's cells); `ranks` is what
    each rank of this launch did, `run` the job's record. Cells without a piece make it an interrupted run."""
    results = [pieces[c.index]["record"] for c in every if "record" in pieces.get(c.index, {})]
    _ratios(results)
    merged = {**data, "results": results, "failed": [pieces[c.index]["failed"] for c in every
                                                      if "failed" in pieces.get(c.index, {})]}
    merged["interrupted"] = data["interrupted"] or any(c.index not in pieces for c in every)
    merged["process"] = {**data["process"], "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks)}
    return {**merged, "ranks": ranks, "run": run}
