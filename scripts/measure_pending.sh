#!/usr/bin/env bash
# The GPU measurements the last changes are waiting for, in one call of under ten minutes:
#   1. scripts/elementwise_bench.py: elementwise groups, scalar against 16-byte vectors, beside PyTorch;
#   2. bert at batch 64 in fp16, tuned (--topk 4) and profiled with `welder profile`, keeping
#      tuned.json (its fusion_checks say which fusions the GPU disproved and how they split).
# Writes everything to $OUT (or /tmp/welder-pending) and prints the tables last.
#
#   ../shared/device/stage.sh                                  # on the development machine
#   source .device/setup.sh; bash scripts/measure_pending.sh   # on the GPU machine
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -f .device/setup.sh ]; then
  # shellcheck disable=SC1091
  source .device/setup.sh
fi
out=${OUT:-/tmp/welder-pending}
mkdir -p "$out"
export WELDER_CACHE_DIR=${WELDER_CACHE_DIR:-/tmp/welder-pending-cache}
start=$(date +%s)

timeout 150 python scripts/elementwise_bench.py --candidates 3 --json "$out/elementwise.json" 2>&1 | tail -n 20

model=/tmp/welder-pending-bert
timeout 60 python -m welder.cli export bert --prefix "$model" --bs 64 --fp16 --no-check 2>&1 | tail -n 1
timeout 300 python -m welder.cli tune "$model" --topk 4 2>&1 | tail -n 4
cp "$model/tuned.json" "$out/tuned_bert_b64_fp16.json" 2>/dev/null
python - "$model/tuned.json" <<'PY'
import json
import sys

checks = json.load(open(sys.argv[1])).get("fusion_checks", [])
print(f"fusion checks ({len(checks)}):")
for line in checks[:20]:
    print("  " + line[:200])
PY
timeout 60 python -m welder.cli profile "$model" --top 30 --json "$out/profile_bert_b64_fp16.json" 2>&1 | tail -n 45
echo "measure_pending: $(( $(date +%s) - start )) s"
