#!/usr/bin/env bash
# Everything welder checks on a GPU, in one call: the gpu-marked tests, then a short tuning
# smoke run (a 2-layer BERT tuned cold, then again from the cache, and a small chain fused
# by measurement), then compute-sanitizer (memcheck, racecheck, initcheck, synccheck) over the
# runtimes of scripts/sanitize.py.  Prints short tables last; writes details to $OUT (or
# /tmp/welder-gpu-suite).  Exit 0 only when all three parts pass.
#
#   ../shared/device/stage.sh                      # on the development machine, once
#   source .device/setup.sh; bash scripts/gpu_suite.sh   # on the GPU machine
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -f .device/setup.sh ]; then
  # shellcheck disable=SC1091
  source .device/setup.sh
fi
results=${OUT:-/tmp/welder-gpu-suite}
mkdir -p "$results"
export WELDER_CACHE_DIR=/tmp/welder-gpu-suite-cache   # fresh, so the first tune is cold
rm -rf "$WELDER_CACHE_DIR"

start=$(date +%s)
python -m pytest -m gpu -q -p no:cacheprovider --junitxml="$results/gpu-tests.xml" 2>&1 \
  | tee "$results/gpu-tests.log" | tail -n 40
tests_rc=${PIPESTATUS[0]}
echo "gpu tests: exit $tests_rc in $(( $(date +%s) - start )) s"

python - "$results" "$tests_rc" <<'PY'
import json
import logging
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, "tests")
results, tests_rc = Path(sys.argv[1]), int(sys.argv[2])

from models import bert_encoder_layer  # noqa: E402
from onnx import helper  # noqa: E402
from onnx_util import make_model  # noqa: E402

import numpy as np  # noqa: E402
from welder.arch import match_gpu_name  # noqa: E402
from welder.frontend.onnx import import_onnx  # noqa: E402
from welder.device.gpu import GpuDevice  # noqa: E402
from welder.tune.cache import TuningCache  # noqa: E402
from welder.schedule.plan import format_summary  # noqa: E402
from welder.tune.tuner import tune_model  # noqa: E402

dropped: list[str] = []


class Dropped(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()  # "candidate N dropped (reason)", not the "(k dropped)" tallies
        if " dropped (" in message or "no valid" in message:
            dropped.append(message)


logger = logging.getLogger("welder.tune")
logger.setLevel(logging.INFO)
logger.addHandler(Dropped())
file_log = logging.FileHandler(results / "tune.log")
file_log.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
logger.addHandler(file_log)


def tests_summary() -> str:
    try:
        suite = ET.parse(results / "gpu-tests.xml").getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        n, f, e, s = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
        return f"{n - f - e - s} passed, {f} failed, {e} errors, {s} skipped in {float(suite.get('time', 0)):.0f} s"
    except Exception as exc:  # no report: pytest itself failed
        return f"no report ({exc}); pytest exit {tests_rc}"


def chain_graph():
    rng = np.random.default_rng(0)
    w = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("LayerNormalization", ["h", "s", "b"], ["n"], axis=-1),
        helper.make_node("Gelu", ["n"], ["y"]),
    ]
    return import_onnx(make_model(nodes, {"x": w(128, 256)}, ["y"], {"w": w(256, 256), "s": w(256), "b": w(256)}, opset=20))


def run(label, graph, arch, cache, device, **kw):
    before = len(dropped)
    t = time.perf_counter()
    plan = tune_model(graph, arch, cache=cache, device=device, **kw)
    seconds = time.perf_counter() - t
    row = {
        "label": label,
        "kernels": len(plan.groups),
        "from_cache": sum(g.from_cache for g in plan.groups),
        "candidates": sum(g.candidates for g in plan.groups if not g.from_cache),
        "dropped": len(dropped) - before,
        "measured_us": round(plan.latency_us, 2),
        "estimated_us": round(sum(g.configs[0].estimate.latency_us for g in plan.groups), 2),
        "seconds": round(seconds, 1),
    }
    print(f"\n-- {label}: {plan.measure}")
    print(format_summary(plan, graph))
    return row


rows, device_line, error = [], "?", None
try:
    with GpuDevice() as device:
        arch = match_gpu_name(device.name)
        device_line = f"{device.name} ({device.arch}), {device.compiler}"
        cache = TuningCache()
        bert, _ = bert_encoder_layer(batch=1, seq=128, hidden=256, heads=4, ffn=1024, layers=2)
        bert = import_onnx(bert)
        rows.append(run("bert 2x256 s128 cold", bert, arch, cache, device, topk=6))
        rows.append(run("bert 2x256 s128 warm", bert, arch, cache, device, topk=6))
        rows.append(run("chain, fused by measurement", chain_graph(), arch, cache, device, topk=4, measure_fusion=True))
except Exception as exc:  # report it in the table rather than losing the table
    import traceback

    traceback.print_exc()
    error = f"{type(exc).__name__}: {exc}"

(results / "gpu_suite.json").write_text(
    json.dumps({"device": device_line, "tests": tests_summary(), "smoke": rows, "error": error, "dropped": dropped}, indent=1)
)
ok = tests_rc == 0 and error is None and len(rows) == 3 and rows[1]["from_cache"] == rows[1]["kernels"]
print("\n" + "=" * 100)
print(f"{'device':<32} {device_line}")
print(f"{'gpu tests':<32} {tests_summary()}")
for r in rows:
    print(
        f"{r['label']:<32} {r['kernels']:>3} kernels ({r['from_cache']} from cache), {r['candidates']:>3} candidates, "
        f"{r['dropped']} dropped, measured {r['measured_us']:.1f} us (model {r['estimated_us']:.1f}), {r['seconds']:.1f} s"
    )
for line in dropped[:5]:
    print(f"{'dropped':<32} {line[:150]}")
if error:
    print(f"{'smoke error':<32} {error[:300]}")
print(f"{'verdict':<32} {'PASS' if ok else 'FAIL'}")
sys.exit(0 if ok else 1)
PY
smoke_rc=$?

python scripts/sanitize.py --out "$results"
sanitize_rc=$?
echo "gpu suite: tests+smoke exit $smoke_rc, sanitizer exit $sanitize_rc, $(( $(date +%s) - start )) s in all"
[ "$smoke_rc" -eq 0 ] && [ "$sanitize_rc" -eq 0 ]
