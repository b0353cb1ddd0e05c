#!/usr/bin/env bash
# GPU check, for sessions lent a CUDA machine: on a fresh machine, set up (scripts/setup.sh), run the GPU-marked
# tests (`pytest -m gpu`), then `kvzip bench --quick --device cuda` with its JSON, table and plot written to $OUT
# (default ./out). Budget: under 5 minutes on one GPU once set up (the bench is capped at 4). Exit code: non-zero
# when either step fails; both steps always run.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"

if [ -f scripts/setup.sh ]; then
  bash scripts/setup.sh > "$OUT/setup.log" 2>&1 || { echo "setup failed, see $OUT/setup.log"; tail -20 "$OUT/setup.log"; exit 1; }
elif [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv && .venv/bin/python -m pip install -q -e ".[test]" || exit 1
fi
nvidia-smi -L || true
.venv/bin/python -c "import torch; assert torch.cuda.is_available(), 'torch does not see CUDA'; print('torch', torch.__version__, torch.cuda.get_device_name(0))" || exit 1

status=0
.venv/bin/python -m pytest -m gpu -ra -q 2>&1 | tee "$OUT/gpu_tests.txt" || status=1
timeout 240 .venv/bin/kvzip bench --quick --device cuda --json "$OUT/bench_quick_cuda.json" \
  --plot "$OUT/bench_quick_cuda.png" 2>&1 | tee "$OUT/bench_quick_cuda.txt" || status=1
echo "gpu_check: $([ $status = 0 ] && echo passed || echo FAILED); results in $OUT"
exit $status
