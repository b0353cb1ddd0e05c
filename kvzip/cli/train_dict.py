"""`kvzip train-dict`: learn a model's key/value dictionaries from calibration text and write them atomically.

Thin: checks flags, builds the calibration documents (user files, or the default: the model's own chat answers to
GSM8K calibration prompts plus calibration prose), captures KV through the model (kvzip.capture), learns one key and
one value dictionary per layer (kvzip.sparse.train), shows progress with ETA for every phase, prints the held-out
error per layer, and saves a KVDictionary (atoms stored in fp16, loaded as fp32). Ctrl-C at any point writes nothing
and exits 130 with one line.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvzip.cli import display
from kvzip.cli.flags import Device, Dtype, Model, TrustRemoteCode, check_choice, check_device, output_path
from kvzip.errors import UserError
from kvzip.sparse import CODERS, KEY_MODES

MAX_HOLDOUT = 0.9  # held-out share of each document: at least a tenth of every document is left to learn from


def _check(tokens: int, atoms: int, sparsity: int, iters: int, keys: str, coder: str, samples: int,
           holdout: float) -> None:
    check_choice("--keys", keys, KEY_MODES)
    check_choice("--coder", coder, CODERS)
    if not 0 < holdout < MAX_HOLDOUT:
        raise UserError(f"--holdout must be a fraction in (0, {MAX_HOLDOUT}), got {holdout}")
    for name, value, low in (("--tokens", tokens, 1), ("--atoms", atoms, 2), ("--iters", iters, 1),
                             ("--sparsity", sparsity, 1), ("--samples", samples, 1)):
        if value < low:
            raise UserError(f"{name} must be at least {low}, got {value}")
    if sparsity > atoms:
        raise UserError(f"--sparsity {sparsity} cannot exceed --atoms {atoms}")
    if samples < atoms:
        raise UserError(f"--samples {samples} must be at least --atoms {atoms} (each atom starts as a sample)")


def _out_path(out: Path | None, model: str, keys: str) -> Path:
    """The output file, checked before the model loads: `--out`, else the default file for the model and key mode."""
    if out is not None:
        return output_path(out, "--out")
    from kvzip.dictionary_lookup import default_dictionary_path
    from kvzip.files import check_writable
    from kvzip.models import resolve_model

    out = default_dictionary_path(resolve_model(model), keys)
    try:
        return check_writable(out)
    except UserError as exc:
        raise UserError(f"default output: {exc}; pass --out FILE") from None


def _error_table(trained, key_mode: str):
    from rich.table import Table

    table = Table(title=f"held-out relative error ||x - Dc|| / ||x|| (keys {key_mode}, centred)",
                  title_justify="left")
    for col in ("layer", "keys", "keys vs raw norm", "values"):
        table.add_column(col, justify="right")
    for i, (k, kr, v) in enumerate(zip(trained.key_error, trained.key_error_vs_raw, trained.value_error)):
        table.add_row(str(i), f"{k:.3f}", f"{kr:.3f}", f"{v:.3f}")
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    table.add_row("mean", f"{mean(trained.key_error):.3f}", f"{mean(trained.key_error_vs_raw):.3f}",
                  f"{mean(trained.value_error):.3f}", style="bold")
    return table


def train_dict(
    model: Model = "smollm2-135m",
    text: Annotated[Optional[list[Path]], typer.Option("--text", help="Calibration text file (plain or JSONL), repeatable. Default: the model's chat answers to GSM8K calibration prompts + calibration prose.")] = None,
    tokens: Annotated[int, typer.Option(help="Calibration tokens to capture (held-out part included).")] = 20000,
    atoms: Annotated[int, typer.Option("--atoms", help="Atoms N per dictionary.")] = 1024,
    sparsity: Annotated[int, typer.Option("--sparsity", help="Atoms per coded vector s (the cache's default).")] = 8,
    iters: Annotated[int, typer.Option(help="Learning iterations per dictionary.")] = 8,
    keys: Annotated[str, typer.Option("--keys", help="post-rope (mean droppable at attention time) or pre-rope (mean stored and added back).")] = "post-rope",
    coder: Annotated[str, typer.Option(help="Sparse coder inside the learning loop: screen1 (one-shot top-n screening), screen (the cache's two-shot coder) or omp. The held-out error uses the cache's coder: screen, or omp for --coder omp.")] = "screen1",
    samples: Annotated[int, typer.Option(help="Training vectors per layer and kind used for learning (random subsample).")] = 16384,
    holdout: Annotated[float, typer.Option(help="Fraction of every calibration document's last tokens held out for the error report.")] = 0.1,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Output file (default: dictionaries/<model>.safetensors, <model>-prerope for pre-rope keys).")] = None,
    seed: Annotated[int, typer.Option(help="Seed for subsampling and initial atoms.")] = 0,
    device: Device = "auto",
    dtype: Dtype = "auto",
    trust_remote_code: TrustRemoteCode = False,
):
    """Learn per-layer key and value dictionaries for a model and save them (safetensors, atomic)."""
    _check(tokens, atoms, sparsity, iters, keys, coder, samples, holdout)
    out = _out_path(out, model, keys)
    check_device(device, dtype)
    command = " ".join(["kvzip", "train-dict", *sys.argv[sys.argv.index("train-dict") + 1:]]) \
        if "train-dict" in sys.argv else "kvzip train-dict (called from Python)"
    try:
        _run(model, text, tokens, atoms, sparsity, iters, keys, coder, samples, holdout, out, seed, device, dtype,
             trust_remote_code, command)
    except KeyboardInterrupt:
        display.console.print("kvzip: interrupted, no dictionary written")
        raise typer.Exit(130) from None


def _run(model, text, tokens, atoms, sparsity, iters, keys, coder, samples, holdout, out, seed, device, dtype,
         trust_remote_code, command):
    import torch

    from importlib.metadata import version

    from kvzip import capture, data
    from kvzip.models import load_model, model_fingerprint
    from kvzip.sparse.dictionary import KVDictionary, make_meta
    from kvzip.sparse.train import heldout_coder, train_dictionaries

    torch.manual_seed(seed)
    clock, phases = time.perf_counter(), {}

    def lap(name):
        nonlocal clock
        now = time.perf_counter()
        phases[name] = round(now - clock, 1)
        clock = now

    if text:
        raw = data.read_text_files(text)  # UserError for missing or empty files, before the model loads
    with display.console.status(f"loading {model}"):
        lm, tokenizer, source = load_model(model, device, dtype, trust_remote_code)
    with display.progress() as bar:
        if text:
            documents = capture.text_documents(tokenizer, raw, tokens)
            calibration = "files: " + ", ".join(str(p) for p in text)
        else:
            task = bar.add_task("chat answers (tokens)", total=tokens // 2)
            documents, calibration = capture.calibration_documents(
                lm, tokenizer, tokens, progress=lambda done, total: bar.update(task, completed=done))
        lap("calibration_text_s")
        total = sum(len(d) for d in documents)
        heads = lm.config.num_key_value_heads
        if int(total * (1 - holdout)) * heads < atoms:
            raise UserError(f"{total} calibration tokens give {int(total * (1 - holdout)) * heads} training vectors "
                            f"per layer, fewer than --atoms {atoms}: give more text or fewer atoms")
        task = bar.add_task("capture KV (tokens)", total=total)
        captured = capture.capture_kv(lm, documents, keys=keys, holdout=holdout,
                                      progress=lambda done, n: bar.update(task, completed=done))
        train, held = captured.split()
        del captured
        lap("capture_s")
        task = bar.add_task("learning (layer x kind x iter)", total=len(train.keys) * 2 * iters)

        def learned(step, n, info):
            bar.update(task, completed=step,
                       description=f"learning L{info['layer']} {info['kind']} it {info['iteration']} "
                                   f"err {info['error']:.3f}")

        trained = train_dictionaries(train.keys, train.values, held.keys, held.values, heads, atoms, sparsity,
                                     iters, coder=coder, samples=samples, seed=seed, progress=learned)
        lap("learning_s")
    meta = make_meta(
        model_fingerprint(lm.config), s=sparsity, keys=keys, source=calibration, tokens=total,
        key_error=trained.key_error, value_error=trained.value_error,
        heldout_key_error_vs_raw="[" + ", ".join(f"{e:.5f}" for e in trained.key_error_vs_raw) + "]",
        heldout_tokens=held.tokens, training_tokens=train.tokens, coder=coder,
        heldout_coder=heldout_coder(coder), iters=iters, samples=samples,
        seed=seed, model=source.name, seconds=json.dumps(phases), command=command, kvzip_version=version("kvzip"),
        created=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        key_mean=("subtracted before coding; post-RoPE it is a per-query constant shift of the scores, "
                  "softmax drops it" if keys == "post-rope" else
                  "subtracted before coding; pre-RoPE it is NOT droppable: add it back before rotating"),
    )
    dictionary = KVDictionary(keys=trained.keys, values=trained.values, meta=meta, key_mean=trained.key_mean)
    dictionary.save(out, dtype=torch.float16)
    display.out.print(_error_table(trained, keys))
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    display.console.print(
        f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB): {len(trained.key_error)} layers x N={atoms}, s={sparsity}, "
        f"{total} tokens ({held.tokens} held out); mean held-out error keys {mean(trained.key_error):.3f} "
        f"(vs raw norm {mean(trained.key_error_vs_raw):.3f}), values {mean(trained.value_error):.3f}; "
        + ", ".join(f"{k[:-2].replace('_', ' ')} {v:.0f}s" for k, v in phases.items()))
