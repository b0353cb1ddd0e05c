"""Fast tier: the fused CPU kernels (kvzip/kernels) equal the PyTorch reference they replace.

`coded_decode_attention` against fadkv's reference attention on the codes (kvzip/methods/fadkv.py, kernel=torch),
over the options that change what it reads: keys before or after RoPE, adapted dictionaries (overlay atoms replaced
or appended), a value sparsity of its own, fp16 or int8 coefficients, a batch whose rows coded on their own schedules
(holes), left padding, and dense tiers in fp32, bf16 and fp16. Where the kernel cannot be built the reference runs,
and this file says so by skipping with the reason.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvzip import engine, kernels
from kvzip.methods import get_method
from tests.test_fadkv import SMALL, make_layer, step

pytestmark = pytest.mark.skipif(not kernels.available(), reason=kernels.status())

INV_FREQ = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))


def fused_and_reference(layer, query, mask=None):
    assert layer._fused()
    got = layer._attention(query, mask, 0.25)
    fused_cfg = layer.cfg
    layer.cfg = dataclasses.replace(fused_cfg, kernel="torch")
    try:
        want = layer._attention(query, mask, 0.25)
    finally:
        layer.cfg = fused_cfg
    return got, want


@pytest.mark.parametrize("keys", ["pre-rope", "post-rope"])
@pytest.mark.parametrize("adapt, value_sparsity, coef", [("none", "0", "int8"), ("fixed", "0", "int8"),
                                                          ("append", "6", "int8"), ("fixed", "0", "fp16")])
@pytest.mark.parametrize("dense", [torch.float32, torch.bfloat16])
def test_coded_decode_attention_equals_the_reference(tiny_dictionaries, keys, adapt, value_sparsity, coef, dense):
    inv = INV_FREQ if keys == "pre-rope" else None
    _, layer = make_layer(tiny_dictionaries, batch=3, adapt=adapt, adapt_threshold="0.2", keys=keys, inv_freq=inv,
                          value_sparsity=value_sparsity, coef_format=coef)
    g = torch.Generator().manual_seed(5)
    for _ in range(70):
        k, v = torch.randn(3, 2, 1, 16, generator=g), torch.randn(3, 2, 1, 16, generator=g)
        step(layer, k.to(dense), v.to(dense), torch.randn(3, 4, 1, 16, generator=g))
    assert layer.coded_pos.shape[1] > 40 and layer.keys.dtype == layer.dense_dtype(dense)
    if adapt != "none":
        assert layer.coded_keys.overlay.ids.shape[1] > 0  # overlay atoms are read through the lookup table
    got, want = fused_and_reference(layer, torch.randn(3, 4, 1, 16, generator=g))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_holes_and_masked_columns_are_never_read(tiny_dictionaries):
    """A row whose coded tier and dense tier have holes (-1), and a mask hiding columns: both paths skip them alike;
    a query row that sees nothing gets zeros from both."""
    _, layer = make_layer(tiny_dictionaries, batch=2, adapt="fixed", adapt_threshold="0.2")
    g = torch.Generator().manual_seed(2)
    for _ in range(50):
        step(layer, torch.randn(2, 2, 1, 16, generator=g), torch.randn(2, 2, 1, 16, generator=g),
             torch.randn(2, 4, 1, 16, generator=g))
    layer.coded_pos[0, :5] = -1  # holes, as a row that coded less leaves them
    width = layer.seen + 1
    mask = torch.ones(2, 1, 1, width, dtype=torch.bool)
    mask[1, ..., :width] = False  # row 1 sees nothing at all
    mask[0, ..., 7:20] = False
    got, want = fused_and_reference(layer, torch.randn(2, 4, 1, 16, generator=g), mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1], torch.zeros_like(got[1]))


@pytest.mark.parametrize("method", ["fadkv", "lexico"])
def test_generation_with_the_kernel_equals_the_reference(tiny, tokenizer, tiny_dictionaries, method):
    """Through the engine, a left-padded batch: the same tokens with the kernel as with the PyTorch path."""
    prompts = [tokenizer("Q?")["input_ids"], tokenizer("a longer question, padded less?")["input_ids"]]
    settings = engine.Settings(max_new_tokens=60, ignore_eos=True)
    out = {}
    for kernel in ("auto", "torch"):
        m = get_method(method, {**SMALL, "kernel": kernel} if method == "fadkv" else
                       {"sparsity": "4", "buffer": "8", "code_chunk": "4", "sinks": "2", "kernel": kernel})
        cache = m.make_cache(tiny, tiny_dictionaries)
        events = list(engine.generate(tiny, tokenizer, prompts, cache, settings))
        out[kernel] = [e.token_ids for e in events if isinstance(e, engine.Result)]
        assert cache.layers[0].coded_pos.shape[1] > 20
    assert out["auto"] == out["torch"]
