"""Integration tier: `kvzip train-dict` end to end on the real default model, small (2,000 tokens, 64 atoms, 2 iterations).

Runs the default calibration path (the model's own chat answers to GSM8K calibration prompts + prose) through the
real CLI in a subprocess and checks the file loads, matches the model's fingerprint, and reports sane held-out errors.
Cost: ~60 s of one CPU core (58 s user time measured; 5 min wall on the shared machine at load average 8).
"""

from __future__ import annotations

import json

import pytest

from tests.integration.conftest import run_cli


@pytest.mark.integration
def test_train_dict_small_on_the_default_model(default_model, tmp_path):
    from kvzip.models import model_fingerprint
    from kvzip.sparse.dictionary import KVDictionary

    out = tmp_path / "d.safetensors"
    proc = run_cli("train-dict", "--tokens", "2000", "--atoms", "64", "--iters", "2", "--samples", "2048",
                   "--out", str(out), "--device", "cpu", timeout=2700, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    model, _, _ = default_model
    d = KVDictionary.load(out)
    d.check_fingerprint(model_fingerprint(model.config))
    assert d.fingerprint == json.loads(json.dumps(model_fingerprint(model.config)))
    assert d.keys.shape == d.values.shape == (30, 64, 64) and d.key_mean.shape == (30, 3, 64)
    assert "GSM8K calibration problems [0, 600)" in d.meta["calibration_source"]
    assert 1900 <= int(d.meta["calibration_tokens"]) <= 2000
    keys, values = json.loads(d.meta["heldout_key_error"]), json.loads(d.meta["heldout_value_error"])
    assert len(keys) == len(values) == 30
    # 64 atoms, s=8 on 64-dim vectors: clearly better than nothing (error 1), clearly not exact
    assert all(0.05 < e < 0.95 for e in keys + values), (keys, values)
    assert "mean" in proc.stdout and "wrote" in proc.stderr
