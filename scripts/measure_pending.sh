#!/usr/bin/env bash
# The GPU measurements the last changes are waiting for, in one call of under ten minutes:
#   1. scripts/attention_bench.py: the attention kind beside PyTorch eager and SDPA;
#   2. bert at batch 64 and 1, vit_small_p32 at batch 1, in fp16 beside torch.compile (scripts/benchmark.py,
#      --topk 4), then bert
#      profiled with `welder profile`, keeping tuned.json (its fusion_checks say which
#      fusions the GPU disproved and how they split).
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

timeout 80 python scripts/attention_bench.py --json "$out/attention.json" 2>&1 | tail -n 24

runs=/tmp/welder-pending-runs
timeout 470 python scripts/benchmark.py --configs bert:64:fp16,bert:1:fp16,vit_small_p32:1:fp16 --systems welder,compile --topk 4 \
  --runs "$runs" --json "$out/benchmark_fp16_b64.json" 2>&1 | tail -n 10
model=$(dirname "$(find "$runs" -path '*bert*' -name tuned.json | head -n 1)")
cp "$model/tuned.json" "$out/tuned_bert_b64_fp16.json" 2>/dev/null
python - "$model/tuned.json" <<'PY'
import json
import sys

checks = json.load(open(sys.argv[1])).get("fusion_checks", [])
print(f"fusion checks ({len(checks)}):")
for line in checks[:12]:
    print("  " + line[:200])
PY
[ "${PROFILE:-1}" = 1 ] && timeout 60 python -m welder.cli profile "$model" --top 16 --json "$out/profile_bert_b64_fp16.json" 2>&1 | tail -n 30
echo "measure_pending: $(( $(date +%s) - start )) s"
