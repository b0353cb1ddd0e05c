"""fadkv and lexico through the engine on the tiny model: a pre-RoPE dictionary matches its dense rebuild after a real
generate, left-padded rows decode like the row alone, rows of any prompt length code together, and the bookkeeping
shared across kinds and layers changes no code. The layer-level tests are in tests/test_fadkv.py."""

from __future__ import annotations

import pytest
import torch

from kvzip import engine
from kvzip.errors import UserError
from kvzip.methods import get_method
from tests.test_fadkv import SMALL, attend, dense_keys_values


def test_prerope_dictionary_through_generate_matches_dense_rebuild(tiny, tokenizer, tiny_dictionaries):
    """keys=auto follows the dictionary: a pre-RoPE one turns keys back before coding. After a real generate with
    left-padded rows (positions from the engine, one RoPE table shared by the layers), every layer's attention on the
    codes equals attention over its keys rebuilt densely and rotated at their positions."""
    from kvzip.sparse.dictionary import KVDictionary

    meta = {**tiny_dictionaries.meta, "keys": "pre-rope"}
    prerope = KVDictionary(keys=tiny_dictionaries.keys, values=tiny_dictionaries.values, meta=meta,
                           key_mean=torch.randn(tiny.config.num_hidden_layers, 2, 16) * 0.1)
    method = get_method("fadkv", SMALL)
    cache = method.make_cache(tiny, prerope)
    assert all(lay.rope is not None for lay in cache.layers)
    prompts = [tokenizer("a short one")["input_ids"], tokenizer("a somewhat longer prompt for the second row")["input_ids"]]
    list(engine.generate(tiny, tokenizer, prompts, cache, engine.Settings(max_new_tokens=30, ignore_eos=True)))
    g = torch.Generator().manual_seed(1)
    for layer in cache.layers[:2]:
        assert layer.coded_pos.shape[1] > 20
        query = torch.randn(2, 4, 1, 16, generator=g)
        got = attend(layer, query)
        for row in range(2):
            keys, values = dense_keys_values(layer, row)
            keys, values = keys.repeat_interleave(2, 0), values.repeat_interleave(2, 0)
            w = torch.softmax(query[row] @ keys.transpose(-1, -2) * 0.25, -1)
            torch.testing.assert_close(got[row], (w @ values).transpose(0, 1), rtol=1e-4, atol=1e-4)
    with pytest.raises(UserError, match="keys=post-rope needs a dictionary of post-rope keys"):
        get_method("fadkv", {**SMALL, "keys": "post-rope"}).make_cache(tiny, prerope)


@pytest.mark.parametrize("name, coef_format, index_bits", [("fadkv", "int8", "16"), ("fadkv", "fp8", "16"),
                                                            ("fadkv", "int4", "10"), ("lexico", "int8", "16")])
def test_left_padded_row_decodes_like_the_row_alone(tiny, tokenizer, tiny_dictionaries, name, coef_format,
                                                    index_bits):
    """A left-padded batch row: the padding's zero keys code to all-zero coefficients (their 8-bit scale must not
    underflow to 0, or 0/0 is NaN) and its fully masked queries get zero weights; either NaN used to reach the whole
    row through the per-atom value sums, and the row decoded token 0 forever."""
    opts = {**SMALL, "coef_format": coef_format, "index_bits": index_bits,
            **({"coder": "omp"} if name == "lexico" else {})}
    prompts = [tokenizer("a short one")["input_ids"], tokenizer("a somewhat longer prompt for the second row")["input_ids"]]
    settings = engine.Settings(max_new_tokens=12, ignore_eos=True)

    def tokens(batch):
        cache = get_method(name, opts).make_cache(tiny, tiny_dictionaries)
        out = [e.token_ids for e in engine.generate(tiny, tokenizer, batch, cache, settings) if isinstance(e, engine.Result)]
        assert not any(bool(kind.codes.stored.float().isnan().any()) for lay in cache.layers for kind in lay.kinds)
        return out

    batched, alone = tokens(prompts), tokens(prompts[:1])
    assert batched[0] == alone[0]


def test_rows_out_of_phase_keep_the_coded_tier_as_wide_as_the_fullest_row(tiny, tokenizer, tiny_dictionaries):
    """Rows of different prompt lengths code on their own schedules; the holes each compress leaves in the rows that
    coded less are filled by that row's next codes, so the coded tier never grows past the row with the most coded
    tokens, and every row stays right-aligned and in order."""
    prompts = [tokenizer("x" * n)["input_ids"] for n in (3, 7, 12, 18)]
    cache = get_method("fadkv", SMALL).make_cache(tiny, tiny_dictionaries)
    events = list(engine.generate(tiny, tokenizer, prompts, cache, engine.Settings(max_new_tokens=80, ignore_eos=True)))
    for layer in cache.layers:
        real = (layer.coded_pos >= 0).sum(1)
        assert layer.coded_pos.shape[1] == int(real.max()) and int(real.min()) > 0
        for row, n in zip(layer.coded_pos, real.tolist()):  # holes in front, then the row's tokens in order
            assert bool((row[: len(row) - n] == -1).all()) and bool((row[len(row) - n :].diff() > 0).all())
    assert events[-1].stats["kv_bytes_peak"] < events[-1].stats["kv_bytes_full"]


def test_rows_of_any_prompt_length_code_together_every_code_chunk_steps(tiny, tokenizer, tiny_dictionaries,
                                                                          monkeypatch):
    """The coding schedule counts decode steps, not each row's tokens: rows whose prompts differ in length code in
    the same events (after the prompt, then every `code_chunk`-th step), each all beyond its sinks and buffer, and
    from its second event on every row codes `code_chunk` tokens."""
    import kvzip.methods.coded.compress as compress_module

    prompts = [tokenizer("x" * n)["input_ids"] for n in (3, 7, 12, 18)]
    cache = get_method("fadkv", SMALL).make_cache(tiny, tiny_dictionaries)
    events, real = [], compress_module.store_codes

    def store_codes(layer, plan, codes):
        if layer is cache.layers[0]:
            events.append((cache.decoded, [len(cols) for cols, _ in plan]))
        return real(layer, plan, codes)

    monkeypatch.setattr(compress_module, "store_codes", store_codes)
    list(engine.generate(tiny, tokenizer, prompts, cache, engine.Settings(max_new_tokens=40, ignore_eos=True)))
    assert all(step % 4 == 0 for step, _ in events) and len(events) >= 9  # decode steps 4, 8, ..., 36
    started = [False] * len(prompts)
    for _, counts in events:
        assert all(n == 4 for n, was in zip(counts, started) if was)
        started = [was or n > 0 for n, was in zip(counts, started)]
    assert all(started)


@pytest.mark.parametrize("name", ["fadkv", "lexico"])
def test_kinds_coded_a_few_per_pass_give_the_codes_of_one_pass(tiny, tokenizer, tiny_dictionaries, monkeypatch, name):
    """On a CPU an event codes a few whole kinds (a layer's keys or values) per pass (`KIND_SLICE` vectors), so their
    correlations stay in cache for the pursuit; each kind's codes, adaptation and atom counts are its own, so one
    kind per pass gives the same codes, tokens and counts as every kind in one pass."""
    from kvzip.methods.coded import coding

    opts = {**SMALL, "adapt_threshold": "0.2", **({"coder": "omp"} if name == "lexico" else {})}
    prompts = [tokenizer("x" * n)["input_ids"] for n in (3, 12)]

    def run(per_pass):
        monkeypatch.setattr(coding, "KIND_SLICE", per_pass)
        cache = get_method(name, opts).make_cache(tiny, tiny_dictionaries)
        out = [e.token_ids for e in engine.generate(tiny, tokenizer, prompts, cache,
                                                    engine.Settings(max_new_tokens=40, ignore_eos=True))
               if isinstance(e, engine.Result)]
        return out, cache

    (one, whole), (sliced, apart) = run(1 << 30), run(1)
    assert sliced == one
    for a, b in zip(whole.layers, apart.layers):
        for ka, kb in zip(a.kinds, b.kinds):
            assert torch.equal(ka.codes.idx, kb.codes.idx) and torch.equal(ka.codes.stored, kb.codes.stored)
            assert torch.equal(ka.refcount, kb.refcount)
    assert whole.coding.replaced == apart.coding.replaced


@pytest.mark.parametrize("name, low", [("fadkv", True), ("lexico", False)])
def test_bfloat16_model_screens_in_bfloat16_and_omp_stays_fp32(tiny, tokenizer, tiny_dictionaries, monkeypatch, name, low):
    """A model computing in bfloat16 screens its pools on bfloat16 correlations (coding.dictionaries); OMP (lexico)
    takes its coefficients from the correlations, so it keeps them fp32."""
    import copy

    from kvzip.methods.coded import coding

    seen = []
    grouped = coding.Grouped

    def spy(*args):
        seen.append(args[-1] is not None)
        return grouped(*args)

    monkeypatch.setattr(coding, "Grouped", spy)
    model = copy.deepcopy(tiny).to(torch.bfloat16)
    cache = get_method(name, SMALL).make_cache(model, tiny_dictionaries)
    prompts = [tokenizer("x" * n)["input_ids"] for n in (5, 11)]
    list(engine.generate(model, tokenizer, prompts, cache, engine.Settings(max_new_tokens=24, ignore_eos=True)))
    assert seen and set(seen) == {low}


@pytest.mark.parametrize("adapt", ["fixed", "append"])
def test_bookkeeping_shared_across_kinds_and_layers_changes_no_code(tiny, tokenizer, tiny_dictionaries, monkeypatch,
                                                                     adapt):
    """Atom counts kept as rows of one tensor per cache and counted in one scatter (`coding.share_atom_use`,
    `coding.count`), and one plan for layers whose tokens sit alike (`compress.same_tokens`): the same tokens,
    codes and counts as each kind counted and each layer planned by itself; every atom's count is the number of live
    codes that use it."""
    from kvzip.methods.coded import coding, compress as compress_module

    opts = {**SMALL, "adapt_threshold": "0.2", "adapt": adapt}
    prompts = [tokenizer("x" * n)["input_ids"] for n in (3, 12)]

    def run():
        cache = get_method("fadkv", opts).make_cache(tiny, tiny_dictionaries)
        out = [e.token_ids for e in engine.generate(tiny, tokenizer, prompts, cache,
                                                    engine.Settings(max_new_tokens=40, ignore_eos=True))
               if isinstance(e, engine.Result)]
        return out, cache

    shared_out, shared = run()
    assert coding.stacked([k.refcount for lay in shared.layers for k in lay.kinds]) is not None or adapt == "append"
    monkeypatch.setattr(coding, "share_atom_use", lambda kinds: None)
    monkeypatch.setattr(compress_module, "share_atom_use", lambda kinds: None)
    monkeypatch.setattr(compress_module, "same_tokens", lambda a, b: False)
    apart_out, apart = run()
    assert shared_out == apart_out
    for a, b in zip(shared.layers, apart.layers):
        for ka, kb in zip(a.kinds, b.kinds):
            assert torch.equal(ka.codes.idx, kb.codes.idx) and torch.equal(ka.codes.stored, kb.codes.stored)
            assert torch.equal(ka.refcount, kb.refcount) and torch.equal(ka.last_used, kb.last_used)
            for row in range(a.batch):
                live = ka.numbers()[row][:, a.coded_pos[row] >= 0].reshape(-1).long()
                assert torch.equal(torch.bincount(live, minlength=ka.refcount.shape[1]), ka.refcount[row])
    assert shared.coding.replaced == apart.coding.replaced > 0
