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
from pathlib import Path

from results_views import VIEWS, BlockError, memory_workload  # beside this script

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path("results")
BLOCK = re.compile(r"<!-- results:(?P<name>[\w.-]+)(?P<attrs>[^>]*?)-->(?P<body>.*?)<!-- /results:(?P=name) -->",
                   re.DOTALL)
OPENING = re.compile(r"<!-- results:([\w.-]+)")
FENCE = re.compile(r"(^```.*?^```[^\n]*$)", re.DOTALL | re.MULTILINE)
# A path the bench recorded as given (often absolute), shown from the repository root: `.../results/x` (and the
# package's old results folder, `.../kvzip/bench/results/x`, which earlier runs wrote to).
RESULTS_PATH = re.compile(r"\S*?/((?:kvzip/bench/)?results/\S*)")


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
