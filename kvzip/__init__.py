"""kvzip: compressed KV caches for LLM reasoning (FAD-KV dictionary coding, ZoomR thought retrieval).

Public API (imported lazily, so `kvzip --help` does not pay for torch and transformers):
    model, tokenizer, source = load_model("smollm2-135m")
    method = get_method("window", {"window": "256"})
    for event in generate(model, tokenizer, [encode(tokenizer, "Hi")], method.make_cache(model), Settings()):
        ...
"""

_API = {
    "load_model": "kvzip.models",
    "get_method": "kvzip.methods",
    "METHODS": "kvzip.methods",
    "generate": "kvzip.engine",
    "encode": "kvzip.engine",
    "Settings": "kvzip.engine",
    "Token": "kvzip.engine",
    "Step": "kvzip.engine",
    "Result": "kvzip.engine",
}


def __getattr__(name):
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'kvzip' has no attribute {name!r}")


__all__ = list(_API)
