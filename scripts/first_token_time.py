"""Seconds from starting a command to its first byte of output, and to its exit: `kvzip generate` start-up.

    python scripts/first_token_time.py --runs 3 -- .venv/bin/kvzip generate --max-new-tokens 16 "Tell me a fact"

The command's stdout is read unbuffered; with a single prompt, `kvzip generate` streams the completion, so the first
byte is the first generated text: the imports, the model load and the prefill of every run, since each command is
one process that starts from nothing. The first run of a fresh machine also pays the one-time GGUF conversion and
a cold file cache, which is why the median over several runs is reported.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time


def once(cmd: list[str]) -> tuple[float, float]:
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    proc.stdout.read(1)
    first = time.perf_counter() - start
    proc.communicate()
    return first, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--pause", type=float, default=8.0, help="seconds between runs (lets the machine settle)")
    parser.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    firsts = []
    for i in range(args.runs):
        first, total = once(cmd)
        firsts.append(first)
        print(f"run {i + 1}: first byte {first:.2f} s, exit {total:.2f} s", flush=True)
        if i + 1 < args.runs:
            time.sleep(args.pause)
    print(f"median first byte {statistics.median(firsts):.2f} s over {len(firsts)} runs")


if __name__ == "__main__":
    main()
