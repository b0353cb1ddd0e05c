"""Options shared by several commands, defined once as Annotated aliases, and the checks every command runs on them
before any model work: `--opt key=value` parsing, sampling flags, device and dtype, output paths and `--dict` files.

The library states an error in its own terms (a path, a device name); the checks here call it and put the flag the
user typed in front, so a message says both what is wrong and where it came from."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Optional, TypeVar

import typer

from kvzip.errors import UserError

Model = Annotated[str, typer.Option("--model", "-m", help="Alias (smollm2-135m, qwen2.5-coder-0.5b), HF folder, .gguf file or hub id.")]
Device = Annotated[str, typer.Option(help="auto (CUDA if available), cpu or cuda.")]
Dtype = Annotated[str, typer.Option(help="auto (bfloat16 where the hardware runs it natively: CUDA, CPUs with AMX or AVX-512 BF16; else float32), float32, bfloat16 or float16.")]
MethodName = Annotated[str, typer.Option("--method", help="Cache method; `kvzip generate --list-methods` lists them.")]
Opts = Annotated[Optional[list[str]], typer.Option("--opt", help="Method option key=value, repeatable.")]
BudgetFraction = Annotated[Optional[str], typer.Option("--budget", help="A fraction of full's KV bytes (0, 1], e.g. 0.25: the method's options are planned for it, with --max-new-tokens as the length (docs/benchmarking.md).")]
DictPath = Annotated[Optional[Path], typer.Option("--dict", help="Dictionary file for dictionary methods (default: the one shipped for the model).")]
TrustRemoteCode = Annotated[bool, typer.Option(help="Allow a hub model's own Python code to run.")]
Resume = Annotated[bool, typer.Option("--resume", help="Finish what an earlier run with the same settings and commit left undone, reading its finished pieces (OUTPUT.parts); refused when anything differs.")]
DeviceMap = Annotated[Optional[str], typer.Option("--device-map", help="Place one model over several devices with accelerate: auto, balanced, balanced_low_0, sequential, or a JSON object (inline or a .json file) of module name -> GPU index or \"cpu\".")]
Seed = Annotated[Optional[int], typer.Option(help="Seed for reproducible sampling (default: none, unseeded).")]
Temperature = Annotated[float, typer.Option(help="Sampling temperature; 0 is greedy.")]
TopP = Annotated[float, typer.Option(help="Nucleus sampling mass.")]
TopK = Annotated[int, typer.Option(help="Sample among the k most likely tokens; 0 is off.")]

T = TypeVar("T")


def flagged(flag: str, check: Callable[..., T], *args) -> T:
    """`check(*args)`, a library check, with its UserError prefixed by the flag whose value it checked."""
    try:
        return check(*args)
    except UserError as exc:
        raise UserError(f"{flag}: {exc}") from None


def cli_words(exc: UserError) -> str:
    """A library error as the command line says it: where the library's advice names its own terms (a dictionary
    to make and where), the advice with the command and flags to use; any other error as it is."""
    from kvzip.dictionary_lookup import MissingDictionary

    if isinstance(exc, MissingDictionary):
        return (f"method '{exc.method}' needs a dictionary and {exc.path} does not exist: train one with "
                f"`kvzip train-dict --model {exc.model} --keys {exc.keys} --out {exc.path}` or pass --dict")
    return str(exc)


def parse_opts(opts: list[str] | None) -> dict[str, str]:
    parsed = {}
    for item in opts or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"--opt takes key=value, got {item!r}")
        parsed[key.strip()] = value.strip()
    return parsed


def check_choice(flag: str, value: str, allowed) -> None:
    """A flag whose value must be one of `allowed`."""
    if value not in allowed:
        raise UserError(f"{flag} must be one of {', '.join(allowed)}, got {value!r}")


def check_sampling(max_new_tokens: int, temperature: float, top_p: float, top_k: int) -> None:
    """The decoding flags, checked in the flags' own words before torch is imported."""
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if temperature < 0:
        raise UserError(f"--temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise UserError(f"--top-p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise UserError(f"--top-k must be >= 0, got {top_k}")


def output_path(path: Path | None, flag: str) -> Path | None:
    """`path` once a file can be published there (kvzip.files.check_writable), the error naming `flag`."""
    from kvzip.files import check_writable

    return None if path is None else flagged(flag, check_writable, path)


def dict_file(path: Path | None) -> Path | None:
    """`--dict` once it names an existing file (not a directory)."""
    from kvzip.dictionary_lookup import check_dictionary_file

    return None if path is None else flagged("--dict", check_dictionary_file, path)


def check_device(device: str, dtype: str) -> None:
    """`--device` and `--dtype` as kvzip.models resolves them (a GPU asked for must be visible), before the model
    loads. Imports torch: call it after the checks that need no torch."""
    from kvzip.models import resolve_device, resolve_dtype

    flagged("--dtype", resolve_dtype, dtype, flagged("--device", resolve_device, device))


def check_fraction(text: str, flag: str = "--budget") -> float:
    """A budget as the user typed it -> F, or a UserError saying what is allowed."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise UserError(f"{flag} takes a fraction of full's KV bytes in (0, 1], e.g. 0.25; got {text!r}") from None
    if not (math.isfinite(value) and 0 < value <= 1):
        raise UserError(f"{flag} takes a fraction of full's KV bytes in (0, 1], e.g. 0.25; got {text!r}")
    return value


def check_fractions(text: str, flag: str = "--budgets") -> tuple[float, ...]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise UserError(f"{flag} takes comma-separated fractions of full's KV bytes in (0, 1], e.g. 0.125,0.25")
    values = tuple(check_fraction(p, flag) for p in parts)
    if len(set(values)) != len(values):
        raise UserError(f"{flag} lists the same budget twice: {text!r}")
    return values


def budgeted(name: str, opts: dict[str, str], fraction: float | None, model, prompt_tokens: int, new_tokens: int):
    """(method, the line saying what the budget became) for `--budget`; the method as given, and no line, without."""
    from kvzip.budget import at_budget
    from kvzip.methods import get_method

    if fraction is None:
        return get_method(name, opts), None
    method, plan = at_budget(name, fraction, model, prompt_tokens, new_tokens, opts=opts)
    chosen = ", ".join(f"{k}={v}" for k, v in plan.options.items() if opts.get(k) != v) or "its own options"
    line = f"budget {fraction:g} of full's KV bytes for {prompt_tokens} + {new_tokens} tokens: {name} with {chosen}"
    return method, line + (f" ({plan.note})" if plan.note else f" (expected {plan.expected:.3f})")
