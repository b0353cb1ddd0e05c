"""`kvzip generate`: one prompt (streamed) or a JSONL batch, with any cache method."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvzip.cli import display
from kvzip.cli.options import DictPath, Device, Dtype, MethodName, Model, Opts, TrustRemoteCode, parse_opts
from kvzip.errors import UserError
from kvzip.files import publish


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
            items.append(obj["prompt"])
        elif isinstance(obj, dict) and isinstance(obj.get("messages"), list):
            items.append(obj["messages"])
        else:
            raise UserError(f'{path}:{n}: each line needs "prompt" (a string) or "messages" (a list)')
    if not items:
        raise UserError(f"{path} holds no prompts")
    return items


def write_atomic(path: Path, text: str) -> None:
    """Write to a temporary file beside `path`, then rename: a reader never sees a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        publish(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def generate(
    prompt: Annotated[Optional[str], typer.Argument(help="The prompt (omit when using --input).")] = None,
    input: Annotated[Optional[Path], typer.Option("--input", "-i", help='JSONL file: one {"prompt": ...} or {"messages": [...]} per line.')] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="JSONL results file (prompt, completion, tokens, stats), written atomically.")] = None,
    model: Model = "smollm2-135m",
    method: MethodName = "full",
    opt: Opts = None,
    dict_path: DictPath = None,
    max_new_tokens: Annotated[int, typer.Option(help="Stop after this many new tokens.")] = 256,
    temperature: Annotated[float, typer.Option(help="Sampling temperature; 0 is greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass.")] = 1.0,
    top_k: Annotated[int, typer.Option(help="Sample among the k most likely tokens; 0 is off.")] = 0,
    seed: Annotated[Optional[int], typer.Option(help="Seed for reproducible sampling.")] = None,
    stop: Annotated[Optional[list[str]], typer.Option(help="Stop string, repeatable.")] = None,
    ignore_eos: Annotated[bool, typer.Option(help="Keep generating past end-of-sequence (for benchmarks).")] = False,
    raw: Annotated[bool, typer.Option(help="Skip the chat template: feed the prompt as it is.")] = False,
    system: Annotated[Optional[str], typer.Option(help="System message for the chat template.")] = None,
    batch_size: Annotated[int, typer.Option(help="Prompts decoded together from --input (left-padded).")] = 8,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object per prompt instead of text.")] = False,
    list_methods: Annotated[bool, typer.Option("--list-methods", help="List methods and their options, then exit.")] = False,
    device: Device = "auto",
    dtype: Dtype = "auto",
    trust_remote_code: TrustRemoteCode = False,
):
    """Generate with a compressed KV cache: one prompt (streamed) or a JSONL batch."""
    from kvzip.methods import METHODS, get_method

    if list_methods:
        for name, cls in METHODS.items():
            opts = ", ".join(f"{k}={f.default}" for k, f in cls.options().items())
            display.out.print(f"[bold]{name}[/bold]: {cls.summary}" + (f"  [dim]({opts})[/dim]" if opts else ""))
        return
    if (prompt is None) == (input is None):
        raise UserError("give either a prompt or --input FILE.jsonl")
    if batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {batch_size}")
    cache_method = get_method(method, parse_opts(opt))
    items = [prompt] if prompt is not None else read_jsonl_prompts(input)

    from kvzip import engine
    from kvzip.dictfiles import dictionaries_for
    from kvzip.models import load_model

    settings = engine.Settings(max_new_tokens, temperature, top_p, top_k, seed, tuple(stop or ()), ignore_eos)
    with display.console.status(f"loading {model} (the first load of a GGUF converts it once, ~30 s)"):
        lm, tokenizer, source = load_model(model, device, dtype, trust_remote_code)
    dictionaries = dictionaries_for(cache_method, lm, source, dict_path)
    encoded = [engine.encode(tokenizer, item, raw, system) for item in items]
    for ids in encoded:
        engine.check_context(lm, len(ids), max_new_tokens)

    records = []
    streaming = len(items) == 1 and not json_out
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
                    item = items[start + event.row]
                    records.append({
                        "prompt": item,
                        "completion": event.text,
                        "finish_reason": event.finish_reason,
                        "prompt_tokens": event.prompt_tokens,
                        "new_tokens": len(event.token_ids),
                        "tokens": event.token_ids,
                        **cache_method.describe(),
                        **{k: v for k, v in event.stats.items() if k not in ("prompt_tokens", "new_tokens")},
                    })
                    if bar is not None:
                        bar.advance(task)
            if any(r["finish_reason"] == "interrupted" for r in records):
                break  # Ctrl-C landed inside the engine: keep what finished, start no new batch
        if bar is not None:
            bar.stop()
    except KeyboardInterrupt:
        if output is not None and records:
            write_atomic(output, "".join(json.dumps(r) + "\n" for r in records))
            display.console.print(f"interrupted: {len(records)} finished results written to {output}")
        else:
            display.console.print("kvzip: interrupted")
        raise typer.Exit(130) from None
    if streaming:
        display.out.print()
        display.out.file.flush()  # the summary goes to stderr: keep it after the streamed text
        display.console.print(display.summary_line(records[0]))
    elif json_out:
        for r in records:
            print(json.dumps(r))
    elif output is None:
        for r in records:
            shown = r["prompt"] if isinstance(r["prompt"], str) else r["prompt"][-1]["content"]
            display.out.print(f">>> {shown}", style="bold", markup=False)
            display.out.print(r["completion"], markup=False)
            display.console.print(display.summary_line(r))
    if output is not None:
        write_atomic(output, "".join(json.dumps(r) + "\n" for r in records))
        display.console.print(f"wrote {len(records)} results to {output}")
    if any(r["finish_reason"] == "interrupted" for r in records):
        display.console.print("kvzip: interrupted")
        raise typer.Exit(130)
