"""Running kvzip as users do, in fresh processes: `python -m kvzip ...` and `torchrun --nproc-per-node N -m kvzip ...`
(as `python -m torch.distributed.run`, so that the test's interpreter runs it), from this checkout, one torch thread
per process. Also: finding a rank's process (to kill it), waiting for a file, reading JSONL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 300  # seconds a launch may take on a loaded 2-core machine before the test fails


def environment(marker: str | None = None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    if marker is not None:
        env["KVZIP_TEST_MARKER"] = marker
    return env


def torchrun_command(nproc: int, *args: str) -> list[str]:
    """torchrun on one node with a free port of its own choosing (`--standalone`)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", "kvzip", *map(str, args)]


def torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(torchrun_command(nproc, *args), cwd=ROOT, env=environment(), capture_output=True,
                          text=True, timeout=TIMEOUT)


def start_torchrun(nproc: int, *args: str) -> tuple[subprocess.Popen, str]:
    """A torchrun launch left running, and the marker its processes carry in their environment."""
    marker = uuid.uuid4().hex
    proc = subprocess.Popen(torchrun_command(nproc, *args), cwd=ROOT, env=environment(marker), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    return proc, marker


def rank_pids(marker: str) -> dict[int, int]:
    """rank -> pid of the live kvzip worker processes of the launch carrying `marker`."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = dict(item.split("=", 1) for item in (proc / "environ").read_text().split("\0") if "=" in item)
            cmdline = (proc / "cmdline").read_bytes()
        except (OSError, UnicodeDecodeError, ValueError):
            continue
        if env.get("KVZIP_TEST_MARKER") == marker and "RANK" in env and b"kvzip" in cmdline:
            found[int(env["RANK"])] = int(proc.name)
    return found


def wait_for(predicate, timeout: float = TIMEOUT, what: str = "a condition") -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def write_prompts(path: Path, n: int) -> Path:
    """n prompts of different lengths (so batches are left-padded), one JSON line each."""
    path.write_text("".join(json.dumps({"prompt": f"prompt {i}: " + "tell me more " * (i % 4)}) + "\n"
                            for i in range(n)))
    return path


def opts(name: str) -> list[str]:
    """The method's small test options as --opt flags."""
    from tests.matrix import tiny_options

    return [x for k, v in tiny_options(name).items() for x in ("--opt", f"{k}={v}")]
