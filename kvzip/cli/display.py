"""Everything rich: the one Console, progress bars and the one-line summaries. Library code never prints."""

from __future__ import annotations

import sys

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


def summary_line(stats: dict) -> str:
    """tokens, speed and KV memory against the fp16 full cache, in one line."""
    full = stats.get("kv_bytes_fp16_full", 0)
    ratio = f" ({stats['kv_bytes_final'] / full:.1%} of fp16 full {human_bytes(full)})" if full else ""
    host = f", host {human_bytes(stats['kv_bytes_host'])}" if stats.get("kv_bytes_host") else ""
    return (
        f"{stats['prompt_tokens']} prompt + {stats['new_tokens']} new tokens | ttft {stats['ttft_s']:.2f}s | "
        f"decode {stats['decode_tokens_per_s']:.1f} tok/s | KV {human_bytes(stats['kv_bytes_final'])}{ratio}, "
        f"peak {human_bytes(stats['kv_bytes'])}{host}"
    )


def is_terminal() -> bool:
    return sys.stdout.isatty()
