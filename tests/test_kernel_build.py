"""Fast tier: the fused kernels' build (kvzip/kernels/build.py) is named by what makes the binary, is done once by
whoever holds the lock, and a build killed halfway (SIGKILL) blocks no later run.

The compile step is a stand-in here (it copies the sources into a file after a pause and counts its calls), so the
locking and renaming are tested in seconds; tests/test_kernels.py loads the real kernels built the real way.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvzip.kernels import build

SOURCES, HEADERS, FLAGS = ("a.cpp", "b.cpp"), ("v.h",), ("-O3",)

# A process that builds with a stand-in compiler: it logs its start, sleeps PAUSE seconds, then writes the "library"
# (the sources joined) and logs its end; each call appends a line to COUNT.
WORKER = textwrap.dedent("""
    import logging, sys, time
    from pathlib import Path
    from kvzip.kernels import build
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    src, root, count, pause, wait = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])

    def fake(folder, sources):
        with open(count, "a") as f:
            f.write("start\\n")
        time.sleep(pause)
        out = folder / "lib.so"
        out.write_bytes(b"".join(s.read_bytes() for s in sources))
        return out

    try:
        lib = build.ensure_built(src, ("a.cpp", "b.cpp"), ("v.h",), ("-O3",), root, fake, wait_s=wait, poll_s=0.05)
    except build.BuildBusy as exc:
        print("busy:", exc)
        sys.exit(3)
    print("library:", lib, lib.read_bytes().decode())
""")


def sources(folder: Path, body: str = "one") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in (("a.cpp", body), ("b.cpp", "two"), ("v.h", "header")):
        (folder / name).write_text(text)
    return folder


def worker(src: Path, root: Path, count: Path, pause: float = 0.0, wait: float = 60.0) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.Popen([sys.executable, "-c", WORKER, str(src), str(root), str(count), str(pause), str(wait)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def builds(count: Path) -> int:
    return count.read_text().count("start") if count.exists() else 0


def in_process(src: Path, root: Path, calls: list) -> Path:
    def fake(folder, copies):
        calls.append(folder)
        out = folder / build.LIBRARY
        out.write_bytes(b"".join(s.read_bytes() for s in copies))
        return out
    return build.ensure_built(src, SOURCES, HEADERS, FLAGS, root, fake, wait_s=5)


def test_second_install_reuses_the_build_and_a_changed_source_rebuilds(tmp_path):
    root, calls = tmp_path / "cache", []
    first = in_process(sources(tmp_path / "install-1"), root, calls)
    assert len(calls) == 1 and first.read_bytes() == b"onetwo"
    # the same bytes at another path (a second clone, `-m kvzip` from a checkout) is the same build
    again = in_process(sources(tmp_path / "install-2"), root, calls)
    assert len(calls) == 1 and again == first
    # a header or a source that changes is another build, beside the first
    changed = sources(tmp_path / "install-3")
    (changed / "v.h").write_text("header 2")
    assert in_process(changed, root, calls) != first and len(calls) == 2
    assert in_process(sources(tmp_path / "install-4", body="ONE"), root, calls).read_bytes() == b"ONEtwo"
    assert len(calls) == 3 and first.exists()
    # only whole builds are left in the cache: no private folder, no object files
    assert not list(root.glob(".build-*"))


def test_flags_and_torch_are_in_the_key(tmp_path):
    src = sources(tmp_path / "src")
    key = build.build_key(src, SOURCES, HEADERS, FLAGS)
    assert key == build.build_key(src, SOURCES, HEADERS, FLAGS)
    assert key != build.build_key(src, SOURCES, HEADERS, ("-O2",))


def test_a_failed_compile_leaves_nothing_behind(tmp_path):
    root = tmp_path / "cache"

    def broken(folder, copies):
        raise RuntimeError("error: no compiler")
    with pytest.raises(RuntimeError, match="no compiler"):
        build.ensure_built(sources(tmp_path / "src"), SOURCES, HEADERS, FLAGS, root, broken, wait_s=5)
    assert [p.name for p in root.iterdir()] == [f"{build.build_key(tmp_path / 'src', SOURCES, HEADERS, FLAGS)}.lock"]


def test_two_processes_at_once_build_once(tmp_path):
    src, root, count = sources(tmp_path / "src"), tmp_path / "cache", tmp_path / "count"
    procs = [worker(src, root, count, pause=2.0) for _ in range(2)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert builds(count) == 1
    libs = {out.split("library:")[1].split()[0] for out, _ in outs}
    assert len(libs) == 1 and Path(libs.pop()).read_bytes() == b"onetwo"
    # the one that waited said so, in one line naming the builder
    assert sum("waiting for process" in err for _, err in outs) == 1
    assert sum(err.count(build.BUILDING) for _, err in outs) == 1


def test_a_build_killed_halfway_does_not_block_the_next_run(tmp_path):
    src, root, count = sources(tmp_path / "src"), tmp_path / "cache", tmp_path / "count"
    victim = worker(src, root, count, pause=60.0)
    deadline = time.monotonic() + 30
    while builds(count) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert builds(count) == 1, "the first build never started"
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    assert list(root.glob(".build-*")), "the killed build left no private folder to clean"
    start = time.monotonic()
    out, err = worker(src, root, count, wait=20.0).communicate(timeout=60)
    assert "library:" in out and time.monotonic() - start < 15, (out, err)
    assert "was cut off" in err and builds(count) == 2
    assert not list(root.glob(".build-*"))


def test_a_live_builder_is_waited_for_up_to_the_limit(tmp_path):
    src, root, count = sources(tmp_path / "src"), tmp_path / "cache", tmp_path / "count"
    holder = worker(src, root, count, pause=30.0)
    try:
        deadline = time.monotonic() + 30
        while builds(count) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        out, err = worker(src, root, count, wait=1.0).communicate(timeout=60)
        assert out.startswith("busy:") and "still building" in out
    finally:
        holder.kill()
        holder.wait()


def test_a_stale_torch_lock_file_is_ignored(tmp_path, caplog):
    """The folder torch's loader used (`torch-<version>/lock`) is no longer read: a leftover lock there blocks
    nothing, and a leftover lock file of ours with no holder does not either."""
    src, root, calls = sources(tmp_path / "src"), tmp_path / "cache", []
    (root / "torch-2.13.0-cpu").mkdir(parents=True)
    (root / "torch-2.13.0-cpu" / "lock").write_text("")
    (root / f"{build.build_key(src, SOURCES, HEADERS, FLAGS)}.lock").write_text("12345 on gone-host")
    with caplog.at_level(logging.WARNING, logger="kvzip.kernels"):
        assert in_process(src, root, calls).exists()
    assert len(calls) == 1 and "waiting" not in caplog.text
    shutil.rmtree(root)
