"""Options shared by several commands, defined once as Annotated aliases, and the checks every command runs on them
before any model work: `--opt key=value` parsing, sampling flags, output paths and `--dict` files, each worded with
the flag the user typed."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from kvzip.errors import UserError

Model = Annotated[str, typer.Option("--model", "-m", help="Alias (smollm2-135m, qwen2.5-coder-0.5b), HF folder, .gguf file or hub id.")]
Device = Annotated[str, typer.Option(help="auto (CUDA if available), cpu or cuda.")]
Dtype = Annotated[str, typer.Option(help="auto (bfloat16 where the hardware runs it natively: CUDA, CPUs with AMX or AVX-512 BF16; else float32), float32, bfloat16 or float16.")]
MethodName = Annotated[str, typer.Option("--method", help="Cache method; `kvzip generate --list-methods` lists them.")]
Opts = Annotated[Optional[list[str]], typer.Option("--opt", help="Method option key=value, repeatable.")]
DictPath = Annotated[Optional[Path], typer.Option("--dict", help="Dictionary file for dictionary methods (default: the one shipped for the model).")]
TrustRemoteCode = Annotated[bool, typer.Option(help="Allow a hub model's own Python code to run.")]
Seed = Annotated[Optional[int], typer.Option(help="Seed for reproducible sampling (default: none, unseeded).")]


def parse_opts(opts: list[str] | None) -> dict[str, str]:
    parsed = {}
    for item in opts or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"--opt takes key=value, got {item!r}")
        parsed[key.strip()] = value.strip()
    return parsed


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
    if path is None:
        return None
    from kvzip.files import check_writable

    try:
        return check_writable(path)
    except UserError as exc:
        raise UserError(f"{flag}: {exc}") from None


def dict_file(path: Path | None) -> Path | None:
    """`--dict` once it names an existing file (not a directory)."""
    if path is None:
        return None
    from kvzip.dictfiles import check_dictionary_file

    try:
        return check_dictionary_file(path)
    except UserError as exc:
        raise UserError(f"--dict: {exc}") from None
