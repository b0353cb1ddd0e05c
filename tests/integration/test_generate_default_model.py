"""Integration tier for the foundation: `kvzip generate` on the default model, `full` vs transformers, user errors."""

from __future__ import annotations

import json

import torch

from kvzip import engine
from kvzip.methods import get_method

from .conftest import run_cli


def test_cli_generate_answers_fluently():
    proc = run_cli("generate", "What is the capital of France? Answer in one sentence.", "--max-new-tokens", "24")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_cli_json_has_the_promised_fields():
    proc = run_cli("generate", "--method", "window", "--opt", "window=16", "--max-new-tokens", "40", "--ignore-eos",
                   "--json", "List some animals.")
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.strip().splitlines()]
    record, summary = lines[0], lines[-1]["summary"]
    assert record["new_tokens"] == 40 and record["completion"]
    batch = summary["batches"][0]
    for key in ("decode_tokens_per_s", "ttft_s", "kv_bytes_peak", "kv_bytes_full", "kv_ratio_vs_full",
                "kv_bytes_fp16_full"):
        assert key in batch
    # The window (4 sinks + 16 recent) holds far fewer tokens than the prompt plus the answer.
    assert batch["kv_bytes_final"] < batch["kv_bytes_full"] / 2


def test_full_method_equals_model_generate(default_model):
    model, tokenizer, _ = default_model
    ids = engine.encode(tokenizer, "Write two sentences about the ocean.")
    cache = get_method("full").make_cache(model)
    result = [e for e in engine.generate(model, tokenizer, [ids], cache, engine.Settings(max_new_tokens=40))
              if isinstance(e, engine.Result)][0]
    reference = model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)[0, len(ids):].tolist()
    if result.finish_reason == "eos":  # transformers keeps the end-of-sequence token, kvzip does not emit it
        reference = reference[:-1]
    assert len(result.token_ids) > 10 and result.token_ids == reference


def test_batch_file_writes_results_atomically(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Say hello."}) + "\n" +
                       json.dumps({"messages": [{"role": "user", "content": "Name a fruit."}]}) + "\n")
    out = tmp_path / "out.jsonl"
    proc = run_cli("generate", "--input", str(prompts), "--output", str(out), "--max-new-tokens", "12")
    assert proc.returncode == 0, proc.stderr
    *rows, summary = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and all(r["completion"] for r in rows)
    assert summary["summary"]["rows"] == 2 and summary["summary"]["batches"][0]["kv_bytes_peak"] > 0  # batch figures once
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def _one_line_error(proc):
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvzip: error:"), proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


def test_corrupt_gguf_is_one_clear_error(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    line = _one_line_error(run_cli("generate", "--model", str(bad), "hi", env={"KVZIP_CACHE": str(tmp_path / "c")}))
    assert "broken.gguf" in line
    assert not any((tmp_path / "c" / "models").glob("broken*")) if (tmp_path / "c" / "models").exists() else True


def test_user_errors_exit_2_with_one_line(tmp_path):
    assert "unknown method 'nope'" in _one_line_error(run_cli("generate", "--method", "nope", "hi"))
    assert "no option 'size'" in _one_line_error(run_cli("generate", "--method", "window", "--opt", "size=3", "hi"))
    assert "not found" in _one_line_error(run_cli("generate", "--input", str(tmp_path / "missing.jsonl")))
    assert "not found" in _one_line_error(run_cli("generate", "--model", str(tmp_path / "nope.gguf"), "hi"))
    line = _one_line_error(run_cli("generate", "--model", "kvzip-tests/no-such-model", "hi"))
    assert "cannot load model" in line or "not reachable" in line
    if not torch.cuda.is_available():
        assert "no CUDA GPU" in _one_line_error(run_cli("generate", "--device", "cuda", "hi"))
    long_prompt = "word " * 9000
    assert "exceeds the model's context" in _one_line_error(run_cli("generate", long_prompt))
