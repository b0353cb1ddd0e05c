"""What a bench run measures: the workload sizes (`BenchConfig`, with a `--quick` preset) and the method settings.

A *setting* is one method with one set of options, under a label; a run compares settings, so one method can appear
several times (`window`, `window:window=256`). Settings come from three places, parsed here:
- `--methods a,b` names methods by their registry name (default: every registered method);
- `--opt method.key=value` overrides an option of a method named in `--methods`;
- `--method-set "method:key=value,key=value"` adds one more setting, labelled with that string.
`full` is always measured first: every ratio and agreement is taken against it in the same run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kvzip.errors import UserError

WORKLOADS = ("output", "prompt", "reasoning", "recall", "speed", "capacity")
FULL_ROWS_IN_BUDGET = 8  # the default capacity budget: what `full` needs for this many rows of the capacity length


@dataclass
class BenchConfig:
    """Workload sizes. Defaults are the full run; `quick_preset()` is the few-minute CPU version of every workload."""

    workloads: tuple[str, ...] = WORKLOADS
    output_tokens: tuple[int, ...] = (1024, 4096, 8192)  # teacher-forced output lengths (the quality workload)
    output_rows: int = 2  # separate texts fed as one batch
    prompt_contexts: tuple[int, ...] = (1024, 4096, 8192)  # total tokens per prefilled text
    prompt_positions: int = 256  # scored positions at the end of each prefilled text, fed one token at a time
    reasoning_prompts: int = 8  # GSM8K evaluation problems, greedy
    reasoning_new_tokens: int = 256
    reasoning_batch: int = 8  # problems generated as one left-padded batch
    recall_filler: tuple[int, ...] = (1024, 4096)  # tokens of prose between the facts and the question, per distance
    recall_trials: tuple[int, ...] = (128, 32)  # trials at each distance (a trial moves recall by 1/trials)
    recall_facts: int = 4  # facts per trial, one asked for: chance is 1/recall_facts
    recall_batch: int = 64  # trials fed as one batch
    speed_contexts: tuple[int, ...] = (1024, 4096, 8192)
    speed_new_tokens: int = 64  # decode steps timed per measurement (steps / their total time): two fadkv chunks
    repeats: int = 2  # paired (method, full) speed measurements per context; the median ratio is reported
    capacity_tokens: int = 1024  # new tokens per row in the capacity workload
    kv_budget: int | None = None  # KV bytes (all tiers) the capacity workload fills; None: full's bytes for 8 rows
    capacity_max_rows: int = 64  # the largest batch the capacity workload tries
    budgets: tuple[float, ...] = ()  # fractions of full's bytes every method other than full runs at (none: defaults)
    budget_tier: str = "all"  # what a budget counts: every tier, or the device tier alone
    seed: int = 0
    quick: bool = False

    def __post_init__(self):
        if not self.workloads:
            raise UserError(f"no workload chosen; use some of: {', '.join(WORKLOADS)}")
        for w in self.workloads:
            if w not in WORKLOADS:
                raise UserError(f"unknown workload '{w}'; use some of: {', '.join(WORKLOADS)}")
        for name in ("output_rows", "prompt_positions", "reasoning_prompts", "reasoning_new_tokens", "reasoning_batch",
                     "recall_facts", "recall_batch", "speed_new_tokens", "repeats", "capacity_tokens",
                     "capacity_max_rows"):
            if getattr(self, name) < 1:
                raise UserError(f"{name.replace('_', ' ')} must be at least 1, got {getattr(self, name)}")
        if len(self.recall_filler) != len(self.recall_trials) or min(self.recall_trials, default=0) < 1:
            raise UserError(f"recall needs one trial count of at least 1 for each distance, got distances "
                            f"{list(self.recall_filler)} and trials {list(self.recall_trials)}")
        if self.budget_tier not in ("all", "device"):
            raise UserError(f"budget tier {self.budget_tier!r} is not allowed; use one of: all, device")
        if not self.output_tokens or any(n < 2 for n in self.output_tokens):
            raise UserError(f"output lengths must be at least 2 tokens each, got {list(self.output_tokens)}")
        for ctx in self.prompt_contexts:
            if ctx <= self.prompt_positions + 1:
                raise UserError(f"prompt context {ctx} must exceed the {self.prompt_positions} scored positions + 1")
        if any(c < 16 for c in self.speed_contexts):
            raise UserError("speed contexts must be at least 16 tokens")
        if self.kv_budget is not None and self.kv_budget < 1:
            raise UserError(f"the KV budget must be a positive number of bytes, got {self.kv_budget}")

    @classmethod
    def quick_preset(cls, workloads: tuple[str, ...] = WORKLOADS) -> "BenchConfig":
        """A small version of every workload: minutes for all methods on a 2-core CPU. The output length is the
        shortest at which every method's defaults compress (zoomr keeps a 128-token tail plus its zoomed thoughts)."""
        return cls(workloads=workloads, output_tokens=(768,), output_rows=2, prompt_contexts=(640,),
                   prompt_positions=96, reasoning_prompts=2, reasoning_new_tokens=32, recall_trials=(2,),
                   recall_filler=(120,), speed_contexts=(1024,), speed_new_tokens=16, repeats=1, capacity_tokens=256,
                   quick=True)

    def capped(self, max_positions: int | None) -> "BenchConfig":
        """Lengths capped to the model's window (room kept for the prompt and the new tokens)."""
        if not max_positions:
            return self
        cap = lambda values, room: tuple(sorted({min(c, room) for c in values}))  # noqa: E731
        return dataclasses.replace(
            self, output_tokens=cap(self.output_tokens, max_positions - 128),
            prompt_contexts=cap(self.prompt_contexts, max_positions),
            speed_contexts=cap(self.speed_contexts, max_positions - self.speed_new_tokens - 1),
            capacity_tokens=min(self.capacity_tokens, max_positions - 256))

    def describe(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class Setting:
    """One method with one set of options under a label (the row of the table, the point of the plot)."""

    label: str
    name: str
    opts: dict[str, str] = field(default_factory=dict)
    budget: float | None = None  # a fraction of full's bytes (the method is planned for it per length), or none

    def build(self):
        from kvzip.methods import get_method

        return get_method(self.name, self.opts)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """'256MiB', '1.5GB', '300000' -> bytes; UserError naming the units otherwise."""
    import re

    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise UserError(f"a size is a number with an optional unit (B, KB, MB, GB, KiB, MiB, GiB), got {text!r}")
    return int(float(match.group(1)) * _UNITS[unit])


def parse_kv_list(text: str, where: str) -> dict[str, str]:
    out = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"{where}: expected key=value, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def parse_settings(methods: str | None, opts: list[str] | None, method_sets: list[str] | None,
                   registered: list[str]) -> list[Setting]:
    """The settings of a run, `full` first; UserError naming the allowed values for anything malformed."""
    names = [m.strip() for m in methods.split(",") if m.strip()] if methods else list(registered)
    for name in names:
        if name not in registered:
            raise UserError(f"unknown method '{name}'; use some of: {', '.join(registered)}")
    per_method: dict[str, dict[str, str]] = {}
    for item in opts or []:
        target, sep, kv = item.partition(".")
        if not sep or "=" not in kv:
            raise UserError(f"a method option is method.key=value (e.g. window.window=256), got {item!r}")
        if target not in names:
            raise UserError(f"option {item!r} names method '{target}', which is not among the methods run ({', '.join(names)})")
        per_method.setdefault(target, {}).update(parse_kv_list(kv, f"option {item!r}"))
    settings = []
    for name in names:
        o = per_method.get(name, {})
        label = name if not o else f"{name}:" + ",".join(f"{k}={v}" for k, v in o.items())
        settings.append(Setting(label, name, o))
    for spec in method_sets or []:
        name, _, rest = spec.partition(":")
        name = name.strip()
        if name not in registered:
            raise UserError(f"setting {spec!r}: unknown method '{name}'; use one of: {', '.join(registered)}")
        o = parse_kv_list(rest, f"setting {spec!r}")
        label = name if not o else f"{name}:" + ",".join(f"{k}={v}" for k, v in o.items())
        settings.append(Setting(label, name, o))
    labels = [s.label for s in settings]
    if len(set(labels)) != len(labels):
        raise UserError(f"the same setting is listed twice: {', '.join(sorted({x for x in labels if labels.count(x) > 1}))}")
    for s in settings:
        s.build()  # validate every option before any model work
    full = [s for s in settings if s.label == "full"]
    return (full or [Setting("full", "full")]) + [s for s in settings if s.label != "full"]


def at_budgets(settings: list[Setting], budgets: tuple[float, ...]) -> list[Setting]:
    """`full` once, then every other setting at each budget, labelled `label@F` (no budgets: the settings as given);
    a user option the budget sets too is a UserError."""
    from kvzip.budget import check_options

    if not budgets:
        return settings
    for s in settings:
        if s.label != "full":
            check_options(s.name, budgets[0], s.opts)
    return [s for s in settings if s.label == "full"] + [
        Setting(f"{s.label}@{f:g}", s.name, s.opts, f) for s in settings if s.label != "full" for f in budgets]
