"""Turn a bench result into what a reader compares: one row per setting, the best per column, the Pareto front, a plot.

Pure data in, pure data out (the CLI renders the rows with rich); the plot is drawn with matplotlib's Agg backend so
it works without a display. "Best" is among the settings other than `full`: full is the reference every quality
column is measured against, so it would trivially win them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Column:
    key: str
    header: str
    workload: str
    field: str
    better: str  # "max" or "min"
    fmt: str = "{:.3f}"


COLUMNS = [
    Column("kv_ratio", "KV/full", "output", "kv_ratio_vs_full", "min", "{:.3f}"),
    Column("kv_device_ratio", "device/full", "output", "kv_device_ratio_vs_full", "min", "{:.3f}"),
    Column("kv_fp16_ratio", "KV/fp16", "output", "kv_ratio_vs_fp16_full", "min", "{:.3f}"),
    Column("kv_peak", "KV peak", "output", "kv_bytes_peak", "min", "bytes"),
    Column("top1", "top-1", "output", "top1_agreement", "max"),
    Column("ppl", "ppl", "output", "ppl", "min", "{:.2f}"),
    Column("kl", "KL", "output", "kl", "min", "{:.4f}"),
    Column("key_top1", "key top-1", "output", "key_top1_agreement", "max"),
    Column("key_kl", "key KL", "output", "key_kl", "min", "{:.4f}"),
    Column("prompt_top1", "prompt top-1", "prompt", "top1_agreement", "max"),
    Column("greedy", "greedy agr", "reasoning", "greedy_agreement", "max"),
    Column("gsm8k", "GSM8K acc", "reasoning", "gsm8k_accuracy", "max", "{:.2f}"),
    Column("recall", "recall", "recall", "recall_accuracy", "max", "{:.2f}"),
    Column("decode", "decode tok/s", "speed", "decode_tokens_per_s", "max", "{:.1f}"),
    Column("speed_ratio", "speed/full", "speed", "speed_ratio_vs_full", "max", "{:.2f}"),
    Column("ttft", "ttft s", "speed", "ttft_s", "min", "{:.2f}"),
    Column("cap_rows", "rows in budget", "capacity", "rows", "max", "{:d}"),
    Column("cap_tps", "tok/s at budget", "capacity", "decode_tokens_per_s", "max", "{:.1f}"),
    Column("cap_ratio", "vs full", "capacity", "speed_ratio_vs_full", "max", "{:.2f}"),
]

# Where the memory columns come from when `output` was not run.
MEMORY_KEYS = ("kv_ratio", "kv_device_ratio", "kv_fp16_ratio", "kv_peak")
MEMORY_FALLBACK = ("output", "reasoning", "speed", "recall", "prompt")


def summary_rows(data: dict) -> list[dict]:
    """One dict per setting: label, then each column's value (None when that workload did not run)."""
    by = {(r["label"], r["workload"]): r for r in data["results"]}
    rows = []
    for s in data["settings"]:
        label = s["label"]
        if not any(k[0] == label for k in by):
            continue
        row = {"label": label}
        for c in COLUMNS:
            source = c.workload
            if c.key in MEMORY_KEYS and (label, source) not in by:
                source = next((w for w in MEMORY_FALLBACK if (label, w) in by), source)
            row[c.key] = by.get((label, source), {}).get(c.field)
        rows.append(row)
    return rows


def best_marks(rows: list[dict], columns=COLUMNS, reference: str = "full") -> dict[str, set[str]]:
    """column key -> labels holding the best value (ties all marked), among rows other than `reference`.

    A column where every such row has the same value marks nothing: there is no best to point at."""
    marks = {}
    for c in columns:
        values = [(r["label"], r[c.key]) for r in rows if r["label"] != reference and r.get(c.key) is not None]
        if not values:
            continue
        if len({v for _, v in values}) == 1 and len(values) > 1:
            continue
        pick = max if c.better == "max" else min
        best = pick(v for _, v in values)
        marks[c.key] = {label for label, v in values if v == best}
    return marks


def pareto_front(points: list[tuple[str, float, float]]) -> list[str]:
    """Labels of the points no other point beats: lower or equal memory (x) and higher or equal quality (y), one
    strictly. Returned in increasing memory order."""
    front = []
    for label, x, y in points:
        dominated = any(x2 <= x and y2 >= y and (x2 < x or y2 > y) for _, x2, y2 in points)
        if not dominated:
            front.append((x, -y, label))
    return [label for _, _, label in sorted(front)]


def quality_points(rows: list[dict]) -> list[tuple[str, float, float]]:
    return [(r["label"], r["kv_ratio"], r["top1"]) for r in rows if r.get("kv_ratio") is not None and r.get("top1") is not None]


def plot(data: dict, path, title: str | None = None) -> list[str]:
    """Quality (top-1 agreement with full on the output workload) vs KV memory (peak bytes, all tiers, over full's
    bytes for the same tokens in the same dtype), Pareto front drawn.

    Writes a PNG to `path` and returns the front's labels. Raises ValueError when there is nothing to plot.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = quality_points(summary_rows(data))
    if not points:
        raise ValueError("the plot needs the output workload (top-1 agreement and KV ratio)")
    front = pareto_front(points)
    fig, ax = plt.subplots(figsize=(7, 4.8), dpi=120)
    xs, ys = [p[1] for p in points], [p[2] for p in points]
    near_x, near_y = 0.04 * (max(xs) - min(xs) or 1), 0.03 * (max(ys) - min(ys) or 1)
    groups: list[tuple[float, float, list[str]]] = []  # settings on (nearly) the same spot share one annotation
    for label, x, y in points:
        on = label in front
        ax.scatter([x], [y], s=46 if on else 30, color="tab:red" if on else "tab:blue", zorder=3)
        group = next((g for g in groups if abs(g[0] - x) < near_x and abs(g[1] - y) < near_y), None)
        if group is None:
            groups.append((x, y, [label]))
        else:
            group[2].append(label)
    for x, y, labels in groups:
        ax.annotate(", ".join(labels), (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    fx = [next(p[1] for p in points if p[0] == label) for label in front]
    fy = [next(p[2] for p in points if p[0] == label) for label in front]
    ax.step(fx, fy, where="post", color="tab:red", alpha=0.6, label="Pareto front")
    env = data.get("environment", {})
    ax.set_xlabel("KV cache bytes, all tiers (peak) / full cache, same dtype and tokens")
    ax.set_ylabel("teacher-forced top-1 agreement with full (long output)")
    quick = " · quick" if data.get("config", {}).get("quick") else ""
    ax.set_title(title or f"kvzip bench · {env.get('model', '')} · {env.get('device', '')}{quick} · "
                          f"{env.get('date', '')[:10]}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return front


def capacity_plot(data: dict, path) -> None:
    """Throughput at equal memory: aggregate decode tok/s of each method's largest batch that fits the KV budget,
    one bar per method, the batch written on it. Raises ValueError when the capacity workload did not run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in data["results"] if r["workload"] == "capacity" and r.get("decode_tokens_per_s")]
    if not records:
        raise ValueError("the capacity plot needs the capacity workload")
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    labels = [r["label"] for r in records]
    values = [r["decode_tokens_per_s"] for r in records]
    bars = ax.bar(range(len(records)), values, color=["tab:gray" if r["label"] == "full" else "tab:blue" for r in records])
    for bar, r in zip(bars, records):
        over = "" if r.get("fits", True) else f", peak {r['kv_bytes_peak'] / r['kv_budget']:.2f}x budget"
        ax.annotate(f"{r['rows']} rows{over}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    textcoords="offset points", xytext=(0, 3), ha="center", fontsize=8)
    ax.set_xticks(range(len(records)), labels, rotation=30, ha="right", fontsize=8)
    env = data.get("environment", {})
    budget = records[0]["kv_budget"] / 2**20
    ax.set_ylabel("aggregate decode tok/s")
    ax.set_title(f"throughput at {budget:.0f} MiB of KV (all tiers) · {env.get('model', '')} · "
                 f"{env.get('device', '')} · {env.get('date', '')[:10]}", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def budget_lines(data: dict, field: str = "key_top1_agreement", workload: str = "output",
                 context: int | None = None) -> dict[str, list[tuple[float, float, bool]]]:
    """method label (without its `@F`) -> [(budget, value, marked)] of the records run at a budget, sorted by budget;
    `context` picks a length of a record that measured several (default: its headline, the longest)."""
    lines: dict[str, list] = {}
    for r in data["results"]:
        if r["workload"] != workload or r.get("budget") is None:
            continue
        entry = r if context is None else next((c for c in r.get("by_context", []) if c["context"] == context), None)
        if entry is None or entry.get(field) is None:
            continue
        lines.setdefault(r["label"].rsplit("@", 1)[0], []).append((entry["budget"], entry[field],
                                                                   bool(entry.get("budget_mark"))))
    return {k: sorted(v) for k, v in lines.items()}


def budget_plot(data: dict, path, field: str = "key_top1_agreement", workload: str = "output",
                context: int | None = None) -> None:
    """One line per method: `field` against the budget it ran at (a fraction of full's bytes). Hollow markers are
    cells marked off budget. Raises ValueError when no record ran at a budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = budget_lines(data, field, workload, context)
    if not lines:
        raise ValueError("the budget plot needs records run at a budget")
    fig, ax = plt.subplots(figsize=(7, 4.8), dpi=120)
    for i, (label, points) in enumerate(lines.items()):
        color = plt.get_cmap("tab10")(i % 10)
        ax.plot([p[0] for p in points], [p[1] for p in points], color=color, label=label, alpha=0.8)
        for x, y, marked in points:
            ax.scatter([x], [y], color=color, facecolors="none" if marked else color, s=36, zorder=3)
    ax.set_xscale("log", base=2)
    budgets = sorted({p[0] for pts in lines.values() for p in pts})
    ax.set_xticks(budgets, [f"{b:g}" for b in budgets])
    ax.set_xlabel("memory budget: fraction of full's KV bytes (hollow: the cell missed it by more than 10%)")
    ax.set_ylabel(f"{field.replace('_', ' ')} ({workload}{f' at {context}' if context else ''})")
    env = data.get("environment", {})
    ax.set_title(f"quality at equal memory · {env.get('model', '')} · {env.get('device', '')} {env.get('dtype', '')} · "
                 f"{env.get('date', '')[:10]}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
