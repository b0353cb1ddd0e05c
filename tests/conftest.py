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
