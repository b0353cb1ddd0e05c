"""Fast tier: `--device-map` (accelerate's placement of one model over several devices), on the CPU.

- A strategy (`auto`) and an explicit JSON map that names every module place the tiny model's layers on the CPU,
  and generation through them writes the same rows as a model moved there whole, for full, fadkv and zoomr (zoomr
  with its detail tier coded by the dictionary, which follows each layer's device).
- The bookkeeping of a split, checked on the CPU by giving two layers two device names that are the same device
  (`cpu` and `cpu:0`): the dictionary is prepared per device for that device's layers only (its own Gram matrices,
  slots counted within them), fadkv codes each device's layers as one group sharing one set of coding totals, and
  the tokens equal an unsplit cache's. What a real split over two GPUs moves between them runs in
  `scripts/gpu_check.sh` on a machine that has them.
- Bad maps are one line with exit code 2, before any model loads.
"""

from __future__ import annotations

import json

import pytest
import torch

import kvzip.methods.fadkv
from kvzip import engine
from kvzip.cli import main
from kvzip.errors import UserError
from kvzip.methods import get_method
from kvzip.models import load_model
from kvzip.placement import check_device_map, layer_devices, parse_device_map
from kvzip.sparse.dictionary import prepare_for_devices, prepare_layers
from tests.launch import jsonl, opts, write_prompts
from tests.matrix import tiny_options
from tests.test_cli import no_model, one_line_error  # noqa: F401  (a fixture)

EVERY_MODULE = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": 'cpu', "model.norm": "cpu",
                "model.rotary_emb": "cpu", "lm_head": "cpu"}


def test_a_mapped_model_has_its_layers_where_the_map_says(tiny_model_dir):
    for placement in ("auto", EVERY_MODULE):
        model, _, _ = load_model(str(tiny_model_dir), "auto", "float32", device_map=placement)
        assert layer_devices(model) == [torch.device("cpu")] * 2 and model.device == torch.device("cpu")


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name, extra", [("full", {}), ("fadkv", {}), ("zoomr", {"detail": "fadkv"})])
def test_generate_with_a_device_map_writes_the_same_rows(tmp_path, tiny_model_dir, tiny_dict_file, name, extra):
    prompts = write_prompts(tmp_path / "in.jsonl", 4)
    dictionary = ["--dict", str(tiny_dict_file)] if name != "full" else []
    base = ["generate", "--model", str(tiny_model_dir), "--dtype", "float32", "--method", name, *opts(name),
            *[x for k, v in extra.items() for x in ("--opt", f"{k}={v}")], *dictionary, "--input", str(prompts),
            "--batch-size", "2", "--max-new-tokens", "32", "--ignore-eos"]
    rows = {}
    for label, placement in (("whole", []), ("auto", ["--device-map", "auto"]),
                             ("map", ["--device-map", json.dumps(EVERY_MODULE)])):
        with pytest.raises(SystemExit) as exc:
            main([*base, *placement, "--output", str(tmp_path / f"{label}.jsonl")])
        assert exc.value.code == 0
        rows[label] = jsonl(tmp_path / f"{label}.jsonl")[:-1]
    assert rows["auto"] == rows["whole"] and rows["map"] == rows["whole"] and len(rows["whole"]) == 4


def test_dictionaries_follow_each_layers_device(tiny_dictionaries):
    split = [torch.device("cpu"), torch.device("cpu", 0)]  # two names, one device: the split's bookkeeping
    whole, apart = prepare_layers(tiny_dictionaries, "cpu"), prepare_for_devices(tiny_dictionaries, split)
    assert [a.slot for a in apart] == [0, 0] and [a.grams.shape[0] for a in apart] == [2, 2]
    for w, a in zip(whole, apart):
        assert torch.equal(w.keys, a.keys) and torch.equal(w.key_gram, a.key_gram) and torch.equal(w.value_gram, a.value_gram)
    assert prepare_for_devices(tiny_dictionaries, [torch.device("cpu")] * 2)[1].slot == 2  # one device: one stack


@pytest.mark.usefixtures("one_thread")
def test_fadkv_split_over_two_devices_codes_per_device_and_equals_one(tiny, tokenizer, tiny_dictionaries, monkeypatch):
    method = get_method("fadkv", tiny_options("fadkv"))
    prompts = [tokenizer("a prompt long enough to be coded " * 2)["input_ids"], tokenizer("short")["input_ids"]]
    settings = engine.Settings(max_new_tokens=32, ignore_eos=True)

    def tokens(cache):
        return [e.token_ids for e in engine.generate(tiny, tokenizer, prompts, cache, settings)
                if isinstance(e, engine.Result)]

    one = method.make_cache(tiny, tiny_dictionaries)
    expected = tokens(one)
    monkeypatch.setattr(kvzip.methods.fadkv, "layer_devices", lambda model: [torch.device("cpu"), torch.device("cpu", 0)])
    two = method.make_cache(tiny, tiny_dictionaries)
    coded, real = [], kvzip.methods.fadkv.compress

    def compress(layers, stats):
        coded.append(([next(i for i, y in enumerate(two.layers) if y is x) for x in layers], stats))
        return real(layers, stats)

    monkeypatch.setattr(kvzip.methods.fadkv, "compress", compress)
    assert tokens(two) == expected
    assert {tuple(layers) for layers, _ in coded} == {(0,), (1,)}  # each device's layers coded on their own
    assert all(stats is two.coding for _, stats in coded)  # one set of coding totals for the cache
    assert two.layers[0].atoms.slot == two.layers[1].atoms.slot == 0  # each device's own Gram stack
    assert two.stats()["tokens_coded"] == one.stats()["tokens_coded"] > 0
    assert two.stats()["mean_residual"] == one.stats()["mean_residual"]


def test_device_map_parsing_and_checks(tmp_path):
    assert parse_device_map("balanced") == "balanced"
    assert parse_device_map('{"": 0}') == {"": 0}
    (tmp_path / "map.json").write_text(json.dumps(EVERY_MODULE))
    assert parse_device_map(str(tmp_path / "map.json")) == EVERY_MODULE
    for text, message in (("fast", "a device map is one of auto"), ("[1]", "a device map is one of"),
                          ('{"lm_head": "disk"}', "disk offload is not supported"),
                          ('{"lm_head": "tpu"}', "the device 'tpu'"), ('{"lm_head": -1}', "the device -1")):
        with pytest.raises(UserError, match=message):
            parse_device_map(text)
    check_device_map({"lm_head": "cpu", "model": 1}, 2)
    with pytest.raises(UserError, match="puts 'model' on GPU 2, but torch sees 2 GPU"):
        check_device_map({"model": "cuda:2"}, 2)


@pytest.mark.usefixtures("no_model")
def test_bad_device_maps_are_one_line_before_the_model(capsys):
    assert "--device-map: a device map is one of" in one_line_error(capsys, "generate", "hi", "--device-map", "nope")
    assert "leave --device at auto" in one_line_error(capsys, "generate", "hi", "--device-map", "auto", "--device", "cpu")
    if torch.cuda.device_count() < 8:
        line = one_line_error(capsys, "generate", "hi", "--device-map", '{"": 7}')
        assert line.endswith(f"puts '' on GPU 7, but torch sees {torch.cuda.device_count()} GPU(s)")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name, extra", [("full", {}), ("fadkv", {}), ("zoomr", {"detail": "fadkv"})])
def test_layers_spread_over_every_visible_gpu_write_the_same_rows(tmp_path, tiny_model_dir, tiny_dict_file, name, extra):
    """Layer 0 on the first GPU, layer 1 on the last (the same one on a one-GPU machine): the same rows as the model
    whole on the first GPU, each cache layer on its layer's device."""
    last = torch.cuda.device_count() - 1
    placement = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": last,
                 "model.norm": last, "lm_head": last}
    model, _, _ = load_model(str(tiny_model_dir), "auto", "float32", device_map=placement)
    assert layer_devices(model) == [torch.device("cuda", 0), torch.device("cuda", last)]
    prompts = write_prompts(tmp_path / "in.jsonl", 4)
    base = ["generate", "--model", str(tiny_model_dir), "--dtype", "float32", "--method", name, *opts(name),
            *[x for k, v in extra.items() for x in ("--opt", f"{k}={v}")],
            *(["--dict", str(tiny_dict_file)] if name != "full" else []), "--input", str(prompts), "--batch-size", "2",
            "--max-new-tokens", "32", "--ignore-eos"]
    for label, where in (("whole", ["--device", "cuda"]), ("spread", ["--device-map", json.dumps(placement)])):
        with pytest.raises(SystemExit) as exc:
            main([*base, *where, "--output", str(tmp_path / f"{label}.jsonl")])
        assert exc.value.code == 0
    assert jsonl(tmp_path / "spread.jsonl")[:-1] == jsonl(tmp_path / "whole.jsonl")[:-1]
