"""`kvzip generate`: one prompt (streamed) or a JSONL batch, with any cache method, in one process or over many.

With `--output`, a batch job is data-parallel and resumable. Under `torchrun --nproc-per-node N -m kvzip generate`,
each rank takes a fixed share of the batches (`kvzip.batches`: whole batches of consecutive rows, so every row is
decoded as one process would), publishes each finished batch in OUTPUT.parts (`kvzip.runs`), and rank 0 writes OUTPUT
in input order once every rank is done. `--resume` generates only the batches that an earlier run, or a rank that
died, left unfinished. One process is the same code with a world of one (`kvzip.distributed`). Every check a user's
input can fail runs on every rank and is agreed on before any model loads, so a bad input is one line from rank 0.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvzip.cli import display
from kvzip.cli.jobs import JobSpec, check_job, finished_run
from kvzip.cli.flags import (BudgetFraction, DeviceMap, DictPath, Device, Dtype, MethodName, Model, Opts, Resume, Seed,
                               Temperature, TopK, TopP, TrustRemoteCode, budgeted, cli_words, parse_opts)
from kvzip.cli.resume import prepare_parts
from kvzip.files import write_atomic

OUTPUT_HELP = ("JSONL file, written atomically: one line per prompt (prompt, completion, finish_reason, prompt_tokens, "
               "new_tokens, tokens), then one {\"summary\": ...} line with the method, the model, each batch's figures "
               "(timing, KV memory, method stats) and each rank's. Finished batches wait in OUTPUT.parts until all are done.")


def generate(
    prompt: Annotated[Optional[str], typer.Argument(help="The prompt (omit when using --input).")] = None,
    input: Annotated[Optional[Path], typer.Option("--input", "-i", help='JSONL file: one {"prompt": ...} or {"messages": [...]} per line.')] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help=OUTPUT_HELP)] = None,
    resume: Resume = False,
    model: Model = "smollm2-135m",
    method: MethodName = "full",
    opt: Opts = None,
    budget: BudgetFraction = None,
    dict_path: DictPath = None,
    max_new_tokens: Annotated[int, typer.Option(help="Stop after this many new tokens.")] = 256,
    temperature: Temperature = 0.0,
    top_p: TopP = 1.0,
    top_k: TopK = 0,
    seed: Seed = None,
    stop: Annotated[Optional[list[str]], typer.Option(help="Stop string, repeatable.")] = None,
    ignore_eos: Annotated[bool, typer.Option(help="Keep generating past end-of-sequence (for benchmarks).")] = False,
    raw: Annotated[bool, typer.Option(help="Skip the chat template: feed the prompt as it is.")] = False,
    system: Annotated[Optional[str], typer.Option(help="System message for the chat template.")] = None,
    batch_size: Annotated[int, typer.Option(help="Prompts decoded together from --input (left-padded); ranks take whole batches.")] = 8,
    json_out: Annotated[bool, typer.Option("--json", help="Print the --output lines on stdout instead of text.")] = False,
    list_methods: Annotated[bool, typer.Option("--list-methods", help="List methods and their options, then exit.")] = False,
    device: Device = "auto",
    device_map: DeviceMap = None,
    dtype: Dtype = "auto",
    trust_remote_code: TrustRemoteCode = False,
):
    """Generate with a compressed KV cache: one prompt (streamed) or a JSONL batch, on one or many ranks."""
    if list_methods:
        from kvzip.methods import METHODS

        for name, cls in METHODS.items():
            opts = ", ".join(f"{k}={f.default}" for k, f in cls.options().items())
            display.out.print(f"[bold]{name}[/bold]: {cls.summary}" + (f"  [dim]({opts})[/dim]" if opts else ""))
        return
    from kvzip import distributed

    world = distributed.World.from_env(os.environ)
    distributed.start(world, device)
    try:
        spec = JobSpec(prompt=prompt, input=input, output=output, resume=resume, model=model, method=method,
                       budget=budget, opt=opt,
                       dict_path=dict_path, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                       top_k=top_k, seed=seed, stop=tuple(stop or ()), ignore_eos=ignore_eos, raw=raw, system=system,
                       batch_size=batch_size, json_out=json_out, device=device, device_map=device_map, dtype=dtype,
                       trust_remote_code=trust_remote_code)
        job = distributed.agree(world, lambda: check_job(spec, world), cli_words)
        _run(spec, job, world)
    except BaseException:
        distributed.finish(world, together=False)
        raise
    distributed.finish(world)


def _run(spec: JobSpec, job, world) -> None:
    """Past every flag check: the pieces folder, the model, the batches of this rank, then rank 0's merge."""
    from kvzip import batches, distributed, engine
    from kvzip.dictionary_lookup import dictionaries_for
    from kvzip.models import load_model
    from kvzip.runs import Parts, parts_folder

    parts = Parts(parts_folder(job.output)) if job.output is not None else None
    run_id = distributed.broadcast(world, uuid.uuid4().hex[:12])
    finished = []
    if parts is not None:
        finished = prepare_parts(world, parts, job.settings_record, job.commit, job.spec.resume, job.output,
                                 finished_run, run_id)
    if finished is None:  # --resume on a finished output of this same job
        if world.main:
            display.console.print(f"nothing to generate: {job.output} holds every row of this job", soft_wrap=True)
        return
    agreed = lambda check: distributed.agree(world, check, cli_words)  # noqa: E731
    status = display.console.status(f"loading {spec.model} (the first load of a GGUF converts it once, ~30 s)")
    with status if world.main else contextlib.nullcontext():
        lm, tokenizer, source = agreed(lambda: load_model(spec.model, job.device, spec.dtype, spec.trust_remote_code,
                                                          job.placement))
    raw = spec.raw
    if not raw and tokenizer.chat_template is None:
        agreed(lambda: job.check_plain_prompts())
        # A base model (Gemma 3 270M is one) ships no template: its prompts are text to continue, so say so and go on.
        if world.main:
            display.console.print(f"[dim]{source.name} has no chat template (a base model): prompts are fed as raw text[/dim]")
        raw = True
    encoded = agreed(lambda: job.encode(lm, tokenizer, raw))
    if job.budget is not None:  # the options for F of full's bytes, for the longest prompt and --max-new-tokens
        longest = max(len(ids) for ids in encoded)
        job.method, line = agreed(lambda: budgeted(spec.method, parse_opts(spec.opt), job.budget, lm, longest,
                                                   spec.max_new_tokens))
        if world.main:
            display.console.print(line, soft_wrap=True)
    dictionaries = agreed(lambda: dictionaries_for(job.method, lm, source, job.dict_path))

    settings = job.settings
    rows = batches.batch_rows(len(job.items), spec.batch_size)
    done = {k for k in range(len(rows)) if batches.piece_name(k) in finished}  # by an earlier run
    pending = [k for k in range(len(rows)) if k not in done]
    mine = distributed.deal(pending, world)
    if not mine and world.size > 1:
        display.console.print(f"rank {world.rank}: idle: {len(pending)} batch(es) of {spec.batch_size} rows left for "
                              f"{world.size} ranks (a smaller --batch-size makes more)", soft_wrap=True)
    streaming = len(job.items) == 1 and not spec.json_out and world.size == 1
    kept: list = []
    t0 = time.perf_counter()
    bar = None if streaming or not world.main or not mine else display.progress()
    try:  # Ctrl-C, here or while waiting for the other ranks, keeps every finished batch
        if bar is not None:
            bar.start()
            task = bar.add_task("generating" if world.size == 1 else f"rank 0 of {world.size}",
                                total=sum(len(rows[k]) for k in mine))

        def on_event(event):
            if isinstance(event, engine.Token) and streaming:
                display.out.print(event.text, end="", markup=False)
            elif isinstance(event, engine.Result) and bar is not None:
                bar.advance(task)

        for k in mine:
            batch = batches.generate_batch(lm, tokenizer, job.method, dictionaries, job.items, encoded, k, rows[k],
                                           settings, on_event)
            if batch.interrupted:  # Ctrl-C landed inside the engine: the batch is not kept, start no other
                raise KeyboardInterrupt
            if parts is not None:
                parts.write(batches.piece_name(k), batch.piece(world.rank, run_id))
            kept.append(batch)
        if bar is not None:
            bar.stop()
        distributed.wait_all(world)  # every rank is done: its batches are in the folder
    except KeyboardInterrupt:
        if bar is not None:
            bar.stop()
        _interrupted(world, parts, len(rows), streaming, kept)
    cuda_peak = None
    if lm.device.type == "cuda":
        import torch

        cuda_peak = torch.cuda.max_memory_allocated(lm.device)
    mine_summary = batches.rank_summary(world.rank, kept, time.perf_counter() - t0, str(lm.device), cuda_peak)
    ranks = distributed.all_gather(world, mine_summary)
    if not world.main:
        return
    pieces = [parts.read(batches.piece_name(k)) for k in range(len(rows))] if parts is not None else \
        [b.piece(world.rank, run_id) for b in kept]
    records, batch_stats = batches.merge(pieces, len(rows))
    totals = batches.run_summary(ranks, len(records), sum(len(rows[k]) for k in done))
    summary = {"summary": {**job.method.describe(), "model": source.name, "rows": len(records), "batches": batch_stats,
                           "totals": totals, "ranks": ranks, "run": {"id": run_id, **job.record()}}}
    _show(records, batch_stats, streaming, spec.json_out, job.output, summary)
    if job.output is not None:
        write_atomic(job.output, _jsonl(records, summary))
        parts.remove()  # only now: the merged file holds every piece
        display.console.print(f"wrote {len(records)} results and a summary to {job.output}")
        if world.size > 1 or totals["earlier_rows"]:
            display.console.print(display.run_line(totals, ranks), soft_wrap=True)


def _interrupted(world, parts, total: int, streaming: bool, kept: list) -> None:
    """Ctrl-C (or a stop from torchrun): what is kept and how to go on, said once, by rank 0; exit 130. Without
    --output, the batches that finished are shown first."""
    if streaming:
        display.out.print()
    elif parts is None and kept:
        _show([r for b in kept for r in b.records], [b.stats for b in kept], False, False, None, {})
    if world.main:
        if parts is not None:
            finished = len(parts.finished())  # every rank's, as far as they got
            display.console.print(f"kvzip: interrupted: {finished} of {total} batches are finished in {parts.folder} "
                                  "(the batch in flight is not kept); run the same command with --resume to finish", soft_wrap=True)
        else:
            display.console.print("kvzip: interrupted")
    raise typer.Exit(130)


def _jsonl(records: list[dict], summary: dict) -> str:
    return "".join(json.dumps(r) + "\n" for r in [*records, summary])


def _show(records: list[dict], batches: list[dict], streaming: bool, json_out: bool, output: Path | None,
          summary: dict) -> None:
    """Print the results: the streamed text's summary line, JSON lines, or each prompt with its answer."""
    if streaming:
        display.out.print()
        display.out.file.flush()  # the summary goes to stderr: keep it after the streamed text
        display.console.print(display.summary_line(batches[0]), soft_wrap=True)
    elif json_out:
        print(_jsonl(records, summary), end="")
    elif output is None:
        for r in records:
            shown = r["prompt"] if isinstance(r["prompt"], str) else r["prompt"][-1]["content"]
            display.out.print(f">>> {shown}", style="bold", markup=False)
            display.out.print(r["completion"], markup=False)
            display.console.print(f"{r['prompt_tokens']} prompt + {r['new_tokens']} new tokens ({r['finish_reason']})")
        for b in batches:
            rows = f"rows {b['first_row'] + 1}-{b['first_row'] + b['rows']}" if b["rows"] > 1 else f"row {b['first_row'] + 1}"
            display.console.print(f"{rows}: {display.summary_line(b)}", soft_wrap=True)
