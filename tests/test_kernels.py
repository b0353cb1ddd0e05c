"""Fast tier: the fused CPU kernels (kvzip/kernels) equal the PyTorch reference they replace.

`coded_decode_attention` against fadkv's reference attention on the codes (kvzip/methods/fadkv.py, kernel=torch),
over the options that change what it reads: keys before or after RoPE, adapted dictionaries (overlay atoms replaced
or appended), a value sparsity of its own, fp16, int8 or int4 coefficients, int16 or ten-bit atom numbers, a batch
whose rows coded on their own schedules (holes), left padding, and dense tiers in fp32, bf16 and fp16. Where the kernel cannot be built the reference runs,
and this file says so by skipping with the reason.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvzip import dictionary_lookup, engine, kernels
from kvzip.methods import get_method
from kvzip.methods.coded.coding import CodingStats
from kvzip.methods.coded.compress import compress
from kvzip.methods.fadkv import FadkvLayer
from kvzip.sparse.dictionary import KVDictionary, prepare_layers
from kvzip.methods.coded.forward import first_visible
from kvzip.methods.thoughts.layer import ThoughtState
from tests.test_fadkv import SMALL, attend, make_layer, step

pytestmark = pytest.mark.skipif(not kernels.available(), reason=kernels.status())

INV_FREQ = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))


def fused_and_reference(layer, query, mask=None):
    assert layer.fused()
    got = attend(layer, query, mask)
    fused_cfg = layer.cfg
    layer.cfg = dataclasses.replace(fused_cfg, kernel="torch")
    try:
        want = attend(layer, query, mask)
    finally:
        layer.cfg = fused_cfg
    return got, want


@pytest.mark.parametrize("keys", ["pre-rope", "post-rope"])
@pytest.mark.parametrize("adapt, value_sparsity, coef, bits", [
    ("none", "0", "int8", "16"), ("fixed", "0", "int8", "16"), ("append", "6", "int8", "16"),
    ("fixed", "0", "fp16", "16"), ("fixed", "0", "int4", "10"), ("none", "6", "int8", "10"), ("fixed", "6", "int4", "16")])
@pytest.mark.parametrize("dense", [torch.float32, torch.bfloat16])
def test_coded_decode_attention_equals_the_reference(tiny_dictionaries, keys, adapt, value_sparsity, coef, bits,
                                                     dense):
    """Every coefficient format and both widths of atom numbers (ten-bit ones packed, read in the kernel's gather)."""
    inv = INV_FREQ if keys == "pre-rope" else None
    _, layer = make_layer(tiny_dictionaries, batch=3, adapt=adapt, adapt_threshold="0.2", keys=keys, inv_freq=inv,
                          value_sparsity=value_sparsity, coef_format=coef, index_bits=bits)
    g = torch.Generator().manual_seed(5)
    for _ in range(70):
        k, v = torch.randn(3, 2, 1, 16, generator=g), torch.randn(3, 2, 1, 16, generator=g)
        step(layer, k.to(dense), v.to(dense), torch.randn(3, 4, 1, 16, generator=g))
    assert layer.coded_pos.shape[1] > 40 and layer.keys.dtype == layer.dense_dtype(dense)
    if adapt != "none":
        assert layer.coded_keys.overlay.ids.shape[1] > 0  # overlay atoms are read through the lookup table
    got, want = fused_and_reference(layer, torch.randn(3, 4, 1, 16, generator=g))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("keys", ["pre-rope", "post-rope"])
@pytest.mark.parametrize("dense, group, narrow", [(torch.float32, 3, False), (torch.bfloat16, 3, False),
                                                  (torch.float32, 1, False), (torch.float32, 5, False),
                                                  (torch.float32, 7, False), (torch.bfloat16, 3, True)])
def test_coded_decode_attention_at_the_shipped_head_size(keys, dense, group, narrow):
    """The shipped SmolLM2 dictionaries (d = 64, the head size the kernel compiles in; 3 query heads per KV head as
    the default model, and the groups of other families, which the kernel sums in blocks of up to three): the kernel
    equals the reference on random keys and values coded with the default options, and with the narrow codes (int4
    coefficients, 14 atom numbers of 1,024 packed in ten bits)."""
    stem = "smollm2-135m-prerope" if keys == "pre-rope" else "smollm2-135m"
    dictionaries = KVDictionary.load(dictionary_lookup.dictionary_dir() / f"{stem}.safetensors")
    inv = 1.0 / (100000.0 ** (torch.arange(0, 64, 2).float() / 64)) if keys == "pre-rope" else None
    method = get_method("fadkv", {"keys": keys, **({"coef_format": "int4", "index_bits": "10", "sparsity": "14"}
                                                   if narrow else {})})
    layer = FadkvLayer(method, prepare_layers(dictionaries, "cpu", paired=inv is not None)[3], rope=inv)
    g = torch.Generator().manual_seed(1)
    layer.update(torch.randn(2, 3, 300, 64, generator=g).to(dense), torch.randn(2, 3, 300, 64, generator=g).to(dense))
    compress([layer], CodingStats())
    assert layer.coded_pos.shape[1] > 100
    got, want = fused_and_reference(layer, torch.randn(2, 3 * group, 1, 64, generator=g))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("keys", ["pre-rope", "post-rope"])
def test_one_long_row_split_into_chunks_equals_the_reference(keys):
    """One row of 1,100 tokens: the kernel splits its coded tokens into chunks (fewer rows than twice the threads) and
    merges them; the same output as the reference, also when left padding hides the whole first chunk."""
    stem = "smollm2-135m-prerope" if keys == "pre-rope" else "smollm2-135m"
    dictionaries = KVDictionary.load(dictionary_lookup.dictionary_dir() / f"{stem}.safetensors")
    inv = 1.0 / (100000.0 ** (torch.arange(0, 64, 2).float() / 64)) if keys == "pre-rope" else None
    atoms = prepare_layers(dictionaries, "cpu", paired=inv is not None)[3]
    layer = FadkvLayer(get_method("fadkv", {"keys": keys}), atoms, rope=inv)
    g = torch.Generator().manual_seed(4)
    layer.update(torch.randn(1, 3, 1100, 64, generator=g), torch.randn(1, 3, 1100, 64, generator=g))
    compress([layer], CodingStats())
    assert layer.coded_pos.shape[1] >= 512  # at least two chunks of 256
    query = torch.randn(1, 9, 1, 64, generator=g) * 4  # sharp weights: a chunk's own largest score matters
    got, want = fused_and_reference(layer, query)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    mask = torch.ones(1, 1, 1, layer.seen + 1, dtype=torch.bool)
    mask[..., :700] = False
    assert first_visible(mask[:, 0, 0], 1, "cpu").tolist() == [700]
    got, want = fused_and_reference(layer, query, mask)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


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


def test_left_padding_masks_are_read_from_positions(tiny_dictionaries):
    """A mask that hides only each row's first positions (the engine's left padding) is not gathered: the kernel
    tells what a query sees from the tokens' positions, with holes; the same output as the reference."""
    _, layer = make_layer(tiny_dictionaries, batch=2)
    g = torch.Generator().manual_seed(3)
    for _ in range(50):
        step(layer, torch.randn(2, 2, 1, 16, generator=g), torch.randn(2, 2, 1, 16, generator=g),
             torch.randn(2, 4, 1, 16, generator=g))
    layer.coded_pos[0, :3] = -1
    width = layer.seen + 1
    mask = torch.ones(2, 1, 1, width, dtype=torch.bool)
    mask[0, ..., :6] = False
    mask[1, ..., :9] = False
    assert first_visible(mask[:, 0, 0], 2, "cpu").tolist() == [6, 9]
    got, want = fused_and_reference(layer, torch.randn(2, 4, 1, 16, generator=g), mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    additive = torch.zeros(2, 1, 1, width).masked_fill(~mask, float("-inf"))
    assert first_visible(additive[:, 0, 0] == 0, 2, "cpu").tolist() == [6, 9]
    mask = mask.clone()  # (a new mask, as every forward brings)
    mask[0, ..., 20] = False  # not a left padding: the general path
    assert first_visible(mask[:, 0, 0], 2, "cpu") is None


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


@pytest.mark.parametrize("shots, pick", [(1, "champions"), (2, "champions"), (2, "top")])
def test_fused_pursuit_gives_the_reference_codes_on_one_dictionary(shots, pick):
    from kvzip.sparse.omp import gram_matrix
    from kvzip.sparse.screen import screen

    g = torch.Generator().manual_seed(0)
    atoms = torch.nn.functional.normalize(torch.randn(256, 32, generator=g), dim=-1)
    x = torch.randn(600, 32, generator=g)
    gram = gram_matrix(atoms)
    want = screen(x, atoms, 6, n=8, gram=gram, shots=shots, pick=pick)
    got = screen(x, atoms, 6, n=8, gram=gram, shots=shots, pick=pick, fused=True)
    same = (want[0] == got[0]).all(1)
    assert same.float().mean() > 0.99  # a float near-tie between two candidates may go either way
    torch.testing.assert_close(got[1][same], want[1][same], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("low", [False, True])
def test_fused_pursuit_reads_each_rows_own_atoms(tiny_dictionaries, low):
    """Grouped dictionaries with overlay atoms (replaced and appended), an all-zero vector and a dependent atom: the
    same codes as the reference coder, group by group; `low`: both screen on bfloat16 correlations."""
    from kvzip.sparse.atoms import Grouped
    from kvzip.sparse.dictionary import prepare_layers
    from kvzip.sparse.screen import screen

    g = torch.Generator().manual_seed(4)
    layer = prepare_layers(tiny_dictionaries, "cpu")
    atoms = torch.stack([layer[0].keys, layer[1].keys])  # (L=2, N=32, d=16)
    grams = torch.stack([atoms[0] @ atoms[0].T, atoms[1] @ atoms[1].T])
    ids = torch.tensor([[[3, -1, 40], [-1, 7, -1]], [[0, 1, -1], [-1, -1, -1]]])  # (L, B=2, R=3); 40 is appended
    vectors = torch.nn.functional.normalize(torch.randn(2, 2, 3, 16, generator=g), dim=-1)
    vectors[1, 0, 1] = atoms[1, 5]  # a copy of a shared atom: dependent when both are picked
    dic = Grouped(atoms, ids, vectors, 41, grams, torch.tensor([0, 1]), atoms.bfloat16() if low else None)
    x = torch.randn(4, 50, 16, generator=g)
    x[2, 7] = 0.0
    want = screen(x, dic, 4, n=8, shots=2, pick="top")
    got = screen(x, dic, 4, n=8, shots=2, pick="top", fused=True)
    same = (want[0] == got[0]).all(-1)
    assert same.float().mean() > 0.9  # the copied atom ties with its original: either may be picked
    torch.testing.assert_close(got[1][same], want[1][same], rtol=1e-4, atol=1e-4)
    rebuilt = [dic.reconstruct(i.view(-1, 4), c.view(-1, 4)) for i, c in (want, got)]  # the same vectors, ties or not
    torch.testing.assert_close(rebuilt[1], rebuilt[0], rtol=1e-4, atol=1e-4)
    assert torch.equal(got[1][2, 7], torch.zeros(4))


def test_bfloat16_screening_codes_as_well_as_float32():
    """Correlations in bfloat16 only screen the pools: the coefficients and residuals still come from the vectors in
    fp32, so the coding error stays that of fp32 screening (measured: within 1%), with the fused pursuit too."""
    from kvzip.sparse.atoms import Grouped
    from kvzip.sparse.omp import gram_matrix
    from kvzip.sparse.screen import screen

    g = torch.Generator().manual_seed(1)
    atoms = torch.nn.functional.normalize(torch.randn(1, 256, 32, generator=g), dim=-1)
    x = torch.randn(1, 3000, 32, generator=g)
    empty = torch.zeros(1, 1, 0, dtype=torch.long), torch.zeros(1, 1, 0, 32)
    err = {}
    for low in (None, atoms.bfloat16()):
        dic = Grouped(atoms, *empty, 256, gram_matrix(atoms[0])[None], torch.tensor([0]), low)
        for fused in (False, True):
            _, _, res = screen(x, dic, 6, n=16, fused=fused, residuals=True)
            err[low is not None, fused] = float((res.norm(dim=-1) / x.norm(dim=-1)).mean())
    assert abs(err[False, True] - err[False, False]) < 1e-3
    for fused in (False, True):
        assert abs(err[True, fused] / err[False, fused] - 1) < 0.01, err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [32, 64])  # 64: the head size compiled in (NV), as the default model's
def test_pooled_decode_attention_equals_sdpa_on_the_gathered_rows(dtype, d):
    """Rows as slot lists into a shared pool (Hkv, N, d), empty slots (-1) and left padding (positions before `first`)
    unseen, free slots between: the kernel equals SDPA over the same rows gathered into a rectangle, a row that sees
    nothing gives zeros."""
    torch.manual_seed(0)
    b, h, g, n, w = 4, 2, 3, 60, 12
    keys, values = torch.randn(h, n, d).to(dtype), torch.randn(h, n, d).to(dtype)
    slots = torch.randperm(n)[: b * w].view(b, w)
    slots[1, :5] = -1  # a shorter row
    slots[3] = -1  # a row with nothing
    positions = torch.arange(w).expand(b, w).masked_fill(slots < 0, -1)
    first = torch.tensor([0, 0, 4, 0])
    q = torch.randn(b, h, g, d)
    got = torch.ops.kvzip.pooled_decode_attention(q, keys, values, slots, positions.contiguous(), first)
    at = slots.clamp(min=0)
    k, v = keys[:, at].transpose(0, 1).float(), values[:, at].transpose(0, 1).float()
    seen = ((slots >= 0) & (positions >= first[:, None]))[:, None, None, :]
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=seen, scale=1.0)
    torch.testing.assert_close(got[:3], want[:3], atol=1e-5, rtol=1e-5)
    assert torch.equal(got[3], torch.zeros_like(got[3]))
    slots[1, -1] = slots[0, -1]  # a slot two rows hold is refused
    with pytest.raises(RuntimeError, match="held twice"):
        torch.ops.kvzip.pooled_decode_attention(q, keys, values, slots, positions.contiguous(), first)


@pytest.mark.parametrize("method", ["zoomr", "sumr"])
def test_thought_caches_attend_alike_with_the_kernel_and_the_reference(tiny, tokenizer, method):
    """A left-padded batch through the engine: the same tokens with the pooled kernel as with the PyTorch path, and at
    the end one more query's attention on every layer equal to float tolerance."""
    prompts = [tokenizer("Q?")["input_ids"], tokenizer("a longer question, padded less?")["input_ids"]]
    settings = engine.Settings(max_new_tokens=60, ignore_eos=True)
    opts = {"window": "8", "summary_tokens": "2", "min_thought_tokens": "4", "max_thought_tokens": "12"}
    out, caches = {}, {}
    for kernel in ("auto", "torch"):
        cache = caches[kernel] = get_method(method, {**opts, "kernel": kernel}).make_cache(tiny)
        events = list(engine.generate(tiny, tokenizer, prompts, cache, settings))
        out[kernel] = [e.token_ids for e in events if isinstance(e, engine.Result)]
    assert out["auto"] == out["torch"]
    cache = caches["auto"]
    assert cache.rebuilds > 0 and (cache.layers[0].slots < 0).any()  # rows of different lengths were rebuilt
    query = torch.randn(2, tiny.config.num_attention_heads, 1, 16)
    mask = torch.ones(2, 1, 1, cache.layers[0].seen + 1, dtype=torch.bool)
    fused, reference = (ThoughtState(None, 1, cache.first_real, kernel=kernel) for kernel in ("auto", "torch"))
    for layer in cache.layers:
        assert layer._fused(query, "auto") and not layer._fused(query, "torch")
        got = layer._attention(query, mask, 0.25, fused)
        want = layer._attention(query, mask, 0.25, reference)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
