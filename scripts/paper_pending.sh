#!/usr/bin/env bash
# One piece of the paper's figures and tables on a GPU machine lent for minutes at a time:
# artifacts/$SCRIPT/run_all.py (default Figure9_10) with $ARGS (e.g. "--models nafnet --bs 1"),
# $GPUS cases at once (default: every visible GPU), stopped after $LIMIT s (default 540),
# no case started after $DEADLINE s (default LIMIT - 240); $RUNS is the scripts' --runs
# (default runs/paper; --runs in ARGS is refused, as the tune logs come back from RUNS: a
# folder outside the checkout, such as /tmp/welder-paper-runs, keeps the exports and builds
# for the next call on a machine still warm, where the checkout is copied afresh).
#
# The state a run goes on from is .paper-state/ in the checkout, when it is there: the
# results folder (results/: a run skips the lines its CSVs hold), the tuning cache
# (cache/tuning.db, or gzipped as cache/tuning.db.gz, a tenth of the size) and commit (the
# welder commit, for a copy without git history).  It is copied in before the run, and the
# state -- results with their PNGs, and a consistent copy of the cache -- goes back as
# paper-state.tgz in $OUT (or /tmp/welder-paper) every 15 s while the run lasts and once at
# its end, so a run cut short still returns what it measured.  Unpack it into .paper-state/
# for the next run (scripts/paper_state.sh seeds it in a fresh checkout), and copy results/
# into artifacts/results/<GPU>/ to commit it.  Each welder build's tuned.json (every group's
# measured and predicted latency, every config it timed) comes back beside it in tuned.tar
# (one file, as a machine may return only a few), gzipped, as
# tuned/tuned_<variant>_<case>.json.gz, its log (the tune's stderr, a line a group, also of a
# tune cut short) as tuned/log_<variant>_<case>.txt.gz, with each case's model as a skeleton
# (tuned/model_<case>.onnx.gz, scripts/model_skeleton.py): what scripts/calibration.py,
# scripts/ranking.py --rerank and a look at the slowest kernels read, kept out of the
# state a next run carries.
#
#   source .device/setup.sh; SCRIPT=Figure9_10 ARGS="--models nafnet --bs 1" bash scripts/paper_pending.sh
#
# Two scripts at once, each on two of four GPUs and half the cores, sharing the state:
#   CUDA_VISIBLE_DEVICES=0,1 GPUS=2 SCRIPT=Figure13 ARGS=... taskset -c 0-31 bash scripts/paper_pending.sh &
#   CUDA_VISIBLE_DEVICES=2,3 GPUS=2 SCRIPT=Figure10b ARGS=... taskset -c 32-63 bash scripts/paper_pending.sh; wait
# or one a GPU, each with its own log: scripts/paper_side_by_side.sh "0|Table5|ARGS" "1|Figure11|ARGS" ...
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ " ${ARGS:-} " =~ [[:space:]]--runs([=[:space:]]|$) ]]; then
  # the scripts would build there while the pack looks for the tune logs under RUNS
  echo "$0: ARGS holds --runs; set RUNS instead (ARGS: ${ARGS})" >&2
  exit 2
fi
out=${OUT:-/tmp/welder-paper}
state=${STATE:-/tmp/welder-paper-state}
limit=${LIMIT:-540}
gpus=${GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}
[ "$gpus" -ge 1 ] 2>/dev/null || gpus=1
mkdir -p "$out" "$state/results" "$state/cache"
if [ -d .paper-state ]; then
  # under the pack lock: a script started beside another must not open a half-copied cache
  # the cache may come gzipped (cache/tuning.db.gz: a tenth of the size, to fit a transfer)
  ( flock 9; cp -rn .paper-state/. "$state/"
    db="$state/cache/tuning.db"
    if [ -f "$db.gz" ] && [ ! -f "$db" ]; then gunzip -c "$db.gz" > "$db.tmp" && mv "$db.tmp" "$db"; fi
  ) 9>"$state/pack.lock"
fi
export WELDER_COMMIT=${WELDER_COMMIT:-$(cat .paper-state/commit 2>/dev/null || git rev-parse --short HEAD)}

pack() {
  # two runs may share one state (two scripts, each on some of the GPUs): one pack at a time
  exec 9>"$state/pack.lock"
  flock 9
  python - "$state" "${RUNS:-runs/paper}" "$state/tuned" <<'PY'
import sqlite3
import sys
from gzip import compress
from pathlib import Path

sys.path.insert(0, "scripts")
import model_skeleton  # noqa: E402

state, runs, tuned = (Path(a) for a in sys.argv[1:4])
db, copy = state / "cache" / "tuning.db", state / "pack" / "cache" / "tuning.db"
copy.parent.mkdir(parents=True, exist_ok=True)
if db.is_file():  # the cache is in WAL mode: a backup is consistent, a file copy may not be
    with sqlite3.connect(db) as source, sqlite3.connect(copy) as target:
        source.backup(target)


def gzip_newer(path: Path, record: Path) -> None:
    """``record``, a gzipped copy of ``path``, rewritten where ``path`` changed since."""
    if not record.is_file() or record.stat().st_mtime < path.stat().st_mtime:
        tuned.mkdir(parents=True, exist_ok=True)
        record.write_bytes(compress(path.read_bytes(), compresslevel=9, mtime=0))


for path in sorted(runs.glob("*/*/tune.log")):  # also a tune cut short: where its time went
    gzip_newer(path, tuned / f"log_{path.parent.parent.name}_{path.parent.name}.txt.gz")
for path in sorted(runs.glob("*/*/tuned.json")):
    gzip_newer(path, tuned / f"tuned_{path.parent.parent.name}_{path.parent.name}.json.gz")
    # the graph the tune planned, for scripts/ranking.py --rerank (weights zeroed: kilobytes)
    skeleton = tuned / f"model_{path.parent.name}.onnx.gz"
    if not skeleton.is_file() and (path.parent / "model.onnx").is_file():
        try:
            model_skeleton.write(path.parent / "model.onnx", skeleton)
        except Exception as e:  # a model still being copied: the next pack tries again
            skeleton.unlink(missing_ok=True)
            print(f"pack: no skeleton of {path.parent} yet ({e})", file=sys.stderr)
PY
  [ -d "$state/tuned" ] && tar cf "$out/tuned.tar" -C "$state" tuned
  tar czf "$out/paper-state.tgz.tmp" -C "$state" results -C "$state/pack" cache \
    && mv "$out/paper-state.tgz.tmp" "$out/paper-state.tgz"
  flock -u 9
}

( while sleep 15; do pack; done ) &
packer=$!
# shellcheck disable=SC2086
timeout "$limit" python "artifacts/${SCRIPT:-Figure9_10}/run_all.py" --runs "${RUNS:-runs/paper}" $ARGS --gpus "$gpus" \
  --out "$state/results" --cache-dir "$state/cache" --deadline-s "${DEADLINE:-$((limit > 300 ? limit - 240 : 60))}"
echo "run_all: exit $?"
kill "$packer" 2>/dev/null
wait "$packer" 2>/dev/null
pack
ls -la "$state/results"
