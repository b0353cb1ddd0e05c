"""Options shared by several commands, defined once as Annotated aliases; parsing of `--opt key=value`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from kvzip.errors import UserError

Model = Annotated[str, typer.Option("--model", "-m", help="Alias (smollm2-135m, qwen2.5-coder-0.5b), HF folder, .gguf file or hub id.")]
Device = Annotated[str, typer.Option(help="auto (CUDA if available), cpu or cuda.")]
Dtype = Annotated[str, typer.Option(help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16 or float16.")]
MethodName = Annotated[str, typer.Option("--method", help="Cache method; `kvzip generate --list-methods` lists them.")]
Opts = Annotated[Optional[list[str]], typer.Option("--opt", help="Method option key=value, repeatable.")]
DictPath = Annotated[Optional[Path], typer.Option("--dict", help="Dictionary file for dictionary methods (default: the one shipped for the model).")]
TrustRemoteCode = Annotated[bool, typer.Option(help="Allow a hub model's own Python code to run.")]


def parse_opts(opts: list[str] | None) -> dict[str, str]:
    parsed = {}
    for item in opts or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"--opt takes key=value, got {item!r}")
        parsed[key.strip()] = value.strip()
    return parsed
