"""The bench's unit of work, of data parallelism and of resumption: a cell, one setting measured on one workload.

A run's cells are numbered in the order its JSON lists them (setting by setting, `full` first, each setting's
workloads in order); a cell skipped by design (a method that keeps the prompt, on the `prompt` workload) is a note,
not a cell. Ranks share the cells in another order, workload by workload with `full` first: every figure of a
setting other than `full` is taken against `full`'s run of the same workload in the same process (its teacher-forced
logits, its greedy tokens, its capacity budget; the speed workload pairs each measurement with a `full` run), so a
rank runs `full` on each workload of its share, as a cell of its own or as a reference. Cutting the workload-ordered
list into contiguous runs of about equal cost keeps those reference runs to at most one per rank boundary.

Each finished cell is one piece in the run's pieces folder (`kvzip.runs`), written the moment it ends, so an
interrupted run loses at most the cells in flight, and `--resume` runs only the cells without a piece.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvzip.bench import workloads
from kvzip.bench.config import WORKLOADS


@dataclass(frozen=True)
class Cell:
    """One setting on one workload; `index` is its place in the JSON's order."""

    index: int
    label: str
    workload: str

    @property
    def piece(self) -> str:
        return f"cell-{self.index:04d}"


def plan(ready: list, wanted: list[str]) -> tuple[list[Cell], list[dict]]:
    """(every cell of the run in the JSON's order, the notes of the cells skipped by design) for the settings that
    can run here (`ready`: (setting, method, dictionaries), full first) and the workloads asked for."""
    cells, skipped = [], []
    for setting, method, _ in ready:
        for w in wanted:
            if w == "prompt" and method.keeps_prompt:
                skipped.append({"label": setting.label, "method": setting.name, "workload": w,
                                "reason": "keeps the prompt in full by design: the output workload measures it"})
            else:
                cells.append(Cell(len(cells), setting.label, w))
    return cells, skipped


def execution_order(cells: list[Cell]) -> list[Cell]:
    """Workload by workload, `full` first in each, then the settings in order (the list is in setting order)."""
    return sorted(cells, key=lambda c: (WORKLOADS.index(c.workload), c.label != "full", c.index))


def assign(cells: list[Cell], cfg, world) -> list[Cell]:
    """This rank's cells, in execution order: contiguous runs of the workload-ordered list, of about equal cost."""
    from kvzip.distributed import split_by_cost

    ordered = execution_order(cells)
    return [ordered[i] for i in split_by_cost([workloads.units(cfg, c.workload) for c in ordered], world)]
