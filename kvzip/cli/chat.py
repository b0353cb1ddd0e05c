"""`kvzip chat`: an interactive chat whose history lives in a compressed cache, with a live memory/speed panel.

The conversation logic (templating, cache continuity, rebuilds, context limits) is `kvzip.conversation.ChatSession`; this
module reads lines, runs commands, turns Ctrl-C into a stop request and draws through `kvzip.cli.display`.
`chat_loop` takes a ready session, so tests drive it through stdin with any model and tokenizer.
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvzip.cli import display
from kvzip.cli.flags import (BudgetFraction, DictPath, Device, Dtype, MethodName, Model, Opts, Seed, Temperature,
                               TopK, TopP, TrustRemoteCode, budgeted, check_choice, check_device, check_fraction,
                               check_sampling, cli_words, dict_file, parse_opts)
from kvzip.errors import UserError
from kvzip.files import check_writable, write_atomic

HELP = """commands:
  /help                        this list
  /stats                       every number: context, KV bytes by tier, speed, method stats
  /method NAME [key=value ...] move the conversation to another method (re-prefills the history)
  /reset                       forget the conversation, keep the method
  /save FILE                   write the transcript and stats as JSON
  /quit                        leave (Ctrl-D too)
Ctrl-C while an answer streams stops it; the partial answer stays in the history. Start a message with // to send
a message that begins with /."""


class _Bar:
    """A progress bar created on first use, for re-prefilling the history."""

    def __init__(self, label: str):
        self.label, self.bar = label, None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            self.bar = display.progress()
            self.bar.start()
            self.task = self.bar.add_task(self.label, total=total)
        self.bar.update(self.task, completed=done)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def _read(prompt: str) -> str:
    """One line from the user; EOFError at the end. Piped input is echoed so the output reads as a transcript."""
    if sys.stdin.isatty():
        return input(prompt)
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    display.out.print(prompt + line.rstrip("\n"), markup=False)
    return line.rstrip("\n")


def _turn(session, text: str, compact: bool) -> None:
    from kvzip import engine
    from kvzip.conversation import ContextFull, Rebuilt, Turn

    stop = [False]

    def on_sigint(signum, frame):
        stop[0] = True

    previous = signal.signal(signal.SIGINT, on_sigint)
    bar, view, turn = _Bar("re-prefilling history"), None, None
    try:
        for event in session.turn(text, should_stop=lambda: stop[0], progress=bar):
            if isinstance(event, Rebuilt):
                display.console.print(f"[yellow]{event.reason}: re-prefilling the history[/yellow]")
            elif isinstance(event, Turn):
                turn = event
            else:
                if view is None:
                    bar.close()
                    view = display.ChatLive(compact).__enter__()
                if isinstance(event, engine.Token):
                    view.write(event.text)
                    view.update(session.snapshot)
                elif isinstance(event, engine.Step):
                    view.update(lambda: session.snapshot(event.memory))
    except ContextFull as exc:
        line = exc.words(reset="/reset to start over (or restart with --on-full evict)", budget="--max-new-tokens")
        display.console.print(f"[yellow]{line}[/yellow]", markup=True)
    finally:
        bar.close()
        if view is not None:
            view.__exit__(None, None, None)
        signal.signal(signal.SIGINT, previous)
    if turn is not None:
        if turn.notice:
            display.console.print(f"[yellow]{turn.notice}[/yellow]")
        flag = {"interrupted": " (interrupted: partial answer kept)", "length": " (hit --max-new-tokens)"}
        display.console.print(
            f"[dim]{display.summary_line(turn.stats)} | context {turn.stats['context_tokens']} tokens"
            f"{flag.get(turn.finish_reason, '')}[/dim]", soft_wrap=True
        )


def _command(session, line: str, dictionaries_for: Callable, model_name: str) -> bool:
    """Run one /command; False means quit. A UserError prints one line and the session goes on."""
    from kvzip.methods import get_method

    name, *args = line.split()
    if name in ("/quit", "/exit"):
        return False
    if name == "/help":
        display.out.print(HELP, markup=False)
    elif name == "/stats":
        display.out.print(display.chat_stats_table(session.snapshot()))
    elif name == "/reset":
        session.reset()
        display.console.print("conversation cleared")
    elif name == "/method":
        if not args:
            raise UserError("usage: /method NAME [key=value ...]")
        method = get_method(args[0], parse_opts(args[1:]))
        dicts = dictionaries_for(method)
        bar = _Bar(f"re-prefilling {len(session.ids)} tokens into {method.name}")
        try:
            session.switch(method, dicts, progress=bar)
        except KeyboardInterrupt:
            display.console.print(f"switch cancelled; still on {session.method.name}")
            return True
        finally:
            bar.close()
        snap = session.snapshot()
        display.console.print(f"switched: {display.chat_compact(snap)}", markup=False, soft_wrap=True)
    elif name == "/save":
        if len(args) != 1:
            raise UserError("usage: /save FILE")
        path = check_writable(Path(args[0]))
        try:
            write_atomic(path, json.dumps({"model": model_name, **session.transcript()}, indent=2) + "\n")
        except OSError as exc:
            raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
        display.console.print(f"saved {len(session.turns)} turns to {path}")
    else:
        raise UserError(f"unknown command {name}; /help lists the commands")
    return True


def chat_loop(session, dictionaries_for: Callable = lambda method: None, compact: bool = False,
              model_name: str = "") -> None:
    """Read messages and commands until /quit or end of input."""
    if sys.stdin.isatty():
        import readline  # noqa: F401  line editing and history for input()
        display.console.print(f"kvzip chat with {session.method.name}: /help for commands, Ctrl-D to leave")
    while True:
        try:
            line = _read("you> ").strip()
        except EOFError:
            display.out.print()
            return
        except KeyboardInterrupt:
            display.out.print()
            display.console.print("(Ctrl-D or /quit to leave)")
            continue
        if not line:
            continue
        try:
            if line.startswith("/") and not line.startswith("//"):
                if not _command(session, line, dictionaries_for, model_name):
                    return
            else:
                _turn(session, line[1:] if line.startswith("//") else line, compact)
        except UserError as exc:
            display.console.print(f"error: {cli_words(exc)}", markup=False, soft_wrap=True)


def chat(
    model: Model = "smollm2-135m",
    method: MethodName = "full",
    opt: Opts = None,
    budget: BudgetFraction = None,
    dict_path: DictPath = None,
    system: Annotated[Optional[str], typer.Option(help="System message (default: the chat template's own).")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Longest answer, in tokens.")] = 256,
    temperature: Temperature = 0.0,
    top_p: TopP = 1.0,
    top_k: TopK = 0,
    seed: Seed = None,
    compact: Annotated[bool, typer.Option(help="One-line live panel, for narrow terminals.")] = False,
    on_full: Annotated[str, typer.Option(help="When the context fills: stop (refuse further turns) or evict "
                                              "(drop the oldest exchanges and re-prefill the rest).")] = "stop",
    device: Device = "auto",
    dtype: Dtype = "auto",
    trust_remote_code: TrustRemoteCode = False,
):
    """Chat with a compressed KV cache: multi-turn, streamed, with a live memory and speed panel."""
    check_sampling(max_new_tokens, temperature, top_p, top_k)
    dict_path = dict_file(dict_path)  # for every dictionary method of the session (at start or after /method)
    from kvzip import engine
    from kvzip.conversation import ON_FULL, ChatSession, has_chat_template
    from kvzip.dictionary_lookup import dictionaries_for
    from kvzip.methods import get_method
    from kvzip.models import load_model

    check_choice("--on-full", on_full, ON_FULL)
    cache_method = get_method(method, parse_opts(opt))
    fraction = check_fraction(budget) if budget is not None else None
    settings = engine.Settings(max_new_tokens, temperature, top_p, top_k, seed)
    check_device(device, dtype)
    lm, tokenizer, source = load_model(model, device, dtype, trust_remote_code)
    if not has_chat_template(tokenizer):
        raise UserError("this model's tokenizer has no chat template, so it cannot chat: use `kvzip generate --raw`")
    if fraction is not None:  # planned for one answer of --max-new-tokens after the system prompt
        system_tokens = len(engine.encode(tokenizer, "", system=system))
        cache_method, line = budgeted(method, parse_opts(opt), fraction, lm, system_tokens, max_new_tokens)
        display.console.print(line, soft_wrap=True)
    dicts = lambda m: dictionaries_for(m, lm, source, dict_path)  # noqa: E731
    session = ChatSession(lm, tokenizer, cache_method, dicts(cache_method), settings, system, on_full)
    chat_loop(session, dicts, compact, source.name)
