"""Fast tier: a decode step's model forward reads nothing back to the host from kvzip's code.

On a GPU such a read (`.item()`, `.tolist()`, `bool(t)`, `int(t)`, `nonzero`) waits for every queued kernel: a host
sync. Cache-wide work that needs values on the host belongs in the cache's `before_forward`/`after_forward` hooks; inside
the forward a layer stores its new tokens and attends. scripts/sync_check.py measures the syncs themselves on a CUDA
device; this test catches the reads that cause them on the CPU, on the path CUDA runs (`kernel=torch`: the fused
kernels are CPU-only), for every registered method.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import transformers

from kvzip import engine
from kvzip.methods import METHODS
from tests.matrix import METHOD_NAMES, needs_dictionary, tiny_method

KVZIP = Path(engine.__file__).parent
TRANSFORMERS = Path(transformers.__file__).parent
READS = ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "__index__")


@contextmanager
def host_reads(seen: list[str], roots: tuple[Path, ...] = (KVZIP,)):
    """While active, each of READS called from a frame in `roots` (kvzip's own code) is noted as 'file:line function'."""
    plain = {name: getattr(torch.Tensor, name) for name in READS}

    def watch(name, fn):
        def read(self, *args, **kwargs):
            caller = sys._getframe(1)
            path = Path(caller.f_code.co_filename)
            root = next((r for r in roots if r in path.parents), None)
            if root is not None:
                seen.append(f"{path.relative_to(root.parent)}:{caller.f_lineno} {caller.f_code.co_name} ({name})")
            return fn(self, *args, **kwargs)
        return read

    for name, fn in plain.items():
        setattr(torch.Tensor, name, watch(name, fn))
    try:
        yield
    finally:
        for name, fn in plain.items():
            setattr(torch.Tensor, name, fn)


def test_the_watch_sees_a_read_from_kvzip_code():
    seen: list[str] = []
    with host_reads(seen):
        torch.tensor([1, 2]).tolist()  # a read from this file: not kvzip's
        from kvzip.methods.coded.state import Overlay
        ov = Overlay(1, 4, "cpu")
        ov.put(torch.tensor([0]), torch.tensor([[3]]), torch.zeros(1, 1, 4), torch.tensor([[True]]))
    assert seen and all(s.startswith("kvzip/methods/coded/state.py:") for s in seen)


@pytest.mark.parametrize("padded", [True, False], ids=["left-padded", "one-row"])  # with and without a mask
@pytest.mark.parametrize("name", METHOD_NAMES)
def test_decode_forward_makes_no_host_read(tiny, tokenizer, request, name, padded):
    torch.manual_seed(0)
    cpu_only = {"kernel": "torch"} if "kernel" in METHODS[name].__dataclass_fields__ else {}
    method = tiny_method(name, **cpu_only)
    dicts = request.getfixturevalue("tiny_dictionaries") if needs_dictionary(name) else None
    cache = method.make_cache(tiny, dicts)
    prompts = [tokenizer("a longer first prompt, so that the second is left-padded " * 2)["input_ids"]]
    if padded:
        prompts.append(tokenizer("short one")["input_ids"])
    # Without padding the engine passes no mask, so transformers' own mask code reads nothing either
    roots = (KVZIP,) if padded else (KVZIP, TRANSFORMERS)
    seen: list[str] = []
    forwards = 0
    plain_forward = tiny.forward

    def forward(*args, **kwargs):  # the prefill's forward may read; every decode step's may not
        nonlocal forwards
        forwards += 1
        if forwards == 1:
            return plain_forward(*args, **kwargs)
        with host_reads(seen, roots):
            return plain_forward(*args, **kwargs)

    tiny.forward = forward
    try:
        settings = engine.Settings(max_new_tokens=48, ignore_eos=True)
        list(engine.generate(tiny, tokenizer, prompts, cache, settings))
    finally:
        del tiny.forward
    assert forwards == 48 and not seen, sorted(set(seen))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_sync_check_refuses_without_cuda_in_one_line():
    import subprocess

    script = KVZIP.parent / "scripts" / "sync_check.py"
    done = subprocess.run([sys.executable, str(script), "--steps", "4"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0 and "needs a CUDA device" in done.stderr
