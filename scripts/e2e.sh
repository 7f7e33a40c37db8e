#!/usr/bin/env bash
# One model end to end on the GPU machine: export, `welder tune` cold, `welder tune` again
# (every group must come from the tuning cache), main_test, test_acc, run_welder, and the
# PyTorch peers on the same module.  Usage: scripts/e2e.sh MODEL BATCH [TOPK]
set -uo pipefail
cd "$(dirname "$0")/.."
name=$1
bs=$2
topk=${3:-8}
prefix=${E2E_DIR:-/tmp/e2e}/${name}_b${bs}
export WELDER_CACHE_DIR=${WELDER_CACHE_DIR:-/tmp/e2e-cache}
rm -rf "$WELDER_CACHE_DIR"

python -m welder.cli export "$name" --prefix "$prefix" --bs "$bs" || exit 1
seconds() { python -c "import time; print(f'{time.time() - $1:.1f}')"; }
start=$(python -c "import time; print(time.time())")
python -m welder.cli tune "$prefix" --arch auto --topk "$topk" > "$prefix/tune_cold.log" 2>&1 || { tail -20 "$prefix/tune_cold.log"; exit 1; }
cold=$(seconds "$start")
start=$(python -c "import time; print(time.time())")
python -m welder.cli tune "$prefix" --arch auto --topk "$topk" > "$prefix/tune_warm.log" 2>&1 || { tail -20 "$prefix/tune_warm.log"; exit 1; }
warm=$(seconds "$start")
hits=$(python -c "import json,sys; g=json.load(open(sys.argv[1]))['groups']; print(f\"{sum(1 for x in g if x.get('from_cache'))}/{len(g)}\")" "$prefix/tuned.json")
python - <<'PY'
from collections import Counter
from welder.tune.cache import TuningCache
cache = TuningCache()
entries = cache.entries()
print("cache:", cache.stats())
print("distinct keys (gpu, arch, compiler, topk):", Counter((e.key.gpu, e.key.arch, e.key.compiler, e.topk) for e in entries))
PY
grep -ci "cache" "$prefix/tune_warm.log" | sed 's/^/warm-log lines mentioning the cache: /'
tail -3 "$prefix/tune_warm.log"
grep -E "^[0-9]+ kernels" "$prefix/tune_cold.log"
grep -E "^(model latency|time): " "$prefix/tune_cold.log"
python -c "import json,sys; t=json.load(open(sys.argv[1]))['totals']; print('tuned.json totals:', {k: t.get(k) for k in ('predicted_latency_us', 'measured_kernels_us', 'measured_runtime_us', 'tuning_seconds', 'build_seconds', 'total_seconds')})" "$prefix/tuned.json"
echo "== main_test"
"$prefix/nnfusion_rt/cuda_codegen/build/main_test" | tail -2
echo "== test_acc"
python artifacts/test_acc.py "$prefix"
acc=$?
echo "== run_welder (CUDA graph replay, the default)"
python artifacts/run_welder.py "$prefix" | tail -1
echo "== PyTorch"
python artifacts/run_torch.py "$prefix" 2>&1 | grep -v Warning | tail -3
echo "SUMMARY $name bs=$bs topk=$topk: tune cold ${cold} s, warm ${warm} s, cache hits ${hits}, test_acc exit ${acc}"
