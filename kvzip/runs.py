"""The finished pieces of a long job on disk: what lets a run be resumed, and the ranks of a data-parallel run merged.

A job that writes OUTPUT keeps its pieces in the folder `OUTPUT.parts` beside it while it runs: `run.json` (the job's
settings, the commit of the code, the id of the launch that last started it) and one JSON file per finished piece (a
batch of rows, a bench cell), each published atomically (`kvzip.files`) the moment it is done. Once every piece is
there, rank 0 writes OUTPUT, atomically, from them, and only then removes the folder. So the folder holds whole
pieces only: Ctrl-C or a killed rank loses the pieces in flight and nothing else, and the temporary file a killed
process may leave is removed when the job starts again.

A resumed job must be the same job. Its settings and commit are compared with what the earlier run recorded (in
run.json, or in a finished OUTPUT) before any model loads; a difference refuses the resume, since one output mixing
two settings or two versions of the code would report something no run measured.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

from kvzip.errors import UserError
from kvzip.files import write_atomic

RECORD = "run.json"


def parts_folder(output: Path) -> Path:
    """Where the pieces of the job writing `output` live while it runs."""
    return output.with_name(output.name + ".parts")


def commit() -> str | None:
    """The git commit of the checkout kvzip runs from (with "-dirty" when tracked files differ), or None outside one."""
    top = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(top), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(top), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def file_digest(path: str | Path) -> str:
    """SHA-256 of a file's bytes (an input file, a dictionary): a job's settings name its files by content."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def check_same_job(record: dict, settings: dict, code: str | None, where: str) -> None:
    """UserError when the earlier run recorded in `record` ({"settings", "commit"}) is not this job."""
    if record.get("commit") != code:
        raise UserError(f"{where} was written at commit {record.get('commit')}, this is {code}: results of two versions "
                        f"of kvzip would mix; run that commit, or start over without resuming")
    theirs = record.get("settings") or {}
    differ = sorted(k for k in set(theirs) | set(settings) if theirs.get(k) != settings.get(k))
    if differ:
        raise UserError(f"{where} was written with other settings ({', '.join(differ)} differ): rerun with the same "
                        f"settings, or start over without resuming")


class Parts:
    """The pieces folder of one job (`parts_folder(output)`)."""

    def __init__(self, folder: Path):
        self.folder = folder

    def record(self) -> dict | None:
        """What run.json says (settings, commit, run id), or None when no run has started here."""
        path = self.folder / RECORD
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise UserError(f"{path} cannot be read ({exc}): remove {self.folder} to start over") from None

    def finished(self) -> list[str]:
        """Names of the finished pieces, sorted (temporary files and run.json are not pieces)."""
        if not self.folder.is_dir():
            return []
        return sorted(p.stem for p in self.folder.glob("*.json") if not p.name.startswith(".") and p.name != RECORD)

    def begin(self, settings: dict, code: str | None, run_id: str) -> None:
        """Rank 0, before any rank works: create the folder, drop what a killed process left half-written, and record
        this launch (the settings and commit of the first one stay, checked by every resume)."""
        self.folder.mkdir(exist_ok=True)
        record = self.record()
        for stale in self.folder.glob(".*" if record is not None else "*"):  # a new job keeps nothing found there
            if stale.is_file():
                stale.unlink()
        record = record or {"settings": settings, "commit": code, "runs": []}
        record["runs"] = [*record.get("runs", []), run_id]
        record["run"] = run_id
        write_atomic(self.folder / RECORD, json.dumps(record, indent=1) + "\n")

    def check_visible(self, run_id: str) -> None:
        """Every rank, after rank 0 began: the folder this rank sees is the one rank 0 wrote (ranks on several nodes
        need it on a filesystem they share); UserError otherwise."""
        record = self.record()
        if record is None or record.get("run") != run_id:
            raise UserError(f"{self.folder} is not the folder rank 0 wrote: every rank must see the same output folder "
                            "(on several nodes, a filesystem they share)")

    def write(self, name: str, piece: dict) -> None:
        """Publish one finished piece (atomically: a reader sees all of it or nothing)."""
        write_atomic(self.folder / f"{name}.json", json.dumps(piece) + "\n")

    def read(self, name: str) -> dict:
        return json.loads((self.folder / f"{name}.json").read_text())

    def remove(self) -> None:
        """Once the merged output is in place: the pieces are in it."""
        shutil.rmtree(self.folder, ignore_errors=True)
