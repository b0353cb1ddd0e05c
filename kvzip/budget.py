"""One memory budget for every method: a fraction F of what `full` holds for the same tokens.

The field compares cache methods at one budget (kvpress gives every press one `compression_ratio`, R-KV one token
budget): a method's quality only means something beside the others' at the same bytes. A `Budget` is F, the tokens
`full` would hold at the end (prompt + new tokens), the model's shape and the tier it counts (`all`: every tier, the
host tier included; `device`: what attention needs resident, zoomr's case on a GPU). Each method turns it into its own
options in one place, `Method.plan_budget` in the method's file, with the reasons in its docs page: the evicting
methods by the tokens they keep, zoomr by its tail, summaries and zoomed thoughts (and its detail format when every
tier counts), fadkv and lexico by sparsity and buffer, the quanto peers by group size and residual.

A `Plan` is those options, the ratio of `full`'s bytes they are expected to give, and a note when that ratio is more
than `TOLERANCE` off F (below what the method can reach, or a format whose size is fixed). The bench measures the
real ratio and marks a cell that misses F by more than the tolerance, with the note or the measured miss.

    from kvzip.budget import Budget, Shape, plan
    p = plan("fadkv", Budget(0.25, prompt_tokens=46, new_tokens=4096, shape=Shape.of(model)))
    method = get_method("fadkv", p.options)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvzip.errors import UserError

TOLERANCE = 0.10  # a measured ratio further than this from F (relative) is marked
BUDGET_TIERS = ("all", "device")


@dataclass(frozen=True)
class Shape:
    """What a byte count needs of the model: layers, query and KV heads, head size, and the bytes of one value of
    the dtype `full` holds (2 for bf16 and fp16, 4 for fp32)."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    element_size: int

    @classmethod
    def of(cls, model) -> "Shape":
        from kvzip.methods.fields import model_layout

        layers, kv_heads, head_dim = model_layout(model)
        size = torch.finfo(model.dtype).bits // 8 if model.dtype.is_floating_point else 4
        return cls(layers, model.config.num_attention_heads, kv_heads, head_dim, size)

    @property
    def vector_bytes(self) -> int:
        """One key or value vector of one head as `full` holds it."""
        return self.head_dim * self.element_size


@dataclass(frozen=True)
class Budget:
    """F of `full`'s bytes for `prompt_tokens + new_tokens` tokens, counted on `tier`."""

    fraction: float
    prompt_tokens: int
    new_tokens: int
    shape: Shape
    tier: str = "all"

    def __post_init__(self):
        if not (isinstance(self.fraction, (int, float)) and math.isfinite(self.fraction) and 0 < self.fraction <= 1):
            raise ValueError(f"a budget is a fraction of full's bytes in (0, 1], got {self.fraction!r}")
        if self.tier not in BUDGET_TIERS:
            raise ValueError(f"budget tier {self.tier!r} is not allowed; use one of: {', '.join(BUDGET_TIERS)}")
        if self.prompt_tokens < 0 or self.new_tokens < 1:
            raise ValueError("a budget needs at least one new token")

    @property
    def tokens(self) -> int:
        """What `full` holds at the end."""
        return self.prompt_tokens + self.new_tokens

    @property
    def dense_tokens(self) -> int:
        """How many tokens F buys when each is kept as `full` keeps it."""
        return int(self.fraction * self.tokens)


@dataclass
class Plan:
    """A method's options at a budget, the ratio of `full`'s bytes they should give (peak, on the budget's tier),
    and, when that misses F by more than `TOLERANCE`, why."""

    options: dict[str, str]
    expected: float
    note: str = ""
    fraction: float = field(default=0.0, repr=False)

    def describe(self) -> dict:
        return {"options": dict(self.options), "expected_ratio": round(self.expected, 4), "note": self.note or None}


def plan(name: str, budget: Budget, opts: dict[str, str] | None = None) -> Plan:
    """Method `name`'s options at `budget`, on top of the user's `opts` (which the plan never overrides: an option the
    budget sets and the user set too is a UserError). The plan's options include the user's."""
    from kvzip.methods import get_method

    opts = dict(opts or {})
    base = get_method(name, opts)
    p = base.plan_budget(budget, frozenset(opts))
    clash = {k: v for k, v in p.options.items() if k in opts and str(opts[k]) != str(v)}
    if clash:
        raise UserError(f"method '{name}': the budget sets {', '.join(sorted(clash))}; drop "
                        f"{'that option' if len(clash) == 1 else 'those options'} or the budget")
    if not p.note and abs(p.expected / budget.fraction - 1) > TOLERANCE:  # a fixed format, or its closest options
        p.note = f"{name} holds {p.expected:.3f} of full's bytes"
    return Plan({**opts, **{k: str(v) for k, v in p.options.items()}}, p.expected, p.note, budget.fraction)


def check_options(name: str, fraction: float, opts: dict[str, str] | None = None) -> None:
    """A UserError now, before any model loads, for options the budget would set too: the plan on a nominal shape
    (a 64-wide head in bf16) names the options it sets."""
    plan(name, Budget(fraction, 64, 1024, Shape(layers=1, heads=1, kv_heads=1, head_dim=64, element_size=2)), opts)


def at_budget(name: str, fraction: float, model, prompt_tokens: int, new_tokens: int, tier: str = "all",
              opts: dict[str, str] | None = None):
    """(method, plan): method `name` built for F of `full`'s bytes on `model` for that many tokens (the Python face of
    `--budget`)."""
    from kvzip.methods import get_method

    p = plan(name, Budget(fraction, prompt_tokens, new_tokens, Shape.of(model), tier), opts)
    return get_method(name, p.options), p


def mark(fraction: float, measured: float | None, note: str = "") -> str | None:
    """Why a cell's measured ratio is not F (None when it is within the tolerance)."""
    if measured is None:
        return note or "no ratio measured"
    if abs(measured / fraction - 1) <= TOLERANCE:
        return None
    return note or f"measured {measured:.3f} of full's bytes against a budget of {fraction:g}"
