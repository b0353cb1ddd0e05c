"""Integration tier: the real default model (SmolLM2-135M-Instruct), loaded once per session."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if "/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def default_model():
    from kvzip.models import load_model

    return load_model("smollm2-135m", device="cpu")


def run_cli(*args: str, stdin: str | None = None, timeout: int = 1800, env: dict | None = None):
    """Run `kvzip ...` in a subprocess; returns CompletedProcess with text stdout/stderr. Timeouts here only catch a
    hang: they are sized for a 2-core machine without native bf16 (fp32, ~5x slower per step than the AMX one the
    tier was first timed on), not as speed checks."""
    return subprocess.run(
        [sys.executable, "-m", "kvzip.cli", *args], input=stdin, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **(env or {})},
    )
