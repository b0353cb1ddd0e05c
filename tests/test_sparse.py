"""Fast CPU tests of kvzip.sparse: coders, dictionary learning, dictionary file IO. Synthetic data, no downloads."""
import os

import pytest
import torch

from kvzip.sparse import dictionary as dictmod
from kvzip.sparse.dictionary import DictionaryError, KVDictionary, make_meta
from kvzip.sparse.learn import learn_dictionary, relative_error
from kvzip.sparse.omp import gram_matrix, omp, reconstruct
from kvzip.sparse.screen import champions, screen


def _dict(N, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    D = torch.randn(N, d, generator=g)
    return D / D.norm(dim=1, keepdim=True)


def _sparse_signals(D, M, s, seed=1):
    """M exactly s-sparse signals over D with coefficients of magnitude in [1, 2]."""
    g = torch.Generator().manual_seed(seed)
    N = D.shape[0]
    idx = torch.stack([torch.randperm(N, generator=g)[:s] for _ in range(M)])          # (M, s)
    coef = torch.where(torch.rand(M, s, generator=g) < 0.5, -1.0, 1.0) * (1 + torch.rand(M, s, generator=g))
    return reconstruct(D, idx, coef), idx


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("coder", ["omp", "screen", "screen1"])
def test_exact_recovery(coder):
    D = _dict(96, 64)                                         # well conditioned: max coherence ~0.45
    X, idx = _sparse_signals(D, 200, 3)
    # exact top-n pools: the signal's atoms are the most correlated ones, so both shots find them
    # (one shot needs a wider pool: with coherence ~0.45 a true atom can rank below 24th)
    i, c = omp(X, D, 3) if coder == "omp" else \
        screen(X, D, 3, pick="top", **(dict(n=24) if coder == "screen" else dict(n=48, shots=1)))
    assert relative_error(X, D, i, c).max() < 1e-4
    assert torch.equal(i.sort(1).values, idx.sort(1).values)


def test_champions_are_each_groups_largest_magnitude():
    g = torch.Generator().manual_seed(0)
    c = torch.randn(500, 1024, generator=g) * torch.rand(500, 1, generator=g) * 10
    for N, n in ((1024, 16), (96, 8)):                        # 96: not a power of two, the low 7 bits hold the column
        got = champions(c[:, :N], n)                          # (500, n)
        size = N // n
        assert torch.equal(got // size, torch.arange(n).expand(500, n))   # one per group, in group order
        best = c[:, :N].abs().view(500, n, size).amax(dim=2)
        # exact up to the 13 mantissa bits kept: a near-tie may go either way
        assert (c[:, :N].abs().gather(1, got) >= best * (1 - 2 ** -12)).all()
        assert (c[:, :N].abs().gather(1, got) == best).float().mean() > 0.99


def test_champion_screening_recovers_signals_whose_atoms_sit_in_different_groups():
    D = _dict(96, 64)
    X, idx = _sparse_signals(D, 400, 3)
    apart = (idx // 4).sort(1).values.diff(dim=1).ne(0).all(1) & (idx // 2).sort(1).values.diff(dim=1).ne(0).all(1)
    X, idx = X[apart], idx[apart]                            # groups of 4 (first pool, n=24) and 2 (second, n2=48)
    i, c = screen(X, D, 3, n=24)
    assert relative_error(X, D, i, c).max() < 1e-4
    assert torch.equal(i.sort(1).values, idx.sort(1).values)


def test_omp_never_repeats_and_matches_least_squares():
    D = _dict(64, 16)
    X = torch.randn(300, 16)
    i, c = omp(X, D, 12)
    assert all(len(set(r.tolist())) == 12 for r in i)
    ls = torch.linalg.lstsq(D[i].transpose(1, 2), X.unsqueeze(2)).solution.squeeze(2)   # (M, s)
    assert torch.allclose(c, ls, atol=1e-4)


def test_omp_handles_dependent_atoms_and_zero_rows():
    D = _dict(8, 4)
    X = torch.cat([torch.zeros(2, 4), torch.randn(5, 4)])
    i, c = omp(X, D, 8)                                       # s > d: later atoms are linearly dependent
    assert torch.isfinite(c).all() and (c[:2] == 0).all()
    assert relative_error(X[2:], D, i[2:], c[2:]).max() < 1e-4
    assert all(len(set(r.tolist())) == 8 for r in i)


@pytest.mark.parametrize("coder", ["omp", "screen"])
def test_gram_passed_or_not_is_identical(coder):
    D = _dict(96, 32)
    X = torch.randn(100, 32)
    f = (lambda **k: omp(X, D, 5, **k)) if coder == "omp" else (lambda **k: screen(X, D, 5, n=12, **k))
    i1, c1 = f()
    i2, c2 = f(gram=gram_matrix(D))
    assert torch.equal(i1, i2) and torch.equal(c1, c2)


def test_half_precision_inputs_computed_in_fp32():
    D = _dict(64, 32)
    X, _ = _sparse_signals(D, 20, 2)
    i, c = omp(X.bfloat16(), D.bfloat16(), 2)
    assert c.dtype == torch.bfloat16 and i.dtype == torch.int64
    assert relative_error(X, D, i, c).mean() < 0.05


def test_screen_with_full_pool_is_omp():
    D = _dict(64, 32)
    X = torch.randn(200, 32)
    G = gram_matrix(D)
    i1, c1 = omp(X, D, 6, gram=G)
    i2, c2 = screen(X, D, 6, n=64, gram=G)
    assert torch.equal(i1.sort(1).values, i2.sort(1).values)
    assert torch.allclose(reconstruct(D, i1, c1), reconstruct(D, i2, c2), atol=1e-4)


@pytest.mark.parametrize("coder", ["omp", "screen"])
def test_learning_reduces_error_and_is_deterministic(coder):
    true = _dict(64, 32, seed=3)
    X, _ = _sparse_signals(true, 2000, 3, seed=4)
    X = X + 0.01 * torch.randn(X.shape, generator=torch.Generator().manual_seed(5))
    rand = _dict(64, 32, seed=9)
    e0 = relative_error(X, rand, *omp(X, rand, 3)).mean()
    steps = []
    D = learn_dictionary(X, 64, 3, iters=15, coder=coder, n=12, seed=0, progress=lambda *a: steps.append(a))
    e1 = relative_error(X, D, *omp(X, D, 3)).mean()
    assert e1 < 0.3 * e0
    assert torch.allclose(D.norm(dim=1), torch.ones(64), atol=1e-5)
    assert [s[:2] for s in steps] == [(k, 15) for k in range(1, 16)] and "error" in steps[0][2]
    assert torch.equal(D, learn_dictionary(X, 64, 3, iters=15, coder=coder, n=12, seed=0))


FP = {"architecture": "llama", "num_layers": 2, "num_kv_heads": 3, "head_dim": 8, "rope_theta": 100000.0,
      "config_hash": "abc"}


def _kvd():
    meta = make_meta(FP, s=4, keys="pre-rope", source="gsm8k[0:600]", tokens=123,
                     key_error=[0.1, 0.2], value_error=[0.3, 0.4])
    return KVDictionary(keys=_dict(2 * 16, 8).view(2, 16, 8), values=_dict(2 * 16, 8, 1).view(2, 16, 8),
                        meta=meta, key_mean=torch.randn(2, 3, 8))


def test_save_load_roundtrip(tmp_path):
    p = tmp_path / "d.safetensors"
    a = _kvd()
    a.save(p)
    b = KVDictionary.load(p)
    assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) and torch.equal(a.key_mean, b.key_mean)
    assert b.meta["atoms"] == "16" and b.meta["keys"] == "pre-rope" and b.fingerprint == FP
    assert {k: v for k, v in b.meta.items() if k != "atoms"} == a.meta
    b.check_fingerprint(FP)
    assert os.listdir(tmp_path) == ["d.safetensors"]


def _one_line_error(p):
    with pytest.raises(DictionaryError) as e:
        KVDictionary.load(p)
    msg = str(e.value)
    assert "\n" not in msg and str(p) in msg
    return msg


def test_load_bad_files(tmp_path):
    p = tmp_path / "d.safetensors"
    _kvd().save(p)
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    assert "truncated" in _one_line_error(p)
    p.write_bytes(os.urandom(4096))
    assert "truncated" in _one_line_error(p)
    p.write_bytes(b"")
    _one_line_error(p)
    assert "not found" in _one_line_error(tmp_path / "missing.safetensors")


def test_load_missing_tensor_and_wrong_version(tmp_path):
    from safetensors.torch import save_file
    p = tmp_path / "d.safetensors"
    save_file({"keys": torch.zeros(1, 2, 3)}, p, metadata={"format_version": "1"})
    assert "values" in _one_line_error(p)
    save_file({"keys": torch.zeros(1, 2, 3), "values": torch.zeros(1, 2, 3)}, p, metadata={"format_version": "99"})
    assert "version 99" in _one_line_error(p)


def test_fingerprint_mismatch():
    d = _kvd()
    with pytest.raises(DictionaryError, match="head dim 8, this model has head dim 64"):
        d.check_fingerprint({**FP, "head_dim": 64})
    with pytest.raises(DictionaryError, match="num layers"):
        d.check_fingerprint({**FP, "num_layers": 30})


def test_atomic_save_interrupted(tmp_path, monkeypatch):
    def boom(*a, **k):
        open(a[1], "wb").write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(dictmod, "save_file", boom)
    with pytest.raises(KeyboardInterrupt):
        _kvd().save(tmp_path / "d.safetensors")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("coder", ["screen", "omp"])
def test_grouped_dictionaries_code_as_each_group_alone(coder):
    """One call over Grouped dictionaries (2 layers x 3 rows, overlays replacing and appending atoms) codes every
    group as the coder does with that group's own explicit dictionary and Gram matrix."""
    from kvzip.sparse.atoms import Grouped

    N, d, s, m = 64, 16, 6, 20
    atoms = torch.stack([_dict(N, d, seed=3), _dict(N, d, seed=4)])  # (L, N, d)
    grams = torch.stack([gram_matrix(a) for a in atoms])
    size = N + 2  # row 2 of layer 1 appends two atoms; every other row sees zero atoms there
    ids = torch.full((2, 3, 3), -1)
    ids[0, 0, :2] = torch.tensor([0, 40])  # atom 0 live beside a free slot
    ids[0, 2, :3] = torch.tensor([0, 63, 17])
    ids[1, 1, :1] = torch.tensor([9])
    ids[1, 2, :2] = torch.tensor([N, N + 1])
    vectors = torch.nn.functional.normalize(torch.randn(2, 3, 3, d, generator=torch.Generator().manual_seed(5)), dim=-1)
    grouped = Grouped(atoms, ids, vectors, size, grams, torch.tensor([0, 1]))
    x = torch.randn(6, m, d, generator=torch.Generator().manual_seed(6))
    code = (lambda x, D, **kw: omp(x, D, s, **kw)) if coder == "omp" else \
        (lambda x, D, **kw: screen(x, D, s, n=8, pick="top", **kw))
    idx, coef = code(x, grouped)
    assert idx.shape == coef.shape == (6, m, s)
    for g in range(6):
        layer, row = divmod(g, 3)
        D = torch.cat([atoms[layer], torch.zeros(size - N, d)])
        live = ids[layer, row] >= 0
        D[ids[layer, row][live]] = vectors[layer, row][live]
        want_idx, want_coef = code(x[g], D, gram=gram_matrix(D))
        assert torch.equal(idx[g], want_idx), g
        torch.testing.assert_close(coef[g], want_coef, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(grouped.reconstruct(idx[g].view(1 * m, s).repeat(6, 1), coef[g].repeat(6, 1))
                                   .view(6, m, d)[g], reconstruct(D, want_idx, want_coef), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("size", [64, 66])
def test_grouped_omp_without_overlays_reads_gram_rows(size):
    """With no overlay atom live (Lexico's static dictionary), OMP over Grouped dictionaries reads its Gram rows from
    the shared Gram matrices and codes each group as OMP with that layer's dictionary alone; atoms past N (empty
    appended slots) are zero vectors, whose Gram rows are zero."""
    from kvzip.sparse.atoms import Grouped

    N, d, s, m = 64, 16, 6, 20
    atoms = torch.stack([_dict(N, d, seed=3), _dict(N, d, seed=4)])
    grams = torch.stack([gram_matrix(a) for a in atoms])
    grouped = Grouped(atoms, torch.full((2, 3, 2), -1), torch.zeros(2, 3, 2, d), size, grams, torch.tensor([0, 1]))
    j = torch.tensor([[0], [N - 1], [size - 1]]).repeat(2, 1)  # one vector per group, the last an empty slot
    want = grouped.correlations(grouped.table[grouped._rows(j)].view(6, 1, d))
    torch.testing.assert_close(grouped.pool(None, 6).row(j), want, rtol=1e-5, atol=1e-6)
    x = torch.randn(6, m, d, generator=torch.Generator().manual_seed(6))
    idx, coef = omp(x, grouped, s)
    for g in range(6):
        want_idx, want_coef = omp(x[g], atoms[g // 3], s, gram=grams[g // 3])
        assert torch.equal(idx[g], want_idx), g
        torch.testing.assert_close(coef[g], want_coef, rtol=1e-4, atol=1e-5)
