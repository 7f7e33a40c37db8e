#!/usr/bin/env bash
# Several paper scripts at once on one machine, one GPU each, sharing one state: each
# argument is "GPU|SCRIPT|ARGS" and runs scripts/paper_pending.sh for SCRIPT with ARGS on that
# GPU alone and its share of the cores (CORES per GPU, default: the cores over the GPUs),
# logging to $OUT/log_<GPU>.txt.  Specs naming the same GPU run on it in turn, in the order
# given, so that a GPU whose first script ends early goes on to the next: LIMIT (default
# 540) bounds each GPU's whole turn, each script getting what is left of it (none started
# with under MIN_LEFT, default 90 s, left), and DEADLINE, where set, is counted from the
# start too (otherwise each script takes paper_pending.sh's default from what it has
# left).  At the end it prints the last TAIL (default 25) lines of each log.  The state
# comes back as paper_pending.sh returns it (paper-state.tgz and tuned.tar in $OUT).
#
#   bash scripts/paper_side_by_side.sh "0|Table5|--models resnet50 --bs 64" \
#     "1|Figure11|--models nerf --bs 1 --dtype fp16" "2|Figure10b|--bs 1" "3|Table4|--dtype fp16" \
#     "1|Figure13|--models nerf --bs 1"
#
# Before any GPU starts, each script lists what it would measure (--pending) against the
# state's results: a spec whose arguments the script refuses (an unknown model), or that
# has nothing left to measure, stops the whole run (exit 2), so that no GPU idles through a
# lent machine's minutes (PAPER_RESULTS names another results folder to check against).
# PREFLIGHT_ONLY=1 stops after that check: run it on the development machine before asking
# for a GPU.  PAPER_PENDING names another runner than scripts/paper_pending.sh (the tests').
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
results=${PAPER_RESULTS:-.paper-state/results}
[ -d "$results" ] || results=$(mktemp -d)
# the listings all at once (a few seconds each, on a machine whose minutes are counted)
lists=$(mktemp -d)
trap 'rm -rf "$lists"' EXIT
k=0
for spec in "$@"; do
  IFS='|' read -r gpu script args <<<"$spec"
  # shellcheck disable=SC2086  # ARGS is a list of options
  ( PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python "artifacts/$script/run_all.py" $args \
      --out "$results" --pending > "$lists/$k" 2>&1; echo $? > "$lists/$k.rc" ) &
  k=$((k + 1))
done
wait
k=0
for spec in "$@"; do
  listed=$(cat "$lists/$k")
  rc=$(cat "$lists/$k.rc")
  k=$((k + 1))
  if [ "$rc" != 0 ]; then
    printf '%s: %s refuses its arguments:\n%s\n' "$0" "$spec" "$(tail -1 <<<"$listed")" >&2
    exit 2
  fi
  if grep -q '^0 case(s) to measure' <<<"$listed"; then
    echo "$0: '$spec' has nothing left to measure in $results" >&2
    exit 2
  fi
  echo "$spec: $(tail -1 <<<"$listed")"
done
[ -n "${PREFLIGHT_ONLY:-}" ] && exit 0
limit=${LIMIT:-540}
start=$SECONDS
pending=${PAPER_PENDING:-scripts/paper_pending.sh}

turn() {
  # the specs of one GPU ($1), in turn, each with what is left of the limit
  local gpu=$1 spec script args left
  shift
  local lo=$((gpu * cores))
  : > "$out/log_$gpu.txt"
  for spec in "$@"; do
    IFS='|' read -r _ script args <<<"$spec"
    left=$((limit - (SECONDS - start)))
    if [ "$left" -lt "${MIN_LEFT:-90}" ]; then
      echo "=== not started, ${left} s left: $spec" >> "$out/log_$gpu.txt"
      continue
    fi
    echo "=== $spec (${left} s left)" >> "$out/log_$gpu.txt"
    ( export LIMIT=$left
      if [ -n "${DEADLINE:-}" ]; then
        d=$((DEADLINE - (SECONDS - start)))
        export DEADLINE=$((d > 1 ? d : 1))
      fi
      CUDA_VISIBLE_DEVICES=$gpu GPUS=1 SCRIPT=$script ARGS=$args OUT=$out \
        taskset -c "$lo-$((lo + cores - 1))" bash "$pending" ) >> "$out/log_$gpu.txt" 2>&1
  done
}

gpus_named=()
for spec in "$@"; do
  gpu=${spec%%|*}
  [[ " ${gpus_named[*]} " == *" $gpu "* ]] || gpus_named+=("$gpu")
done
for gpu in "${gpus_named[@]}"; do
  mine=()
  for spec in "$@"; do [ "${spec%%|*}" = "$gpu" ] && mine+=("$spec"); done
  turn "$gpu" "${mine[@]}" &
done
wait
for gpu in "${gpus_named[@]}"; do
  echo "=== GPU $gpu"
  grep -v '^\s*$' "$out/log_$gpu.txt" | grep -v '^cp:\|^tar:\|^total\|^-rw\|^d' | tail -"${TAIL:-25}"
done
