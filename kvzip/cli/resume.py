"""The pieces folder of a resumable command (`generate --output`, `bench --json`), settled by every rank before any
model loads: is there an earlier run, is it this same job, which pieces did it finish, and does every rank see the
folder that rank 0 prepared.

- No earlier run: rank 0 creates OUTPUT.parts and records the job there (`kvzip.runs.Parts.begin`).
- OUTPUT.parts holds an earlier run: without `--resume` that is refused (finish it or remove it: one job at a time
  per output); with `--resume` its settings and commit must equal this job's, and its finished pieces are kept.
- `--resume` and no folder, but a finished OUTPUT that records this same job: nothing is left to do.
- Then every rank reads back what rank 0 recorded: a rank that cannot (node-local storage, several nodes) stops all.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvzip.cli.flags import cli_words, flagged
from kvzip.errors import UserError


def prepare_parts(world, parts, record: dict, code: str | None, resume: bool, output: Path,
                  finished_run: Callable[[Path], dict | None], run_id: str) -> list[str] | None:
    """Names of the pieces an earlier run finished ([] for a new job), or None when `output` already holds this whole
    job. `finished_run(output)` reads the job record a finished output carries (None when it has none)."""
    from kvzip import distributed

    look = lambda: _look(parts, record, code, resume, output, finished_run)  # noqa: E731
    finished = distributed.broadcast(world, distributed.agree(world, look, cli_words))  # rank 0's view is the plan
    if finished is None:
        return None
    if world.main:
        parts.begin(record, code, run_id)
    distributed.all_gather(world, None)  # the folder is ready: now every rank must see it
    distributed.agree(world, lambda: flagged("--output", parts.check_visible, run_id), cli_words)
    return finished


def _look(parts, record: dict, code, resume: bool, output: Path, finished_run) -> list[str] | None:
    from kvzip.runs import check_same_job

    earlier = parts.record()
    if earlier is not None:
        if not resume:
            raise UserError(f"{parts.folder} holds an unfinished run: pass --resume to finish it, or remove that "
                            "folder to start over")
        flagged("--resume", check_same_job, earlier, record, code, str(parts.folder))
        return parts.finished()
    if resume and output.is_file():
        try:
            run = finished_run(output)
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            run = None
        if run is None:
            raise UserError(f"--resume: {output} has no record of a finished run's settings: start over without "
                            "--resume")
        flagged("--resume", check_same_job, run, record, code, str(output))
        return None
    return []
