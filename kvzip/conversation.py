"""A multi-turn chat kept in one compressed cache: only each new turn is prefilled, never the whole history.

`ChatSession` owns the conversation (messages), the cache, and the exact token ids that are in the cache. A turn is
built by rendering the chat template over the whole conversation and taking the text after what is already cached,
so the cached sequence is what a full re-templating would produce (templates that add a default system prompt to
any conversation, as SmolLM2's does, would otherwise repeat it on every turn). Two details keep the cache and the
history in step:

- the engine never feeds the last sampled token (`<|im_end|>` for ChatML models, or the token that used up
  `max_new_tokens`); the next turn's new ids start with whatever of the answer is not in the cache yet, then the
  template text that closes the answer and opens the next user turn;
- a stop request (Ctrl-C) is acted on only at a `Step` event, after a forward has finished, so every answer token
  kept in the history is in the cache. The partial answer stays in the history, marked "interrupted".

When the template would rewrite earlier turns (the rendered text no longer starts with the cached text), when the
method changes, or when old turns are evicted to make room, the session rebuilds: a fresh cache, the history
prefilled in chunks with a progress callback. Library code: no printing, and errors in the session's own terms
(`on_full`, `max_new_tokens`); the CLI (kvzip/cli/chat.py) draws, and words a `ContextFull` with its flags.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import torch

from kvzip import engine
from kvzip.errors import UserError
from kvzip.methods.base import Method, kv_report

PREFILL_CHUNK = 256  # tokens per forward when the history is re-prefilled (the progress bar advances per chunk)
ON_FULL = ("stop", "evict")
NO_LIMIT = 1 << 30  # the context of a model whose config states none: no limit a chat can reach
# Why a turn did not fit (ContextFull.reason): no room after the cached history (on_full="stop"), the message and a
# whole answer exceed the context on their own, or they still do with every earlier exchange evicted.
NO_ROOM, TOO_LONG, EVICTED_ALL = "no_room", "too_long", "evicted_all"


class ContextFull(Exception):
    """The next turn does not fit in the model's context; the session is unchanged.

    `reason` is NO_ROOM, TOO_LONG or EVICTED_ALL, with the token counts behind it, so that a front end can give the
    advice in its own words (`words`); str() gives it in the session's terms."""

    def __init__(self, reason: str, limit: int, message_tokens: int = 0, context_tokens: int = 0):
        self.reason, self.limit = reason, limit
        self.message_tokens, self.context_tokens = message_tokens, context_tokens
        super().__init__(self.words(reset="reset the session (or open it with on_full='evict')",
                                    budget="max_new_tokens"))

    def words(self, reset: str, budget: str) -> str:
        """The one-line message, with `reset` saying how to start over and `budget` naming the answer's token limit."""
        if self.reason == NO_ROOM:
            return (f"context full: {self.context_tokens} tokens in context + {self.message_tokens} for this message "
                    f"leave no room in the model's {self.limit}; {reset}")
        if self.reason == TOO_LONG:
            return (f"this message alone ({self.message_tokens} tokens + {budget}) exceeds the model's context of "
                    f"{self.limit} tokens: shorten it or lower {budget}")
        return (f"this message does not fit in the model's context of {self.limit} tokens even with every earlier "
                f"turn evicted: shorten it or lower {budget}")


def has_chat_template(tokenizer) -> bool:
    """Whether the tokenizer can render a conversation (a base model's has no template: it continues raw text)."""
    return getattr(tokenizer, "chat_template", None) is not None


@dataclass
class Turn:
    """One exchange: what the user said, what the model answered (possibly cut short), and the engine's stats."""

    user: str
    assistant: str
    finish_reason: str
    stats: dict = field(default_factory=dict)
    notice: str = ""


@dataclass
class Rebuilt:
    """Yielded before a turn's generation when the history had to be re-prefilled; says why."""

    reason: str


class Throughput:
    """Decode tokens per second: over the last `window_s` seconds, and averaged over every turn so far."""

    def __init__(self, window_s: float = 2.0):
        self.window_s = window_s
        self.recent: deque = deque()  # (elapsed_s,) of decode steps in the current turn
        self.tokens, self.seconds = 0, 0.0
        self._last = None

    def step(self, event: engine.Step) -> None:
        if event.step == 0:  # the prefill forward: decode timing starts after it
            self.recent.clear()
            self._last = event.elapsed_s
            return
        self.tokens += 1
        self.seconds += event.elapsed_s - self._last
        self._last = event.elapsed_s
        self.recent.append(event.elapsed_s)
        while self.recent and self.recent[-1] - self.recent[0] > self.window_s:
            self.recent.popleft()

    def rates(self) -> tuple[float, float]:
        """(recent, average) tokens per second; 0 until there is something to measure."""
        span = self.recent[-1] - self.recent[0] if len(self.recent) > 1 else 0.0
        recent = (len(self.recent) - 1) / span if span > 0 else 0.0
        return recent, (self.tokens / self.seconds if self.seconds > 0 else 0.0)


class ChatSession:
    """The conversation, its cache and the token ids in that cache. `turn()` runs one exchange as events."""

    def __init__(self, model, tokenizer, method: Method, dictionaries=None, settings: engine.Settings | None = None,
                 system: str | None = None, on_full: str = "stop"):
        if on_full not in ON_FULL:
            raise UserError(f"on_full must be one of {', '.join(ON_FULL)}, got {on_full!r}")
        if not has_chat_template(tokenizer):
            raise UserError("this model's tokenizer has no chat template, so it cannot chat: give it raw text to "
                            "continue instead")
        self.model, self.tokenizer = model, tokenizer
        self.method, self.dictionaries = method, dictionaries
        self.settings = settings or engine.Settings()
        self.system, self.on_full = system, on_full
        self.limit = getattr(model.config, "max_position_embeddings", None) or NO_LIMIT
        self.meter = Throughput()
        self.reset()

    # -- state ---------------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the conversation and start a fresh cache of the current method."""
        self.messages: list[dict] = [{"role": "system", "content": self.system}] if self.system is not None else []
        self.turns: list[Turn] = []
        self.cache = self.method.make_cache(self.model, self.dictionaries)
        self.ids: list[int] = []  # token ids in the cache, in order
        self.pending: list[int] = []  # answer tokens sampled but not fed yet (they open the next turn's ids)
        self.rendered = ""  # template text that ids + pending stand for

    def context_tokens(self) -> int:
        return self.cache.get_seq_length()

    def snapshot(self, memory: dict | None = None) -> dict:
        """Numbers for the live panel and /stats: context, KV bytes by tier against fp16 full, speed, method stats."""
        mem = memory if memory is not None else self.cache.memory()
        recent, average = self.meter.rates()
        return {
            **self.method.describe(),
            "context_tokens": self.context_tokens(),
            "context_limit": self.limit,
            "turns": len(self.turns),
            **kv_report(mem, mem),
            "decode_tokens_per_s_recent": round(recent, 2),
            "decode_tokens_per_s_average": round(average, 2),
            "method_stats": self.cache.stats(),
        }

    def transcript(self) -> dict:
        """Everything /save writes: settings, the conversation turn by turn with stats, and the current numbers."""
        return {
            **self.method.describe(),
            "system": self.system,
            "settings": {k: getattr(self.settings, k) for k in ("max_new_tokens", "temperature", "top_p", "top_k", "seed")},
            "on_full": self.on_full,
            "messages": self.messages,
            "turns": [vars(t) for t in self.turns],
            "stats": self.snapshot(),
        }

    # -- building the next turn's ids ------------------------------------------------------------------------------
    def _render(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def _tokens(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _fits(self, past: int, new: int) -> bool:
        return past + new + self.settings.max_new_tokens <= self.limit

    def _plan(self, user: str) -> tuple[list[int], str, str]:
        """(ids to feed, full rendered text, why a rebuild is needed or ""). May evict old turns (on_full="evict")."""
        full = self._render(self.messages + [{"role": "user", "content": user}])
        if self.ids and full.startswith(self.rendered):
            new = self.pending + self._tokens(full[len(self.rendered):])
            if self._fits(len(self.ids), len(new)):
                return new, full, ""
            if self.on_full == "stop":
                room = self.limit - len(self.ids) - len(new)
                if room >= 1:
                    return new, full, ""  # the answer is shortened to the room left; turn() says so
                raise ContextFull(NO_ROOM, self.limit, len(new), len(self.ids))
        elif not self.ids:
            new = self._tokens(full)
            if self._fits(0, len(new)):
                return new, full, ""
            raise ContextFull(TOO_LONG, self.limit, len(new))
        else:
            return self._tokens(full), full, "the chat template rewrites earlier turns"
        # on_full="evict": drop the oldest exchanges until the history, this message and a full answer fit.
        # Worked on a copy: when nothing fits, the session is left as it was (ContextFull's promise).
        kept, dropped = list(self.messages), 0
        while True:
            first = next((i for i, m in enumerate(kept) if m["role"] != "system"), None)
            if first is None or len(kept) - first < 2:
                raise ContextFull(EVICTED_ALL, self.limit)
            del kept[first : first + 2]
            dropped += 1
            full = self._render(kept + [{"role": "user", "content": user}])
            new = self._tokens(full)
            if self._fits(0, len(new)):
                self.messages = kept
                return new, full, f"context full: evicted the oldest {dropped} exchange(s) ({self.limit} token limit)"

    # -- running ---------------------------------------------------------------------------------------------------
    def _prefill(self, ids: list[int], progress: Callable[[int, int], None] | None) -> None:
        """Feed `ids` into the cache in chunks of PREFILL_CHUNK through the engine's Stream (logits discarded)."""
        stream = engine.Stream(self.model, self.tokenizer, self.cache)
        with torch.inference_mode():
            for start in range(0, len(ids), PREFILL_CHUNK):
                chunk = ids[start : start + PREFILL_CHUNK]
                stream.prefill([chunk])
                self.ids.extend(chunk)
                if progress is not None:
                    progress(len(self.ids), len(ids))

    def turn(self, user: str, should_stop: Callable[[], bool] = lambda: False,
             progress: Callable[[int, int], None] | None = None) -> Iterator:
        """Run one exchange. Yields Rebuilt (if the history was re-prefilled), engine Token and Step events, then
        the finished Turn. Raises ContextFull (session unchanged) when the message cannot fit."""
        if not user.strip():
            raise UserError("empty message")
        new, full, rebuild = self._plan(user)
        if rebuild:
            yield Rebuilt(rebuild)
            self.cache = self.method.make_cache(self.model, self.dictionaries)
            self.ids, self.pending = [], []
            self._prefill(new[:-1], progress)  # the last token goes through generate() with the turn itself
            new = new[-1:]
        past = len(self.ids)
        room = self.limit - past - len(new)
        settings = replace(self.settings, max_new_tokens=min(self.settings.max_new_tokens, room))
        notice = rebuild
        if settings.max_new_tokens < self.settings.max_new_tokens:
            notice = f"context nearly full: this answer is limited to {room} tokens ({self.limit} token limit)"
        result = summary = None
        events = engine.generate(self.model, self.tokenizer, [new], self.cache, settings)
        event = next(events)
        while True:
            if isinstance(event, engine.Result):
                result = event
            elif isinstance(event, engine.Summary):
                summary = event
                break
            elif isinstance(event, engine.Step):
                self.meter.step(event)
                yield event
            else:
                yield event
            if isinstance(event, engine.Step) and should_stop():
                event = events.throw(KeyboardInterrupt)  # at a Step every kept answer token is in the cache
            else:
                event = next(events)
        events.close()
        fed = self.cache.get_seq_length() - past - len(new)
        assert 0 <= fed <= len(result.token_ids), (fed, len(result.token_ids))
        self.ids.extend(new + result.token_ids[:fed])
        self.pending = result.token_ids[fed:]
        answer = self.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        self.messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        self.rendered = full + answer
        stats = {**summary.stats, **result.stats, "context_tokens": len(self.ids)}
        turn = Turn(user, answer, result.finish_reason, stats, notice)
        self.turns.append(turn)
        yield turn

    def switch(self, method: Method, dictionaries=None, progress: Callable[[int, int], None] | None = None) -> None:
        """Move the conversation to another method: a fresh cache with the same token ids prefilled into it."""
        before = (self.method, self.dictionaries, self.cache, self.ids)
        self.method, self.dictionaries = method, dictionaries
        self.cache = method.make_cache(self.model, dictionaries)
        self.ids = []
        try:
            self._prefill(before[3], progress)
        except BaseException:  # interrupted or failed: keep the old method and its cache, which still match
            self.method, self.dictionaries, self.cache, self.ids = before
            raise
