"""The `kvzip` command: a Typer app with one module per command; `main` is the console script's entry point.

Errors a user can cause, a `UserError` from kvzip or a usage error from click (unknown option, bad value), become
one line `kvzip: error: ...` on stderr with exit code 2; everything else is a bug and keeps its traceback. The
command runs in this process and leaves nothing behind when it exits; SIGTERM unwinds it like Ctrl-C (torchrun sends
it to the other ranks when one fails), so files being written are removed and finished ones kept. Under torchrun an
error every rank finds is said once, by rank 0 (`kvzip.errors.SharedUserError`).

Start-up stays short because nothing heavy is imported here: torch, transformers and the method registry are imported
inside the commands, after their flags and paths have been checked. Help is click's plain formatter, which wraps
to the terminal's width and never crops an option's help text.
"""

from __future__ import annotations

import os
import signal
import sys

import typer

from kvzip.cli import bench as _bench
from kvzip.cli import chat as _chat
from kvzip.cli import generate as _generate
from kvzip.cli import train_dict as _train_dict
from kvzip.cli.flags import cli_words
from kvzip.errors import SharedUserError, UserError

HELP_WIDTH = 120  # help wraps at the terminal's width, but at most this: lines a reader's eye can follow
HELP = "kvzip: run LLM reasoning with a compressed KV cache (FAD-KV dictionaries, ZoomR thought retrieval)."

app = typer.Typer(
    help=HELP,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"max_content_width": HELP_WIDTH},
)
app.command("generate")(_generate.generate)
app.command("train-dict")(_train_dict.train_dict)
app.command("chat")(_chat.chat)
app.command("bench")(_bench.bench)


def library_env_defaults() -> None:
    """Quiet transformers' own progress bars and advisories, which would interleave with kvzip's display. Set before
    transformers is first imported (it reads some of them at import); a value the user set is kept."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")


def _fail(message: str, code: int = 2) -> None:
    print(f"kvzip: error: {message}", file=sys.stderr)
    sys.exit(code)


def _terminated(signum, frame) -> None:
    """SIGTERM (torchrun stopping the other ranks when one fails, `kill`, a scheduler) unwinds like Ctrl-C: files
    being written are removed, finished ones kept, and the command says how to go on."""
    raise KeyboardInterrupt


def main(args: list[str] | None = None) -> None:
    """Run `kvzip` with `args` (default: sys.argv[1:]) and exit with its code."""
    args = sys.argv[1:] if args is None else list(args)
    library_env_defaults()
    import threading

    main_thread = threading.current_thread() is threading.main_thread()  # only there can a handler be set
    previous = signal.signal(signal.SIGTERM, _terminated) if main_thread else None
    try:
        code = app(args=args or ["--help"], prog_name="kvzip", standalone_mode=False)
    except typer.TyperException as exc:  # click's usage errors (unknown option or command, bad value) and kin
        ctx = getattr(exc, "ctx", None)
        hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        _fail(" ".join(exc.format_message().split()) + hint, exc.exit_code)
    except SharedUserError as exc:  # every rank has it: rank 0 says it
        if exc.speaker:
            _fail(" ".join(str(exc).split()))
        sys.exit(2)
    except UserError as exc:
        _fail(" ".join(cli_words(exc).split()))
    except (typer.Abort, KeyboardInterrupt):  # Abort: end of input at a prompt
        print("kvzip: interrupted", file=sys.stderr)
        code = 130
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    sys.exit(code if isinstance(code, int) else 0)
