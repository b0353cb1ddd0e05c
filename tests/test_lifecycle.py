"""Fast tier: the cache's lifecycle, for every registered method (tests/matrix.py).

- The engine wraps every forward in the cache's hooks: `before_forward`, the model's forward (layers store and
  attend), `after_forward`; cache-wide work (fadkv's coding, zoomr's rebuilds, thought ends and votes) never runs
  while the model's forward is in progress.
- `reset()` empties a cache so completely that generating again equals a fresh cache.
- `reorder_cache()` moves every row's state with it (decoding on equals a batch built in that order), or is refused
  in one line by a method whose per-row state it cannot move.
"""

from __future__ import annotations

import pytest
import torch

from kvzip import engine
from kvzip.errors import UserError
from tests.matrix import METHOD_NAMES, needs_dictionary, tiny_method

TEXT = "".join(f"Line {i}: the tiny model reads a short line.\n\n" for i in range(6))


def _cache(request, model, name):
    method = tiny_method(name)
    dicts = request.getfixturevalue("tiny_dictionaries") if needs_dictionary(name) else None
    return method.make_cache(model, dicts)


def _decode(model, tokenizer, cache, prompts, steps):
    """Greedy token ids (B, steps) through the engine's step primitives, forced to run every step."""
    settings = engine.Settings(max_new_tokens=steps, ignore_eos=True)
    rows = [e.token_ids for e in engine.generate(model, tokenizer, prompts, cache, settings)
            if isinstance(e, engine.Result)]
    return torch.tensor(rows)


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_hooks_wrap_every_forward_and_no_cache_wide_work_inside_it(tiny, tokenizer, request, monkeypatch, name):
    import kvzip.methods.fadkv as fadkv
    import kvzip.methods.thoughts.cache as thoughts

    events, inside = [], [False]
    pre = tiny.register_forward_pre_hook(lambda *a: inside.__setitem__(0, True))
    post = tiny.register_forward_hook(lambda *a: inside.__setitem__(0, False))

    def outside(label, fn):
        def wrapped(*args, **kwargs):
            assert not inside[0], f"{label} ran inside the model's forward"
            events.append(label)
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(fadkv, "compress", outside("compress", fadkv.compress))
    monkeypatch.setattr(thoughts, "rebuild_rows", outside("rebuild", thoughts.rebuild_rows))
    monkeypatch.setattr(thoughts, "finalize", outside("finalize", thoughts.finalize))
    monkeypatch.setattr(thoughts.ThoughtCache, "cast_votes", outside("cast_votes", thoughts.ThoughtCache.cast_votes))
    cache = _cache(request, tiny, name)
    for hook in ("before_forward", "after_forward"):
        monkeypatch.setattr(cache, hook, outside(hook, getattr(cache, hook)))
    prompts = [tokenizer("Q?")["input_ids"], tokenizer(TEXT[:60])["input_ids"]]
    try:
        _decode(tiny, tokenizer, cache, prompts, 40)
    finally:
        pre.remove()
        post.remove()
    hooks = [e for e in events if e in ("before_forward", "after_forward")]
    assert hooks == ["before_forward", "after_forward"] * 40  # the prefill and 39 decode steps
    if name in ("fadkv", "lexico"):
        assert "compress" in events
    if name in ("zoomr", "sumr"):
        assert "finalize" in events


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_reset_then_generate_equals_a_fresh_cache(tiny, tokenizer, request, name):
    prompts = [tokenizer("Q?")["input_ids"], tokenizer(TEXT[:60])["input_ids"]]
    fresh = _decode(tiny, tokenizer, _cache(request, tiny, name), prompts, 30)
    cache = _cache(request, tiny, name)
    _decode(tiny, tokenizer, cache, [tokenizer(TEXT[60:120])["input_ids"]], 25)  # another sequence, another batch
    cache.reset()
    assert cache.get_seq_length() == 0
    assert torch.equal(_decode(tiny, tokenizer, cache, prompts, 30), fresh)


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_reorder_moves_every_row_or_is_refused_in_one_line(tiny, tokenizer, request, name):
    """Two rows of one length (no padding) are fed the same tokens; after 12 steps the rows are swapped, and the
    logits of 8 more steps must equal those of a batch built swapped from the start."""
    prompts = [tokenizer(TEXT[:40])["input_ids"], tokenizer(TEXT[40:80])["input_ids"]]
    forced = torch.tensor(tokenizer(TEXT)["input_ids"][1:41]).view(20, 2)  # (steps, B)

    def run(stream, rows, swap_after=None):
        logits = [stream.prefill([prompts[r] for r in rows])]
        for i, ids in enumerate(forced):
            if i == swap_after:
                swap = torch.tensor([1, 0])
                stream.cache.reorder_cache(swap)
                stream.mask = stream.mask.index_select(0, swap)
                rows = rows[::-1]
            logits.append(stream.step(ids[rows], texts=["", ""]))
        return logits

    with torch.inference_mode():
        stream = engine.Stream(tiny, tokenizer, _cache(request, tiny, name))
        try:
            got = run(stream, [0, 1], swap_after=12)
        except UserError as exc:
            assert "\n" not in str(exc) and "reorder" in str(exc)
            assert name not in ("full", "window", "h2o")  # plain dense rows must move
            return
        other = engine.Stream(tiny, tokenizer, _cache(request, tiny, name))
        want = run(other, [1, 0])
    for g, w in zip(got[13:], want[13:]):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    # and every per-row tensor a layer holds (scores, positions, padding...) is the swapped batch's
    for mine, theirs in zip(stream.cache.layers, other.cache.layers):
        for key, value in vars(mine).items():
            if type(value) is torch.Tensor and value.dim() and value.shape[0] == 2 and key in vars(theirs):
                if type(vars(theirs)[key]) is torch.Tensor:
                    torch.testing.assert_close(value, vars(theirs)[key], rtol=1e-4, atol=1e-4, msg=key)
