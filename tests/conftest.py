"""Fixtures for the fast tier: a tiny random Llama built in the test (no downloads) and a byte-level tokenizer."""

from __future__ import annotations

import pytest
import torch

import kvzip.attention  # noqa: F401  registers the "kvzip" attention implementation


class ByteTokenizer:
    """Just enough of a Hugging Face tokenizer for the engine: ids 3..258 are bytes, 2 is end-of-sequence."""

    eos_token_id = 2
    pad_token_id = 0
    eos_token = "<eos>"
    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [1] + [b + 3 for b in text.encode()]}

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i - 3 for i in ids if 3 <= i < 259).decode("utf-8", errors="replace")


def tiny_llama(seed: int = 0, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, eos_token_id=2, pad_token_id=0, bos_token_id=1,
    )
    model = LlamaForCausalLM(config)
    model.set_attn_implementation(kvzip.attention.ATTN_IMPLEMENTATION)
    return model.eval()


def interrupt_at_step(monkeypatch, n: int) -> list:
    """Ctrl-C (a KeyboardInterrupt) inside the n-th decode step the engine takes from now on; returns the list that
    counts the steps taken."""
    from kvzip import engine

    step, calls = engine.Stream.step, []

    def interrupted(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return step(self, *args, **kwargs)

    monkeypatch.setattr(engine.Stream, "step", interrupted)
    return calls


@pytest.fixture
def one_thread():
    """Run a test on one torch thread (timing-sensitive coders; the machine has two cores), then restore."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny():
    return tiny_llama()


@pytest.fixture(scope="session")
def tokenizer():
    return ByteTokenizer()


@pytest.fixture(scope="session")
def tiny_dictionaries(tiny):
    """A small random KVDictionary (32 atoms per layer) matching the tiny model, for methods that need one."""
    from kvzip.models import model_fingerprint
    from kvzip.sparse.dictionary import KVDictionary, make_meta

    cfg = tiny.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    g = torch.Generator().manual_seed(0)
    atoms = lambda: torch.nn.functional.normalize(torch.randn(cfg.num_hidden_layers, 32, head_dim, generator=g), dim=-1)  # noqa: E731
    meta = make_meta(model_fingerprint(cfg), s=4, keys="post-rope", source="random", tokens=0)
    return KVDictionary(keys=atoms(), values=atoms(), meta=meta)


def save_tiny_model(folder) -> None:
    """tiny_llama() as a Hugging Face folder that `--model FOLDER` loads in a fresh process: its weights (safetensors),
    config, and a byte-level tokenizer with the ids ByteTokenizer uses (0 pad, 1 bos, 2 eos, 3..258 the bytes) and no
    chat template, so prompts go in as raw text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tiny_llama().save_pretrained(folder)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{char: byte + 3 for byte, char in bytes_to_unicode().items()}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>").save_pretrained(folder)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The tiny model as a folder, for tests that run kvzip as a command (in a subprocess, under torchrun)."""
    folder = tmp_path_factory.mktemp("models") / "tiny"
    save_tiny_model(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_dict_file(tiny_dictionaries, tmp_path_factory):
    """tiny_dictionaries as a file, for `--dict`."""
    path = tmp_path_factory.mktemp("dict") / "tiny.safetensors"
    tiny_dictionaries.save(path)
    return path
