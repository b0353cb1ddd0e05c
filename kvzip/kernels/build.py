"""Build the fused CPU kernels once per binary they make, and never leave a state that blocks another process.

A build is named by what determines its binary and nothing else: the sources' and header's bytes (not their paths:
two installs sharing `$KVZIP_CACHE` reuse one build), the compiler flags, the compiler, what `-march=native`
resolves to on this CPU, torch's version and C++ ABI, and Python's version. The binary lives in
`$KVZIP_CACHE/kernels/<torch>-<key>/`, which appears only whole:

1. A process takes the key's lock (`fcntl.flock` on `<key>.lock`: the kernel drops it when its holder exits, however
   it exits, so a build killed with SIGKILL never leaves a lock that blocks the next run).
2. It compiles into a private folder (`.build-<key>-<pid>-<random>`), then renames it into place. Private folders
   left by a killed build are removed by the next holder of the lock, which says so in one line.
3. Others wait for the lock with one line saying who builds, up to a time limit (`KVZIP_KERNELS_WAIT` seconds, 300 by
   default), then give up: the caller runs the PyTorch path with one warning.

Torch's own loader keyed its build on the sources' absolute paths and always re-ran ninja in one shared folder, so
`torchrun -m kvzip` from a checkout (which imports the checkout's `kvzip/`) and the installed `kvzip` rebuilt each
other's objects every time they alternated.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

LOG = logging.getLogger("kvzip.kernels")
LIBRARY = "kvzip_kernels.so"
BUILDING = "building kvzip's fused CPU kernels, once per torch version and CPU, about a minute"


class BuildBusy(RuntimeError):
    """Another live process held the build lock past the time limit."""


def compiler() -> str:
    return os.environ.get("CXX", "c++")


def _native_target() -> str:
    """What `-march=native` means here: the compiler's own expansion of it (gcc's cc1 line, clang's target cpu and
    features), so a cache shared by two CPU kinds keeps one build per kind."""
    try:
        out = subprocess.run([compiler(), "-march=native", "-###", "-E", "-x", "c++", os.devnull],
                             capture_output=True, text=True, timeout=30)
        version = subprocess.run([compiler(), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"no compiler ({type(exc).__name__})"
    lines = [x for x in out.stderr.splitlines() if "cc1" in x or "-target-cpu" in x] or out.stderr.splitlines()
    return (version.stdout.splitlines() or [""])[0] + "\n" + "\n".join(lines)


def build_key(folder: Path, sources: Sequence[str], headers: Sequence[str], flags: Sequence[str]) -> str:
    """A hex digest of everything that determines the binary (see the module docstring), and nothing else."""
    h = hashlib.sha256()
    for name in (*sources, *headers):
        h.update(name.encode() + b"\0" + (folder / name).read_bytes() + b"\0")
    abi = getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", None)
    for part in (*flags, torch.__version__, f"abi={abi}", f"py={sys.version_info[:2]}", _native_target()):
        h.update(str(part).encode() + b"\0")
    return h.hexdigest()[:16]


def _holder(lock: Path) -> str:
    try:
        text = lock.read_text().strip()
    except OSError:
        text = ""
    return f"process {text}" if text else "another process"


def _orphans(root: Path, key: str) -> list[Path]:
    return sorted(root.glob(f".build-{key}-*"))


def ensure_built(folder: Path, sources: Sequence[str], headers: Sequence[str], flags: Sequence[str], root: Path,
                 compile: Callable[[Path, list[Path]], Path], wait_s: float, poll_s: float = 0.5) -> Path:
    """The built library's path, building it under the key's lock if no process has. `compile(build_dir, sources)`
    compiles the given copies of the sources in `build_dir` and returns the library it wrote there."""
    key = build_key(folder, sources, headers, flags)
    final = root / f"torch-{torch.__version__.replace('+', '-')}-{key}"
    if (final / LIBRARY).exists():
        return final / LIBRARY
    root.mkdir(parents=True, exist_ok=True)
    lock = root / f"{key}.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _acquire(fd, lock, wait_s, poll_s, done=final / LIBRARY)
        if (final / LIBRARY).exists():  # built by the process we waited for
            return final / LIBRARY
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} on {os.uname().nodename}".encode())
        orphans = _orphans(root, key)
        if orphans:
            LOG.warning("kvzip: an earlier build of the fused CPU kernels was cut off (%s); building them again",
                        ", ".join(p.name for p in orphans))
            for p in orphans:
                shutil.rmtree(p, ignore_errors=True)
        LOG.warning("kvzip: %s", BUILDING)
        private = root / f".build-{key}-{os.getpid()}-{secrets.token_hex(4)}"
        private.mkdir()
        try:
            copies = []
            for name in (*sources, *headers):
                shutil.copy2(folder / name, private / name)
                copies.append(private / name)
            built = compile(private, copies[:len(sources)])
            if built.name != LIBRARY:
                os.replace(built, private / LIBRARY)
            for leftover in private.glob("*.o"):
                leftover.unlink()
            os.rename(private, final)
        except BaseException:
            shutil.rmtree(private, ignore_errors=True)
            raise
        return final / LIBRARY
    finally:
        os.close(fd)  # closing drops the flock


def _acquire(fd: int, lock: Path, wait_s: float, poll_s: float, done: Path) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        pass
    LOG.warning("kvzip: waiting for %s, which is building kvzip's fused CPU kernels (up to %.0f s)",
                _holder(lock), wait_s)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(poll_s)
        if done.exists():
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            continue
    raise BuildBusy(f"{_holder(lock)} was still building them after {wait_s:.0f} s")


def compile_library(cflags: Sequence[str], ldflags: Sequence[str]) -> Callable[[Path, list[Path]], Path]:
    """A `compile` for `ensure_built`: each source compiled at once by the C++ compiler against torch's headers (no
    Python headers: the kernels register `torch.ops` and are loaded with `torch.ops.load_library`), then linked
    against torch's libraries into one shared library."""
    from torch.utils import cpp_extension

    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", 1))
    includes = [f for p in cpp_extension.include_paths("cpu") for f in ("-isystem", p)]
    libs = [f"-L{p}" for p in cpp_extension.library_paths("cpu")]
    common = ["-fPIC", "-pipe", "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, *cflags]

    def run(folder: Path, sources: list[Path]) -> Path:
        jobs = [(s, subprocess.Popen([compiler(), *common, "-c", str(s), "-o", str(s.with_suffix(".o"))],
                                     cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     preexec_fn=_die_with_parent))
                for s in sources]
        try:
            outputs = [(s, p.communicate()[0], p.returncode) for s, p in jobs]  # they run side by side meanwhile
            failed = [(s, out) for s, out, code in outputs if code]
        finally:
            for _, p in jobs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if failed:
            raise RuntimeError(_first_error(failed[0][1]) + f" (compiling {failed[0][0].name})")
        out = folder / LIBRARY
        link = subprocess.run([compiler(), *[str(s.with_suffix(".o")) for s in sources], "-shared", *ldflags,
                               *libs, "-lc10", "-ltorch_cpu", "-ltorch", "-o", str(out)],
                              cwd=folder, capture_output=True, text=True, preexec_fn=_die_with_parent)
        if link.returncode:
            raise RuntimeError(_first_error(link.stderr) + " (linking)")
        return out

    return run


def _die_with_parent() -> None:
    """Run in each compiler driver before it starts: on Linux, ask the kernel to kill it when kvzip dies. The
    compiler proper it started (cc1plus) then finishes its one file into a folder the next build removes; with
    `-pipe` it leaves no temporary file behind."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _first_error(text: str) -> str:
    lines = [x.strip() for x in text.strip().splitlines()] or ["no output"]
    return next((x for x in lines if "error" in x.lower()), lines[-1])[:200]
