"""Integration tier: `kvzip generate` served by a warm process (kvzip/warm.py) on the default model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

PROMPT = "What is the capital of France? Answer in one word."


def _env(tmp_path) -> dict:
    return {**os.environ, "KVZIP_WARM": "1", "KVZIP_WARM_DIR": str(tmp_path / "run"), "KVZIP_WARM_IDLE": "120"}


def _console(env, *args, timeout=300):
    """The `kvzip` console script's entry (kvzip.warm.main), as a user's shell runs it."""
    code = "import sys; from kvzip.warm import main; sys.argv = ['kvzip', *sys.argv[1:]]; main()"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout, env=env)


def _remote(env, *args, timeout=300):
    """Only the warm path: exit 100 when no warm process answered, else the served command's own exit code."""
    code = ("import sys; from kvzip.warm import _run_remote; c = _run_remote(sys.argv[1:]); "
            "sys.exit(100 if c is None else c)")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout, env=env)


def _socket(env):
    from kvzip.warm import socket_path

    return socket_path(env)


def test_second_generate_is_served_warm_with_the_same_answer_and_exit_codes(tmp_path):
    env = _env(tmp_path)
    args = ("generate", "--json", "--max-new-tokens", "8", PROMPT)
    assert _remote(env, *args).returncode == 100  # nothing warm yet
    cold = _console(env, *args)
    assert cold.returncode == 0, cold.stderr
    path = _socket(env)
    deadline = time.time() + 120
    while not path.exists() and time.time() < deadline:  # the first command left a warm process starting
        time.sleep(0.5)
    assert path.exists(), "the first kvzip generate did not leave a warm process"
    try:
        warm = _remote(env, *args)
        assert warm.returncode == 0, warm.stderr
        assert json.loads(warm.stdout)["completion"] == json.loads(cold.stdout)["completion"]
        assert "Paris" in json.loads(warm.stdout)["completion"]
        bad = _remote(env, "generate", "--method", "nope", "x")
        assert bad.returncode == 2
        assert bad.stderr.strip().startswith("kvzip: error: unknown method 'nope'") and "\n" not in bad.stderr.strip()
    finally:
        stop = subprocess.run([sys.executable, "-m", "kvzip.warm", "stop"], capture_output=True, text=True, env=env)
    assert stop.stdout.strip() == "stopped"
    deadline = time.time() + 10
    while path.exists() and time.time() < deadline:
        time.sleep(0.2)
    assert not path.exists()


def test_warm_is_off_with_kvzip_warm_0(tmp_path):
    env = {**_env(tmp_path), "KVZIP_WARM": "0"}
    out = _console(env, "generate", "--max-new-tokens", "2", "Hi")
    assert out.returncode == 0, out.stderr
    time.sleep(2)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("change", [{"OMP_NUM_THREADS": "1"}, {"KVZIP_CACHE": "/elsewhere"}])
def test_socket_key_follows_what_the_warm_process_fixed_at_import(tmp_path, change):
    env = _env(tmp_path)
    assert _socket(env) == _socket(dict(env))
    assert _socket({**env, **change}) != _socket(env)
