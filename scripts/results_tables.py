"""Regenerate every results table in README.md and docs/*.md from the bench JSON committed in results/.

A table lives between two markers; the opening one says what to draw:

    <!-- results:quick file=bench_quick_cpu.json view=summary plot=yes -->
    ...generated text, rewritten by this script...
    <!-- /results:quick -->

Attributes: `file` (a JSON file in results/, or a path from the repository root), `caption=short` (name
the file and commit only, for a later table of a JSON whose caption is already on the page), `view` (`summary`:
one row per setting and the headline columns of every workload; `workload`: every column present in one workload's
records; `contexts`: one field of one workload at each context length), `workload`, `field` (for `contexts`),
`columns` (a comma-separated list of column names or dotted record paths such as `method_stats.selections`,
instead of the automatic choice), `plot=yes` (show the PNG that sits beside the JSON). Columns are chosen from the
fields the records hold, so a new workload or field needs no edit here. Byte ratios are computed from the byte
fields: against `full` in the run's dtype for the same tokens (`kv_bytes_full`, or for older files
`kv_bytes_fp16_full` scaled to the run's dtype) and against fp16.

    .venv/bin/python scripts/results_tables.py           # rewrite the blocks in place
    .venv/bin/python scripts/results_tables.py --check   # exit 1 naming a stale block, 0 when all are current
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from kvzip.stats import wilson_interval

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path("results")
BLOCK = re.compile(r"<!-- results:(?P<name>[\w.-]+)(?P<attrs>[^>]*?)-->(?P<body>.*?)<!-- /results:(?P=name) -->",
                   re.DOTALL)
OPENING = re.compile(r"<!-- results:([\w.-]+)")
FENCE = re.compile(r"(^```.*?^```[^\n]*$)", re.DOTALL | re.MULTILINE)
# A path the bench recorded as given (often absolute), shown from the repository root: `.../results/x` (and the
# package's old results folder, `.../kvzip/bench/results/x`, which earlier runs wrote to).
RESULTS_PATH = re.compile(r"\S*?/((?:kvzip/bench/)?results/\S*)")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


class BlockError(Exception):
    """A marker or its JSON is wrong: one line for the user."""


@dataclass(frozen=True)
class Column:
    header: str
    fmt: str = "{:.3f}"  # or "bytes", "ci" (accuracy with its 95% interval)


def _ratio(num: str, den: str):
    """A derived column: record[num] over the denominator `den` (see den_value), None when either is missing."""
    def ratio(record: dict, env: dict):
        top, bottom = record.get(num), den_value(record, den, env)
        return top / bottom if top is not None and bottom else None
    return ratio


def den_value(record: dict, field: str, env: dict):
    """The denominator of a byte ratio. `kv_bytes_full` (full's bytes, same dtype, same tokens) is derived from the
    fp16 figure for files written before the bench recorded it: the two differ only by the element size."""
    if field == "kv_bytes_full" and record.get("kv_bytes_full") is None and record.get("kv_bytes_fp16_full"):
        size = DTYPE_BYTES.get(env.get("dtype", ""))
        return record["kv_bytes_fp16_full"] * size / 2 if size else None
    return record.get(field)


# Every column a table may show, in display order. Derived ones compute from the record and the run's environment.
COLUMNS = {
    "kv_vs_full": Column("KV / full"),
    "device_vs_full": Column("device KV / full"),
    "kv_vs_fp16": Column("KV / fp16 full"),
    "kv_bytes_peak": Column("KV peak", "bytes"),
    "kv_bytes_device_peak": Column("device KV peak", "bytes"),
    "batch_in_budget": Column("batch in budget", "{}"),
    "rows_device_tier": Column("batch if device KV alone counted", "{}"),
    "peak_vs_budget": Column("KV peak / budget", "{:.2f}"),
    "budget": Column("budget", "{:g}"),
    "budget_ratio": Column("KV / full, measured"),
    "budget_mark": Column("off budget: why", "{}"),
    "top1_agreement": Column("top-1"),
    "ppl": Column("ppl", "{:.2f}"),
    "kl": Column("KL", "{:.4f}"),
    "key_positions": Column("key positions", "{}"),
    "key_top1_agreement": Column("key top-1"),
    "key_kl": Column("key KL", "{:.4f}"),
    "key_ppl": Column("key ppl", "{:.2f}"),
    "greedy_agreement": Column("greedy agreement"),
    "gsm8k_accuracy": Column("GSM8K accuracy, 95% CI", "ci"),
    "recall_accuracy": Column("recall, 95% CI", "ci"),
    "chance": Column("chance", "{:.2f}"),
    "decode_tokens_per_s": Column("decode tok/s", "{:.1f}"),
    "speed_ratio_vs_full": Column("speed / full", "{:.2f}"),
    "decode_tokens_per_s_end": Column("decode tok/s, last steps", "{:.1f}"),
    "end_speed_ratio_vs_full": Column("speed / full, last steps", "{:.2f}"),
    "ttft_s": Column("ttft s", "{:.2f}"),
    "ttft_ratio_vs_full": Column("ttft / full", "{:.2f}"),
}
DERIVED = {
    "kv_vs_full": _ratio("kv_bytes_peak", "kv_bytes_full"),
    "device_vs_full": _ratio("kv_bytes_device_peak", "kv_bytes_full"),
    "kv_vs_fp16": _ratio("kv_bytes_peak", "kv_bytes_fp16_full"),
    # the capacity workload's batch (other workloads' `rows` is the batch they were given, not one that fits)
    "batch_in_budget": lambda record, env: record.get("rows") if "kv_budget" in record else None,
    "peak_vs_budget": _ratio("kv_bytes_peak", "kv_budget"),
}
MEMORY = ("kv_vs_full", "device_vs_full", "kv_vs_fp16", "kv_bytes_peak", "kv_bytes_device_peak")
# The summary view: memory from the first quality workload present, then each workload's headline fields.
QUALITY = ("top1_agreement", "ppl", "kl")
HEADLINE = {"output": QUALITY, "prompt": QUALITY, "ppl": QUALITY, "reasoning": ("greedy_agreement", "gsm8k_accuracy"),
            "recall": ("recall_accuracy",), "speed": ("speed_ratio_vs_full", "ttft_ratio_vs_full"),
            "capacity": ("batch_in_budget", "peak_vs_budget", "speed_ratio_vs_full")}


def value(record: dict, key: str, env: dict):
    if key in DERIVED:
        return DERIVED[key](record, env)
    out = record
    for part in key.split("."):
        out = out.get(part) if isinstance(out, dict) else None
    return out


def cell(record: dict, key: str, env: dict) -> str:
    v = value(record, key, env)
    if v is None:
        return ""
    fmt = COLUMNS[key].fmt if key in COLUMNS else "{}"
    if fmt == "bytes":
        return f"{v / 2**20:.1f} MiB"
    if fmt == "ci":  # a Wilson interval from the count, whatever the file recorded (a normal approximation before)
        n = record.get("prompts") or record.get("trials") or 0
        if not n:
            return f"{v:.2f}"
        k = round(v * n)
        lo, hi = wilson_interval(k, n)
        return f"{k}/{n} = {v:.2f} ({lo:.2f}-{hi:.2f})"
    if isinstance(v, (list, dict)):
        return json.dumps(v, separators=(",", ":"))
    return fmt.format(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def header(key: str) -> str:
    return COLUMNS[key].header if key in COLUMNS else key.rsplit(".", 1)[-1].replace("_", " ")


def present(records: list[dict], key: str, env: dict) -> bool:
    return any(value(r, key, env) is not None for r in records)


def auto_columns(records: list[dict], env: dict) -> list[str]:
    """Every known column some record has, minus the device columns where no setting keeps a host tier."""
    keys = [k for k in COLUMNS if present(records, k, env)]
    if all(r.get("kv_bytes_device_peak") == r.get("kv_bytes_peak") for r in records):
        keys = [k for k in keys if k not in ("device_vs_full", "kv_bytes_device_peak")]
    return keys


def markdown(headers: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return out + ["| " + " | ".join(row) + " |" for row in rows]


def records_of(data: dict, workload: str) -> list[dict]:
    found = [r for r in data["results"] if r["workload"] == workload]
    if not found:
        have = sorted({r["workload"] for r in data["results"]})
        raise BlockError(f"workload '{workload}' is not in this file; it has: {', '.join(have)}")
    return found


def at_context(records: list[dict], attrs: dict) -> list[dict]:
    """With `context=N`, each record's entry at that length (labelled as the record); the records as they are
    otherwise."""
    if "context" not in attrs:
        return records
    want, out = int(attrs["context"]), []
    for r in records:
        entry = next((c for c in r.get("by_context", [r]) if c.get("context") == want), None)
        if entry is not None:
            out.append({**entry, "label": r["label"]})
    if not out:
        raise BlockError(f"no '{attrs.get('workload')}' record was measured at context {want}")
    return out


def view_workload(data: dict, attrs: dict) -> list[str]:
    env = data.get("environment", {})
    records = at_context(records_of(data, attrs.get("workload", "")), attrs)
    keys = attrs["columns"].split(",") if "columns" in attrs else auto_columns(records, env)
    missing = [k for k in keys if not present(records, k, env)]
    if missing:
        raise BlockError(f"no '{attrs['workload']}' record has {', '.join(missing)}")
    rows = [[r["label"]] + [cell(r, k, env) for k in keys] for r in records]
    return markdown(["method"] + [header(k) for k in keys], rows)


def view_contexts(data: dict, attrs: dict) -> list[str]:
    env = data.get("environment", {})
    field = attrs.get("field")
    if not field:
        raise BlockError("view=contexts needs field=NAME (e.g. field=top1_agreement)")
    records = records_of(data, attrs.get("workload", ""))
    contexts = sorted({c["context"] for r in records for c in r.get("by_context", [])})
    if not contexts:
        raise BlockError(f"workload '{attrs['workload']}' has no per-context records")
    if not any(present(r.get("by_context", []), field, env) for r in records):
        raise BlockError(f"no '{attrs['workload']}' record has {field} per context")
    rows = []
    for r in records:
        by = {c["context"]: c for c in r.get("by_context", [])}
        rows.append([r["label"]] + [cell(by[c], field, env) if c in by else "" for c in contexts])
    return markdown(["method"] + [f"{header(field)} @ {c}" for c in contexts], rows)


def run_workloads(data: dict) -> list[str]:
    ran = {r["workload"] for r in data["results"]}
    listed = data.get("config", {}).get("workloads", [])
    return [w for w in listed if w in ran] + sorted(ran - set(listed))


def memory_workload(data: dict, attrs: dict) -> str:
    """The workload whose byte fields fill the summary's memory columns: `memory=` or the first one not `speed`."""
    workloads = run_workloads(data)
    if not workloads:
        raise BlockError("this file holds no results")
    return attrs.get("memory") or next((w for w in workloads if w != "speed"), workloads[0])


def view_summary(data: dict, attrs: dict) -> list[str]:
    env = data.get("environment", {})
    by = {(r["label"], r["workload"]): r for r in data["results"]}
    workloads = run_workloads(data)
    order = [s["label"] for s in data.get("settings", [])] + [r["label"] for r in data["results"]]
    labels = [label for label in dict.fromkeys(order) if any(k[0] == label for k in by)]
    memory_from = memory_workload(data, attrs)
    mem_records = records_of(data, memory_from)
    columns = [(memory_from, k) for k in auto_columns(mem_records, env) if k in MEMORY and k != "kv_bytes_device_peak"]
    for w in workloads:
        records = [r for r in data["results"] if r["workload"] == w]
        fields = HEADLINE.get(w) or [k for k in auto_columns(records, env) if k not in MEMORY]
        columns += [(w, k) for k in fields if present(records, k, env)]
    rows = [[label] + [cell(by.get((label, w), {}), k, env) for w, k in columns] for label in labels]
    return markdown(["method"] + [f"{header(k)} ({w})" if k not in MEMORY else header(k) for w, k in columns], rows)


VIEWS = {"summary": view_summary, "workload": view_workload, "contexts": view_contexts}


def caption(data: dict, rel_json: str, view: str, attrs: dict) -> list[str]:
    """Where the table comes from; `caption=short` names the file and commit only (a later table of one JSON)."""
    env, cfg = data.get("environment", {}), data.get("config", {})
    sha = data.get("commit") or env.get("commit") or ""
    dirty = "-dirty" if sha.endswith("-dirty") else ""
    commit = f"commit `{sha.removesuffix(dirty)[:12]}{dirty}`" if sha else "commit not recorded"
    if attrs.get("caption") == "short":
        return [f"From `{rel_json}`, {commit}: the run named above."]
    command = RESULTS_PATH.sub(r"\1", data.get("command") or "")
    run = f"`{command}`" if command else "command not recorded"
    threads = env.get("torch_threads", "?")
    where = f"{env.get('model', '?')}, {env.get('device', '?')} {env.get('dtype', '')}, {threads} thread{'s' * (threads != 1)}"
    lines = [f"From `{rel_json}`: {run}, {commit}, run {env.get('date', '?')[:16].replace('T', ' ')} UTC, {where}"
             + (f", {data['wall_s'] / 60:.1f} min." if data.get("wall_s") else ".")]
    if view == "summary":
        lines.append(f"Memory columns: peak KV bytes on the `{memory_workload(data, attrs)}` workload; the other "
                     "columns name their workload.")
    earlier = (data.get("run") or {}).get("earlier_cells")
    if earlier:
        lines.append(f"Resumed (`--resume`): {earlier} of its cells were measured by an earlier run of the same commit "
                     "and settings; the line above describes the run that finished it.")
    w = attrs.get("workload")
    sizes = {k[len(w) + 1:]: v for k, v in cfg.items() if w and k.startswith(w + "_")}
    if sizes:
        lines.append(f"`{w}` sizes: " + ", ".join(f"{k} {v}" for k, v in sizes.items()) + ".")
    return lines


def notes(data: dict, workload: str | None) -> list[str]:
    """Skipped and failed settings (of `workload` only, when the table shows one), and an interrupted run."""
    mine = lambda e: workload is None or e.get("workload") in (None, workload)  # noqa: E731
    out = [f"Skipped: {s['label']} ({s.get('workload', 'every workload')}): {s['reason']}"
           for s in data.get("skipped", []) if mine(s)]
    out += [f"Failed: {f['label']} on {f['workload']}: {f['error'].splitlines()[0]}"
            for f in data.get("failed", []) if mine(f)]
    if data.get("interrupted"):
        out.append("The run was interrupted: settings after the last record are missing.")
    return out


def json_path(attrs: dict, root: Path) -> Path:
    """The JSON a marker names: a path from the repository root, or a bare name in results/."""
    if "file" not in attrs:
        raise BlockError("the marker names no file=...")
    return root / attrs["file"] if "/" in attrs["file"] else root / RESULTS / attrs["file"]


def render(attrs: dict, md_path: Path, root: Path) -> str:
    """The generated text of one block: plot, caption, table, notes."""
    path = json_path(attrs, root)
    rel_json = Path(os.path.relpath(path, root)).as_posix()
    if not path.is_file():
        raise BlockError(f"{rel_json} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise BlockError(f"{rel_json} is not valid JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("results"), list):
        raise BlockError(f"{rel_json} is not a `kvzip bench --json` file (no results list)")
    view = attrs.get("view", "workload" if "workload" in attrs else "summary")
    if view not in VIEWS:
        raise BlockError(f"view={view} is not one of: {', '.join(VIEWS)}")
    lines = ["<!-- generated by scripts/results_tables.py from the JSON named above; edit the marker, not this -->"]
    if attrs.get("plot") == "yes":
        png = path.with_suffix(".png")
        if not png.is_file():
            raise BlockError(f"plot=yes but {Path(rel_json).with_suffix('.png')} does not exist")
        what = "throughput at equal KV memory" if attrs.get("workload") == "capacity" else (
            "key-position top-1 against the memory budget" if any(r.get("budget") for r in data["results"])
            else "top-1 agreement vs KV bytes")
        lines.append(f"![{what}, from {path.name}]({os.path.relpath(png, md_path.parent)})")
        lines.append("")
    lines += caption(data, rel_json, view, attrs) + [""] + VIEWS[view](data, attrs)
    extra = notes(data, None if view == "summary" else attrs.get("workload"))
    return "\n".join(lines + ([""] + extra if extra else [])) + "\n"


def regenerate(text: str, md_path: Path, root: Path) -> tuple[str, list[str]]:
    """(new text, names of the blocks whose content changed). Markers inside fenced code (an example of the syntax)
    are left alone."""
    parts = FENCE.split(text)  # odd items are fenced code blocks
    changed: list[str] = []
    captioned: set[Path] = set()  # JSON files whose full caption is already on the page
    for i in range(0, len(parts), 2):
        parts[i], names = _regenerate_prose(parts[i], md_path, root, captioned)
        changed += names
    return "".join(parts), changed


def _regenerate_prose(text: str, md_path: Path, root: Path, captioned: set[Path]) -> tuple[str, list[str]]:
    opened = OPENING.findall(text)
    closed = {m.group("name") for m in BLOCK.finditer(text)}
    for name in opened:
        if name not in closed:
            raise BlockError(f"results block '{name}' has no closing <!-- /results:{name} --> marker")
    changed = []

    def one(m: re.Match) -> str:
        name = m.group("name")
        try:
            attrs = dict(item.split("=", 1) for item in shlex.split(m.group("attrs")))
        except ValueError:
            raise BlockError(f"results block '{name}': attributes must be key=value") from None
        try:
            path = json_path(attrs, root)
            if attrs.get("caption") != "short":
                captioned.add(path)
            elif path not in captioned:
                raise BlockError(f"caption=short, but no block above it gives {attrs['file']}'s full caption")
            body = "\n" + render(attrs, md_path, root)
        except BlockError as exc:
            raise BlockError(f"results block '{name}': {exc}") from None
        if body != m.group("body"):
            changed.append(name)
        return f"<!-- results:{name}{m.group('attrs')}-->{body}<!-- /results:{name} -->"

    return BLOCK.sub(one, text), changed


def documents(root: Path) -> list[Path]:
    return [p for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))] if p.is_file()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block is stale")
    parser.add_argument("--root", type=Path, default=ROOT, help="repository root (default: this script's)")
    args = parser.parse_args(argv)
    stale, updates = [], []
    for md in documents(args.root):  # every block is rendered before any file is written
        try:
            new, changed = regenerate(md.read_text(), md, args.root)
        except BlockError as exc:
            print(f"{md.relative_to(args.root)}: {exc}", file=sys.stderr)
            return 2
        stale += [f"{md.relative_to(args.root)}: results block '{name}' is stale" for name in changed]
        if changed:
            updates.append((md, new))
    if not args.check:
        from kvzip.files import write_atomic

        for md, new in updates:  # a reader sees the old page or the new one, never half of it
            write_atomic(md, new)
    if args.check and stale:
        print(f"{stale[0]} (and {len(stale) - 1} more)" if len(stale) > 1 else stale[0],
              "- run: .venv/bin/python scripts/results_tables.py")
        return 1
    for line in ([] if args.check else stale):
        print(line.replace("is stale", "rewritten"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
