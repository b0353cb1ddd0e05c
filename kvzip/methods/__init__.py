"""The method registry: every `--method` name maps to a Method dataclass; CLI choices, tests and bench read it.

A new method is a new file in this folder holding a `Method` subclass with a `name`: it is found here without any
other edit, and the test matrix and the bench pick it up. Subpackages (kvzip/methods/thoughts/, the machinery zoomr
and sumr share) hold no methods and are not searched.
"""

from __future__ import annotations

import importlib
import pkgutil

from kvzip.errors import UserError
from kvzip.methods.base import KVCache, KVLayer, Method

# Display order for the known methods; any other method follows in file order.
_ORDER = ["full", "window", "h2o", "rkv", "sumr", "zoomr", "lexico", "fadkv", "hf-fp8", "hf-int4", "hf-int2"]


def _discover() -> dict[str, type[Method]]:
    found: dict[str, type[Method]] = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name == "base" or info.ispkg:
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, Method) and obj.name and obj.__module__ == module.__name__:
                found[obj.name] = obj
    rank = {name: i for i, name in enumerate(_ORDER)}
    return dict(sorted(found.items(), key=lambda kv: rank.get(kv[0], len(rank))))


METHODS: dict[str, type[Method]] = _discover()


def get_method(name: str, opts: dict[str, str] | None = None) -> Method:
    """Build a method from its name and `--opt key=value` strings; UserError naming the allowed values otherwise."""
    if name not in METHODS:
        raise UserError(f"unknown method '{name}'; use one of: {', '.join(METHODS)}")
    return METHODS[name].from_options(opts or {})


__all__ = ["METHODS", "KVCache", "KVLayer", "Method", "get_method"]
