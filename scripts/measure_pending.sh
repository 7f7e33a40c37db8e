#!/usr/bin/env bash
# The GPU measurements the last changes are waiting for, in one call of under ten minutes:
# scripts/benchmark.py on $CONFIGS (default: bert:1:fp16,vit_small_p32:64:fp16) with
# $SYSTEMS (default: welder,eager,compile) at --topk $TOPK (default 20): device time and
# call latency for every system, then each welder tune's wall time and where it went
# (tuned.json's tuning_phase_seconds) and what it did (tuning_work).
# Writes the table (JSON and markdown) and $NAME-files.tgz (logs, each row's tuned.json, and
# the state below) to $OUT (or /tmp/welder-pending), and prints the tables last.
#
# A table longer than one call: GPUS=4 measures four configs at once on a four-GPU machine
# (benchmark.py --gpus); the rows, the exports and the tuning cache stay in $STATE
# (default /tmp/welder-table) on the machine, so the next call on the same warm machine
# goes on with the configs not yet measured (--skip-done), and a tune cut short resumes
# from its cache.  On a fresh machine, unpack the archive's state/ into .table-state/ here
# (`mkdir .table-state && tar xzf FILES.tgz -C /tmp/x && cp -r /tmp/x/state/. .table-state/`)
# and carry it.  DEADLINE=S starts no config after S seconds, so that a call's last rows are
# not cut off mid-tune (their cold tune time would be lost).
# The table so far is copied to $OUT every 15 s, so a call cut short still returns its rows.
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
configs=${CONFIGS:-bert:1:fp16,vit_small_p32:64:fp16}
systems=${SYSTEMS:-welder,eager,compile}
name=${NAME:-benchmark}
start=$(date +%s)

state=${STATE:-/tmp/welder-table}
runs=$state/runs
# A fresh machine goes on from what an earlier call brought back (the archive's state/),
# carried here as .table-state/: the rows and the tuning cache (exports are redone).
if [ -d .table-state ] && [ ! -d "$state" ]; then
  mkdir -p "$state" && cp -r .table-state/. "$state/"
fi
mkdir -p "$state/cache"
# The rows so far go to $out every 15 s: a call cut short by the device's own limit (which
# can be lower than LIMIT once the machine's lent time runs low) still brings them back.
( while sleep 15; do cp "$state/$name.json" "$state/$name.md" "$out/" 2>/dev/null; done ) &
copier=$!
timeout "${LIMIT:-540}" python scripts/benchmark.py --configs "$configs" --systems "$systems" --topk "${TOPK:-20}" \
  --runs "$runs" --json "$state/$name.json" --out "$state/$name.md" --gpus "${GPUS:-1}" --skip-done \
  --cache-dir "$state/cache" ${DEADLINE:+--deadline-s "$DEADLINE"} 2>&1 | grep -v "^\[.*\] started on GPU" | tail -n "${TAIL:-4}"
kill "$copier" 2>/dev/null
cp "$state/$name.json" "$state/$name.md" "$out/" 2>/dev/null
# Everything else goes back in one archive: the workers' logs, each row's tuned.json (gzipped,
# as artifacts/results keeps it), and the state a fresh machine goes on from (.table-state/).
bundle=$(mktemp -d)
mkdir -p "$bundle/logs" "$bundle/tuned" "$bundle/state/cache"
cp "$state"/*.log "$bundle/logs/" 2>/dev/null
cp "$state/$name.json" "$bundle/state/" 2>/dev/null
cp "$state"/cache/tuning.db* "$bundle/state/cache/" 2>/dev/null
python - "$runs" "$bundle/tuned" <<'PY'
import gzip
import json
import sys
from pathlib import Path

for tuned in sorted(Path(sys.argv[1]).glob("*/tuned.json")):
    totals = json.loads(tuned.read_text())["totals"]
    record = Path(sys.argv[2]) / f"tuned_{tuned.parent.name}.json.gz"
    record.write_bytes(gzip.compress(tuned.read_bytes(), compresslevel=9, mtime=0))
    phases = ", ".join(f"{k} {v:.0f}" for k, v in totals.get("tuning_phase_seconds", {}).items())
    work = ", ".join(f"{k} {v:.0f}" for k, v in totals.get("tuning_work", {}).items())
    print(f"{tuned.parent.name}: tune {totals['tuning_seconds']:.0f} s ({phases}; {work}), {totals['kernels']} kernels")
PY
tar czf "$out/$name-files.tgz" -C "$bundle" . && rm -rf "$bundle"
cat "$out/$name.md" 2>/dev/null
echo "measure_pending: $(( $(date +%s) - start )) s"
