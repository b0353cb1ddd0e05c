"""Fast tier for fadkv / lexico: attention on codes equals the dense reference, adaptation keeps the size fixed and
codes valid, batched rows keep separate dictionaries."""

from __future__ import annotations

import pytest
import torch

from kvzip import engine
from kvzip.methods import get_method
from kvzip.methods.coded.coding import CodingStats
from kvzip.methods.coded.compress import compress
from kvzip.methods.coded.forward import CodedState
from kvzip.methods.fadkv import FadkvCache, FadkvLayer
from kvzip.rope import from_pairs, rotate
from kvzip.sparse.dictionary import prepare_layers

SMALL = {"sparsity": "4", "screen_pool": "8", "buffer": "8", "code_chunk": "4", "sinks": "2"}


def make_layer(tiny_dictionaries, batch=1, heads=2, inv_freq=None, **opts):
    """A fadkv layer in a cache of its own (`layer.cache`): its coding runs in the cache's `after_forward`."""
    method = get_method("fadkv", {**SMALL, **opts})
    # pre-RoPE layers keep key atoms (and the key mean, random here) in to_pairs order
    atoms = prepare_layers(tiny_dictionaries, "cpu", paired=inv_freq is not None)[0]
    mean = torch.randn(heads, atoms.keys.shape[1], generator=torch.Generator().manual_seed(0)) * 0.3
    layer = FadkvLayer(method, atoms._replace(key_mean=mean), rope=inv_freq)
    layer.cache = FadkvCache([layer], method, 0)
    return method, layer


def step(layer, k, v, q):
    """One decode forward of a lone layer, through its cache's lifecycle: store, attend, then code what is due."""
    layer.cache.before_forward(torch.ones(k.shape[0], layer.seen + k.shape[2], dtype=torch.long), k.shape[2])
    layer.update(k, v)
    out = layer.attend(None, q, None, None, None, 0.25, layer.cache.state)
    layer.cache.after_forward()
    return out


def attend(layer, query, mask=None):
    """One more query's attention on a layer (no new token stored), handed a `CodedState` as its cache's
    `before_forward` builds it; `mask` is the 4D mask (B, 1, q, P) the model would pass, or None."""
    visible = None if mask is None else (mask if mask.dtype == torch.bool else mask == 0)[:, 0, 0]
    state = CodedState.build([layer], visible, query.shape[2], {})
    return layer.attend(None, query, None, None, mask, 0.25, state)


def feed(layer, steps, batch=1, heads=2, dim=16, q_heads=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = None
    for _ in range(steps):
        k, v = torch.randn(batch, heads, 1, dim, generator=g), torch.randn(batch, heads, 1, dim, generator=g)
        out = step(layer, k, v, torch.randn(batch, q_heads, 1, dim, generator=g))
    return out


def dense_keys_values(layer, row):
    """Rebuild every stored token of a row densely (coded ones from their codes), in stored order."""
    rebuilt = []
    for kind in layer.kinds:
        idx, coef = kind.numbers(), kind.codes.coefficients()
        h, t, s = idx.shape[1:]
        atoms = kind.atom_table(layer.batch)[row][idx[row].long().reshape(-1, s)]  # (H*T, s, d), plain indexing
        vec = (coef[row].reshape(-1, s, 1) * atoms).sum(1)
        rebuilt.append(vec.view(h, t, -1))
    coded_keys = rebuilt[0] + layer.key_mean[:, None]
    if layer.rope is not None:  # keys=pre-rope: the codes hold content keys in pair order; RoPE goes on after
        coded_keys = rotate(from_pairs(coded_keys), layer.coded_pos[row], layer.rope)
    keys = torch.cat([coded_keys, layer.keys[row].float()], 1)
    values = torch.cat([rebuilt[1], layer.values[row].float()], 1)
    real = torch.cat([layer.coded_pos[row], layer.positions[row]]) >= 0  # holes (-1) of a shorter row hold nothing
    return keys[:, real], values[:, real]  # (H, stored, d)


@pytest.mark.parametrize("kernel", ["torch", "auto"])  # the PyTorch reference and, where built, the fused kernel
@pytest.mark.parametrize("adapt, value_sparsity, index_bits", [("none", "0", "16"), ("fixed", "0", "16"),
                                                               ("append", "0", "16"), ("fixed", "6", "16"),
                                                               ("fixed", "6", "10")])
def test_attention_on_codes_equals_dense_reference(tiny_dictionaries, adapt, value_sparsity, index_bits, kernel):
    """index_bits=10 packs the atom numbers (the fused kernel reads 16-bit ones, so `auto` runs the reference)."""
    _, layer = make_layer(tiny_dictionaries, adapt=adapt, adapt_threshold="0.2", value_sparsity=value_sparsity,
                          kernel=kernel, index_bits=index_bits)
    feed(layer, 60)
    assert layer.coded_keys.numbers().shape[-1] == 4
    assert layer.coded_values.numbers().shape[-1] == (int(value_sparsity) or 4)
    assert (layer.coded_keys.codes.idx.dtype == torch.uint8) == (index_bits == "10")
    assert layer.coded_pos.shape[1] > 40
    if adapt != "none":
        assert layer.cache.coding.replaced > 0
    query = torch.randn(1, 4, 1, 16)
    got = attend(layer, query)  # (1, 1, 4, 16)
    keys, values = dense_keys_values(layer, 0)
    keys, values = keys.repeat_interleave(2, 0), values.repeat_interleave(2, 0)  # GQA: 2 query heads per KV head
    w = torch.softmax(query[0] @ keys.transpose(-1, -2) * 0.25, -1)
    expected = (w @ values).transpose(0, 1)[None]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernel", ["torch", "auto"])
@pytest.mark.parametrize("adapt", ["none", "fixed"])
def test_prerope_attention_equals_dense_reference(tiny_dictionaries, adapt, kernel, monkeypatch):
    """keys=pre-rope: keys are turned back to content before coding, and scores rebuild each chunk of codes and apply
    RoPE at the token's position; chunked (3 coded tokens per chunk here) it equals rebuilding every key densely."""
    import kvzip.methods.coded.attend as fadkv_module

    monkeypatch.setattr(fadkv_module, "SCORE_CHUNK", 3)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    _, layer = make_layer(tiny_dictionaries, adapt=adapt, adapt_threshold="0.2", keys="pre-rope", inv_freq=inv_freq,
                          kernel=kernel)
    feed(layer, 60)
    assert layer.coded_pos.shape[1] > 40
    query = torch.randn(1, 4, 1, 16)
    got = attend(layer, query)
    keys, values = dense_keys_values(layer, 0)
    keys, values = keys.repeat_interleave(2, 0), values.repeat_interleave(2, 0)
    w = torch.softmax(query[0] @ keys.transpose(-1, -2) * 0.25, -1)
    torch.testing.assert_close(got, (w @ values).transpose(0, 1)[None], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("keys", ["post-rope", "pre-rope"])
def test_multi_token_query_over_codes_equals_dense_reference(tiny_dictionaries, keys):
    """A follow-up prompt (several new tokens at once) over a coded past: scores and rebuilt values equal dense
    attention with the new tokens causal among themselves."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16)) if keys == "pre-rope" else None
    _, layer = make_layer(tiny_dictionaries, adapt="fixed", adapt_threshold="0.2", keys=keys, inv_freq=inv_freq)
    feed(layer, 60)
    g = torch.Generator().manual_seed(3)
    layer.update(torch.randn(1, 2, 3, 16, generator=g), torch.randn(1, 2, 3, 16, generator=g))
    query = torch.randn(1, 4, 3, 16, generator=g)
    got = attend(layer, query)  # (1, 3, 4, 16)
    keys_d, values_d = dense_keys_values(layer, 0)
    keys_d, values_d = keys_d.repeat_interleave(2, 0), values_d.repeat_interleave(2, 0)
    scores = query[0] @ keys_d.transpose(-1, -2) * 0.25  # (4, 3, S)
    n = scores.shape[-1]
    allowed = torch.ones(3, n, dtype=torch.bool)
    allowed[:, n - 3:] = torch.ones(3, 3, dtype=torch.bool).tril()
    w = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)
    torch.testing.assert_close(got, (w @ values_d).transpose(0, 1)[None], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("adapt", ["none", "fixed"])
def test_rebuilt_values_equal_per_atom_sums(tiny_dictionaries, adapt, monkeypatch):
    """Many query rows (a follow-up prompt) rebuild coded values chunk by chunk; decoding sums weights per atom. The two
    give the same weighted sum, overlay atoms included."""
    import kvzip.methods.coded.attend as fadkv_module
    from kvzip.sparse import coded_attention as coded

    monkeypatch.setattr(fadkv_module, "SCORE_CHUNK", 5)
    _, layer = make_layer(tiny_dictionaries, adapt=adapt, adapt_threshold="0.2")
    feed(layer, 60)
    if adapt != "none":
        assert layer.cache.coding.replaced > 0
    t = layer.coded_pos.shape[1]
    w = torch.rand(1, 2, 6, t)
    values = layer.coded_values
    per_atom = values.values_from_atoms(coded.atom_weights(w, values.numbers().long(), values.codes.coefficients(),
                                                           values.n_total() + 1))
    torch.testing.assert_close(fadkv_module.rebuilt_values(w, values, layer.values.shape[-1]), per_atom, rtol=1e-4,
                               atol=1e-4)


def test_int4_coefficients_round_trip_two_a_byte():
    """int4 stores each coefficient in a nibble, two a byte, against one fp16 scale a vector: the round trip is within
    half a step (absmax / 7 / 2), a vector's largest coefficient is exact to fp16, zeros stay zero, and an odd
    sparsity is refused."""
    from kvzip.sparse import coded_attention as coded

    coef = torch.randn(3, 5, 8)
    coef[0, 0] = 0.0
    stored, scale = coded.quantize(coef, "int4")
    assert stored.dtype == torch.uint8 and stored.shape == (3, 5, 4) and scale.shape == (3, 5, 1)
    back = coded.dequantize(stored, scale)
    step = coef.abs().amax(-1, keepdim=True) / 7
    assert ((back - coef).abs() <= step / 2 + 1e-3).all() and torch.equal(back[0, 0], torch.zeros(8))
    top = coef.abs().argmax(-1, keepdim=True)
    torch.testing.assert_close(back.gather(-1, top), coef.gather(-1, top), rtol=2e-3, atol=1e-6)
    with pytest.raises(ValueError, match="must be even"):
        coded.quantize(torch.randn(2, 3), "int4")
    from kvzip.errors import UserError

    with pytest.raises(UserError, match="must be even"):
        get_method("fadkv", {"coef_format": "int4", "sparsity": "5"})


def test_atom_numbers_packed_in_ten_bits_round_trip():
    """pack_indices keeps each number's low byte and its two high bits four to a byte: every number below 1,024
    comes back at every sparsity, in s + ceil(s/4) bytes; index_bits=10 with appended atoms is refused."""
    from kvzip.errors import UserError
    from kvzip.sparse import coded_attention as coded

    g = torch.Generator().manual_seed(0)
    for s in range(1, 15):
        idx = torch.randint(0, coded.PACKED_ATOMS, (2, 3, 5, s), generator=g, dtype=torch.int16)
        idx[0, 0, 0] = coded.PACKED_ATOMS - 1
        idx[0, 0, 1] = 0
        packed = coded.pack_indices(idx)
        assert packed.dtype == torch.uint8 and packed.shape[-1] == s + (s + 3) // 4 == coded.packed_width(s)
        assert torch.equal(coded.unpack_indices(packed, s), idx.int())
    with pytest.raises(UserError, match="adapt=append grows past"):
        get_method("fadkv", {"index_bits": "10", "adapt": "append"})


def test_fp8_table_matches_cast():
    from kvzip.sparse import coded_attention as coded

    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(2, 8, 16)
    expected = every.float()
    got = coded.dequantize(every, None)
    finite = ~expected.isnan()
    assert torch.equal(got[finite], expected[finite]) and got[~finite].isnan().all()


def test_prerope_codes_content_keys(tiny_dictionaries):
    """A key stored post-RoPE at position p is coded as its content (RoPE undone): with a dictionary holding that
    content as an atom, the code is exact, which a post-RoPE coder would miss."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    _, layer = make_layer(tiny_dictionaries, keys="pre-rope", inv_freq=inv_freq, sinks="0", buffer="0", code_chunk="1")
    content = from_pairs(layer.atoms.keys[5] * 2.0 + layer.key_mean[0])  # (d,) atom 5, scaled, plus the head's key mean
    layer.update(rotate(content, torch.tensor([0]), inv_freq).view(1, 1, 1, 16).expand(1, 2, 1, 16).clone(),
                 torch.randn(1, 2, 1, 16))
    layer.update(rotate(content, torch.tensor([1]), inv_freq).view(1, 1, 1, 16).expand(1, 2, 1, 16).clone(),
                 torch.randn(1, 2, 1, 16))
    compress([layer], CodingStats())  # what the cache's after_forward runs after a prompt's forward
    idx, coef = layer.coded_keys.numbers(), layer.coded_keys.codes.coefficients()
    assert idx.shape[2] == 2
    for t in range(2):
        assert int(idx[0, 0, t][coef[0, 0, t].abs().argmax()]) == 5
        torch.testing.assert_close(coef[0, 0, t].abs().max().item(), 2.0, rtol=0.05, atol=0.05)


def test_fixed_adaptation_never_grows_and_keeps_old_codes_valid(tiny_dictionaries):
    from kvzip.sparse.dictionary import KVDictionary

    # 256 atoms, so inactive atoms remain to be replaced long after the first tokens were coded.
    g = torch.Generator().manual_seed(1)
    atoms = lambda: torch.nn.functional.normalize(torch.randn(2, 256, 16, generator=g), dim=-1)  # noqa: E731
    big = KVDictionary(keys=atoms(), values=atoms(), meta=tiny_dictionaries.meta)
    _, layer = make_layer(big, adapt="fixed", adapt_threshold="0.2")
    feed(layer, 24)
    n = layer.coded_keys.n_atoms
    before_keys, _ = dense_keys_values(layer, 0)
    first = layer.coded_pos.shape[1]
    replaced = layer.cache.coding.replaced
    feed(layer, 200, seed=1)
    assert layer.cache.coding.replaced > replaced
    assert layer.coded_keys.n_total() == n and layer.coded_values.n_total() == n
    assert int(layer.coded_keys.overlay.ids.max()) < n
    after_keys, _ = dense_keys_values(layer, 0)
    # Tokens coded before later replacements still decode to the same vectors: referenced atoms are never overwritten.
    torch.testing.assert_close(after_keys[:, :first], before_keys[:, :first])


def test_append_grows_and_none_stays_static(tiny_dictionaries):
    _, grow = make_layer(tiny_dictionaries, adapt="append", adapt_threshold="0.2")
    feed(grow, 60)
    assert grow.coded_keys.n_total() > grow.coded_keys.n_atoms
    _, static = make_layer(tiny_dictionaries, adapt="none")
    feed(static, 60)
    assert static.cache.coding.replaced == 0 and static.coded_keys.overlay.ids.numel() == 0


def test_batched_rows_keep_their_own_dictionaries(tiny_dictionaries):
    g = torch.Generator().manual_seed(3)
    steps = [(torch.randn(2, 2, 1, 16, generator=g), torch.randn(2, 2, 1, 16, generator=g), torch.randn(2, 4, 1, 16, generator=g))
             for _ in range(50)]
    _, both = make_layer(tiny_dictionaries, adapt="fixed", adapt_threshold="0.2")
    singles = [make_layer(tiny_dictionaries, adapt="fixed", adapt_threshold="0.2")[1] for _ in range(2)]
    for k, v, q in steps:
        out = step(both, k, v, q)
        for row, layer in enumerate(singles):
            one = step(layer, k[row:row + 1], v[row:row + 1], q[row:row + 1])
            torch.testing.assert_close(out[row:row + 1], one, rtol=1e-5, atol=1e-5)
    for row, layer in enumerate(singles):
        assert torch.equal(both.coded_keys.codes.idx[row], layer.coded_keys.codes.idx[0])


def test_dictionary_size_fixed_over_8000_decoded_tokens(tokenizer, tiny_dictionaries):
    from tests.conftest import tiny_llama

    from kvzip.sparse.dictionary import KVDictionary

    model = tiny_llama(layers=1)
    model.config.max_position_embeddings = 9000
    g = torch.Generator().manual_seed(2)
    atoms = lambda: torch.nn.functional.normalize(torch.randn(1, 256, 16, generator=g), dim=-1)  # noqa: E731
    dictionary = KVDictionary(keys=atoms(), values=atoms(), meta=tiny_dictionaries.meta)
    method = get_method("fadkv", {**SMALL, "adapt_threshold": "0.3", "code_chunk": "128", "buffer": "64"})
    cache = method.make_cache(model, dictionary)
    prompt = tokenizer("adaptive")["input_ids"]
    events = list(engine.generate(model, tokenizer, [prompt], cache, engine.Settings(max_new_tokens=8000, ignore_eos=True)))
    result, summary = events[-2:]
    assert len(result.token_ids) == 8000
    layer = cache.layers[0]
    stats = summary.stats["method_stats"]
    assert stats["atoms_replaced"] > 0
    assert layer.coded_keys.n_total() == layer.coded_keys.n_atoms == layer.coded_values.n_total()
    assert stats["tokens_coded"] >= 8000 - 64 - 64


def test_lexico_is_omp_and_static():
    method = get_method("lexico")
    assert method.coder == "omp" and method.adapt == "none"


def test_atoms_replaced_first_are_the_least_recently_used_of_the_unused():
    """`least_recent_unused` picks what a stable sort of the unused atoms by last use would put first (ties: the
    lower atom number), and marks an atom in use as not free."""
    from kvzip.methods.coded.coding import least_recent_unused

    g = torch.Generator().manual_seed(3)
    counts = torch.randint(0, 3, (50, 64), generator=g)
    counts[0] = 1  # a group with every atom in use
    last = torch.randint(-1, 5, (50, 64), generator=g)  # many ties
    atoms, free = least_recent_unused(counts, last, 6)
    order = torch.where(counts == 0, last, torch.iinfo(torch.long).max).sort(dim=1, stable=True)
    want_free = order.values[:, :6] < torch.iinfo(torch.long).max
    assert torch.equal(free, want_free) and not bool(free[0].any())
    assert torch.equal(atoms[free], order.indices[:, :6][free])
