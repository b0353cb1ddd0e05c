"""zoomr's and sumr's options at a memory budget (kvzip.budget): how many tokens each part of a thought cache holds.

A thought cache's device tier holds the prompt (kept whole by design), the tail (the last `window` tokens and the
open thought, moved a quarter window at a time), `summary_tokens` per finished thought, zoomr's index (one fp32 key per
thought, layer and KV head) and zoomr's `zoom_thoughts` zoomed thoughts. Its host tier (zoomr) holds every finished
thought's detail in the detail format. How many thoughts a text makes is known only after the run: the estimate is
`THOUGHT_TOKENS` tokens a thought (the default segmentation cut results-2's 8,064-token evaluation text into ~123
thoughts, ~65 tokens each), or 7/8 of `max_thought_tokens` when that is smaller: boundaries cut some thoughts
before the cap (32-token caps made 28-token thoughts on the frontier's 2,048-token rows, 71 a row, and a plan that
assumed 32 held 0.280 of `full`'s device bytes at a budget of 0.25). The bench measures what the cells really hold
and marks those that miss.

The parts shrink in this order as F falls: the tail down to 32 tokens, then the summaries (half, then 2, then 1 a
thought), then zoomr's zoom count (down to 1), then the longest thought (`max_thought_tokens` 64, then 32: an open
thought stays whole in the tail, so the longest sets the tail's peak), then the tail down to 16. A larger F grows the tail: more recent context
helps every position. Where every tier counts (zoomr), the detail format is the most faithful one that leaves the
device tier a feasible plan: int8, then int4, then fadkv codes of `CODED_DETAIL_SPARSITY` atoms a vector (fadkv needs
a dictionary). A detail is read back only for the few zoomed thoughts, so its coding error touches few positions,
while its bytes count for every finished thought: at an all-tier 0.25 of a 2,048-token output (4 rows, bf16), 2 atoms
and the device room they leave scored key top-1 0.387 and top-1 0.851, where 4 atoms scored 0.200 and 0.825.
"""

from __future__ import annotations

from kvzip.budget import Budget, Plan

THOUGHT_TOKENS = 64  # tokens a thought, estimated (module docstring)
CODED_DETAIL_SPARSITY = 2  # the atoms a detail vector when a budget picks fadkv details (module docstring)
TAIL_FLOOR, TAIL_MIN = 32, 16


def thought_tokens(options, max_thought: int | None = None) -> int:
    return max(1, min(THOUGHT_TOKENS, (max_thought or options.max_thought_tokens) * 7 // 8))


def index_tokens(options, budget: Budget, zoom: int) -> float:
    """zoomr's index of one thought, in `full`'s K and V bytes a token: a key and a length a KV head (the summary
    index), or a low and a high a channel in the model's dtype (`zoom_index=bounds`, one token's K and V)."""
    if not zoom:
        return 0.0
    d = budget.shape.head_dim
    return 1.0 if getattr(options, "zoom_index", "summary") == "bounds" else (d + 1) / (2 * d)


def device_tokens(budget: Budget, window: int, summaries: int, zoom: int, thought: int, max_thought: int,
                  index: float) -> float:
    """Peak device tokens (in `full`'s K and V bytes a token) of a thought cache with these options: the prompt,
    the tail (the window or an open thought of average length, whichever is longer, plus the quarter window it
    lags), the summaries of the thoughts before it, the zoomed thoughts' other tokens, and zoomr's index (a key
    and a length per thought and KV head, in the model's dtype)."""
    t, p = budget.tokens, budget.prompt_tokens
    tail = min(max(window, thought) + window // 4, max(t - p, 0))
    thoughts = max(t - p - tail, 0) / thought
    held = p + tail + summaries * thoughts + zoom * max(thought - summaries, 0)
    return held + thoughts * index


def caps(options, fixed) -> list[int]:
    """The thought lengths a plan may cap thoughts at: the option's, then 64 and 32 (an open thought stays whole in
    the tail, so the longest one sets the tail's peak)."""
    if "max_thought_tokens" in fixed:
        return [options.max_thought_tokens]
    return list(dict.fromkeys(c for c in (options.max_thought_tokens, 64, 32)
                              if options.min_thought_tokens <= c <= options.max_thought_tokens))


def solve(budget: Budget, allowance: float, options, summaries: int, zoom: int, fixed) -> dict | None:
    """The options (window, summary_tokens, zoom_thoughts when `zoom`, max_thought_tokens when capped) holding at
    most `allowance` device tokens, by the order of the module docstring; None when even the smallest do not fit."""
    index = index_tokens(options, budget, zoom)
    sizes = [summaries, max(1, summaries // 2), 2, 1] if "summary_tokens" not in fixed else [summaries]
    zooms = [zoom] + ([1] if zoom > 1 and "zoom_thoughts" not in fixed else []) if zoom else [0]
    steps = [(s, z, cap, TAIL_FLOOR) for cap in caps(options, fixed) for z in zooms
             for s in dict.fromkeys(x for x in sizes if x <= summaries)]
    steps.append(steps[-1][:3] + (TAIL_MIN,))
    for s, z, cap, floor in steps:
        thought = thought_tokens(options, cap)
        fits = lambda w: device_tokens(budget, w, s, z, thought, cap, index) <= allowance  # noqa: E731
        if "window" in fixed:
            if fits(options.window):
                return _options(options, options.window, s, z, zoom, cap)
            continue
        if not fits(floor):
            continue
        lo, hi = floor, max(floor, budget.tokens)
        while lo < hi:  # the largest tail that fits
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return _options(options, lo, s, z, zoom, cap)
    return None


def held(budget: Budget, options, found: dict, zoom: int) -> float:
    """Device tokens of a found plan."""
    cap = found.get("max_thought_tokens", options.max_thought_tokens)
    return device_tokens(budget, found["window"], found["summary_tokens"], found.get("zoom_thoughts", 0),
                         thought_tokens(options, cap), cap, index_tokens(options, budget, zoom))


def _options(options, window: int, summaries: int, zoom: int, zooms: bool, cap: int) -> dict:
    out = {"window": window, "summary_tokens": summaries}
    if zooms:
        out["zoom_thoughts"] = zoom
    if cap != options.max_thought_tokens:
        out["max_thought_tokens"] = cap
    return out


def detail_ratio(detail: str, budget: Budget, thought: int, sparsity: int = 8) -> float:
    """Bytes of one key or value vector in the detail tier, against `full`'s."""
    d, e = budget.shape.head_dim, budget.shape.element_size
    per_vector = {"host": d * e, "int8": d + 2, "fadkv": 4 * sparsity,
                  # keys: codes + an fp16 scale and low per channel over the thought; values: per group of 32
                  "int4": d / 2 + 2 * d / thought + 2 * d / min(32, d)}[detail]
    return per_vector / (d * e)


def plan(options, budget: Budget, fixed, zoom: int, details: tuple[tuple[str, int], ...] = ()) -> Plan:
    """sumr (zoom 0, no details) or zoomr at `budget`: see the module docstring. `details` are the detail formats to
    try in order, each a (name, atoms a vector) pair; the atoms count for fadkv codes only (0 elsewhere)."""
    t = budget.tokens
    defaults = options.summary_tokens
    if budget.tier == "device" or not details:
        found = solve(budget, budget.fraction * t, options, defaults, zoom, fixed)
        if found is None:
            return _unreachable(options, budget, zoom, 0.0, fixed=fixed)
        return Plan(found, held(budget, options, found, zoom) / t)
    thought = thought_tokens(options)
    for detail in details:
        host = detail_ratio(detail[0], budget, thought, detail[1]) * max(t - budget.prompt_tokens, 0) / t
        found = solve(budget, (budget.fraction - host) * t, options, defaults, zoom, fixed)
        if found is not None:
            return Plan({**found, **_detail_options(detail)}, held(budget, options, found, zoom) / t + host)
    host = detail_ratio(details[-1][0], budget, thought, details[-1][1]) * max(t - budget.prompt_tokens, 0) / t
    return _unreachable(options, budget, zoom, host, details[-1], fixed)


def _detail_options(detail: tuple[str, int]) -> dict:
    name, sparsity = detail
    return {"detail": name, **({"detail_sparsity": sparsity} if sparsity else {})}


def _unreachable(options, budget: Budget, zoom: int, host: float, detail: tuple | None = None, fixed=()) -> Plan:
    """The smallest options (a 16-token tail, one summary token a thought, one zoomed thought, each unless the user
    fixed it), with the note."""
    cap = caps(options, fixed)[-1]
    tail = options.window if "window" in fixed else TAIL_MIN
    summaries = options.summary_tokens if "summary_tokens" in fixed else 1
    zooms = (options.zoom_thoughts if "zoom_thoughts" in fixed else 1) if zoom else 0
    smallest = {"window": tail, "summary_tokens": summaries, **({"zoom_thoughts": zooms} if zoom else {}),
                **(_detail_options(detail) if detail else {}),
                **({"max_thought_tokens": cap} if cap != options.max_thought_tokens else {})}
    floor = device_tokens(budget, tail, summaries, zooms, thought_tokens(options, cap), cap,
                          index_tokens(options, budget, zoom)) / budget.tokens + host
    how = "".join(f" {k}={v}" for k, v in _detail_options(detail).items()) if detail else ""
    how = f" with{how}" if how else ""
    each = "a summary token a thought" if summaries == 1 else f"{summaries} summary tokens a thought"
    zoomed = "" if not zoom else f", {zooms} zoomed thought{'s' if zooms > 1 else ''}"
    return Plan({k: v for k, v in smallest.items() if k not in fixed}, floor,
                f"holds at least {floor:.3f} of full's bytes{how} (the prompt, a {tail}-token tail, {each}{zoomed})")
