"""The method registry: every `--method` name maps to a Method dataclass; CLI choices, tests and bench read it."""

from __future__ import annotations

from kvzip.errors import UserError
from kvzip.methods.base import KVCache, KVLayer, Method
from kvzip.methods.full import Full
from kvzip.methods.window import Window

METHODS: dict[str, type[Method]] = {cls.name: cls for cls in (Full, Window)}


def get_method(name: str, opts: dict[str, str] | None = None) -> Method:
    """Build a method from its name and `--opt key=value` strings; UserError naming the allowed values otherwise."""
    if name not in METHODS:
        raise UserError(f"unknown method '{name}'; use one of: {', '.join(METHODS)}")
    return METHODS[name].from_options(opts or {})


__all__ = ["METHODS", "KVCache", "KVLayer", "Method", "get_method"]
