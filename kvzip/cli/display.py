"""Everything rich: the one Console, progress bars and the one-line summaries. Library code never prints."""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

console = Console(stderr=True, highlight=False)
out = Console(highlight=False, soft_wrap=True)


def progress() -> Progress:
    """A progress bar with count, elapsed time and ETA, drawn on stderr."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def kv_text(stats: dict) -> str:
    """KV bytes against `full` for the same tokens in the same dtype (device and all tiers apart), then against fp16."""
    full, fp16 = stats.get("kv_bytes_full", 0), stats.get("kv_bytes_fp16_full", 0)
    total, device = stats.get("kv_bytes_peak", 0), stats.get("kv_bytes_device_peak", 0)
    if not full:
        return "KV: no tokens yet"
    text = f"KV peak {human_bytes(total)} = {total / full:.2f}x full"
    if device != total:
        text += f" (device {human_bytes(device)} = {device / full:.2f}x)"
    if fp16 and fp16 != full:
        text += f", {total / fp16:.2f}x an fp16 full cache"
    if (stats.get("method_stats") or {}).get("tokens_coded") == 0:
        text += " (nothing coded yet: tokens stay dense until the sinks and the buffer fill)"
    return text


def summary_line(stats: dict) -> str:
    """tokens, speed and KV memory against full, in one line."""
    return (
        f"{stats['prompt_tokens']} prompt + {stats['new_tokens']} new tokens | ttft {stats['ttft_s']:.2f}s | "
        f"decode {stats['decode_tokens_per_s']:.1f} tok/s | {kv_text(stats)}"
    )


def run_line(totals: dict, ranks: list[dict]) -> str:
    """A data-parallel or resumed run in one line: rows, tokens, the decode rate of all ranks together (they decode at
    once, so their rates add), the slowest rank's time, then each rank's rows and memory."""
    earlier = f", {totals['earlier_rows']} from an earlier run" if totals["earlier_rows"] else ""
    each = "; ".join(
        f"rank {r['rank']}: {r['rows']} rows, KV peak {human_bytes(r['kv_bytes_peak'])}, RSS {human_bytes(r['peak_rss_bytes'])}"
        + (f", CUDA peak {human_bytes(r['cuda_max_memory_allocated'])}" if "cuda_max_memory_allocated" in r else "")
        for r in ranks)
    return (f"{totals['rows']} rows ({totals['generated_rows']} generated on {totals['world_size']} rank(s){earlier}), "
            f"{totals['new_tokens']} new tokens, decode {totals['decode_tokens_per_s']:.1f} tok/s over all ranks, "
            f"{totals['wall_s']:.1f} s | {each}")


def is_terminal() -> bool:
    return sys.stdout.isatty()


# -- kvzip chat: the live panel under a streaming answer, the /stats table ---------------------------------------------

def _options_text(snap: dict) -> str:
    opts = snap.get("options") or {}
    return snap.get("method", "?") + (f" ({', '.join(f'{k}={v}' for k, v in opts.items())})" if opts else "")


def _method_stats_text(stats: dict) -> str:
    return ", ".join(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}" for k, v in stats.items()) or "none"


def chat_compact(snap: dict) -> str:
    """The whole panel in one line, for narrow terminals (--compact) and the /method switch notice."""
    return (
        f"{snap['method']} | ctx {snap['context_tokens']}/{snap['context_limit']} | "
        f"{snap['decode_tokens_per_s_recent']:.1f} tok/s (avg {snap['decode_tokens_per_s_average']:.1f}) | "
        f"{kv_text(snap)} | {_method_stats_text(snap['method_stats'])}"
    )


def chat_panel(snap: dict, compact: bool = False):
    """The live panel: speed, context, KV bytes by tier against fp16 full, and the method's own stats."""
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    if compact:
        return Text(chat_compact(snap), style="dim", no_wrap=True, overflow="ellipsis")
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    tiers = " | ".join(f"{k} {human_bytes(v)}" for k, v in snap["kv_bytes_by_tier"].items())
    grid.add_row("decode", f"{snap['decode_tokens_per_s_recent']:.1f} tok/s now, "
                           f"{snap['decode_tokens_per_s_average']:.1f} tok/s average")
    grid.add_row("context", f"{snap['context_tokens']} / {snap['context_limit']} tokens, {snap['turns']} turns done")
    grid.add_row("KV cache", f"{human_bytes(snap['kv_bytes_final'])}: {tiers}")
    grid.add_row("vs full", kv_text(snap))
    grid.add_row("method", Text(_method_stats_text(snap["method_stats"])))
    return Panel(grid, title=Text(_options_text(snap)), title_align="left", expand=False)


def chat_stats_table(snap: dict):
    """/stats: every number of the snapshot as a two-column table."""
    from rich.table import Table

    table = Table(title=f"kvzip chat: {_options_text(snap)}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_row("turns", str(snap["turns"]))
    table.add_row("tokens in context", f"{snap['context_tokens']} of {snap['context_limit']}")
    table.add_row("decode tok/s (recent / average)",
                  f"{snap['decode_tokens_per_s_recent']:.1f} / {snap['decode_tokens_per_s_average']:.1f}")
    table.add_row("KV bytes total", f"{snap['kv_bytes_final']:,} ({human_bytes(snap['kv_bytes_final'])})")
    table.add_row("KV bytes on the device", f"{snap['kv_bytes_device_peak']:,}")
    for tier, n in snap["kv_bytes_by_tier"].items():
        table.add_row(f"  {tier}", f"{n:,}")
    table.add_row("full cache, same dtype", f"{snap['kv_bytes_full']:,}")
    table.add_row("full cache, fp16", f"{snap['kv_bytes_fp16_full']:,}")
    table.add_row("ratio vs full (same dtype)", f"{snap['kv_ratio_vs_full'] or 0:.4f}")
    table.add_row("ratio vs fp16 full", f"{snap['kv_ratio_vs_fp16_full'] or 0:.4f}")
    for key, value in snap["method_stats"].items():
        table.add_row(f"{snap['method']}: {key}", str(value))
    return table


ECHO_ROOM = len("^C")  # columns kept free at the end of the live region's lines


class ChatLive:
    """An answer streaming above the live panel. Finished lines go to the scrollback; the line being written and
    the panel are redrawn at most `per_second` times a second (and not at all when stdout is not a terminal:
    then text streams as it comes)."""

    def __init__(self, compact: bool = False, per_second: float = 4.0):
        from rich.live import Live

        self.compact, self.period = compact, 1.0 / per_second
        self.terminal = is_terminal()
        self.live = Live(console=out, auto_refresh=False, transient=True) if self.terminal else None
        self.line, self.snap, self.drawn = "", None, 0.0

    def __enter__(self):
        if self.live is not None:
            self.soft_wrap, out.soft_wrap = out.soft_wrap, False  # a soft-wrapping console crops the live region
            self.live.start()
        return self

    def write(self, text: str) -> None:
        if self.live is None:
            out.print(text, end="", markup=False)
            return
        self.line += text
        if "\n" in self.line:
            done, _, self.line = self.line.rpartition("\n")
            self.live.console.print(done, markup=False)
        if len(self.line) > 4 * out.width and " " in self.line:  # a long paragraph: move it up to the last space
            done, _, self.line = self.line.rpartition(" ")
            self.live.console.print(done, markup=False)

    def update(self, snapshot, force: bool = False) -> None:
        """`snapshot` is a callable giving the numbers; it is only called when a redraw is due."""
        if self.live is None or (not force and time.monotonic() - self.drawn < self.period):
            return
        from rich.console import Group
        from rich.constrain import Constrain
        from rich.text import Text

        self.snap = snapshot()
        self.drawn = time.monotonic()
        # The region is drawn ECHO_ROOM columns narrower than the terminal: the cursor rests after its last line,
        # where the terminal echoes a Ctrl-C as "^C". On a full-width line that echo wraps, the region slides down a
        # line, and clearing it at the end would leave its first line (the partial answer) on screen twice.
        region = Group(Text(self.line), chat_panel(self.snap, self.compact))
        self.live.update(Constrain(region, width=max(out.width - ECHO_ROOM, 1)), refresh=True)

    def __exit__(self, *exc):
        if self.live is not None:
            self.live.stop()
            if self.line:
                out.print(self.line, markup=False)
            out.soft_wrap = self.soft_wrap
        else:
            out.print()
        self.line = ""
        return False
