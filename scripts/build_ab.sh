#!/usr/bin/env bash
# Two welder commits on one model, side by side on one GPU: what a runtime change is worth.
#
#   git archive OLD | tar x -C .old-code       # the older tree, carried to the GPU machine
#   source .device/setup.sh; bash scripts/build_ab.sh .old-code bsrn --bs 64 --fp16
#
# MODEL is exported once (`welder export MODEL ARGS`, with this checkout's code) and tuned
# by both trees from one tuning cache, the older first: where their search is the same the
# newer tune finds every config cached, so the two builds differ by what changed after
# planning (codegen, the runtime) alone.  Then: the newer build checked against onnxruntime
# on the GPU, both timed in turns by scripts/env_ab.py (ROUNDS rounds, default 5, of
# `welder run --iters ITERS --number NUMBER`, default 50 and 10: fewer for a model of tens
# of milliseconds), `welder profile` of each as JSON, and the newer
# main_test under compute-sanitizer's memcheck.  Everything goes to $OUT (default
# /tmp/welder-ab): ab.txt (the log; its tail is the summary), profile_old.json and
# profile_new.json.  Exit 2 on bad arguments, 1 when a step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "$#" -lt 2 ] || [ ! -f "$1/welder/cli.py" ]; then
  echo "usage: $0 OLD_TREE MODEL [welder export options]  (OLD_TREE: a welder source tree)" >&2
  exit 2
fi
old_tree=$(cd "$1" && pwd)
shift
root=$PWD
out=${OUT:-/tmp/welder-ab}
work=${WORK:-/tmp/welder-ab-work}
rm -rf "$work"
mkdir -p "$out" "$work"
log=$out/ab.txt
: > "$log"
export WELDER_CACHE_DIR=$work/cache
WELDER='import sys; from welder.cli import main; sys.exit(main(sys.argv[1:]))'
new() { python -c "$WELDER" "$@"; }
old() { (cd "$old_tree" && PYTHONPATH="$old_tree${PYTHONPATH:+:$PYTHONPATH}" python -c "$WELDER" "$@"); }
failed=0
step() {  # a named step, its output logged; a failure is remembered, the rest still runs
  local name=$1
  shift
  echo "== $name ($SECONDS s)" >> "$log"
  "$@" >> "$log" 2>&1 || { failed=1; echo "!! $name failed" >> "$log"; }
}
step "export $*" new export "$@" --prefix "$work/new"
cp -r "$work/new" "$work/old"
step "tune old ($old_tree)" old tune "$work/old"
step "tune new ($root)" new tune "$work/new"
for v in old new; do
  grep -m1 "kernel launches" "$work/$v/nnfusion_rt/cuda_codegen/nnfusion_rt.cu" >> "$log" 2>&1
done
step "check new" new check "$work/new" --backend gpu
step "turns" python scripts/env_ab.py "$work/old" "$work/new" --set WELDER_AB=1 --rounds "${ROUNDS:-5}" \
  --iters "${ITERS:-50}" --number "${NUMBER:-10}"
step "profile old" new profile "$work/old" --json "$out/profile_old.json" --top 5
step "profile new" new profile "$work/new" --json "$out/profile_new.json" --top 5
step "memcheck new" compute-sanitizer --tool memcheck --error-exitcode 1 \
  "$work/new/nnfusion_rt/cuda_codegen/build/main_test" --iters 2 --warmup 1
echo "== done ($SECONDS s)" >> "$log"
grep -E "^(==|!!)|kernel launches|^/|PASS|FAIL|ERROR SUMMARY|end to end|kernels:" "$log"
exit "$failed"
