"""What every bench workload shares: the run's `Context`, one engine generation, and a setting's method at a budget.

A setting run at a memory budget (`kvzip bench --budgets`) is a `Budgeted`: its options depend on how many tokens
the cache will hold, so each workload asks for the method at its own lengths (`resolve`) and records the plan beside
what it measured (`budget_fields`: F asked, the options it became, the measured ratio on the budget's tier, and the
mark of a cell that missed F by more than kvzip.budget.TOLERANCE, with the reason).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvzip import engine
from kvzip.budget import Budget, Plan, Shape, mark, plan


@dataclass
class Context:
    """What every workload needs: the model, the config, `full`'s reference figures, a progress tick."""

    model: object
    tokenizer: object
    cfg: object
    tick: object = lambda n=1: None
    ref: dict = field(default_factory=dict)  # filled while `full` runs, read by every other setting
    _prose: list | None = None
    _documents: dict = field(default_factory=dict)  # row -> that row's long document, tokenized

    def prose(self, n: int, offset: int = 0) -> list[int]:
        """n tokens of held-out prose starting `offset` tokens in (rows use disjoint offsets)."""
        if self._prose is None:
            from kvzip.data import evaluation_prose

            self._prose = self.tokenizer(evaluation_prose(), add_special_tokens=False)["input_ids"]
        if len(self._prose) < offset + n:
            raise ValueError(f"held-out prose has {len(self._prose)} tokens, {offset + n} needed")
        return self._prose[offset : offset + n]

    def document(self, row: int, n: int) -> list[int]:
        """The first n tokens of long held-out text `row`: even rows are Wikipedia articles (kvzip.data.long_documents,
        longest first), odd rows standard-library source files (kvzip.data.long_sources); both are texts whose tokens
        depend on what was written thousands of tokens before, one text per row."""
        if row not in self._documents:
            from kvzip.data import long_documents, long_sources

            texts = long_sources() if row % 2 else long_documents()
            if row // 2 >= len(texts):
                raise ValueError(f"{len(texts)} long texts of row {row}'s kind, row {row} asked for one more")
            self._documents[row] = self.tokenizer(texts[row // 2], add_special_tokens=False)["input_ids"]
        if len(self._documents[row]) < n:
            raise ValueError(f"long text {row} has {len(self._documents[row])} tokens, {n} needed")
        return self._documents[row][:n]

    def chat_prompt(self, text: str) -> list[int]:
        return engine.encode(self.tokenizer, text, raw=self.tokenizer.chat_template is None)


def headline(by_context: list[dict]) -> dict:
    """A record of several lengths: the longest one's figures, and each length's under `by_context`."""
    return {**by_context[-1], "by_context": by_context}


def run_generate(ctx: Context, method, dictionaries, prompts: list[list[int]], settings) -> tuple[list, dict, list]:
    """(Results, the batch Summary's stats, seconds of each decode step) of one engine run, ticking per step."""
    cache = method.make_cache(ctx.model, dictionaries)
    results, summary, steps, last = [], {}, [], 0.0
    for event in engine.uninterrupted(engine.generate(ctx.model, ctx.tokenizer, prompts, cache, settings)):
        if isinstance(event, engine.Step):
            if event.step > 0:
                steps.append(event.elapsed_s - last)
                ctx.tick(1)
            last = event.elapsed_s
        elif isinstance(event, engine.Result):
            results.append(event)
        elif isinstance(event, engine.Summary):
            summary = event.stats
    return results, summary, steps


@dataclass
class Budgeted:
    """A setting at F of `full`'s bytes: method `name` with the user's `opts`, planned anew for each length.
    `load(method)` finds the dictionaries a planned method needs (a plan may choose one that needs a dictionary)."""

    name: str
    opts: dict
    fraction: float
    tier: str
    shape: Shape
    load: object
    keeps_prompt: bool = False
    _dictionaries: dict = field(default_factory=dict)

    def describe(self) -> dict:
        return {"method": self.name, "options": dict(self.opts), "budget": self.fraction, "budget_tier": self.tier}

    def at(self, prompt_tokens: int, new_tokens: int):
        """(method, dictionaries, plan) for a cache holding `prompt_tokens + new_tokens` at the end."""
        from kvzip.methods import get_method

        p = plan(self.name, Budget(self.fraction, prompt_tokens, max(new_tokens, 1), self.shape, self.tier), self.opts)
        method = get_method(self.name, p.options)
        dictionaries = None
        if method.needs_dictionary:
            key = method.dictionary_keys()
            if key not in self._dictionaries:
                self._dictionaries[key] = self.load(method)
            dictionaries = self._dictionaries[key]
        return method, dictionaries, p


def resolve(method, dictionaries, prompt_tokens: int, new_tokens: int) -> tuple[object, object, Plan | None]:
    """A setting's (method, dictionaries, plan) for so many tokens: a `Budgeted` setting's planned method, or the
    setting's own method and no plan."""
    if isinstance(method, Budgeted):
        return method.at(prompt_tokens, new_tokens)
    return method, dictionaries, None


def budget_fields(method, p: Plan | None, record: dict) -> dict:
    """What a budgeted record carries beside its figures (nothing for a setting without a budget)."""
    if p is None:
        return {}
    key = "kv_device_ratio_vs_full" if method.tier == "device" else "kv_ratio_vs_full"
    measured = record.get(key)
    return {"budget": p.fraction, "budget_tier": method.tier, "budget_plan": p.describe(), "budget_ratio": measured,
            "budget_mark": mark(p.fraction, measured, p.note)}
