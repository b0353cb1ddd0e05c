"""Fast tier: one memory budget for every method (kvzip/budget.py, each method's `plan_budget`).

Every registered method, planned for F of full's bytes, holds what its plan expects (the byte model of each method
is right) and lands within the tolerance of F where its plan says it can, at two lengths (the matrix finds a new
method by itself: a method without a budget mapping fails here). Also: bad budgets, the options a budget sets and
the user's, the key positions against a hand-computed example.
"""

from __future__ import annotations

import pytest
import torch

from kvzip import evaluate
from kvzip.budget import TOLERANCE, Budget, Shape, plan
from kvzip.cli.flags import check_fraction, check_fractions
from kvzip.errors import UserError
from kvzip.methods import get_method
from tests.matrix import METHOD_NAMES

PROMPT = list(range(10, 30))
LENGTHS = (320, 480)
FRACTIONS = (0.25, 0.5)


def _text(tokenizer, n: int) -> list[int]:
    """n byte tokens of the held-out prose, a paragraph break every ~60 bytes: thoughts as long as the budget's
    estimate (kvzip/methods/thoughts/budget.py), which counts the default model's tokens, ~4 bytes each."""
    import textwrap

    from kvzip.data import evaluation_prose

    text = "\n\n".join(textwrap.wrap(evaluation_prose()[: 2 * n], 58))
    return tokenizer(text, add_special_tokens=False)["input_ids"][1 : n + 1]


def _measure(tiny, tokenizer, dictionaries, name, fraction, length, tier="all", options=None):
    budget = Budget(fraction, len(PROMPT), length, Shape.of(tiny), tier)
    p = plan(name, budget, options or {})
    method = get_method(name, p.options)
    cache = method.make_cache(tiny, dictionaries if method.needs_dictionary else None)
    run = evaluate.teacher_forced(tiny, tokenizer, cache, [PROMPT], [_text(tokenizer, length)])
    key = "kv_device_ratio_vs_full" if tier == "device" else "kv_ratio_vs_full"
    return p, run.report[key]


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_every_method_lands_on_its_budget(tiny, tokenizer, tiny_dictionaries, name):
    if name.startswith("hf-int"):
        pytest.importorskip("optimum.quanto")
    landed = {}
    for fraction in FRACTIONS:
        for length in LENGTHS:
            p, measured = _measure(tiny, tokenizer, tiny_dictionaries, name, fraction, length)
            if p.note:  # the plan said F is out of its reach (a floor, a fixed format): the cell is indeed marked
                assert abs(measured / fraction - 1) > TOLERANCE, (fraction, length, p, measured)
                continue
            # the plan's byte model holds: the cache holds what the plan expected, which is F
            assert abs(measured / p.expected - 1) <= TOLERANCE, (fraction, length, p, measured)
            assert abs(measured / fraction - 1) <= TOLERANCE, (fraction, length, p, measured)
            landed.setdefault(fraction, []).append(length)
    if name != "full":
        assert any(sorted(v) == list(LENGTHS) for v in landed.values()), f"{name} reached no budget at both lengths"


def test_zoomr_on_the_device_tier(tiny, tokenizer):
    for length in LENGTHS:
        p, measured = _measure(tiny, tokenizer, None, "zoomr", 0.5, length, tier="device")
        assert not p.note and abs(measured / 0.5 - 1) <= TOLERANCE, (length, p, measured)


@pytest.mark.parametrize("index", ["summary", "bounds"])
def test_zoomr_on_the_device_tier_with_either_index(tiny, tokenizer, index):
    """The plan counts zoomr's index as it is stored: the summary index's fp32 keys or the bounds' low and high a
    channel (a token's K and V a thought); both land on the device budget."""
    p, measured = _measure(tiny, tokenizer, None, "zoomr", 0.5, LENGTHS[-1], "device", {"zoom_index": index})
    assert p.options["zoom_index"] == index
    assert not p.note and abs(measured / 0.5 - 1) <= TOLERANCE, (index, p, measured)


def test_fadkv_with_int4_coefficients_lands_on_an_even_sparsity(tiny, tokenizer, tiny_dictionaries):
    """int4 coefficients (two a byte) are counted as stored: a 14-atom code lands on its budget, and a plan that
    lowers the sparsity lowers it to even numbers only."""
    for bits in ("16", "10"):  # and atom numbers packed in 10 bits are counted as stored
        p, measured = _measure(tiny, tokenizer, tiny_dictionaries, "fadkv", 0.5, LENGTHS[-1], "all",
                               {"coef_format": "int4", "sparsity": "14", "index_bits": bits})
        assert not p.note and abs(measured / p.expected - 1) <= TOLERANCE, (bits, p, measured)
    shape = Shape(layers=30, heads=9, kv_heads=3, head_dim=64, element_size=2)
    low = plan("fadkv", Budget(0.125, 46, 2048, shape), {"coef_format": "int4"})
    assert int(low.options["sparsity"]) % 2 == 0 and not low.note


def test_a_budget_the_method_cannot_reach_is_noted():
    shape = Shape(layers=30, heads=9, kv_heads=3, head_dim=64, element_size=2)
    fp8 = plan("hf-fp8", Budget(0.125, 46, 2048, shape))
    assert "0.500" in fp8.note
    full = plan("full", Budget(0.25, 46, 2048, shape))
    assert full.note == "full keeps every token"
    window = plan("window", Budget(0.125, 46, 2048, shape))
    assert not window.note and int(window.options["window"]) + int(window.options["sinks"]) == int(0.125 * 2094)


def test_an_unreachable_thought_plan_counts_the_options_the_user_fixed():
    """The floor a note names is the smallest plan with the user's own options: 2 summary tokens and 8 zoomed 16-token
    thoughts do not fit 0.25 of 2,048 tokens, and the floor says what they hold, not what 1 and 1 would."""
    shape = Shape(layers=30, heads=9, kv_heads=3, head_dim=64, element_size=2)
    budget = Budget(0.25, 46, 2048, shape, tier="device")
    opts = {"max_thought_tokens": "16", "min_thought_tokens": "4", "zoom_thoughts": "8", "summary_tokens": "2"}
    p = plan("zoomr", budget, opts)
    assert p.note and p.expected > 0.25 and "2 summary tokens a thought, 8 zoomed thoughts" in p.note
    assert p.options["summary_tokens"] == "2" and p.options["zoom_thoughts"] == "8"
    loose = plan("zoomr", budget, {k: v for k, v in opts.items() if k != "summary_tokens"})
    assert not loose.note and loose.expected <= 0.25 * (1 + TOLERANCE)


def test_budget_options_and_user_options():
    shape = Shape(layers=30, heads=9, kv_heads=3, head_dim=64, element_size=2)
    budget = Budget(0.25, 46, 4096, shape)
    kept = plan("zoomr", budget, {"detail": "int8", "vote_decay": "0.5"})
    assert kept.options["detail"] == "int8" and kept.options["vote_decay"] == "0.5"
    with pytest.raises(UserError, match="the budget sets window"):
        plan("window", budget, {"window": "100"})
    fixed = plan("fadkv", budget, {"sparsity": "4"})
    assert fixed.options["sparsity"] == "4" and int(fixed.options["buffer"]) > 128


@pytest.mark.parametrize("text", ["0", "-0.5", "1.5", "abc", "nan", "inf", ""])
def test_bad_budgets_are_refused(text):
    with pytest.raises(UserError, match=r"in \(0, 1\]"):
        check_fraction(text)
    with pytest.raises(UserError):
        check_fractions(text)


def test_budget_lists():
    assert check_fractions("0.125, 0.25,1") == (0.125, 0.25, 1.0)
    with pytest.raises(UserError, match="twice"):
        check_fractions("0.25,0.25")


def test_key_positions_by_hand():
    # full's and the short reference's negative log-likelihoods at five positions
    full = torch.tensor([[0.5, 1.9, 3.0, 0.1, 2.5]])
    short = torch.tensor([[3.0, 3.0, 6.0, 2.2, 5.0]])
    # gains 2.5, 1.1, 3.0, 2.1, 2.5; full's log-probability -0.5, -1.9, -3.0, -0.1, -2.5
    assert evaluate.key_positions(full, short).tolist() == [[True, False, False, True, False]]


def test_key_scores_average_over_key_positions_only():
    forced = evaluate.Forced(nll=torch.tensor([[1.0, 2.0, 3.0]]), top1=torch.tensor([[5, 6, 7]]),
                             kl=torch.tensor([[0.1, 0.2, 0.3]]), reference=None, report={}, decode_s=1.0)
    ref = evaluate.Reference(top1=torch.tensor([[5, 0, 7]]), top_ids=None, top_logprobs=None)
    scores = forced.scores(ref, torch.tensor([[False, True, True]]))
    assert scores["key_positions"] == 2 and scores["key_top1_agreement"] == 0.5
    assert scores["key_kl"] == pytest.approx(0.25) and scores["key_ppl"] == pytest.approx(2.71828 ** 2.5, rel=1e-4)
    assert scores["top1_agreement"] == pytest.approx(2 / 3, abs=1e-4)
    none = forced.scores(ref, torch.zeros(1, 3, dtype=torch.bool))
    assert none["key_positions"] == 0 and none["key_top1_agreement"] is None


def test_a_resumed_budget_sweep_reruns_no_finished_cell(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """Ctrl-C in the middle of `kvzip bench --budgets`, then `--resume`: the cells finished before the interrupt are
    not measured again (full runs again only as the reference of the cells left), and the JSON holds every cell."""
    import json
    import sys

    from kvzip.bench import workloads
    from kvzip.cli import main
    from tests.conftest import interrupt_at_step

    out = tmp_path / "sweep.json"
    args = ["kvzip", "bench", "--model", str(tiny_model_dir), "--dtype", "float32", "--methods", "full,window,h2o",
            "--budgets", "0.25,0.5", "--workloads", "output", "--output-tokens", "40", "--rows", "1", "--json", str(out)]
    measured = []
    output = workloads.RUNNERS["output"]

    def counting(ctx, label, method, dictionaries):
        measured.append(label)
        return output(ctx, label, method, dictionaries)

    monkeypatch.setitem(workloads.RUNNERS, "output", counting)
    steps = interrupt_at_step(monkeypatch, 40 * 2 + 40 * 2 + 10)  # full (and its short reference), window's 2 cells
    monkeypatch.setattr(sys, "argv", args)
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code == 130 and len(steps) == 170
    first = list(measured)
    assert first == ["full", "window@0.25", "window@0.5", "h2o@0.25"]
    monkeypatch.undo()
    monkeypatch.setitem(workloads.RUNNERS, "output", counting)
    measured.clear()
    monkeypatch.setattr(sys, "argv", args + ["--resume"])
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code == 0
    assert measured == ["full", "h2o@0.25", "h2o@0.5"]  # full as the reference only
    data = json.loads(out.read_text())
    assert [r["label"] for r in data["results"]] == ["full", "window@0.25", "window@0.5", "h2o@0.25", "h2o@0.5"]
    assert all(r["budget"] in (0.25, 0.5) for r in data["results"][1:])
    capsys.readouterr()


def test_a_budget_planned_like_an_earlier_one_is_not_measured_again(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """hf-fp8 has one format whatever the budget: its second budget reuses the first one's pass, says so, and still
    carries its own budget and mark."""
    import json
    import sys

    from kvzip import evaluate
    from kvzip.cli import main

    out = tmp_path / "fp8.json"
    passes = []
    forced = evaluate.teacher_forced
    monkeypatch.setattr(evaluate, "teacher_forced", lambda *a, **k: passes.append(1) or forced(*a, **k))
    monkeypatch.setattr(sys, "argv", ["kvzip", "bench", "--model", str(tiny_model_dir), "--dtype", "float32",
                                      "--methods", "full,hf-fp8", "--budgets", "0.25,0.5", "--workloads", "output",
                                      "--output-tokens", "24", "--rows", "1", "--json", str(out)])
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code == 0 and len(passes) == 3  # full, its short reference, hf-fp8 once
    full, first, second = json.loads(out.read_text())["results"]
    assert "same_run_as" not in first and second["same_run_as"] == first["label"] == "hf-fp8@0.25"
    assert (first["budget"], second["budget"]) == (0.25, 0.5) and first["top1_agreement"] == second["top1_agreement"]
    assert first["budget_mark"] is None and "holds 0.250" in second["budget_mark"]  # fp32: a byte of four
    capsys.readouterr()
