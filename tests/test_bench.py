"""Fast tier: the bench library on the tiny model (every registered method), its settings parser, the Pareto front
and the best-per-column marks; the `kvzip bench` user errors (exit 2, one line) without loading a model.

The recall workload needs single-token object words, which the byte tokenizer has none of: it is exercised by the
integration test on the real model.
"""

from __future__ import annotations

import json
import types

import pytest
import torch

from kvzip.bench import BenchConfig, Setting, parse_settings, run_bench
from kvzip.bench.report import COLUMNS, best_marks, pareto_front, plot, summary_rows
from kvzip.bench.reasoning import agreement, parse_answer
from kvzip.errors import UserError
from kvzip.methods import METHODS
from kvzip.models import ModelSource
from kvzip.stats import wilson_interval
from tests.conftest import interrupt_at_step
from tests.matrix import tiny_options

TINY = BenchConfig(workloads=("output", "prompt", "reasoning", "speed", "capacity"), output_tokens=(48, 96), output_rows=2,
                   prompt_contexts=(40, 64), prompt_positions=12, reasoning_prompts=2, reasoning_batch=2,
                   reasoning_new_tokens=6, speed_contexts=(32,), speed_new_tokens=4, repeats=2, capacity_tokens=40,
                   capacity_max_rows=24)


@pytest.fixture(scope="module")
def tiny_run(tiny, tokenizer, tiny_dictionaries, tmp_path_factory):
    path = tmp_path_factory.mktemp("dict") / "tiny.safetensors"
    tiny_dictionaries.save(path)
    settings = [Setting("full", "full")] + [Setting(n, n, tiny_options(n)) for n in METHODS if n != "full"]
    settings.append(Setting("window:window=4", "window", {"sinks": "1", "window": "4"}))
    seen = []
    data = run_bench(tiny, tokenizer, ModelSource("tiny", "", False), settings, TINY, dict_path=path,
                     on_progress=lambda done, total, what: seen.append((done, total)))
    return data, seen


def test_every_method_runs_and_reports_the_issue_fields(tiny_run):
    data, _ = tiny_run
    assert not data["failed"], data["failed"]
    labels = {r["label"] for r in data["results"]}
    assert labels == {"full", "window:window=4", *METHODS} - {s["label"] for s in data["skipped"] if "workload" not in s}
    common = ("method", "options", "kv_bytes_peak", "kv_bytes_device_peak", "kv_bytes_full", "kv_ratio_vs_full",
              "kv_device_ratio_vs_full", "kv_ratio_vs_fp16_full", "decode_tokens_per_s", "speed_ratio_vs_full")
    quality = {"output": ("ppl", "top1_agreement", "kl"), "prompt": ("ppl", "top1_agreement", "kl"),
               "reasoning": ("greedy_agreement", "gsm8k_accuracy", "gsm8k_accuracy_95ci"), "speed": (),
               "capacity": ("rows", "kv_budget", "kv_bytes_per_row", "rows_device_tier")}
    for r in data["results"]:
        for key in common + quality[r["workload"]]:
            if r.get("scoring_shortcut") and key in ("decode_tokens_per_s", "speed_ratio_vs_full"):
                assert r[key] is None and r["method"].startswith("hf-")  # their stock layers' speed is not measured
                continue
            assert r.get(key) is not None, (r["label"], r["workload"], key)
        assert r["kv_bytes_peak"] > 0 and r["process_peak_rss_bytes"] > 0
        # every ratio can be recomputed from the byte fields it is made of
        assert r["kv_ratio_vs_full"] == pytest.approx(r["kv_bytes_peak"] / r["kv_bytes_full"], abs=1e-4)
        assert r["kv_device_ratio_vs_full"] == pytest.approx(r["kv_bytes_device_peak"] / r["kv_bytes_full"], abs=1e-4)
    json.dumps(data)  # everything is JSON-serialisable


def test_methods_that_keep_the_prompt_skip_the_prompt_workload(tiny_run):
    data, _ = tiny_run
    skipped = {s["label"] for s in data["skipped"] if s.get("workload") == "prompt"}
    assert skipped == {n for n, cls in METHODS.items() if cls.keeps_prompt} and skipped
    assert not any(r["workload"] == "prompt" and r["label"] in skipped for r in data["results"])


def test_full_is_its_own_reference_and_compression_shows(tiny_run):
    data, _ = tiny_run
    by = {(r["label"], r["workload"]): r for r in data["results"]}
    full = by["full", "output"]
    assert full["top1_agreement"] == 1.0 and full["kl"] == 0.0 and full["kv_ratio_vs_full"] == 1.0
    assert by["full", "reasoning"]["greedy_agreement"] == 1.0
    assert full["kv_ratio_vs_fp16_full"] == pytest.approx(2.0, abs=0.01)  # the tiny model is fp32
    win = by["window:window=4", "output"]
    assert win["kv_bytes_peak"] < full["kv_bytes_peak"] and win["top1_agreement"] < 1.0
    assert [c["context"] for c in full["by_context"]] == [48, 96]
    assert full["positions"] == 2 * 96  # both rows, every fed position
    for r in data["results"]:  # the quality workload: every method but full holds fewer bytes than full
        if r["workload"] == "output" and r["method"] != "full":
            for entry in r["by_context"][1:]:
                assert entry["kv_bytes_peak"] < entry["kv_bytes_full"], (r["label"], entry["context"])
    fp8 = by.get(("hf-fp8", "output"))
    if fp8 is not None:  # fp8 codes are one byte per value: about a quarter of the fp32 cache
        assert fp8["kv_bytes_peak"] == pytest.approx(full["kv_bytes_peak"] / 4, rel=0.05)
    speed = by["window", "speed"]
    assert speed["speed_ratio_vs_full"] == pytest.approx(sorted(speed["paired_speed_ratios"])[0] / 2
                                                         + sorted(speed["paired_speed_ratios"])[1] / 2, abs=1e-3)


def test_capacity_fills_the_budget_full_needs_for_eight_rows(tiny_run):
    data, _ = tiny_run
    cap = {r["label"]: r for r in data["results"] if r["workload"] == "capacity"}
    full = cap["full"]
    assert full["kv_budget"] == full["kv_bytes_peak"] and full["rows"] == 8 and full["fits"]  # its 8-row batch
    assert full["tries"] == full["tries"][:1]  # the budget is its own batch: nothing to grow or shrink
    for label, r in cap.items():
        assert r["kv_budget"] == full["kv_budget"]  # one budget for every method
        first = r["tries"][0]["rows"]
        if label != "full":
            assert first == min(24, r["kv_budget"] // r["kv_bytes_per_row"])
        assert r["new_tokens"] == 40 * r["rows"]
        fit = [t["rows"] for t in r["tries"] if t["kv_bytes_peak"] <= r["kv_budget"]]
        assert r["rows"] == (max(fit) if fit else r["tries"][-1]["rows"]) and r["fits"] == bool(fit)
        assert len(r["tries"]) <= 3 and len({t["rows"] for t in r["tries"]}) == len(r["tries"])
        assert r["rows_device_tier"] >= r["rows"]
        if r["method"] in ("window", "h2o", "hf-int2") and not r["rows_capped"]:
            assert r["rows"] > 8, label  # a smaller cache buys a larger batch


def _capacity_with(monkeypatch, per_row) -> tuple[list[int], dict]:
    """The capacity workload against a budget of 1,600 bytes, each batch of n rows holding per_row(n) bytes a row:
    (the batch sizes run, the one-row probe first; the result)."""
    from kvzip.bench import workloads

    ran = []

    def fake_run(ctx, method, dictionaries, prompts, settings):
        ran.append(len(prompts))
        held = per_row(len(prompts)) * len(prompts)
        return [], {"kv_bytes_peak": held, "kv_bytes_device_peak": held, "decode_tokens_per_s": float(len(prompts)),
                    "new_tokens": 4 * len(prompts)}, []

    monkeypatch.setattr(workloads, "run_generate", fake_run)
    monkeypatch.setattr(workloads, "capacity_prompts", lambda ctx, rows: [[1]] * rows)
    ctx = types.SimpleNamespace(cfg=BenchConfig(capacity_tokens=4), ref={"capacity_budget": 1600})
    return ran, workloads.capacity(ctx, "m", None, None)


def test_capacity_shrinks_a_batch_that_overshoots_the_budget(monkeypatch):
    """A batch that holds more per row than the one-row probe is measured again, smaller by what it overshot."""
    ran, r = _capacity_with(monkeypatch, lambda n: 100 if n == 1 else 130)  # a batch pads its rows: 30% more a row
    assert ran == [1, 16, 12] and r["rows"] == 12 and r["fits"] and r["kv_bytes_peak"] == 1560
    assert [t["rows"] for t in r["tries"]] == [16, 12] and r["decode_tokens_per_s"] == 12.0


def test_a_process_without_full_capacity_cell_gets_the_same_budget(tiny, tokenizer, tiny_run):
    """A resumed run or a rank that does not measure full's capacity cell runs full's 8-row batch for the budget."""
    from kvzip.bench import workloads
    from kvzip.methods import get_method

    data, _ = tiny_run
    budget = next(r for r in data["results"] if r["workload"] == "capacity" and r["label"] == "full")["kv_budget"]
    ctx = workloads.Context(tiny, tokenizer, TINY)
    workloads.reference(ctx, "capacity", get_method("full"))
    assert ctx.ref["capacity_budget"] == budget


@pytest.mark.parametrize("crowded, expect", [(80, [16, 20]), (95, [16, 20, 16])])
def test_capacity_grows_a_batch_that_lands_under_the_budget(monkeypatch, crowded, expect):
    """A batch that holds less per row than the one-row probe is grown to what its own bytes per row allow; when the
    grown batch overshoots (rows past 18 hold `crowded` bytes each), the largest batch that fit is the result."""
    ran, r = _capacity_with(monkeypatch, lambda n: 100 if n == 1 else (80 if n <= 18 else crowded))
    assert ran == [1] + expect[:2] and [t["rows"] for t in r["tries"]] == expect[:2]
    assert r["rows"] == expect[-1] and r["fits"] and r["decode_tokens_per_s"] == float(expect[-1])
    assert r["kv_bytes_peak"] == 80 * expect[-1]


def test_progress_counts_up_to_the_total(tiny_run):
    _, seen = tiny_run
    dones = [d for d, _ in seen]
    assert dones == sorted(dones) and seen[-1][0] == seen[-1][1] > 0


def test_table_marks_the_best_and_plot_draws_the_front(tiny_run, tmp_path):
    data, _ = tiny_run
    rows = summary_rows(data)
    marks = best_marks(rows)
    top1 = max(r["top1"] for r in rows if r["label"] != "full")
    assert marks["top1"] == {r["label"] for r in rows if r["label"] != "full" and r["top1"] == top1}
    assert "full" not in set().union(*marks.values())
    front = plot(data, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG" and front
    from kvzip.bench.report import capacity_plot

    capacity_plot(data, tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_option_draws_what_ran(tiny_run, tmp_path):
    """--plot: the quality plot at the path and the capacity plot beside it; with capacity alone, that at the path."""
    from kvzip.cli.bench import _save_plots

    data, _ = tiny_run
    both = _save_plots(data, tmp_path / "a.png", ("output", "capacity"))
    assert len(both) == 2 and {p.name for p in tmp_path.iterdir()} == {"a.png", "a-capacity.png"}
    only = _save_plots(data, tmp_path / "b.png", ("capacity",))
    assert only == [f"wrote {tmp_path / 'b.png'} (throughput at equal KV memory)"]
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG" and not (tmp_path / "b-capacity.png").exists()


def test_best_marks_directions_and_ties():
    rows = [{"label": "full", "kv_ratio": 2.0, "top1": 1.0}, {"label": "a", "kv_ratio": 0.5, "top1": 0.9},
            {"label": "b", "kv_ratio": 0.25, "top1": 0.9}, {"label": "c", "kv_ratio": None, "top1": 0.5}]
    cols = [c for c in COLUMNS if c.key in ("kv_ratio", "top1")]
    assert best_marks(rows, cols) == {"kv_ratio": {"b"}, "top1": {"a", "b"}}
    same = [{"label": "full", "top1": 1.0}, {"label": "a", "top1": 0.0}, {"label": "b", "top1": 0.0}]
    assert best_marks(same, cols) == {}  # nothing to choose between


def test_pareto_front():
    points = [("full", 2.0, 1.0), ("a", 0.5, 0.95), ("b", 0.5, 0.90), ("c", 0.25, 0.6), ("d", 1.0, 0.94)]
    assert pareto_front(points) == ["c", "a", "full"]
    assert pareto_front([("x", 1.0, 1.0), ("y", 1.0, 1.0)]) == ["x", "y"]


def test_parse_settings():
    names = list(METHODS)
    s = parse_settings("window", ["window.window=64"], ["window:window=16,sinks=2"], names)
    assert [x.label for x in s] == ["full", "window:window=64", "window:window=16,sinks=2"]
    assert s[2].opts == {"window": "16", "sinks": "2"}
    assert parse_settings(None, None, None, names)[0].label == "full" and len(parse_settings(None, None, None, names)) == len(names)
    for args, match in [(("nope", None, None), "unknown method 'nope'"),
                        (("window", ["full.x=1"], None), "not among the methods run"),
                        (("window", ["window=3"], None), "method.key=value"),
                        (("window", None, ["window:size=3"]), "has no option 'size'"),
                        (("window", None, ["window:window"]), "expected key=value"),
                        (("window,window", None, None), "listed twice")]:
        with pytest.raises(UserError, match=match):
            parse_settings(*args, names)


def test_config_validation():
    with pytest.raises(UserError, match="unknown workload 'x'"):
        BenchConfig(workloads=("x",))
    with pytest.raises(UserError, match="must exceed"):
        BenchConfig(prompt_contexts=(100,), prompt_positions=256)
    with pytest.raises(UserError, match="output lengths must be at least 2"):
        BenchConfig(output_tokens=(1,))
    with pytest.raises(UserError, match="output rows must be at least 1"):
        BenchConfig(output_rows=0)
    capped = BenchConfig().capped(2048)
    assert max(capped.prompt_contexts) == 2048 and max(capped.speed_contexts) == 2048 - BenchConfig().speed_new_tokens - 1
    assert max(capped.output_tokens) == 2048 - 128


def test_answer_parsing_and_agreement():
    assert parse_answer("so 3 + 4 = 7\n#### 1,234") == "1234"
    assert parse_answer("she pays 12 then 18.5 dollars.") == "18.5"
    assert parse_answer("no numbers") is None
    assert agreement([1, 2, 3, 4], [1, 2, 9, 4]) == (0.75, 0.5)
    assert agreement([1, 2, 3, 4], [1, 2]) == (0.5, 0.5)


def test_accuracy_interval_is_wilson():
    lo, hi = wilson_interval(1, 64)  # the normal approximation would give 0.000-0.046
    assert lo == pytest.approx(0.0028, abs=1e-4) and hi == pytest.approx(0.0833, abs=1e-4)
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(0, 10)[1] > 0.25
    assert wilson_interval(10, 10)[1] == pytest.approx(1.0) and wilson_interval(10, 10)[0] < 0.75
    lo, hi = wilson_interval(14, 64)
    assert lo < 14 / 64 < hi and wilson_interval(0, 0) == (0.0, 1.0)


@pytest.mark.parametrize("args, message", [
    (["--methods", "nope"], "unknown method 'nope'"),
    (["--workloads", "output,fast"], "unknown workload 'fast'"),
    (["--plot", "out.jpg"], "ending in .png"),
    (["--plot", "x.png", "--workloads", "speed"], "needs the output workload"),
    (["--output-tokens", "512,x"], "comma-separated integers"),
    (["--output-tokens", "1"], "output lengths must be at least 2"),
    (["--rows", "0"], "output rows must be at least 1"),
    (["--kv-budget", "lots"], "a size is a number with an optional unit"),
    (["--kv-budget", "0MiB"], "KV budget must be a positive number"),
    (["--capacity-tokens", "0"], "capacity tokens must be at least 1"),
    (["--contexts", "a,b"], "comma-separated integers"),
    (["--opt", "window=3"], "method.key=value"),
    (["--dict", "/nonexistent/d.safetensors"], "does not exist"),
    (["--repeats", "0"], "repeats must be at least 1"),
    (["--budgets", "0"], "--budgets takes a fraction of full's KV bytes in (0, 1]"),
    (["--budgets", "0.25,1.5"], "--budgets takes a fraction of full's KV bytes in (0, 1]"),
    (["--budgets", "a quarter"], "--budgets takes a fraction of full's KV bytes in (0, 1]"),
    (["--budgets", "0.25,0.25"], "--budgets lists the same budget twice"),
    (["--budget-tier", "device"], "--budget-tier says what --budgets counts"),
    (["--budgets", "0.25", "--budget-tier", "gpu"], "budget tier 'gpu' is not allowed"),
    (["--budgets", "0.25", "--opt", "window.window=9", "--methods", "full,window"], "the budget sets window"),
])
def test_cli_user_errors_are_one_line_exit_2(args, message, capsys, monkeypatch):
    import sys

    from kvzip.cli import main

    monkeypatch.setattr(sys, "argv", ["kvzip", "bench", *args])
    with pytest.raises(SystemExit) as exc:
        main()
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and message.split("'")[0] in err and "\n" not in err and "Traceback" not in err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_full_and_window_on_cuda_report_cuda_memory(tokenizer):
    from kvzip import engine
    from kvzip.methods import get_method
    from tests.conftest import tiny_llama

    model = tiny_llama().to("cuda")
    ids = tokenizer("hello cuda " * 8)["input_ids"]
    for name, opts in (("full", {}), ("window", {"sinks": "2", "window": "8"})):
        cache = get_method(name, opts).make_cache(model)
        events = list(engine.generate(model, tokenizer, [ids], cache, engine.Settings(max_new_tokens=12, ignore_eos=True)))
        result, summary = events[-2:]
        assert len(result.token_ids) == 12
        assert summary.stats["cuda_max_memory_allocated"] > 0 and summary.stats["kv_bytes_peak"] > 0


@pytest.mark.parametrize("workload", ["capacity", "reasoning", "speed"])
def test_ctrl_c_inside_a_generated_batch_keeps_no_record_of_it(workload, tiny, tokenizer, monkeypatch):
    """The engine catches Ctrl-C mid-batch and finishes the rows as "interrupted" (generate and chat keep their
    text); the bench must stop there rather than measure the cut batch and keep it as a finished cell."""
    interrupt_at_step(monkeypatch, 3)
    cfg = BenchConfig(workloads=(workload,), reasoning_prompts=2, reasoning_new_tokens=8, speed_contexts=(32,),
                      speed_new_tokens=8, repeats=1, capacity_tokens=12, capacity_max_rows=4)
    data = run_bench(tiny, tokenizer, ModelSource("tiny", "", False), [Setting("full", "full")], cfg)
    assert data["interrupted"] is True and data["results"] == []


def test_ctrl_c_keeps_the_records_finished_before_it(tiny, tokenizer, monkeypatch):
    from kvzip.bench import workloads

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setitem(workloads.RUNNERS, "speed", interrupted)
    settings = [Setting("full", "full"), Setting("window", "window", tiny_options("window"))]
    cfg = BenchConfig(workloads=("output", "speed"), output_tokens=(24,), output_rows=1, speed_contexts=(32,),
                      speed_new_tokens=4, repeats=1)
    data = run_bench(tiny, tokenizer, ModelSource("tiny", "", False), settings, cfg)
    assert data["interrupted"] is True  # cells run workload by workload, full first: both output cells finished
    assert [(r["label"], r["workload"]) for r in data["results"]] == [("full", "output"), ("window", "output")]
