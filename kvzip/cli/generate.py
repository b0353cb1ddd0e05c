"""`kvzip generate`: one prompt (streamed) or a JSONL batch, with any cache method."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvzip.cli import display
from kvzip.cli.options import (DictPath, Device, Dtype, MethodName, Model, Opts, Seed, Temperature, TopK, TopP,
                               TrustRemoteCode, check_device, check_sampling, dict_file, output_path, parse_opts)
from kvzip.errors import UserError
from kvzip.files import write_atomic


def read_jsonl_prompts(path: Path) -> list:
    """Each line: {"prompt": "..."} or {"messages": [...]}; UserError naming the bad line otherwise."""
    if not path.is_file():
        raise UserError(f"input file not found: {path}")
    items = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
        if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            if not obj["prompt"].strip():
                raise UserError(f"{path}:{n}: the prompt is empty")
            items.append(obj["prompt"])
        elif isinstance(obj, dict) and isinstance(obj.get("messages"), list):
            if not obj["messages"]:
                raise UserError(f"{path}:{n}: the messages list is empty")
            items.append(obj["messages"])
        else:
            raise UserError(f'{path}:{n}: each line needs "prompt" (a string) or "messages" (a list)')
    if not items:
        raise UserError(f"{path} holds no prompts")
    return items


OUTPUT_HELP = ("JSONL file, written atomically: one line per prompt (prompt, completion, finish_reason, prompt_tokens, "
               "new_tokens, tokens), then one {\"summary\": ...} line with the method, the model and each batch's "
               "figures (timing, KV memory, method stats).")


def generate(
    prompt: Annotated[Optional[str], typer.Argument(help="The prompt (omit when using --input).")] = None,
    input: Annotated[Optional[Path], typer.Option("--input", "-i", help='JSONL file: one {"prompt": ...} or {"messages": [...]} per line.')] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help=OUTPUT_HELP)] = None,
    model: Model = "smollm2-135m",
    method: MethodName = "full",
    opt: Opts = None,
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
    batch_size: Annotated[int, typer.Option(help="Prompts decoded together from --input (left-padded).")] = 8,
    json_out: Annotated[bool, typer.Option("--json", help="Print the --output lines on stdout instead of text.")] = False,
    list_methods: Annotated[bool, typer.Option("--list-methods", help="List methods and their options, then exit.")] = False,
    device: Device = "auto",
    dtype: Dtype = "auto",
    trust_remote_code: TrustRemoteCode = False,
):
    """Generate with a compressed KV cache: one prompt (streamed) or a JSONL batch."""
    if list_methods:
        from kvzip.methods import METHODS

        for name, cls in METHODS.items():
            opts = ", ".join(f"{k}={f.default}" for k, f in cls.options().items())
            display.out.print(f"[bold]{name}[/bold]: {cls.summary}" + (f"  [dim]({opts})[/dim]" if opts else ""))
        return
    # 1. Everything the flags alone can tell, before torch is imported.
    if (prompt is None) == (input is None):
        raise UserError("give either a prompt or --input FILE.jsonl")
    if prompt is not None and not prompt.strip():
        raise UserError("the prompt is empty: give the text to answer")
    if batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {batch_size}")
    check_sampling(max_new_tokens, temperature, top_p, top_k)
    output = output_path(output, "--output")
    dict_path = dict_file(dict_path)
    items = [prompt] if prompt is not None else read_jsonl_prompts(input)
    if raw and any(not isinstance(item, str) for item in items):
        raise UserError("--raw takes plain prompts, not chat messages")

    # 2. The method and its options, then the model.
    from kvzip.methods import get_method

    cache_method = get_method(method, parse_opts(opt))
    if dict_path is not None and not cache_method.needs_dictionary:
        raise UserError(f"--dict is for methods that use a dictionary; '{cache_method.name}' with these options uses none")
    check_device(device, dtype)

    from kvzip import engine
    from kvzip.dictfiles import dictionaries_for
    from kvzip.models import load_model

    settings = engine.Settings(max_new_tokens, temperature, top_p, top_k, seed, tuple(stop or ()), ignore_eos)
    with display.console.status(f"loading {model} (the first load of a GGUF converts it once, ~30 s)"):
        lm, tokenizer, source = load_model(model, device, dtype, trust_remote_code)
    dictionaries = dictionaries_for(cache_method, lm, source, dict_path)
    if not raw and tokenizer.chat_template is None:
        if any(not isinstance(item, str) for item in items):
            raise UserError("this model's tokenizer has no chat template, so it cannot take chat messages: "
                            "give plain prompts")
        # A base model (Gemma 3 270M is one) ships no template: its prompts are text to continue, so say so and go on.
        display.console.print(f"[dim]{source.name} has no chat template (a base model): prompts are fed as raw text[/dim]")
        raw = True
    encoded = [engine.encode(tokenizer, item, raw, system) for item in items]
    for ids in encoded:
        engine.check_context(lm, len(ids), max_new_tokens)

    # 3. Generate batch by batch; rows carry their own figures, each batch's Summary goes into one summary.
    records, batches = [], []
    streaming = len(items) == 1 and not json_out
    summary = lambda: {"summary": {**cache_method.describe(), "model": source.name, "rows": len(records),  # noqa: E731
                                   "batches": batches}}
    try:
        bar = None if streaming else display.progress()
        if bar is not None:
            bar.start()
            task = bar.add_task("generating", total=len(items))
        for start in range(0, len(items), batch_size):
            chunk = encoded[start : start + batch_size]
            cache = cache_method.make_cache(lm, dictionaries)
            for event in engine.generate(lm, tokenizer, chunk, cache, settings):
                if isinstance(event, engine.Token) and streaming:
                    display.out.print(event.text, end="", markup=False)
                elif isinstance(event, engine.Result):
                    records.append({
                        "prompt": items[start + event.row],
                        "completion": event.text,
                        "finish_reason": event.finish_reason,
                        "prompt_tokens": event.prompt_tokens,
                        "new_tokens": len(event.token_ids),
                        "tokens": event.token_ids,
                    })
                    if bar is not None:
                        bar.advance(task)
                elif isinstance(event, engine.Summary):
                    batches.append({"first_row": start, **event.stats})
            if any(r["finish_reason"] == "interrupted" for r in records):
                break  # Ctrl-C landed inside the engine: keep what finished, start no new batch
        if bar is not None:
            bar.stop()
    except KeyboardInterrupt:
        if output is not None and records:
            write_atomic(output, _jsonl(records, summary()))
            display.console.print(f"interrupted: {len(records)} finished results written to {output}")
        else:
            display.console.print("kvzip: interrupted")
        raise typer.Exit(130) from None
    _show(records, batches, streaming, json_out, output, summary())
    if output is not None:
        write_atomic(output, _jsonl(records, summary()))
        display.console.print(f"wrote {len(records)} results and a summary to {output}")
    if any(r["finish_reason"] == "interrupted" for r in records):
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
        display.console.print(display.summary_line(batches[0]))
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
            display.console.print(f"{rows}: {display.summary_line(b)}")
