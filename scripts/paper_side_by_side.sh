#!/usr/bin/env bash
# Several paper scripts at once on one machine, one GPU each, sharing one state: each
# argument is "GPU|SCRIPT|ARGS" and runs scripts/paper_pending.sh for SCRIPT with ARGS on that
# GPU alone and its share of the cores (CORES per GPU, default: the cores over the GPUs),
# logging to $OUT/log_<GPU>.txt; LIMIT and DEADLINE apply to each.  At the end it prints the
# last TAIL (default 25) lines of each log.  The state comes back as paper_pending.sh
# returns it (paper-state.tgz and tuned.tar in $OUT).
#
#   bash scripts/paper_side_by_side.sh "0|Table5|--models resnet50 --bs 64" \
#     "1|Figure11|--models nerf --bs 1 --dtype fp16" "2|Figure10b|--bs 1" "3|Table4|--dtype fp16"
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/welder-paper}
mkdir -p "$out"
if [ "$#" -eq 0 ]; then
  echo "usage: $0 'GPU|SCRIPT|ARGS' ..." >&2
  exit 2
fi
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
cores=${CORES:-$(( $(nproc) / (gpus > 0 ? gpus : 1) ))}
for spec in "$@"; do
  IFS='|' read -r gpu script args <<<"$spec"
  if ! [[ "$gpu" =~ ^[0-9]+$ ]] || [ ! -f "artifacts/$script/run_all.py" ]; then
    echo "$0: '$spec' is not GPU|SCRIPT|ARGS with a script of artifacts/" >&2
    exit 2
  fi
done
for spec in "$@"; do
  IFS='|' read -r gpu script args <<<"$spec"
  lo=$((gpu * cores))
  CUDA_VISIBLE_DEVICES=$gpu GPUS=1 SCRIPT=$script ARGS=$args OUT=$out \
    taskset -c "$lo-$((lo + cores - 1))" bash scripts/paper_pending.sh > "$out/log_$gpu.txt" 2>&1 &
done
wait
for spec in "$@"; do
  gpu=${spec%%|*}
  echo "=== GPU $gpu: ${spec#*|}"
  grep -v '^\s*$' "$out/log_$gpu.txt" | grep -v '^cp:\|^tar:\|^total\|^-rw\|^d' | tail -"${TAIL:-25}"
done
