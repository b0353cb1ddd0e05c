"""The checks of a `kvzip generate` job, run before any model loads (on every rank, agreed on), and what they yield:
the prompts, the method, the device, the decoding settings and the job's record (its settings and commit), which a
resumed run must match.

Errors a user can cause here, each one line with exit code 2: the flags of one prompt or a file; an output that is
a folder, in a missing or read-only folder, standard output (`-`: ranks publish files), or the input file itself;
`--resume` without `--output`, or against an output made with other settings or at another commit; several ranks
with no `--output`; a device map that is malformed, names a missing GPU, or is combined with several ranks. An output
folder that the ranks do not share (node-local storage on several nodes) is found once rank 0 has created the pieces
folder: every rank must read back what rank 0 wrote there (`kvzip.runs.Parts.check_visible`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from kvzip.cli.flags import (check_device, check_fraction, check_sampling, dict_file, flagged, output_path,
                               parse_opts)
from kvzip.errors import UserError


def read_jsonl_prompts(path: Path) -> list:
    """Each line: {"prompt": "..."} or {"messages": [...]}; UserError naming the bad line otherwise."""
    if not path.is_file():
        raise UserError(f"input file not found: {path}")
    items = []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path} is not UTF-8 text (byte {exc.start}): --input takes a JSONL file of prompts") from None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
        if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            if not obj["prompt"].strip():
                raise UserError(f"{path}:{n}: the prompt is empty")
            items.append(obj["prompt"])
        elif isinstance(obj, dict) and isinstance(obj.get("messages"), list):
            if not obj["messages"]:
                raise UserError(f"{path}:{n}: the messages list is empty")
            items.append(obj["messages"])
        else:
            raise UserError(f'{path}:{n}: each line needs "prompt" (a string) or "messages" (a list)')
    if not items:
        raise UserError(f"{path} holds no prompts")
    return items


@dataclass(frozen=True)
class JobSpec:
    """The flags of `kvzip generate` that shape a job, as typed."""

    prompt: str | None
    input: Path | None
    output: Path | None
    resume: bool
    model: str
    method: str
    budget: str | None
    opt: list[str] | None
    dict_path: Path | None
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool
    raw: bool
    system: str | None
    batch_size: int
    json_out: bool
    device: str
    device_map: str | None
    dtype: str
    trust_remote_code: bool


@dataclass
class Job:
    """A checked job: what to generate, with what, where; `settings_record` is what a resume must match."""

    spec: JobSpec
    items: list
    output: Path | None
    method: object
    device: object  # torch.device: this rank's own
    placement: str | dict | None
    dict_path: Path | None
    settings: object  # kvzip.engine.Settings
    settings_record: dict
    commit: str | None
    budget: float | None = None  # --budget: the method is planned for it once the model's shape is known

    def record(self) -> dict:
        return {"settings": self.settings_record, "commit": self.commit}

    def check_plain_prompts(self) -> None:
        if any(not isinstance(item, str) for item in self.items):
            raise UserError("this model's tokenizer has no chat template, so it cannot take chat messages: "
                            "give plain prompts")

    def encode(self, model, tokenizer, raw: bool) -> list[list[int]]:
        """Every prompt's token ids, each checked against the model's context."""
        from kvzip import engine

        encoded = [engine.encode(tokenizer, item, raw, self.spec.system) for item in self.items]
        for ids in encoded:
            engine.check_context(model, len(ids), self.spec.max_new_tokens)
        return encoded


def _same_file(a: Path, b: Path) -> bool:
    return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))


def check_job(spec: JobSpec, world) -> Job:
    """Every check the flags and files allow, before the model loads: a Job, or UserError in the flags' words."""
    # 1. What the flags alone tell, before torch is imported.
    if (spec.prompt is None) == (spec.input is None):
        raise UserError("give either a prompt or --input FILE.jsonl")
    if spec.prompt is not None and not spec.prompt.strip():
        raise UserError("the prompt is empty: give the text to answer")
    if spec.batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {spec.batch_size}")
    check_sampling(spec.max_new_tokens, spec.temperature, spec.top_p, spec.top_k)
    if spec.output is not None and str(spec.output) == "-":
        raise UserError("--output -: results are published as files (each rank's batches, then the merged file), "
                        "not on standard output; give a file path, or drop --output and use --json to print the lines")
    output = output_path(spec.output, "--output")
    if spec.resume and output is None:
        raise UserError("--resume continues the job that writes --output: give that --output")
    if world.size > 1 and output is None:
        raise UserError(f"{world.size} ranks write one merged file: give --output FILE, a path every rank can reach")
    if output is not None and spec.input is not None and _same_file(output, spec.input):
        raise UserError(f"--output {spec.output} is the --input file: the results would replace the prompts; "
                        "give another path")
    placement = None
    if spec.device_map is not None:
        from kvzip.placement import parse_device_map

        placement = flagged("--device-map", parse_device_map, spec.device_map)
        if world.size > 1:
            raise UserError("--device-map spreads one model over this node's GPUs: run it in one process, not under "
                            f"torchrun with {world.size} ranks")
        if spec.device != "auto":
            raise UserError(f"--device-map places the model itself: leave --device at auto, got {spec.device}")
    dict_path = dict_file(spec.dict_path)
    items = [spec.prompt] if spec.prompt is not None else read_jsonl_prompts(spec.input)
    if spec.raw and any(not isinstance(item, str) for item in items):
        raise UserError("--raw takes plain prompts, not chat messages")

    # 2. The method and its options, the device this rank computes on, the decoding settings.
    from kvzip import engine
    from kvzip.methods import get_method
    from kvzip.models import resolve_device, resolve_dtype
    from kvzip.runs import commit, file_digest

    method = get_method(spec.method, parse_opts(spec.opt))
    budget = check_fraction(spec.budget) if spec.budget is not None else None
    if budget is not None:
        from kvzip.budget import check_options

        check_options(spec.method, budget, parse_opts(spec.opt))
    if dict_path is not None and not method.needs_dictionary and budget is None:
        raise UserError(f"--dict is for methods that use a dictionary; '{method.name}' with these options uses none")
    check_device(spec.device, spec.dtype)
    device = flagged("--device", world.device, resolve_device(spec.device))
    if placement is not None:
        import torch

        from kvzip.placement import check_device_map

        flagged("--device-map", check_device_map, placement, torch.cuda.device_count())
    settings = engine.Settings(spec.max_new_tokens, spec.temperature, spec.top_p, spec.top_k, spec.seed, spec.stop,
                               spec.ignore_eos)
    source = file_digest(spec.input) if spec.input is not None else hashlib.sha256(spec.prompt.encode()).hexdigest()
    record = {"model": spec.model, "device_map": spec.device_map, "method": method.name, "budget": budget,
              "options": method.describe()["options"], "dict": file_digest(dict_path) if dict_path else None,
              "input": source, "rows": len(items), "batch_size": spec.batch_size, "raw": spec.raw,
              "system": spec.system, **asdict(settings), "device": device.type,
              "dtype": str(resolve_dtype(spec.dtype, device)).replace("torch.", "")}
    record = json.loads(json.dumps(record))  # as the files keep it (tuples as lists)
    return Job(spec, items, output, method, device, placement, dict_path, settings, record, commit(), budget)


def finished_run(output: Path) -> dict | None:
    """The job record a finished output carries: its summary line's \"run\"."""
    lines = output.read_text().splitlines()
    return json.loads(lines[-1])["summary"]["run"] if lines else None
