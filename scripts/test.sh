#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the whole test suite: the fast tier and the integration tier on the default model.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -m "not integration"` for the fast tier alone).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -ra "$@"
