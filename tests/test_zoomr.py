"""Fast tier for zoomr, sumr, h2o and window on the tiny random Llama: segmentation, summaries, index keys, votes,
tiers, batching; the machinery is kvzip/methods/thoughts/."""

from __future__ import annotations

import pytest
import torch

from kvzip import engine
from kvzip.bench.recall import forced_decode
from kvzip.errors import UserError
from kvzip.methods import get_method
from kvzip.methods.thoughts.detail import part_bytes
from kvzip.methods.thoughts.index import ThoughtIndex
from kvzip.methods.thoughts.segment import Row, parse_boundary
from kvzip.methods.thoughts.summary import novelty, pick_summary
from kvzip.rope import unrotate

SMALL = {"window": "8", "summary_tokens": "2", "min_thought_tokens": "4", "max_thought_tokens": "64"}


def feed(model, tok, method, prompt: str, text: str, **kw):
    """Teacher-force `text` after `prompt` through a fresh cache of `method` (on_step runs per byte)."""
    cache = method.make_cache(model)
    preds, logits, _, peak = forced_decode(model, tok, cache, [tok(prompt)["input_ids"]], [tok(text)["input_ids"][1:]])
    return cache, preds, logits, peak


def test_paragraph_breaks_split_thoughts_and_the_prompt_is_kept(tiny, tokenizer):
    text = "first thought here.\n\nsecond one, longer.\n\nx\n\nthird after a short one\n\ntail"
    cache, _, _, _ = feed(tiny, tokenizer, get_method("zoomr", SMALL), "prompt!", text)
    row, plen = cache.rows[0], len(tokenizer("prompt!")["input_ids"])
    assert row.keep == [(0, plen)]
    # "\n\n" arrives as two byte tokens: a thought ends at the second; "x\n\n" is too short (min_thought_tokens 4) to end one.
    ends = [e - plen for _, e in row.thoughts]
    assert ends == [len("first thought here.\n\n"), len("first thought here.\n\nsecond one, longer.\n\n"),
                    len("first thought here.\n\nsecond one, longer.\n\nx\n\nthird after a short one\n\n")]
    assert row.cur == row.thoughts[-1][1]


def test_max_thought_and_token_id_boundaries():
    assert parse_boundary("\\n\\n|id:7") == (("\n\n",), frozenset({7}))
    with pytest.raises(ValueError):
        parse_boundary("|")


def test_generated_summaries_use_the_marker_span(tiny, tokenizer):
    opts = {**SMALL, "summary_source": "generated", "begin_marker": "<S>", "end_marker": "<E>"}
    text = "a long thought without breaks<S>short sum<E>next"
    cache, _, _, _ = feed(tiny, tokenizer, get_method("zoomr", opts), "p", text)
    row, plen = cache.rows[0], 1 + 1
    s = plen + text.index("<S>")
    assert row.thoughts == [(plen, s)] and row.spans == [(s, plen + text.index("<E>") + 3)]
    layer = cache.layers[1]
    assert layer.summary_pos[0][0].tolist() == list(range(*row.spans[0]))
    # The summary tokens stay on the device.
    kept = layer.positions[0]
    assert torch.equal(kept[torch.isin(kept, layer.summary_pos[0][0])], layer.summary_pos[0][0])


@pytest.mark.parametrize("detail, atol", [("host", 1e-5), ("int8", 5e-3), ("int4", 0.1)])
def test_detail_is_on_host(tiny, tokenizer, detail, atol):
    """The detail tier holds every thought's K/V off the device: dense copies (detail=host), int8 with one fp16
    scale per vector (detail=int8, the default: within the int8 step of the keys, a quarter of fp32's bytes) or int4
    (within its step)."""
    text = "one two three four.\n\nfive six seven eight.\n\nnine ten eleven twelve"
    opts = {**SMALL, "zoom_thoughts": "1", "detail": detail}
    cache, _, _, _ = feed(tiny, tokenizer, get_method("zoomr", opts), "hello", text)
    full = get_method("full").make_cache(tiny)
    ids = tokenizer("hello")["input_ids"] + tokenizer(text)["input_ids"][1:]
    with torch.inference_mode():
        tiny(input_ids=torch.tensor([ids]), cache=full, use_cache=True)
    layer0, ref = cache.layers[0], full.layers[0].keys  # layer 0 keys depend only on token and position
    row = cache.rows[0]
    for t, (s, e) in enumerate(row.thoughts):
        assert layer0.detail[0][t][0][0].device.type == "cpu"
        hk, hv = layer0._load(0, t)
        assert hk.shape == (2, e - s, 16)
        assert torch.allclose(hk, ref[0, :, s:e], atol=atol)
    heads, d = 2, 16
    per_thought = {  # bytes of one thought of n tokens, keys and values
        "host": lambda n: 2 * heads * n * d * 4,
        "int8": lambda n: 2 * heads * n * (d + 2),  # int8 codes and an fp16 scale per vector
        # two codes a byte; keys a scale and a low per head and channel, values per vector (one group at d = 16)
        "int4": lambda n: 2 * heads * n * d // 2 + heads * d * 4 + heads * n * 4,
    }[detail]
    detail_bytes = sum(per_thought(e - s) for s, e in row.thoughts) * len(cache.layers)
    assert cache.memory()["host"] == detail_bytes


def test_int4_detail_keeps_each_key_channel_and_value_group_in_its_own_range():
    """detail=int4: a key channel far larger than the rest (as real keys have) gets its own scale over the thought's
    tokens, so the small channels keep a small error; values round within half a step of their group of channels;
    two codes to a byte, fp16 scales and lows."""
    from kvzip.methods.thoughts.detail import Int4Detail

    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 40, 64, generator=g), torch.randn(2, 40, 64, generator=g)
    k[:, :, 5] *= 100  # one outlier channel
    v[:, :, 32:] *= 10  # the second group of value channels ten times the first
    tier = Int4Detail()
    stored = tier.store(k, v)
    hk, hv = tier.load(stored, "cpu", torch.float32)
    k_step = (k.amax(1, keepdim=True) - k.amin(1, keepdim=True)) / 15  # per head and channel
    assert ((hk - k).abs() <= k_step / 2 + 1e-2).all()
    assert (hk - k)[:, :, :5].abs().max() < 0.3  # untouched by channel 5's range (a scale per token: ~7)
    groups = v.unflatten(-1, (2, 32))
    v_step = (groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)) / 15
    assert ((hv.unflatten(-1, (2, 32)) - groups).abs() <= v_step / 2 + 1e-2).all()
    assert (hv - v)[..., :32].abs().max() < 0.3  # the first group's own scale
    codes = 2 * 40 * 32  # bytes of codes per part: heads x tokens x d / 2
    assert part_bytes(stored) == codes + 2 * 64 * 2 * 2 + codes + 2 * 40 * 2 * 2 * 2


def test_content_index_key_is_mean_of_unrotated_summary_keys(tiny, tokenizer):
    """The index holds the mean of each thought's summary keys with RoPE undone, so scores ignore position."""
    text = "one two three four.\n\nfive six seven eight.\n\nnine ten eleven twelve"
    cache, _, _, _ = feed(tiny, tokenizer, get_method("zoomr", {**SMALL, "zoom_thoughts": "1"}), "hello", text)
    full = get_method("full").make_cache(tiny)
    ids = tokenizer("hello")["input_ids"] + tokenizer(text)["input_ids"][1:]
    with torch.inference_mode():
        tiny(input_ids=torch.tensor([ids]), cache=full, use_cache=True)
    layer0, ref = cache.layers[0], full.layers[0].keys
    assert len(cache.rows[0].thoughts) >= 2
    raw = cache.index.raw(0)[0]  # row 0's index keys in layer 0 (Hkv, T, d), back from their centred form
    for t in range(len(cache.rows[0].thoughts)):
        pos = layer0.summary_pos[0][t]
        want = unrotate(ref[0][:, pos], pos, layer0.rope).mean(1)  # (Hkv, d)
        assert torch.allclose(raw[:, t], want, atol=1e-5)


def voting_layer(tiny, keys, opts):
    """Layer 0 of a fresh zoomr cache holding index keys `keys` (per thought (Hkv, d)) for one row, every thought
    finished, the row voting; its buffer's last token at position 0, where turning the query back changes nothing."""
    cache = get_method("zoomr", opts).make_cache(tiny)
    layer = cache.layers[0]
    layer.lazy_initialization(torch.zeros(1, 2, 0, 16), torch.zeros(1, 2, 0, 16))
    layer.positions = torch.zeros(1, 1, dtype=torch.long)
    cache.index = ThoughtIndex(1)
    for k in keys:
        cache.index.add(0, k.expand(len(cache.layers), *k.shape))  # every layer's index key (L, Hkv, d)
    cache.rows, cache.last_zoom = [Row(0, 4)], [[[]]]
    cache.rows[0].thoughts = [(4 + 10 * i, 14 + 10 * i) for i in range(len(keys))]
    cache.voting = torch.ones(1, dtype=torch.bool)
    return cache, layer


def test_votes_pick_the_thought_whose_keys_match_the_query(tiny):
    eye = torch.eye(16)
    keys = [eye[t].expand(2, 16) for t in range(5)]  # (Hkv, d): thought t's index key is direction t
    cache, layer = voting_layer(tiny, keys, {"votes_per_head": "1", "zoom_thoughts": "1"})
    cache.cast_votes({layer.idx: (10 * eye[3]).expand(1, 4, 16)})  # (1, Hq=4, 16): every head points at thought 3
    assert cache.ballot.votes.argmax().item() == 3 and cache.ballot.votes[0, 0, 3] == 4  # 4 query heads, 1 vote each
    assert cache._select() and cache.rows[0].zoom == [[3]]


def test_each_layer_zooms_in_on_its_own_heads_choice_with_zoom_scope_layer(tiny):
    """zoom_scope=layer: layer 0's heads all point at thought 3, layer 1's at thought 1; each layer gets its own
    thought, where the row's consensus (scope row) would give both layers one of the two."""
    eye = torch.eye(16)
    keys = [eye[t].expand(2, 16) for t in range(5)]
    opts = {"votes_per_head": "1", "zoom_thoughts": "1", "vote_decay": "0"}
    for scope, want in (("layer", [[3], [1]]), ("row", [[1]])):
        cache, _ = voting_layer(tiny, keys, {**opts, "zoom_scope": scope})
        cache.last_zoom, cache.rows[0].zoom = [[[]] * cache.groups], [[]] * cache.groups
        second = cache.layers[1]
        second.lazy_initialization(torch.zeros(1, 2, 0, 16), torch.zeros(1, 2, 0, 16))
        second.positions = torch.zeros(1, 1, dtype=torch.long)
        cache.cast_votes({0: (10 * eye[3]).expand(1, 4, 16), 1: (10 * eye[1]).expand(1, 4, 16)})
        assert cache._select() and cache.rows[0].zoom == want  # (a tie in the row's tally goes to the earlier thought)
        assert [cache.rows[0].zoom_of(i) for i in (0, 1)] == (want if scope == "layer" else want * 2)


def test_centered_index_removes_what_every_thought_shares(tiny):
    """Every index key holds a shared direction, thought 0 five times more of it (its summary kept the task's
    recurring words). A query about thought 2's own content with a little of the shared direction scores thought 0
    highest on raw keys; with the mean over thoughts removed and unit length, thought 2 wins the votes."""
    eye = torch.eye(16)
    shared, own = eye[0], eye[1:5]  # the shared direction; thought t's own direction own[t]
    raw = torch.stack([5.0 * shared + own[0], shared + own[1], shared + own[2], shared + own[3]])  # (T, d)
    query = 0.3 * shared + own[2]
    assert (raw @ query).argmax().item() == 0
    cache, layer = voting_layer(tiny, [k.expand(2, 16) for k in raw], {"votes_per_head": "1", "zoom_thoughts": "1"})
    cache.cast_votes({layer.idx: query.expand(1, 4, 16)})  # (1, Hq=4, 16)
    assert cache.ballot.votes.argmax().item() == 2
    stacked = cache.index.keys()[layer.idx]  # (B, Hkv, T, d)
    want = torch.nn.functional.normalize(raw - raw.mean(0), dim=-1)
    torch.testing.assert_close(stacked[0, 0], want)
    torch.testing.assert_close(stacked[0, 1], want)


def test_index_kept_centred_as_thoughts_arrive_equals_centring_them_all_at_once():
    """ThoughtIndex keeps one centred copy and re-centres a row from it when a thought arrives (past its first room,
    so it grows): the same unit keys as centring every raw key at once, the raw keys back, and a row's keys the same
    beside another row as alone."""
    g = torch.Generator().manual_seed(0)
    raw = [3 * torch.randn(2, 1, 4, 16, generator=g) + torch.randn(2, 12, 4, 16, generator=g),  # (L, T, Hkv, d)
           torch.randn(2, 5, 4, 16, generator=g)]
    both, alone = ThoughtIndex(2), ThoughtIndex(1)
    for t in range(12):
        for b, r in enumerate(raw):
            if t < r.shape[1]:
                both.add(b, r[:, t])
        alone.add(0, raw[0][:, t])
    assert both.width == 12 and both.valid().sum(1).tolist() == [12, 5]
    for b, r in enumerate(raw):
        r = r.transpose(1, 2)  # (L, Hkv, T, d)
        want = torch.nn.functional.normalize(r - r.mean(2, keepdim=True), dim=-1)
        torch.testing.assert_close(both.keys()[:, b, :, : r.shape[2]], want)
        torch.testing.assert_close(both.raw(b), r, atol=1e-5, rtol=1e-5)
    assert torch.equal(both.keys()[:, :1], alone.keys())
    assert both.layer_bytes() == (2 * 4 * 12 * 17 + 2 * 4 * 16) * 4 + 2 * 12


def test_novel_pick_keeps_the_tokens_unlike_the_keys_before_the_thought(tiny):
    """summary_pick=novel: a thought token whose content key (RoPE undone) repeats a prompt key scores ~0; new ones
    score high, and those are the ones the summary keeps."""
    rope = get_method("zoomr").make_cache(tiny).layers[0].rope
    g = torch.Generator().manual_seed(0)
    a, b, c, d, e, f = (torch.randn(2, 1, 16, generator=g) for _ in range(6))  # content keys (Hkv, 1, d)
    content = torch.cat([a, b, c, d, a, e, b, f], 1)  # prompt: positions 0-3; the thought: 4-7 repeats a and b
    score = novelty(content[:, 4:], content[:, :4])
    assert score[0] < 1e-4 and score[2] < 1e-4 and score[1] > 0.1 and score[3] > 0.1
    pos = torch.arange(8)
    rotated = unrotate(content, -pos, rope)  # turning by -pos is RoPE at pos: the keys as the cache holds them
    mine, before = rotated[None, :, 4:], rotated[None, :, :4]  # one layer
    for pad in (0, 3):  # the layer's tokens before the thought padded to another layer's count: padding is ignored
        before_pos = torch.cat([pos[None, :4], torch.full((1, pad), -1)], 1)
        padded = torch.cat([before, torch.randn(1, 2, pad, 16, generator=g)], 2)
        pick = lambda n: pick_summary(mine, pos[4:], n, "novel", rope, padded, before_pos, before_pos >= 0)  # noqa: E731
        assert (pick(2) + 4).tolist() == [[5, 7]]
        assert (pick(9) + 4).tolist() == [[4, 5, 6, 7]]


@pytest.mark.parametrize("decay, expect", [(0.0, [2]), (0.5, [1])])
def test_decay_carries_earlier_votes_into_the_next_selection(tiny, decay, expect):
    cache = get_method("zoomr", {"zoom_thoughts": "1", "vote_decay": str(decay)}).make_cache(tiny)
    cache.rows, cache.last_zoom = [Row(0, 4)], [[[]]]
    cache.rows[0].thoughts = [(4 + 10 * i, 14 + 10 * i) for i in range(3)]
    cache.ballot.votes = torch.tensor([[[0.0, 10.0, 0.0]]])
    assert cache._select() and cache.rows[0].zoom == [[1]]
    cache.ballot.votes = torch.tensor([[[0.0, 0.0, 4.0]]])  # a weaker vote for thought 2: 0.5 * 10 > 4 keeps thought 1
    cache._select()
    assert cache.rows[0].zoom == [expect]


@pytest.mark.parametrize("margin, second, expect", [("0", 9.0, [2]), ("0.25", 9.0, [1]), ("0.25", 7.0, [2])])
def test_a_zoomed_thought_is_replaced_only_by_a_challenger_ahead_by_the_margin(tiny, margin, second, expect):
    """zoom_margin: thought 1, zoomed in, counts its votes 1 + margin times; thought 2 with 10 votes replaces it only
    when 10 beats that (9 * 1.25 = 11.25 holds, 7 * 1.25 = 8.75 does not)."""
    cache = get_method("zoomr", {"zoom_thoughts": "1", "vote_decay": "0", "zoom_margin": margin}).make_cache(tiny)
    cache.rows, cache.last_zoom = [Row(0, 4)], [[[]]]
    cache.rows[0].thoughts = [(4 + 10 * i, 14 + 10 * i) for i in range(3)]
    cache.ballot.votes = torch.tensor([[[0.0, 10.0, 0.0]]])
    assert cache._select() and cache.rows[0].zoom == [[1]]
    cache.ballot.votes = torch.tensor([[[0.0, second, 10.0]]])
    cache._select()
    assert cache.rows[0].zoom == [expect]


@pytest.mark.parametrize("scope", ["row", "layer"])
def test_zooming_in_on_every_thought_equals_full(tiny, tokenizer, scope):
    """With every thought zoomed in at every step, the active context is everything: logits match full."""
    text = "alpha beta gamma.\n\ndelta epsilon zeta.\n\neta theta iota.\n\nkappa lambda mu nu xi"
    opts = {**SMALL, "votes_per_head": "50", "zoom_thoughts": "50", "select_at": "token", "zoom_scope": scope}
    cache, preds, logits, peak = feed(tiny, tokenizer, get_method("zoomr", opts), "start", text)
    _, full_preds, full_logits, _ = feed(tiny, tokenizer, get_method("full"), "start", text)
    assert len(cache.rows[0].thoughts) == 3 and cache.rebuilds > 0
    assert torch.equal(preds, full_preds) and torch.allclose(logits, full_logits, atol=1e-4)


@pytest.mark.parametrize("scope", ["row", "layer"])
def test_active_context_is_prompt_summaries_zoom_and_tail(tiny, tokenizer, scope):
    """Each layer holds the prompt, its summaries, the tail and its zoomed thoughts: the row's set, or its own."""
    text = "".join(f"thought number {i} says hi.\n\n" for i in range(8)) + "end"
    method = get_method("zoomr", {**SMALL, "zoom_thoughts": "1", "zoom_scope": scope})
    cache, _, _, peak = feed(tiny, tokenizer, method, "the prompt", text)
    row = cache.rows[0]
    for layer in cache.layers:
        active = set(layer.positions[0].tolist())
        expected = set(range(*row.keep[0])) | set(range(cache.tail_start[0], layer.seen))
        expected |= {p for sp in layer.summary_pos[0] for p in sp.tolist()}
        expected |= {p for t in row.zoom_of(layer.idx) for p in range(*row.thoughts[t])}
        # Between rebuilds the tail only grows: every expected token is active, nothing else but newer tail tokens.
        assert expected <= active and all(p >= cache.tail_start[0] for p in active - expected)
        assert len(active) < layer.seen
    mem = cache.memory()
    assert 0 < mem["on_device"] < mem["full_same_dtype"] and mem["host"] > 0
    zoomed = cache.stats()["zoomed_thoughts"][0]  # row 0's set, or its set in each layer
    assert cache.stats()["thoughts_indexed"] == [8] and len(zoomed if scope == "row" else zoomed[1]) == 1


def test_sumr_keeps_no_detail_and_never_zooms(tiny, tokenizer):
    text = "".join(f"thought number {i} says hi.\n\n" for i in range(6))
    cache, _, _, _ = feed(tiny, tokenizer, get_method("sumr", SMALL), "p", text)
    assert cache.memory()["host"] == 0 and cache.rows[0].zoom == [[]] and len(cache.rows[0].thoughts) == 6
    assert cache.ballot is None and cache.index is None  # no index to vote on


def test_tails_move_together_every_quarter_window_of_decode_steps(tiny, tokenizer, monkeypatch):
    """sumr rebuilds only when a tail moves: while decoding, that happens at every quarter window (2 steps here) of
    decode steps and for every row at once, whatever each row's thought ends do to its tail."""
    import kvzip.methods.thoughts.cache as thought_cache
    at = []
    real = thought_cache.rebuild_rows
    cache = get_method("sumr", {**SMALL, "max_thought_tokens": "5"}).make_cache(tiny)
    monkeypatch.setattr(thought_cache, "rebuild_rows", lambda *args: (at.append(cache.steps), real(*args)))
    prompts = [tokenizer("a")["input_ids"], tokenizer("a much longer prompt here")["input_ids"]]
    list(engine.generate(tiny, tokenizer, prompts, cache, engine.Settings(max_new_tokens=40, ignore_eos=True)))
    decoding = at[1:]  # the first is the prompt's
    assert len(decoding) >= 10 and all(step % 2 == 0 for step in decoding)


@pytest.mark.parametrize("name", ["zoomr", "sumr", "h2o", "zoomr-thought", "sumr-novel", "zoomr-layer", "zoomr-reread"])
def test_left_padded_batch_matches_rows_one_by_one(tiny, tokenizer, name):
    opts = {"h2o": {"heavy": "6", "window": "6"}, "sumr-novel": {**SMALL, "summary_pick": "novel"},
            "zoomr-layer": {**SMALL, "zoom_scope": "layer"},
            "zoomr-reread": {**SMALL, "zoom_scope": "layer", "zoom_reread": "3"},
            "zoomr-thought": {**SMALL, "summary_pick": "norm", "select_at": "thought", "vote_decay": "0"}}
    opts = opts.get(name, SMALL)
    method = get_method(name.split("-")[0], opts)
    prompts = [tokenizer("a")["input_ids"], tokenizer("a much longer prompt here")["input_ids"]]
    settings = engine.Settings(max_new_tokens=40, ignore_eos=True)
    batched = [e for e in engine.generate(tiny, tokenizer, prompts, method.make_cache(tiny), settings)
               if isinstance(e, engine.Result)]
    for p, res in zip(prompts, batched):
        single = [e for e in engine.generate(tiny, tokenizer, [p], method.make_cache(tiny), settings)
                  if isinstance(e, engine.Result)]
        assert res.token_ids == single[0].token_ids


def test_options_are_validated():
    assert get_method("zoomr", {"summary_source": "generated"}).summary_source == "generated"
    with pytest.raises(UserError, match="zoom_scope='head' is not allowed; use one of: row, layer"):
        get_method("zoomr", {"zoom_scope": "head"})
    with pytest.raises(UserError, match="zoom_index='max' is not allowed; use one of: summary, bounds"):
        get_method("zoomr", {"zoom_index": "max"})
    with pytest.raises(UserError, match="summary_pick='attention' is not allowed; use one of: norm, novel"):
        get_method("zoomr", {"summary_pick": "attention"})
    with pytest.raises(UserError, match="select_at='sentence' is not allowed; use one of: token, thought"):
        get_method("zoomr", {"select_at": "sentence"})
    with pytest.raises(UserError, match="max_thought_tokens"):
        get_method("sumr", {"min_thought_tokens": "10", "max_thought_tokens": "5"})
    with pytest.raises(UserError, match="vote_decay must be in"):
        get_method("zoomr", {"vote_decay": "1.5"})
    with pytest.raises(UserError, match="detail_sparsity is the atoms per vector of detail=fadkv"):
        get_method("zoomr", {"detail_sparsity": "2"})
    for gone in ("zoom_thoughts", "detail"):  # sumr never zooms in and keeps no detail
        with pytest.raises(UserError, match=f"has no option '{gone}'"):
            get_method("sumr", {gone: "2"})
    for gone in ("index", "index_space", "index_norm", "summary", "r", "k", "c"):  # fixed, or renamed
        with pytest.raises(UserError, match=f"has no option '{gone}'"):
            get_method("zoomr", {gone: "1"})


def test_fadkv_detail_codes_the_host_tier(tiny, tokenizer, tiny_dictionaries):
    text = "".join(f"thought number {i} says hi.\n\n" for i in range(5))
    ids = [tokenizer("p")["input_ids"]], [tokenizer(text)["input_ids"][1:]]
    caches = {}
    for name, opts in (("host", {"detail": "host"}), ("fadkv", {"detail": "fadkv"}),
                       ("fadkv-2", {"detail": "fadkv", "detail_sparsity": "2"})):
        method = get_method("zoomr", {**SMALL, **opts})
        assert method.needs_dictionary == (opts["detail"] == "fadkv")
        caches[name] = method.make_cache(tiny, tiny_dictionaries)
        forced_decode(tiny, tokenizer, caches[name], *ids)
    dense, coded = caches["host"], caches["fadkv"]
    assert 0 < coded.memory()["host"] < dense.memory()["host"] / 2
    sparsity = int(tiny_dictionaries.meta.get("sparsity", 8))  # 4 B an atom: the host tier scales with the atoms
    assert caches["fadkv-2"].memory()["host"] * sparsity == coded.memory()["host"] * 2
    k_dense, _ = dense.layers[0]._load(0, 2)
    k_coded, v_coded = coded.layers[0]._load(0, 2)  # layer 0: the same tokens give the same keys in both caches
    assert k_coded.shape == k_dense.shape and v_coded.dtype == k_dense.dtype
    assert ((k_coded - k_dense).norm() / k_dense.norm()) < 0.9
    with pytest.raises(UserError, match="needs a dictionary"):
        get_method("zoomr", {"detail": "fadkv"}).make_cache(tiny, None)


def test_unrotate_inverts_the_models_rope(tiny):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from kvzip.rope import layer_ropes, unrotate

    x = torch.randn(1, 2, 5, 16)
    pos = torch.tensor([[0, 3, 7, 100, 4000]])
    cos, sin = tiny.model.rotary_emb(x, pos)
    rotated, _ = apply_rotary_pos_emb(x, x, cos, sin)
    assert torch.allclose(unrotate(rotated, pos[0], layer_ropes(tiny, "this test")[0]), x, atol=1e-4)
    assert not torch.allclose(rotated, x, atol=1e-2)
