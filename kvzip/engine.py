"""The generation engine: prefill, then decode one token at a time, as a generator of events.

It works with any kvzip cache the same way (no method-specific branches): the cache rides along in the model's
forward call (`cache.model_kwargs()`), hears about every sampled token (`cache.on_step`), and reports its memory by
tier after every forward. The engine knows nothing of the CLI: callers consume `Token`, `Step` and `Result` events.

    for event in generate(model, tokenizer, [ids], cache, Settings(max_new_tokens=64)):
        if isinstance(event, Token): print(event.text, end="")
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from kvzip.errors import UserError
from kvzip.methods.base import KVCache


@dataclass
class Settings:
    """Decoding settings. temperature 0 means greedy."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise UserError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise UserError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise UserError(f"--top-k must be >= 0, got {self.top_k}")


@dataclass
class Token:
    """One sampled token of one row, with the text it adds (may be empty mid-character)."""

    row: int
    token_id: int
    text: str


@dataclass
class Step:
    """After every forward: tokens in context and the cache's memory by tier."""

    step: int
    context_tokens: int
    memory: dict
    elapsed_s: float


@dataclass
class Result:
    row: int
    prompt_tokens: int
    token_ids: list[int]
    text: str
    finish_reason: str  # "eos", "stop", "length" or "interrupted"
    stats: dict = field(default_factory=dict)


def encode(tokenizer, item: str | list[dict], raw: bool = False, system: str | None = None) -> list[int]:
    """Token ids for a prompt string or a list of chat messages, through the model's chat template unless raw."""
    if raw:
        if not isinstance(item, str):
            raise UserError("--raw takes plain prompts, not chat messages")
        return tokenizer(item, add_special_tokens=True)["input_ids"]
    messages = [{"role": "user", "content": item}] if isinstance(item, str) else list(item)
    if system is not None and not (messages and messages[0].get("role") == "system"):
        messages = [{"role": "system", "content": system}] + messages
    if tokenizer.chat_template is None:
        raise UserError("this model's tokenizer has no chat template: pass --raw to use the prompt as it is")
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(out["input_ids"])


def eos_ids(model, tokenizer) -> set[int]:
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def sample(logits: torch.Tensor, s: Settings, generator: torch.Generator | None) -> torch.Tensor:
    """logits (B, V) -> token ids (B,). Greedy at temperature 0, else temperature, top-k, top-p."""
    if s.temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / s.temperature
    if s.top_k > 0:
        kth = torch.topk(logits, min(s.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > s.top_p  # keep the smallest prefix whose mass reaches top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    if generator is not None:  # a seeded CPU generator makes sampling reproducible on any device
        return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)
    return torch.multinomial(probs, 1).squeeze(-1)


class _Detok:
    """Incremental detokenizer: emits text only once a token sequence decodes to whole characters."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.prefix, self.read = tokenizer, [], 0, 0

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        dec = lambda a, b: self.tokenizer.decode(self.ids[a:b], skip_special_tokens=True)  # noqa: E731
        before = dec(self.prefix, self.read)
        after = dec(self.prefix, len(self.ids))
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_context(model, prompt_len: int, max_new_tokens: int, past: int = 0) -> None:
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit and past + prompt_len + max_new_tokens > limit:
        raise UserError(
            f"prompt of {prompt_len} tokens{f' after {past} in context' if past else ''} plus --max-new-tokens "
            f"{max_new_tokens} exceeds the model's context of {limit} tokens: shorten the prompt or lower --max-new-tokens"
        )


@torch.inference_mode()
def generate(model, tokenizer, prompts: list[list[int]], cache: KVCache, settings: Settings) -> Iterator:
    """Prefill `prompts` (token ids, left-padded into one batch) into `cache`, then decode.

    Yields Token and Step events, then one Result per row. When the cache already holds tokens (a chat turn),
    the batch must be a single row and the new tokens are appended after them.
    """
    device = model.device
    past = cache.get_seq_length()
    if past and len(prompts) != 1:
        raise ValueError("continuing a cache works with a single row")
    for ids in prompts:
        if not ids:
            raise UserError("empty prompt")
        check_context(model, len(ids), settings.max_new_tokens, past)
    generator = None
    if settings.seed is not None:
        generator = torch.Generator(device="cpu").manual_seed(settings.seed)
    stops = set() if settings.ignore_eos else eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos_ids(model, tokenizer)))

    # 1. Left-pad the batch: (B, T) ids, a 2D mask over past + new tokens, positions that skip the padding.
    width = max(len(p) for p in prompts)
    batch = len(prompts)
    input_ids = torch.full((batch, width), pad, dtype=torch.long)
    mask = torch.zeros(batch, past + width, dtype=torch.long)
    mask[:, :past] = 1
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids):] = torch.tensor(ids)
        mask[row, past + width - len(ids):] = 1
    input_ids, mask = input_ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, past:]

    peak: dict[str, int] = {}

    def forward(ids, attn_mask, pos):
        out = model(input_ids=ids, attention_mask=attn_mask, position_ids=pos, cache=cache, use_cache=True,
                    logits_to_keep=1, **cache.model_kwargs())
        mem = cache.memory()
        for k, v in mem.items():
            peak[k] = max(peak.get(k, 0), v)
        return out.logits[:, -1, :], mem

    # 2. Prefill.
    _sync(device)
    t0 = time.perf_counter()
    logits, mem = forward(input_ids, mask, positions)
    next_ids = sample(logits, settings, generator)
    _sync(device)
    ttft = time.perf_counter() - t0
    yield Step(0, cache.get_seq_length(), mem, ttft)

    # 3. Decode until every row has finished.
    detoks = [_Detok(tokenizer) for _ in prompts]
    texts = [""] * batch
    out_ids: list[list[int]] = [[] for _ in prompts]
    finish: list[str | None] = [None] * batch
    step = 0
    t_decode = time.perf_counter()
    try:
        while True:
            deltas = [""] * batch
            for row in range(batch):
                if finish[row] is not None:
                    continue
                tok = int(next_ids[row])
                if tok in stops:
                    finish[row] = "eos"
                    continue
                out_ids[row].append(tok)
                deltas[row] = detoks[row].add(tok)
                texts[row] += deltas[row]
                hit = next((s for s in settings.stop if s in texts[row]), None)
                if hit is not None:
                    texts[row] = texts[row][: texts[row].index(hit)]
                    finish[row] = "stop"
                    continue
                if deltas[row]:
                    yield Token(row, tok, deltas[row])
                if len(out_ids[row]) >= settings.max_new_tokens:
                    finish[row] = "length"
            if all(f is not None for f in finish):
                break
            cache.on_step(next_ids, deltas)
            step += 1
            mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=-1)
            positions = positions[:, -1:] + 1
            logits, mem = forward(next_ids.view(batch, 1), mask, positions)
            next_ids = sample(logits, settings, generator)
            yield Step(step, cache.get_seq_length(), mem, time.perf_counter() - t0)
    except KeyboardInterrupt:
        finish = [f or "interrupted" for f in finish]
    _sync(device)
    decode_s = time.perf_counter() - t_decode
    new_tokens = sum(len(o) for o in out_ids)
    final = cache.memory()
    stats = {
        "prompt_tokens": sum(len(p) for p in prompts),
        "new_tokens": new_tokens,
        "ttft_s": round(ttft, 4),
        "prefill_tokens_per_s": round(sum(len(p) for p in prompts) / ttft, 2),
        "decode_s": round(decode_s, 4),
        "decode_tokens_per_s": round(max(new_tokens - batch, 0) / decode_s, 2) if decode_s > 0 else 0.0,
        "kv_bytes": peak.get("total", 0),
        "kv_bytes_device": peak.get("on_device", 0),
        "kv_bytes_host": peak.get("host", 0),
        "kv_bytes_final": final["total"],
        "kv_bytes_by_tier": {k: final[k] for k in ("device", "codes", "dictionary", "host")},
        "kv_bytes_full": final["full_same_dtype"],
        "kv_bytes_fp16_full": final["fp16_full"],
        "kv_ratio_vs_fp16_full": round(final["total"] / final["fp16_full"], 4) if final["fp16_full"] else 0.0,
        "method_stats": cache.stats(),
    }
    if device.type == "cuda":
        stats["cuda_max_memory_allocated"] = torch.cuda.max_memory_allocated(device)
    for row in range(batch):
        yield Result(row, len(prompts[row]), out_ids[row], texts[row], finish[row] or "length", dict(stats))
