#!/usr/bin/env bash
# GPU check, for sessions lent a CUDA machine. Steps, each logged under $OUT (default ./out):
#   1. set up (scripts/setup.sh), unless KVZIP_PYTHON names a Python that already has kvzip's dependencies
#      (e.g. a machine with no package index: wheels installed with --target and PYTHONPATH set);
#   2. the GPU-marked tests (`pytest -m gpu`: every method on CUDA in bf16, full == transformers greedy on CUDA);
#   2b. scripts/sync_check.py: host syncs inside the decode forward of every method on the default model (the
#      forward only queues kernels; cache-wide reads belong in the cache's hooks), with the call site of each;
#   3. `kvzip generate --device cuda` on the default model with fadkv and zoomr (CLI path, JSON kept);
#   3b. `kvzip generate --device-map auto` (accelerate spreads the layers over every visible GPU) with fadkv and
#      zoomr on a JSONL batch: the rows must equal those of the model whole on the first GPU (the gpu-marked tests
#      of step 2 check the same on the tiny model, its two layers on the first and the last GPU);
#   3c. with two GPUs or more: `torchrun --nproc-per-node <GPUs> -m kvzip generate` (one rank per GPU, NCCL beside
#      gloo) on the same batch: the rows must equal one process's;
#   4. `kvzip bench --quick --device cuda` (every method on the real model; JSON, table and plot), within a limit;
#   4b. `scripts/measure_coders.py --device cuda` at the shipped (N, s): screening vs OMP time and error on the GPU
#      (the issues' 5x target; on the 2-core CPU it measured 1.6-4.2x, moving with the machine);
#   5. only when KVZIP_BENCH_LIMIT is set (seconds): the full-size `kvzip bench --device cuda`, stopped with SIGINT
#      after that many seconds; the bench keeps every record finished before the interrupt. Off by default: the
#      full-size run does not fit a lease.
# KVZIP_QUICK_LIMIT (seconds, default 300) stops step 4's quick bench, keeping what finished.
# KVZIP_GPU_STEPS picks steps (comma-separated from tests,sync,generate,bench,coders; default all), so that a short
# lease can run them in two calls.
# Exit code: non-zero when a step fails (a full bench cut short by the limit is not a failure); every step runs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"

if [ -n "${KVZIP_PYTHON:-}" ]; then
  PY=$KVZIP_PYTHON
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # kvzip from this checkout, for the scripts too
else
  bash scripts/setup.sh > "$OUT/setup.log" 2>&1 || { echo "setup failed, see $OUT/setup.log"; tail -20 "$OUT/setup.log"; exit 1; }
  PY=.venv/bin/python
fi
nvidia-smi -L || true
"$PY" -c "import torch; assert torch.cuda.is_available(), 'torch does not see CUDA'; print('torch', torch.__version__, torch.cuda.get_device_name(0))" || exit 1
export PYTHONUNBUFFERED=1

status=0
step() { echo "== $1 ($(date +%T))"; }
# bench_within SECONDS NAME ARGS...: `kvzip bench --device cuda ARGS` into $OUT/NAME.{json,png,txt}, stopped with SIGINT
# after SECONDS (the bench keeps every cell finished before the interrupt); a stop at the limit is not a failure.
bench_within() {
  local limit=$1 name=$2
  shift 2
  timeout -s INT "$limit" "$PY" -m kvzip.cli bench --device cuda "$@" --json "$OUT/$name.json" \
    --plot "$OUT/$name.png" > "$OUT/$name.txt" 2>&1
  rc=$?
  tail -30 "$OUT/$name.txt"
  [ $rc = 0 ] || [ $rc = 130 ] || [ $rc = 124 ] || status=1
}
STEPS=",${KVZIP_GPU_STEPS:-tests,sync,generate,bench,coders},"
want() { [[ $STEPS == *",$1,"* ]]; }

if want tests; then
step "pytest -m gpu"
"$PY" -m pytest -m gpu -ra -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.txt" || status=1
fi

if want sync; then
step "scripts/sync_check.py (host syncs in the decode forward, every method, default model)"
"$PY" scripts/sync_check.py --context 128 --steps 16 --json "$OUT/sync_check.json" 2>&1 | tee "$OUT/sync_check.txt" || status=1
fi

if want generate; then
for method in fadkv zoomr; do
  step "kvzip generate --method $method --device cuda"
  "$PY" -m kvzip.cli generate --device cuda --method "$method" --max-new-tokens 96 --json \
    "A train leaves at 3 pm and travels 60 km/h for 2.5 hours. How far does it go? Think step by step." \
    > "$OUT/generate_${method}_cuda.json" 2> "$OUT/generate_${method}_cuda.err" || { status=1; cat "$OUT/generate_${method}_cuda.err"; }
  head -c 600 "$OUT/generate_${method}_cuda.json"; echo
done

step "kvzip generate --method fadkv --opt zoom=4 --device cuda (exact detail in pinned host memory)"
"$PY" -m kvzip.cli generate --device cuda --method fadkv --opt zoom=4 --max-new-tokens 96 --json \
  "A train leaves at 3 pm and travels 60 km/h for 2.5 hours. How far does it go? Think step by step." \
  > "$OUT/generate_fadkv_zoom_cuda.json" 2> "$OUT/generate_fadkv_zoom_cuda.err" || { status=1; cat "$OUT/generate_fadkv_zoom_cuda.err"; }
head -c 600 "$OUT/generate_fadkv_zoom_cuda.json"; echo

printf '%s\n' '{"prompt": "What is 17 x 23? Think step by step."}' '{"prompt": "Name three prime numbers above 50."}' \
  '{"prompt": "Explain why the sky is blue in two sentences."}' > "$OUT/device_map_prompts.jsonl"
for method in fadkv zoomr; do
  step "kvzip generate --method $method --device-map auto (on $("$PY" -c 'import torch; print(torch.cuda.device_count())') GPU(s))"
  "$PY" -m kvzip generate --method "$method" --device cuda --input "$OUT/device_map_prompts.jsonl" --max-new-tokens 64 \
    --output "$OUT/whole_${method}.jsonl" > /dev/null 2>&1 || status=1
  "$PY" -m kvzip generate --method "$method" --device-map auto --input "$OUT/device_map_prompts.jsonl" \
    --max-new-tokens 64 --output "$OUT/spread_${method}.jsonl" 2>&1 | tail -1 || status=1
  "$PY" -c "import json, sys; rows = lambda p: [json.loads(l) for l in open(p)][:-1]; same = rows(sys.argv[1]) == rows(sys.argv[2]); print('same rows as the model whole on one GPU:', same); sys.exit(not same)" \
    "$OUT/whole_${method}.jsonl" "$OUT/spread_${method}.jsonl" || status=1
done

GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
if [ "$GPUS" -ge 2 ]; then
  step "torchrun --nproc-per-node $GPUS -m kvzip generate --method fadkv (one rank per GPU)"
  "$PY" -m torch.distributed.run --standalone --nproc-per-node "$GPUS" -m kvzip generate --method fadkv --device cuda \
    --input "$OUT/device_map_prompts.jsonl" --max-new-tokens 64 --batch-size 1 --output "$OUT/ranks_fadkv.jsonl" \
    > "$OUT/ranks_fadkv.txt" 2>&1 || { status=1; tail -20 "$OUT/ranks_fadkv.txt"; }
  "$PY" -m kvzip generate --method fadkv --device cuda --input "$OUT/device_map_prompts.jsonl" --max-new-tokens 64 \
    --batch-size 1 --output "$OUT/one_fadkv.jsonl" > /dev/null 2>&1 || status=1
  "$PY" -c "import json, sys; rows = lambda p: [json.loads(l) for l in open(p)][:-1]; same = rows(sys.argv[1]) == rows(sys.argv[2]); print('same rows as one process:', same); sys.exit(not same)" \
    "$OUT/one_fadkv.jsonl" "$OUT/ranks_fadkv.jsonl" || status=1
else
  echo "one GPU: the data-parallel step needs two (the CPU tests run two ranks with gloo)"
fi
fi

if want bench; then
step "kvzip bench --quick --device cuda"
t0=$SECONDS
# Within KVZIP_QUICK_LIMIT seconds (default 300): the quick bench's sizes grew since 2026-11-30 and no longer fit a
# 15-minute lease beside the other steps.
bench_within "${KVZIP_QUICK_LIMIT:-300}" bench_quick_cuda --quick
echo "quick bench wall time: $((SECONDS - t0)) s$([ $rc = 0 ] || echo ', stopped at the limit') (the H200 run of 2026-11-30, smaller sizes: 252 s)"
fi

if want coders; then
step "scripts/measure_coders.py --device cuda (shipped N=1024, s=8; pre-RoPE keys)"
"$PY" scripts/measure_coders.py --device cuda --keys pre-rope --configs 1024x8 --out "$OUT/coders_cuda.md" \
  > "$OUT/coders_cuda.txt" 2>&1 || status=1
tail -12 "$OUT/coders_cuda.txt"
fi

if [ -n "${KVZIP_BENCH_LIMIT:-}" ]; then
  step "kvzip bench --device cuda (full size, limit $KVZIP_BENCH_LIMIT s)"
  bench_within "$KVZIP_BENCH_LIMIT" bench_full_cuda
fi
step "done"

echo "gpu_check: $([ $status = 0 ] && echo passed || echo FAILED) in ${SECONDS} s; results in $OUT"
exit $status
