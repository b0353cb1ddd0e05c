"""Markdown tables from a `kvzip bench --json` file: the headline columns of the bench's own table, then top-1
agreement and decode speed against full at each context length.

    .venv/bin/python scripts/bench_markdown.py kvzip/bench/results/bench_full_cpu.json
"""

from __future__ import annotations

import json
import sys

from kvzip.bench.report import COLUMNS, summary_rows
from kvzip.cli.display import human_bytes


def _cell(value, fmt: str) -> str:
    if value is None:
        return ""
    return human_bytes(value) if fmt == "bytes" else fmt.format(value)


def by_context(data: dict, workload: str, field: str) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for r in data["results"]:
        if r["workload"] == workload:
            out[r["label"]] = {c["context"]: c.get(field) for c in r.get("by_context", [])}
    return out


def main(path: str) -> None:
    data = json.load(open(path))
    rows = summary_rows(data)
    print("| method | " + " | ".join(c.header for c in COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 1) + "|")
    for row in rows:
        print(f"| {row['label']} | " + " | ".join(_cell(row[c.key], c.fmt) for c in COLUMNS) + " |")
    top1 = by_context(data, "ppl", "top1_agreement")
    speed = by_context(data, "speed", "speed_ratio_vs_full")
    ppl_ctx = sorted({c for v in top1.values() for c in v})
    speed_ctx = sorted({c for v in speed.values() for c in v})
    print()
    print("| method | " + " | ".join(f"top-1 @ {c}" for c in ppl_ctx) + " | "
          + " | ".join(f"decode / full @ {c}" for c in speed_ctx) + " |")
    print("|---" * (1 + len(ppl_ctx) + len(speed_ctx)) + "|")
    for row in rows:
        label = row["label"]
        cells = [_cell(top1.get(label, {}).get(c), "{:.3f}") for c in ppl_ctx]
        cells += [_cell(speed.get(label, {}).get(c), "{:.2f}") for c in speed_ctx]
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: bench_markdown.py BENCH.json")
    main(sys.argv[1])
