"""Capture the key and value vectors a model writes for some text, and build the default calibration text.

Dictionary learning (`kvzip train-dict`) needs the KV vectors a model really produces. `capture_kv` feeds token
documents through the model (each document with a fresh kvzip `full` cache, forward in chunks of at most 1024 tokens
so that attention inside a chunk stays cheap) and collects, per layer, keys and values with the KV heads flattened
into rows: row r of a layer's (M, d) tensor is token r // Hkv, head r % Hkv.

Keys come in two flavours. `post-rope`: read back from the cache after each chunk, i.e. exactly what a cache stores
and what attention multiplies the query with. `pre-rope`: the same keys with each layer's own RoPE turned back
(kvzip.rope: its base, the channels it turns, its scale), i.e. the key as the projection (and the model's key norm,
where it has one) wrote it, exactly what fadkv codes when it undoes RoPE on a cached key. Turning back, rather than
hooking `k_proj`, gives that whatever the family: fused qkv projections (Phi-3), key norms after the projection
(Qwen3, Gemma 3), partial rotary. Values are the same either way (read from the cache). The capture cache keeps
every token of every layer, sliding-window layers included (the model's mask still limits what they see).

The last `holdout` fraction of every document's tokens is marked held out, so the error report of `train-dict`
is measured on text the dictionary never saw, spread over every source and position range.

`calibration_documents` builds the default calibration text: the model's own greedy chat answers to GSM8K
calibration prompts (kvzip.data's calibration split, never the evaluation split) for about half of the token
budget, and plain English (kvzip.data.calibration_prose) for the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kvzip.sparse import KEY_MODES

Progress = Callable[[int, int], None]


@dataclass
class Captured:
    """Per-layer keys and values (M, d) with M = tokens * heads, rows token-major; `heldout` (tokens,) bool."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    heads: int
    tokens: int
    heldout: torch.Tensor
    key_mode: str

    def split(self) -> tuple["Captured", "Captured"]:
        """(training part, held-out part), by the per-token held-out mark."""
        rows = self.heldout.repeat_interleave(self.heads)                 # (M,)
        parts = []
        for keep in (~rows, rows):
            n = int(keep.sum()) // self.heads
            parts.append(Captured([k[keep] for k in self.keys], [v[keep] for v in self.values], self.heads, n,
                                  torch.zeros(n, dtype=torch.bool), self.key_mode))
        return parts[0], parts[1]


@torch.inference_mode()
def capture_kv(model, documents: list[list[int]], keys: str = "post-rope", chunk: int = 1024,
               holdout: float = 0.0, store_dtype: torch.dtype = torch.float16,
               progress: Progress | None = None) -> Captured:
    """Feed each document (token ids) through `model` and collect its K/V vectors per layer.

    keys: "post-rope" (from the cache) or "pre-rope" (the cached keys with each layer's RoPE turned back). holdout: fraction of each document's last
    tokens marked held out. Vectors are stored in `store_dtype` (fp16 halves the memory of a 20k-token capture to
    ~0.5 GB for SmolLM2; its rounding, ~5e-4 relative, is far below any coding error). progress(tokens_done, total).
    """
    from kvzip.methods.base import KVCache, model_layout
    from kvzip.methods.full import FullLayer
    from kvzip.rope import layer_ropes, unrotate

    if keys not in KEY_MODES:
        raise ValueError(f"keys must be one of {', '.join(KEY_MODES)}, got {keys!r}")
    if not 0.0 <= holdout < 1.0:
        raise ValueError(f"holdout must be in [0, 1), got {holdout}")
    documents = [d for d in documents if d]
    assert documents, "no tokens to capture"
    n_layers, n_kv, head_dim = model_layout(model)
    total = sum(len(d) for d in documents)
    k_out: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]
    v_out: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]
    held: list[torch.Tensor] = []
    ropes = layer_ropes(model, "pre-RoPE keys") if keys == "pre-rope" else None
    done = 0
    for doc in documents:
        ids = torch.tensor(doc, dtype=torch.long, device=model.device)
        cache = KVCache([FullLayer() for _ in range(n_layers)], None)  # every token, even on sliding layers
        for a in range(0, len(doc), chunk):
            b = min(a + chunk, len(doc))
            model(input_ids=ids[None, a:b], cache=cache, use_cache=True, logits_to_keep=1,
                  **cache.model_kwargs())
            t = b - a
            for i in range(n_layers):
                layer = cache.layers[i]
                k = layer.keys[0, :, -t:]                                     # (Hkv, t, d)
                if ropes is not None:
                    k = unrotate(k.float(), torch.arange(a, b, device=k.device), ropes[i])
                k_out[i].append(k.transpose(0, 1).to("cpu", store_dtype))   # (t, Hkv, d)
                v_out[i].append(layer.values[0, :, -t:].transpose(0, 1).to("cpu", store_dtype))  # (t, Hkv, d)
            done += t
            if progress is not None:
                progress(done, total)
        mark = torch.zeros(len(doc), dtype=torch.bool)                    # (t_doc,)
        n_held = int(round(holdout * len(doc)))
        if n_held:
            mark[-n_held:] = True
        held.append(mark)
    flat = lambda parts: torch.cat(parts).reshape(-1, head_dim)          # noqa: E731  (T, Hkv, d) -> (T * Hkv, d)
    return Captured([flat(k) for k in k_out], [flat(v) for v in v_out], n_kv, total, torch.cat(held), keys)


def text_documents(tokenizer, text: str, max_tokens: int, doc_tokens: int = 2048) -> list[list[int]]:
    """Tokenize text, keep the first max_tokens tokens, cut into documents of at most doc_tokens tokens."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]
    return [ids[a:a + doc_tokens] for a in range(0, len(ids), doc_tokens)]


def chat_documents(model, tokenizer, max_tokens: int, batch_size: int = 32, max_new_tokens: int = 200,
                   progress: Progress | None = None) -> list[list[int]]:
    """The model's own greedy chat answers to GSM8K calibration prompts, as prompt + answer token documents.

    Prompts are taken in order from kvzip.data.gsm8k("calibration") and answered at most `batch_size` at a time
    (left padded, kvzip's engine, `full` cache; on CPU a decode step of 32 rows costs little more than one of 8:
    measured 23 vs 11 answer tokens/s on the loaded 2-core machine) until the documents hold at least max_tokens tokens (the last batch may
    overshoot; documents are then cut to the budget). progress(tokens_done, max_tokens).
    """
    from kvzip import data, engine
    from kvzip.methods import get_method

    problems = data.gsm8k("calibration")
    settings = engine.Settings(max_new_tokens=max_new_tokens)
    # A batch runs until its longest answer ends, so spread the ~max_tokens / 300 documents evenly over batches.
    docs_needed = -(-max_tokens // 300)
    batch_size = -(-docs_needed // -(-docs_needed // batch_size))
    docs: list[list[int]] = []
    have = 0
    for start in range(0, len(problems), batch_size):
        if have >= max_tokens:
            break
        # A base model (no chat template, e.g. Gemma 3 270M) answers the question as raw text.
        prompts = [engine.encode(tokenizer, p["question"], raw=tokenizer.chat_template is None)
                   for p in problems[start:start + batch_size]]
        cache = get_method("full").make_cache(model)
        for event in engine.uninterrupted(engine.generate(model, tokenizer, prompts, cache, settings)):
            if isinstance(event, engine.Result):
                doc = prompts[event.row] + event.token_ids
                docs.append(doc[:max_tokens - have])
                have += len(docs[-1])
                if progress is not None:
                    progress(min(have, max_tokens), max_tokens)
                if have >= max_tokens:
                    break
    return [d for d in docs if d]


def calibration_documents(model, tokenizer, tokens: int, chat_share: float = 0.5,
                          progress: Progress | None = None) -> tuple[list[list[int]], str]:
    """Default calibration: chat answers for chat_share of the token budget, calibration prose for the rest.

    Returns (documents, a one-line description of the source for the dictionary's metadata).
    """
    from kvzip import data

    chat = chat_documents(model, tokenizer, int(tokens * chat_share), progress=progress)
    n_chat = sum(len(d) for d in chat)
    prose = text_documents(tokenizer, data.calibration_prose(), tokens - n_chat)
    n_prose = sum(len(d) for d in prose)
    source = (f"default: {n_chat} tokens of the model's greedy chat answers to GSM8K calibration problems "
              f"[{data.GSM8K_CALIBRATION.start}, {data.GSM8K_CALIBRATION.stop}) + {n_prose} tokens of "
              f"calibration prose (pydoc_data.topics)")
    return chat + prose, source
