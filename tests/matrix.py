"""The one place the tests take each method's small options from: `Method.test_options`, declared by the method.

Every test that runs "every registered method" parametrizes over `METHOD_NAMES` and builds with `tiny_method`, so a
new method file is covered by the whole matrix without editing a test.
"""

from __future__ import annotations

from kvzip.methods import METHODS, get_method

METHOD_NAMES = list(METHODS)


def tiny_options(name: str) -> dict[str, str]:
    return dict(METHODS[name].test_options)


def tiny_method(name: str, **overrides: str):
    """The method under its small test options, with `overrides` (option strings) on top."""
    return get_method(name, {**tiny_options(name), **overrides})


def lossless_method(name: str):
    """The method at a budget beyond any test sequence (`Method.lossless_options`), or None when it has none."""
    opts = METHODS[name].lossless_options
    return None if opts is None else tiny_method(name, **opts)


def needs_dictionary(name: str) -> bool:
    return bool(tiny_method(name).needs_dictionary)
