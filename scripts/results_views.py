"""The tables `scripts/results_tables.py` draws from one bench JSON: its columns (stored and derived from the byte
fields) and its views (`summary`, `workload`, `contexts`, `frontier`). A view takes the JSON and the marker's
attributes and returns markdown lines; a marker that asks for what the file lacks is a BlockError, one line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvzip.stats import wilson_interval

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


def view_frontier(data: dict, attrs: dict) -> list[str]:
    """Quality against the budget: a row per method, per budget F its top-1 and its KL, each as key positions /
    every position. A cell whose measured ratio missed F (`budget_mark`) shows the ratio it held and is footnoted."""
    records = at_context(records_of(data, attrs.get("workload", "")), attrs)
    budgets = sorted({r["budget"] for r in records if r.get("budget") is not None})
    if not budgets:
        raise BlockError(f"no '{attrs.get('workload')}' record was run at a budget (kvzip bench --budgets)")
    by: dict[str, dict] = {}
    for r in records:
        if r.get("budget") is not None:
            by.setdefault(r["label"].rsplit("@", 1)[0], {})[r["budget"]] = r  # a setting: its label less "@F"
    rows, marks = [], []
    for setting, cells in by.items():
        row = [setting]
        for f in budgets:
            r = cells.get(f)
            if r is None:
                row += ["", ""]
                continue
            missed = r.get("budget_mark")
            if missed:
                marks.append(f"- † {r['label']} held {r['budget_ratio']:.3f} of full's bytes: {missed}")
            tag = f" † ({r['budget_ratio']:.2f})" if missed else ""
            row.append(f"{_pair(r, 'key_top1_agreement', 'top1_agreement', '{:.3f}')}{tag}")
            row.append(_pair(r, "key_kl", "kl", "{:.3f}"))
        rows.append(row)
    headers = ["method"] + [h for f in budgets for h in (f"top-1 @ {f:g}: key / all", f"KL @ {f:g}: key / all")]
    return markdown(headers, rows) + ([""] + marks if marks else []) + [""] + _key_note(records)


def _pair(record: dict, key: str, every: str, fmt: str) -> str:
    a, b = record.get(key), record.get(every)
    return " / ".join("-" if v is None else fmt.format(v) for v in (a, b))


def _key_note(records: list[dict]) -> list[str]:
    """How many key positions the scores stand on, the short reference's own scores, and the widest interval."""
    full = next((r for r in records if r.get("method") == "full"), {})
    n, positions = full.get("key_positions") or 0, full.get("positions") or 0
    if not n:
        return ["No key positions were found: the key-position scores are empty."]
    lo, hi = wilson_interval(n // 2, n)
    line = (f"Key positions: {n} of {positions} fed ({n / positions:.1%}); a key top-1 near 0.5 over {n} positions has "
            f"a 95% interval of {lo:.2f}-{hi:.2f}.")
    short = full.get("short_reference")
    if short:
        opts = ", ".join(f"{k} {v}" for k, v in short.get("options", {}).items())
        line += (f" The short reference that finds them (window: {opts}) scores top-1 {short['key_top1_agreement']:.3f}"
                 f" / {short['top1_agreement']:.3f} and KL {short['key_kl']:.3f} / {short['kl']:.4f}, key / all.")
    return [line]


VIEWS = {"summary": view_summary, "workload": view_workload, "contexts": view_contexts, "frontier": view_frontier}
