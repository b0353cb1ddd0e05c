"""`kvzip bench`: every method (or chosen settings) on the same model and workloads in one run, against `full`.

Thin: check the flags, load the model, call `kvzip.bench.run_bench` with a progress callback, then print the table
(best value per column among methods other than full marked with *), the notes, and write `--json` (atomically) and
`--plot`. Exit code 1 when a method crashed (its error is in the JSON), 2 for a user error. With `--json`, each
finished cell is kept in JSON.parts as it ends and `--resume` runs only the missing ones; under torchrun the ranks
share the cells (`kvzip.bench.cells`) and rank 0 merges them into the one JSON (docs/scaling.md).

    kvzip bench --quick                                    # every registered method, small workloads, minutes on CPU
    kvzip bench --json bench.json --plot bench.png         # the full run behind the README results table
    kvzip bench --model qwen2.5-coder-0.5b --methods full,fadkv,zoomr,hf-int4 --workloads reasoning \
        --prompts 50 --json gsm8k.json                     # GSM8K accuracy on a model that can solve it
    kvzip bench --methods full,window --method-set "window:window=256" --method-set "window:window=1024,sinks=8"
    kvzip bench --methods full,hf-int4 --opt hf-int4.residual_length=64 --workloads output,speed --contexts 1024,4096
    torchrun --nproc-per-node 2 -m kvzip bench --quick --json bench.json    # the cells over two ranks; --resume after
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import types
import uuid
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvzip.cli import display
from kvzip.cli.flags import (DictPath, Device, Dtype, Model, Resume, TrustRemoteCode, check_device, cli_words, dict_file,
                               flagged, output_path)
from kvzip.cli.resume import prepare_parts
from kvzip.errors import UserError
from kvzip.files import atomic_path, write_atomic

LOG_WIDTH = 150  # columns of the table in a pipe or log: every column of a run with all workloads fits


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UserError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not values:
        raise UserError(f"{flag} is empty")
    return values


def _config(quick: bool, workloads: str | None, contexts: str | None, prompts: int | None, new_tokens: int | None,
            repeats: int | None, output_tokens: str | None = None, rows: int | None = None,
            kv_budget: str | None = None, capacity_tokens: int | None = None, budgets: str | None = None,
            budget_tier: str | None = None):
    from kvzip.bench import WORKLOADS, BenchConfig
    from kvzip.bench.config import parse_bytes

    chosen = tuple(w.strip() for w in workloads.split(",") if w.strip()) if workloads else WORKLOADS
    cfg = BenchConfig.quick_preset(chosen) if quick else BenchConfig(workloads=chosen)
    changes = {}
    if contexts:
        changes["prompt_contexts"] = changes["speed_contexts"] = _ints(contexts, "--contexts")
    if output_tokens:
        changes["output_tokens"] = _ints(output_tokens, "--output-tokens")
    if rows is not None:
        changes["output_rows"] = rows
    if prompts is not None:
        changes["reasoning_prompts"] = prompts
    if new_tokens is not None:
        changes["reasoning_new_tokens"] = new_tokens
    if repeats is not None:
        changes["repeats"] = repeats
    if kv_budget is not None:
        changes["kv_budget"] = flagged("--kv-budget", parse_bytes, kv_budget)
    if capacity_tokens is not None:
        changes["capacity_tokens"] = capacity_tokens
    if budgets is not None:
        from kvzip.cli.flags import check_fractions

        changes["budgets"] = check_fractions(budgets)
    if budget_tier is not None:
        if not budgets:
            raise UserError("--budget-tier says what --budgets counts: give --budgets too")
        changes["budget_tier"] = budget_tier
    return dataclasses.replace(cfg, **changes) if changes else cfg


def _cell(value, col, best: bool) -> str:
    if value is None:
        return "[dim]-[/dim]"
    text = display.human_bytes(value) if col.fmt == "bytes" else col.fmt.format(value)
    return f"[bold green]{text}*[/bold green]" if best else text


def _table(data: dict):
    from rich.table import Table

    from kvzip.bench.report import COLUMNS, best_marks, summary_rows

    rows = summary_rows(data)
    shown = [c for c in COLUMNS if any(r.get(c.key) is not None for r in rows)]
    marks = best_marks(rows, shown)
    table = Table(title=f"kvzip bench · {data['environment']['model']} · {data['environment']['device']}"
                        f"{' · quick' if data['config']['quick'] else ''}  (* best among methods other than full)")
    table.add_column("method", style="bold")
    for c in shown:
        table.add_column(c.header, justify="right")
    for r in rows:
        table.add_row(r["label"], *(_cell(r[c.key], c, r["label"] in marks.get(c.key, ())) for c in shown))
    return table


def _save_plots(data: dict, path: Path, workloads) -> list[str]:
    """What `--plot` draws, one line per file written: quality against memory at `path` when the output workload
    ran; throughput at equal memory when the capacity workload did, beside it (or at `path` when it is the only
    plot)."""
    from kvzip.bench.report import budget_plot, capacity_plot, plot

    written = []
    if "output" in workloads and any(r.get("budget") is not None for r in data["results"]):
        with atomic_path(path) as tmp:
            budget_plot(data, tmp)
        written.append(f"wrote {path} (key-token top-1 against the memory budget, one line per method)")
    elif "output" in workloads:
        with atomic_path(path) as tmp:
            front = plot(data, tmp)
        written.append(f"wrote {path} (Pareto front: {', '.join(front)})")
    if any(r["workload"] == "capacity" and r.get("decode_tokens_per_s") for r in data["results"]):
        where = capacity_plot_path(path) if "output" in workloads else path
        with atomic_path(where) as tmp:
            capacity_plot(data, tmp)
        written.append(f"wrote {where} (throughput at equal KV memory)")
    return written


def capacity_plot_path(path: Path) -> Path:
    return path.with_name(f"{path.stem}-capacity{path.suffix}")


def bench(
    quick: Annotated[bool, typer.Option("--quick", help="Small version of every workload (minutes on a CPU).")] = False,
    methods: Annotated[Optional[str], typer.Option("--methods", help="Comma-separated methods (default: all registered; full always runs).")] = None,
    opt: Annotated[Optional[list[str]], typer.Option("--opt", help="method.key=value for a method in --methods, repeatable.")] = None,
    method_set: Annotated[Optional[list[str]], typer.Option("--method-set", help='One more setting, "method:key=value,key=value", repeatable.')] = None,
    workloads: Annotated[Optional[str], typer.Option("--workloads", help="Comma-separated: output, prompt, reasoning, recall, speed, capacity (default: all).")] = None,
    output_tokens: Annotated[Optional[str], typer.Option("--output-tokens", help="Teacher-forced output lengths of the output workload, e.g. 1024,4096 (default 1024,4096,8192; --quick 768).")] = None,
    rows: Annotated[Optional[int], typer.Option("--rows", help="Texts fed as one batch in the output workload (default 2).")] = None,
    contexts: Annotated[Optional[str], typer.Option("--contexts", help="Context lengths for prompt and speed, e.g. 1024,4096 (default 1024,4096,8192; --quick 640 for prompt, 1024 for speed).")] = None,
    prompts: Annotated[Optional[int], typer.Option("--prompts", help="GSM8K problems for the reasoning workload (default 8; --quick 2).")] = None,
    new_tokens: Annotated[Optional[int], typer.Option("--new-tokens", help="Greedy tokens per reasoning problem (default 256; --quick 32).")] = None,
    kv_budget: Annotated[Optional[str], typer.Option("--kv-budget", help="KV memory (all tiers) the capacity workload fills, e.g. 256MiB (default: what full needs for 8 rows).")] = None,
    capacity_tokens: Annotated[Optional[int], typer.Option("--capacity-tokens", help="New tokens per row in the capacity workload (default 1024; --quick 256).")] = None,
    budgets: Annotated[Optional[str], typer.Option("--budgets", help="Fractions of full's KV bytes, e.g. 0.125,0.25,0.5: every method other than full runs at each, its options planned per length (docs/benchmarking.md).")] = None,
    budget_tier: Annotated[Optional[str], typer.Option("--budget-tier", help="What --budgets counts: all (every tier, default) or device (what attention needs resident).")] = None,
    repeats: Annotated[Optional[int], typer.Option("--repeats", help="Paired speed measurements per context, median reported (default 2; --quick 1).")] = None,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write the resolved config and every figure here (atomic).")] = None,
    plot_path: Annotated[Optional[Path], typer.Option("--plot", help="PNG: top-1 agreement vs KV memory, Pareto front drawn; with the capacity workload, throughput at equal memory beside it (NAME-capacity.png), or here when output did not run.")] = None,
    model: Model = "smollm2-135m",
    dict_path: DictPath = None,
    device: Device = "auto",
    dtype: Dtype = "auto",
    trust_remote_code: TrustRemoteCode = False,
    resume: Resume = False,
):
    """Benchmark every cache method against full: KV memory, speed, quality (ppl, agreement, GSM8K, recall)."""
    from kvzip import distributed

    world = distributed.World.from_env(os.environ)
    distributed.start(world, device)
    try:
        flags = dict(quick=quick, methods=methods, opt=opt, method_set=method_set, workloads=workloads,
                     output_tokens=output_tokens, rows=rows, contexts=contexts, prompts=prompts, new_tokens=new_tokens,
                     kv_budget=kv_budget, capacity_tokens=capacity_tokens, budgets=budgets, budget_tier=budget_tier,
                     repeats=repeats, json_path=json_path,
                     plot_path=plot_path, model=model, dict_path=dict_path, device=device, dtype=dtype, resume=resume)
        job = distributed.agree(world, lambda: _check(world, **flags), cli_words)
        _run(job, world, model, dtype, trust_remote_code)
    except BaseException:
        distributed.finish(world, together=False)
        raise
    distributed.finish(world)


def _check(world, quick, methods, opt, method_set, workloads, output_tokens, rows, contexts, prompts, new_tokens,
           kv_budget, capacity_tokens, budgets, budget_tier, repeats, json_path, plot_path, model, dict_path, device,
           dtype, resume):
    """Every check of the flags and files, before the model loads: the run's settings, config, paths and record."""
    from kvzip.bench import parse_settings
    from kvzip.bench.config import at_budgets
    from kvzip.bench.workloads import check_data
    from kvzip.methods import METHODS
    from kvzip.models import resolve_device, resolve_dtype
    from kvzip.runs import commit, file_digest

    cfg = _config(quick, workloads, contexts, prompts, new_tokens, repeats, output_tokens, rows, kv_budget, capacity_tokens,
                  budgets, budget_tier)
    settings = at_budgets(parse_settings(methods, opt, method_set, list(METHODS)), cfg.budgets)
    check_data(cfg)
    if plot_path is not None:
        if plot_path.suffix.lower() != ".png":
            raise UserError(f"--plot writes a PNG: give a path ending in .png, got {plot_path}")
        if "output" not in cfg.workloads and "capacity" not in cfg.workloads:
            raise UserError("--plot needs the output workload (top-1 agreement vs KV memory) or the capacity workload "
                            "(throughput at equal KV memory): add one to --workloads")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UserError("--plot needs matplotlib: pip install matplotlib") from None
    dict_path = dict_file(dict_path)
    if dict_path is not None and not any(s.build().needs_dictionary for s in settings):
        raise UserError("--dict is for methods that use a dictionary; none of these settings uses one")
    json_path, plot_path = output_path(json_path, "--json"), output_path(plot_path, "--plot")
    if resume and json_path is None:
        raise UserError("--resume continues the run that writes --json: give that --json")
    if world.size > 1 and json_path is None:
        raise UserError(f"{world.size} ranks write one merged JSON: give --json FILE, a path every rank can reach")
    check_device(device, dtype)
    dev = flagged("--device", world.device, resolve_device(device))
    record = {"model": model, "dict": file_digest(dict_path) if dict_path else None, "config": cfg.describe(),
              "settings": [{"label": s.label, "method": s.name, "options": s.build().describe()["options"],
                            "budget": s.budget} for s in settings],
              "device": dev.type, "dtype": str(resolve_dtype(dtype, dev)).replace("torch.", "")}
    return types.SimpleNamespace(settings=settings, cfg=cfg, json_path=json_path, plot_path=plot_path,
                                 dict_path=dict_path, device=dev, resume=resume,
                                 record=json.loads(json.dumps(record)), commit=commit())


def _finished_run(path: Path) -> dict | None:
    """The job record of a finished bench JSON (an interrupted one is not finished)."""
    data = json.loads(path.read_text())
    return None if data.get("interrupted") else data.get("run")


def _run(job, world, model: str, dtype: str, trust_remote_code: bool) -> None:
    """Past every flag check: the pieces folder, the model, this rank's cells, then rank 0's merge and report."""
    from kvzip import distributed
    from kvzip.bench import run_bench
    from kvzip.bench.cells import assign
    from kvzip.bench.runner import merge
    from kvzip.models import load_model
    from kvzip.runs import Parts, parts_folder

    parts = Parts(parts_folder(job.json_path)) if job.json_path is not None else None
    run_id = distributed.broadcast(world, uuid.uuid4().hex[:12])
    finished = []
    if parts is not None:
        finished = prepare_parts(world, parts, job.record, job.commit, job.resume, job.json_path, _finished_run, run_id)
    if finished is None:
        if world.main:
            display.console.print(f"nothing to measure: {job.json_path} holds every cell of this run", soft_wrap=True)
        return
    lm, tokenizer, source = distributed.agree(world, lambda: load_model(model, job.device, dtype, trust_remote_code),
                                              cli_words)
    every, chosen = [], []  # the run's cells, this rank's share of those left

    def share(cells):
        every[:] = cells
        chosen[:] = assign([c for c in cells if c.piece not in finished], job.cfg, world)
        return chosen

    def on_cell(cell, outcome):
        if parts is not None:
            parts.write(cell.piece, {"cell": cell.index, "label": cell.label, "workload": cell.workload,
                                     "rank": world.rank, "run": run_id, **outcome})

    bar = display.progress()
    task = bar.add_task("bench" if world.size == 1 else f"rank 0 of {world.size}", total=None)
    last = [""]

    def on_progress(done, total, description):
        if not world.main:
            return
        bar.update(task, completed=done, total=total, description=description)
        if description != last[0] and not display.console.is_terminal:  # a log gets one line per step instead
            display.console.print(f"{done}/{total} {description}")
            last[0] = description

    with bar if world.main else contextlib.nullcontext():
        data = run_bench(lm, tokenizer, source, job.settings, job.cfg, job.dict_path, on_progress, share, on_cell)
    mine = {"rank": world.rank, "device": str(lm.device), "cells": [c.index for c in chosen],
            "reference_runs": data.pop("reference_runs"), "wall_s": data["wall_s"],
            "peak_rss_bytes": data["process"]["peak_rss_bytes"]}
    if parts is None:  # one process, no --json: the run is all in `data`
        _report(data, job, interrupted_hint="")
        return
    if not data["interrupted"]:
        try:
            distributed.wait_all(world)  # every rank's cells are in the folder
        except KeyboardInterrupt:
            data["interrupted"] = True
    ranks = [mine] if data["interrupted"] else distributed.all_gather(world, mine)
    if not world.main:
        if data["interrupted"]:
            raise typer.Exit(130)
        return
    pieces = {p["cell"]: p for p in (parts.read(name) for name in parts.finished())}
    run = {"id": run_id, "settings": job.record, "commit": job.commit, "earlier_cells": len(finished)}
    merged = merge(data, pieces, every, ranks, run)
    hint = (f"; {len(pieces)} of {len(every)} cells are finished in {parts.folder}: run the same command with --resume "
            "to finish" if merged["interrupted"] else "")
    _report(merged, job, hint)
    if not merged["interrupted"]:
        parts.remove()  # only now: the merged JSON holds every cell


def _report(data: dict, job, interrupted_hint: str) -> None:
    """Rank 0: the table, the notes, the JSON and plots; exit 130 when interrupted, 1 when a setting failed."""
    data["command"] = "kvzip bench " + " ".join(_argv())
    if not display.out.is_terminal:  # a pipe or log gets the whole table, not one squeezed to 80 columns
        display.out.width = max(display.out.width, LOG_WIDTH)
    display.out.print(_table(data))
    for note in data["skipped"]:
        display.console.print(f"[yellow]skipped[/yellow] {note['label']}{' ' + note['workload'] if 'workload' in note else ''}: {note['reason']}")
    for r in data["results"]:
        for e in r.get("by_context") or [r]:
            if e.get("budget_mark"):
                at = f" at {e['context']}" if "context" in e else ""
                display.console.print(f"[yellow]off budget[/yellow] {r['label']} {r['workload']}{at}: {e['budget_mark']}",
                                      soft_wrap=True)
    for fail in data["failed"]:
        display.console.print(f"[red]failed[/red] {fail['label']} {fail['workload']}: {fail['error']}")
    env = data["environment"]
    ranks = f" on each of {len(data['ranks'])} ranks" if len(data.get("ranks", ())) > 1 else ""
    display.console.print(f"{data['wall_s']:.0f} s on {env['device']}{ranks} ({env['torch_threads']} threads, load average "
                          f"{env['load_average_start'][0]} -> {env['load_average_end'][0]}); peak RSS "
                          f"{display.human_bytes(data['process']['peak_rss_bytes'])}; speed ratios are against full in this run")
    if job.json_path is not None:
        write_atomic(job.json_path, json.dumps(data, indent=1) + "\n")
        display.console.print(f"wrote {job.json_path}")
    if job.plot_path is not None:
        for line in _save_plots(data, job.plot_path, job.cfg.workloads):
            display.console.print(line)
    if data["interrupted"]:
        display.console.print(f"[yellow]interrupted[/yellow]: {len(data['results'])} finished records kept{interrupted_hint}",
                              soft_wrap=True)
        raise typer.Exit(130)
    if data["failed"]:
        raise typer.Exit(1)


def _argv() -> list[str]:
    import sys

    args = sys.argv[1:]
    return args[1:] if args and args[0] == "bench" else args
