#!/usr/bin/env bash
# Nsight Compute over the tensor-core kernels of scripts/mma_bench.py and cuBLAS's kernel for
# the same shapes: each launched once (mma_bench --profile), with the sections that say where
# a compute-bound product loses time -- throughput against the peaks (SpeedOfLight), L2 and
# DRAM traffic (MemoryWorkloadAnalysis), why warps stall (WarpStateStats) -- and a short table
# of the headline metrics last.  BENCH=conv_bench profiles scripts/conv_bench.py's
# convolutions beside cuDNN's instead (SHAPES and CANDIDATES as there; no DTYPE).  On the GPU
# machine:
#
#   source .device/setup.sh; bash scripts/ncu_mma.sh [SHAPES] [CANDIDATES] [KINDS]
#
# SHAPES: mma_bench's shape indices (default 3,4: the two 8192-row products); CANDIDATES per
# family (default 2); KINDS (default wgmma); DTYPE (default fp16; fp32 profiles the ffma kind
# beside cuBLAS's exact SGEMM).  Writes ncu.csv and ncu.log to $OUT (or
# /tmp/welder-ncu).
set -uo pipefail
cd "$(dirname "$0")/.."
shapes=${1:-3,4}
candidates=${2:-2}
kinds=${3:-wgmma}
out=${OUT:-/tmp/welder-ncu}
bench=${BENCH:-mma_bench}
extra=()
if [ "$bench" = mma_bench ]; then
  extra=(--dtype "${DTYPE:-fp16}")
fi
mkdir -p "$out"
# The SM clock under load, the FMA pipe's busy share, shared-memory wavefronts per load
# instruction, and the stall reasons that tell a product fed too slowly from shared memory
# (short scoreboard, MIO throttle) from one held at its barriers or by its math pipe.
stalls=sm__cycles_elapsed.avg.per_second,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active
stalls+=,smsp__inst_executed_op_shared_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum
# Warp instructions, issued per active cycle, and the warps resident: a kernel of few warps
# that issues slowly (a gather's index arithmetic) against one waiting on memory.
stalls+=,smsp__inst_executed.sum,smsp__inst_executed.avg.per_cycle_active,sm__warps_active.avg.per_cycle_active
for reason in short_scoreboard mio_throttle barrier math_pipe_throttle long_scoreboard wait not_selected; do
  stalls+=,smsp__average_warps_issue_stalled_${reason}_per_issue_active.ratio
done
ncu --profile-from-start off --target-processes all \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
  --metrics "gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum,$stalls" \
  --csv --page details \
  python "scripts/$bench.py" --profile --kinds "$kinds" --shapes "$shapes" --candidates "$candidates" \
  "${extra[@]}" \
  >"$out/ncu.csv" 2>"$out/ncu.log"
rc=$?
python - "$out/ncu.csv" <<'PY'
import csv
import sys
from collections import defaultdict

# The rows of interest per kernel, in the units ncu reports them.
WANTED = {
    "Duration": "time",
    "Compute (SM) Throughput": "SM %",
    "Memory Throughput": "mem %",
    "L2 Cache Throughput": "L2 %",
    "DRAM Throughput": "DRAM %",
    "lts__t_bytes.sum": "L2 bytes",
    "dram__bytes_write.sum": "DRAM written",
    "Warp Cycles Per Issued Instruction": "cycles/issue",
    "sm__cycles_elapsed.avg.per_second": "SM clock",
    "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active": "FMA pipe %",
    "smsp__inst_executed_op_shared_ld.sum": "LDS",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum": "LDS wavefronts",
    "smsp__inst_executed.sum": "warp instrs",
    "smsp__inst_executed.avg.per_cycle_active": "IPC/SMSP",
    "sm__warps_active.avg.per_cycle_active": "warps/SM",
}
for reason in ("short_scoreboard", "mio_throttle", "barrier", "math_pipe_throttle", "long_scoreboard", "wait", "not_selected"):
    WANTED[f"smsp__average_warps_issue_stalled_{reason}_per_issue_active.ratio"] = f"stall {reason}"
lines = [ln for ln in open(sys.argv[1]) if ln.startswith('"')]
table: dict[tuple[str, str], dict[str, str]] = defaultdict(dict)
for row in csv.DictReader(lines):
    name = row.get("Metric Name", "")
    if name in WANTED:
        key = (row.get("ID", ""), row.get("Kernel Name", "")[:48])
        table[key][WANTED[name]] = f"{row.get('Metric Value', '')} {row.get('Metric Unit', '')}".strip()
cols = list(WANTED.values())
print("| id | kernel | " + " | ".join(cols) + " |")
print("|" + "---|" * (len(cols) + 2))
for (kid, kernel), vals in table.items():
    print(f"| {kid} | {kernel} | " + " | ".join(vals.get(c, "") for c in cols) + " |")
PY
tail -n 5 "$out/ncu.log"
exit $rc
