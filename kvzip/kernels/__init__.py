"""kvzip's fused CPU kernels: C++ built on first use by torch's extension loader, then loaded from its cache.

The coded paths of fadkv and lexico spend their time in many small PyTorch ops per layer and step (rebuilding coded
keys chunk by chunk, scattering weights onto atoms, the coder's pursuit over tiny pools). The kernels here do each of
those in one pass per row (or chunk of a row) or per vector, registered as `torch.ops.kvzip.*`:

- `coded_decode_attention` (coded_attention.cpp): one new token's attention over coded keys and values plus the
  dense tier, pre-RoPE keys rebuilt and turned a tile at a time, values in atom space; a row's coded tokens split
  into chunks, merged by their largest scores, when there are fewer rows than twice the threads.
- `screen_pursue` (screen_coder.cpp): the screening coder's pursuit on each vector's candidate pool, with an explicit
  residual, one vector per pass (the correlations with every atom stay one batched product in PyTorch);
  `screen_two_shots` both shots in one pass per block of a group's vectors, the correlations with every atom
  included (fp32), the second shot's from the first atoms' Gram rows.
- `pooled_decode_attention` (pooled_attention.cpp): one new token's attention over a thought cache's rows, each a list
  of slots in a token pool the batch shares (zoomr and sumr hold no padding for the batch's widest row).

The plain PyTorch code stays the reference every kernel is tested against (tests/test_kernels.py), and it is what
runs where a kernel cannot be built (no C++ compiler, a torch without its headers) or does not apply (CUDA, a
coefficient format the kernel does not read): `available()` says which, and `status()` why, in one line.

Built with -O3 -march=native for the machine it runs on, and OpenMP (each kernel splits its work over torch's
threads), in `$KVZIP_CACHE/kernels` (default ~/.cache/kvzip/kernels), one folder per binary: `build.py` names it
by what determines the binary, builds it once under a lock the kernel frees when its holder dies, and renames it
into place whole, so ranks and installs sharing a cache build once and a killed build blocks nothing.
"""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path

import torch

from kvzip.kernels import build

SOURCES = ("coded_attention.cpp", "screen_coder.cpp", "pooled_attention.cpp")
HEADERS = ("vec.h",)
OPS = ("coded_decode_attention", "screen_pursue", "screen_two_shots", "pooled_decode_attention")
# at::parallel_for is inline code in torch's OpenMP builds: compiled without -fopenmp its `omp parallel` is dropped and
# a kernel runs on one thread (coded attention at batch 8 x 1,024 on two cores: 2.2 against 1.2 ms a layer). The
# runtime it links is the libgomp.so.1 torch has already loaded (the same soname), so the two share one thread pool.
OPENMP = torch.backends.openmp.is_available()
FLAGS = ("-O3", "-march=native", "-fopenmp" if OPENMP else "-fopenmp-simd", "-fno-math-errno")
LDFLAGS = ("-fopenmp",) if OPENMP else ()
WAIT_S = 300.0  # how long a run waits for another process's build before it runs the PyTorch path
_LOCK = threading.Lock()
_STATE: dict[str, object] = {}  # "ok": bool once tried, "why": the reason it is not available


def cache_root() -> Path:
    root = Path(os.environ.get("KVZIP_CACHE", Path.home() / ".cache" / "kvzip"))
    return root / "kernels"


def _load() -> None:
    wait_s = float(os.environ.get("KVZIP_KERNELS_WAIT", WAIT_S))
    library = build.ensure_built(Path(__file__).resolve().parent, SOURCES, HEADERS, FLAGS + LDFLAGS, cache_root(),
                                 build.compile_library(FLAGS, LDFLAGS), wait_s)
    torch.ops.load_library(str(library))


def available() -> bool:
    """Whether the CPU kernels are built and loaded (building them on the first call). Never raises: a build that
    fails leaves the PyTorch reference in charge, with one warning saying why."""
    if "ok" in _STATE:
        return bool(_STATE["ok"])
    with _LOCK:
        if "ok" not in _STATE:
            if os.environ.get("KVZIP_KERNELS", "1") == "0":
                _STATE.update(ok=False, why="turned off by KVZIP_KERNELS=0")
            else:
                try:
                    _load()
                    _STATE.update(ok=all(hasattr(torch.ops.kvzip, op) for op in OPS), why="")
                except build.BuildBusy as exc:
                    _STATE.update(ok=False, why=f"not ready ({exc})")
                    warnings.warn(f"kvzip: fused CPU kernels {_STATE['why']}; using the PyTorch path", stacklevel=2)
                except Exception as exc:  # a missing compiler or header: the reference path still works
                    lines = str(exc).strip().splitlines() or [type(exc).__name__]
                    first = next((x for x in lines if "error" in x.lower()), lines[-1]).strip()[:200]
                    _STATE.update(ok=False, why=f"could not be built ({first})")
                    warnings.warn(f"kvzip: fused CPU kernels {_STATE['why']}; using the PyTorch path", stacklevel=2)
    return bool(_STATE["ok"])


def status() -> str:
    """One line: whether the fused CPU kernels run, and why not."""
    if "ok" not in _STATE:
        return "fused CPU kernels: not loaded yet"
    return "fused CPU kernels: built and loaded" if _STATE["ok"] else f"fused CPU kernels: off, {_STATE['why']}"
