"""Fast tier: scripts/throughput.py's lockstep decode on the tiny model. Methods that decode in turn, one step each,
must each generate exactly what they generate alone (their caches are separate), and each one's speed must come from
its own steps only."""

from __future__ import annotations

import pytest

from kvzip import engine
from tests.matrix import tiny_method
from tests.scripts import load_script


def test_lockstep_runs_each_method_as_it_runs_alone(tiny, tokenizer, tiny_dictionaries):
    methods = [tiny_method("full"), tiny_method("zoomr"), tiny_method("window")]
    dicts = [tiny_dictionaries if m.needs_dictionary else None for m in methods]
    prompts = [tokenizer("Count the boxes: one, two.")["input_ids"], tokenizer("Two more.")["input_ids"]]
    settings = engine.Settings(max_new_tokens=24, ignore_eos=True)
    summaries = load_script("throughput").lockstep(engine, tiny, tokenizer, prompts, methods, dicts, settings, end_steps=8)
    for method, d, summary in zip(methods, dicts, summaries):
        alone = [e for e in engine.generate(tiny, tokenizer, prompts, method.make_cache(tiny, d), settings)
                 if isinstance(e, engine.Summary)][0].stats
        for key in ("new_tokens", "kv_bytes_peak", "kv_bytes_final"):
            assert summary[key] == alone[key], (method.name, key)
        untimed = lambda stats: {k: v for k, v in stats.items() if "_ms_" not in k}  # noqa: E731
        assert untimed(summary["method_stats"]) == untimed(alone["method_stats"]), method.name
        steps = settings.max_new_tokens - 1  # the first token of each row comes from the prefill
        assert summary["decode_s"] > 0
        assert summary["decode_tokens_per_s"] == pytest.approx(len(prompts) * steps / summary["decode_s"], rel=1e-2)
        assert 0 < summary["decode_tokens_per_s_end"]
        quarters = summary["decode_tokens_per_s_by_quarter"]
        assert len(quarters) == 4 and all(q > 0 for q in quarters)
        # the quarters split the same steps: their times add up to the whole decode's
        total = sum(len(prompts) * n / q for n, q in zip((5, 6, 6, 6), quarters))
        assert total == pytest.approx(summary["decode_s"], rel=2e-2)
