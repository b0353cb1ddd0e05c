"""The generation engine: one set of step primitives that every loop over the model runs through.

`Stream` owns a batch of rows in one cache: it left-pads the prompts (telling the cache each row's padding,
`cache.on_prefill`), calls the cache's step hook (`cache.on_step`) with the decoded text before every fed token, runs
each forward between the cache's `before_forward` and `after_forward` hooks (where all cache-wide work happens), and
tracks memory by tier after every forward. Generation (`generate`, below), teacher-forced evaluation
(`kvzip.evaluate`), forced decoding (`kvzip.bench.recall`) and chat prefill (`kvzip.conversation`) are short loops over it, so
every cache hook runs on every path. The engine knows nothing of the CLI or of any method's internals; callers
consume `Token`, `Step`, `Result` and `Summary` events.

    for event in generate(model, tokenizer, [ids], cache, Settings(max_new_tokens=64)):
        if isinstance(event, Token): print(event.text, end="")
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from kvzip.errors import UserError
from kvzip.methods.base import KVCache, kv_report


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
            raise UserError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise UserError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise UserError(f"top_k must be >= 0, got {self.top_k}")


@dataclass
class Token:
    """One sampled token of one row, with the text it adds (may be empty mid-character)."""

    row: int
    token_id: int
    text: str


@dataclass
class Step:
    """After every forward: tokens in context, the cache's memory by tier, and the logits (B, V) it produced."""

    step: int
    context_tokens: int
    memory: dict
    elapsed_s: float
    logits: torch.Tensor | None = None


@dataclass
class Result:
    """One finished row: its tokens, text and why it stopped; `stats` holds only this row's own figures."""

    row: int
    prompt_tokens: int
    token_ids: list[int]
    text: str
    finish_reason: str  # "eos", "stop", "length" or "interrupted"
    stats: dict = field(default_factory=dict)


@dataclass
class Summary:
    """After the last Result: the batch's figures (timing, KV bytes by tier and their ratios, method statistics)."""

    stats: dict


def encode(tokenizer, item: str | list[dict], raw: bool = False, system: str | None = None) -> list[int]:
    """Token ids for a prompt string or a list of chat messages, through the model's chat template unless raw."""
    if raw:
        if not isinstance(item, str):
            raise UserError("raw prompts are plain strings, not chat messages")
        return tokenizer(item, add_special_tokens=True)["input_ids"]
    messages = [{"role": "user", "content": item}] if isinstance(item, str) else list(item)
    if system is not None and not (messages and messages[0].get("role") == "system"):
        messages = [{"role": "system", "content": system}] + messages
    if tokenizer.chat_template is None:
        raise UserError("this model's tokenizer has no chat template: use the prompt as raw text")
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


class Detokenizer:
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


def sync(device: torch.device) -> None:
    """Wait for queued device work before reading a timer (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_context(model, prompt_len: int, max_new_tokens: int, past: int = 0) -> None:
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit and past + prompt_len + max_new_tokens > limit:
        raise UserError(
            f"prompt of {prompt_len} tokens{f' after {past} in context' if past else ''} plus {max_new_tokens} new "
            f"tokens exceeds the model's context of {limit} tokens: shorten the prompt or ask for fewer new tokens"
        )


class Stream:
    """A batch of rows in one cache, fed through the model one forward at a time: the engine's step primitives.

    `prefill(prompts)` left-pads and feeds whole prompts (when the cache already holds tokens, a single row is
    appended after them); `step(token_ids, texts)` tells the cache which token comes next and with what text
    (`cache.on_step`), then feeds that one token per row. Both return the next-token logits (B, V). `memory` is the
    cache's report after the last forward and `peak` the per-tier maximum over all of them.
    """

    def __init__(self, model, tokenizer, cache: KVCache):
        self.model, self.tokenizer, self.cache = model, tokenizer, cache
        self.device = model.device
        self.mask: torch.Tensor | None = None  # (B, past + fed) 1 for real tokens, 0 for left padding
        self.padded = False  # whether any row of the batch is left-padded (known on the host from the prompts)
        self.positions: torch.Tensor | None = None  # (B, 1) position of each row's last fed token
        self.detoks: list[Detokenizer] = []
        self.memory: dict = {}
        self.peak: dict[str, int] = {}

    @property
    def batch(self) -> int:
        return 0 if self.mask is None else self.mask.shape[0]

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # The cache's lifecycle: cache-wide work for the tokens about to be fed, the model's forward (each layer stores
        # its new tokens and attends, nothing more), then cache-wide work on what the forward wrote.
        self.cache.before_forward(self.mask, ids.shape[1])
        # A batch without left padding passes no mask: transformers would check on every forward that it is all ones,
        # a read back to the host (a sync on a GPU), and then drop it.
        out = self.model(input_ids=ids, attention_mask=self.mask if self.padded else None, position_ids=positions,
                         cache=self.cache, use_cache=True, logits_to_keep=1, **self.cache.model_kwargs())
        self.cache.after_forward()
        self.memory = self.cache.memory()
        for tier, n in self.memory.items():
            self.peak[tier] = max(self.peak.get(tier, 0), n)
        self.positions = positions[:, -1:]
        return out.logits[:, -1, :]

    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        """Feed whole prompts (token ids), left-padded into one batch; returns the logits (B, V) after them."""
        past = self.cache.get_seq_length()
        if past and len(prompts) != 1:
            raise ValueError("continuing a cache works with a single row")
        if any(not ids for ids in prompts):
            raise UserError("empty prompt")
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = next(iter(eos_ids(self.model, self.tokenizer)), 0)
        width, batch = max(len(p) for p in prompts), len(prompts)
        ids = torch.full((batch, width), pad, dtype=torch.long)
        mask = torch.zeros(batch, past + width, dtype=torch.long)
        mask[:, :past] = 1
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, past + width - len(p):] = 1
        self.mask = mask.to(self.device)
        self.padded = any(len(p) < width for p in prompts)
        positions = (self.mask.cumsum(-1) - 1).clamp(min=0)[:, past:]  # (B, width), padding at position 0
        if len(self.detoks) != batch:
            self.detoks = [Detokenizer(self.tokenizer) for _ in range(batch)]
        self.cache.on_prefill(self.mask)
        return self._forward(ids.to(self.device), positions)

    def step(self, token_ids: torch.Tensor, texts: list[str] | None = None) -> torch.Tensor:
        """Feed one token per row, token_ids (B,); `texts` the text each adds (decoded here when None)."""
        if texts is None:
            texts = [d.add(t) for d, t in zip(self.detoks, token_ids.tolist())]
        self.cache.on_step(token_ids, texts)
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.batch, 1)], dim=-1)
        return self._forward(token_ids.view(-1, 1).to(self.device), self.positions + 1)

    def report(self) -> dict:
        """KV bytes by tier (peak and last), full's bytes for the same tokens, their ratios, the method's stats."""
        return {**kv_report(self.peak, self.memory), "method_stats": self.cache.stats()}


@torch.inference_mode()
def generate(model, tokenizer, prompts: list[list[int]], cache: KVCache, settings: Settings) -> Iterator:
    """Prefill `prompts` (token ids, left-padded into one batch) into `cache`, then decode.

    Yields Token and Step events, then one Result per row and a Summary of the batch. When the cache already
    holds tokens (a chat turn), the batch must be a single row and the new tokens are appended after them.
    """
    past = cache.get_seq_length()
    for ids in prompts:  # an empty prompt is refused by Stream.prefill, before any forward
        check_context(model, len(ids), settings.max_new_tokens, past)
    generator = None
    if settings.seed is not None:
        generator = torch.Generator(device="cpu").manual_seed(settings.seed)
    stops = set() if settings.ignore_eos else eos_ids(model, tokenizer)
    stream = Stream(model, tokenizer, cache)
    batch = len(prompts)

    # 1. Prefill: time to first token.
    sync(stream.device)
    t0 = time.perf_counter()
    logits = stream.prefill(prompts)
    next_ids = sample(logits, settings, generator)
    sync(stream.device)
    ttft = time.perf_counter() - t0
    yield Step(0, cache.get_seq_length(), stream.memory, ttft, logits)

    # 2. Decode until every row has finished: emit each row's token, then feed the batch's tokens as one step.
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
                deltas[row] = stream.detoks[row].add(tok)
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
            step += 1
            logits = stream.step(next_ids, deltas)
            next_ids = sample(logits, settings, generator)
            yield Step(step, cache.get_seq_length(), stream.memory, time.perf_counter() - t0, logits)
    except KeyboardInterrupt:
        finish = [f or "interrupted" for f in finish]
    sync(stream.device)
    decode_s = time.perf_counter() - t_decode

    # 3. One Result per row (its own figures only), then the batch's Summary.
    for row in range(batch):
        yield Result(row, len(prompts[row]), out_ids[row], texts[row], finish[row] or "length",
                     {"prompt_tokens": len(prompts[row]), "new_tokens": len(out_ids[row])})
    new_tokens = sum(len(o) for o in out_ids)
    prompt_tokens = sum(len(p) for p in prompts)
    stats = {
        "rows": batch,
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "ttft_s": round(ttft, 4),
        "prefill_tokens_per_s": round(prompt_tokens / ttft, 2),
        "decode_s": round(decode_s, 4),
        # the first new token of each row comes from the prefill; every later one from a decode step
        "decode_tokens_per_s": round(max(new_tokens - batch, 0) / decode_s, 2) if decode_s > 0 else 0.0,
        **stream.report(),
    }
    if stream.device.type == "cuda":
        stats["cuda_max_memory_allocated"] = torch.cuda.max_memory_allocated(stream.device)
    yield Summary(stats)


def uninterrupted(events: Iterator) -> Iterator:
    """`generate`'s events, except that a Ctrl-C (or SIGTERM) that `generate` caught mid-batch is raised again at the
    first row it cut short. `generate` finishes such rows as "interrupted" so that `kvzip generate` and chat keep
    their text; a caller that measures or learns from whole answers (the bench, calibration) must stop instead."""
    for event in events:
        if isinstance(event, Result) and event.finish_reason == "interrupted":
            raise KeyboardInterrupt
        yield event
