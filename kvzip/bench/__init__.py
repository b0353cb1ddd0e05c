"""kvzip bench: every method on the same model, the same workloads and the same run, against `full`.

Library side of `kvzip bench` (the CLI renders tables and progress; nothing here prints):
- `config`: `BenchConfig` (workload sizes, budgets, `quick_preset()`), `Setting` (one method with one set of options,
  at a budget or not), `parse_settings` for `--methods`, `--opt method.key=value` and `--method-set`, `at_budgets`.
- `workloads`: output, prompt, speed and capacity, one record each (`reasoning` and `recall` in modules of their own);
  `context`: what every workload shares (the run's `Context`, one generation, a setting at a memory budget).
- `cells`: a run's cells (one setting on one workload), the order they run in and each rank's share of them.
- `runner`: `run_bench(model, tokenizer, source, settings, cfg)` -> a JSON-ready dict, `full` first, skips with notes;
  optionally only some cells, each reported as it ends; `merge` builds the run's JSON from every cell's piece.
- `report`: table rows, the best per column, the Pareto front of quality vs KV memory, the PNG plot.

    from kvzip.bench import BenchConfig, parse_settings, run_bench
    data = run_bench(model, tokenizer, source, parse_settings("full,window", None, None, list(METHODS)),
                     BenchConfig.quick_preset())
"""

from kvzip.bench.config import WORKLOADS, BenchConfig, Setting, parse_settings
from kvzip.bench.runner import run_bench

__all__ = ["WORKLOADS", "BenchConfig", "Setting", "parse_settings", "run_bench"]
