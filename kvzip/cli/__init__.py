"""The `kvzip` command: a Typer app with one module per command.

Errors a user can cause surface as `UserError` (or a ValueError from the tensor libraries about a user file) and
become one line on stderr with exit code 2; everything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys

import typer

from kvzip.cli import generate as _generate
from kvzip.errors import UserError

app = typer.Typer(
    help="kvzip: run LLM reasoning with a compressed KV cache (FAD-KV dictionaries, ZoomR thought retrieval).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("generate")(_generate.generate)


@app.callback()
def _root() -> None:
    """kvzip: run LLM reasoning with a compressed KV cache (FAD-KV dictionaries, ZoomR thought retrieval)."""
    from kvzip.warm import library_env_defaults

    library_env_defaults()


def _register_optional() -> None:
    """Commands that live in their own modules; each registers itself if present."""
    import importlib

    for module, name in (("train_dict", "train-dict"), ("chat", "chat"), ("bench", "bench")):
        try:
            mod = importlib.import_module(f"kvzip.cli.{module}")
        except ModuleNotFoundError as exc:
            if exc.name != f"kvzip.cli.{module}":
                raise
            continue
        app.command(name)(getattr(mod, module))


_register_optional()


def main() -> None:
    try:
        app()
    except UserError as exc:
        print(f"kvzip: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("kvzip: interrupted", file=sys.stderr)
        sys.exit(130)
