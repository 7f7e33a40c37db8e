"""Per-kind corrections of the cost model's latencies, fitted to GPU measurements.

Each kind's estimate (``kinds/*.py``) models its kernel from first principles: FLOPs at an
efficiency of the unit's peak, bytes at a share of the bandwidth, fills and launches.  What
those models miss is systematic per kind -- the fp16 attention kernel's copy-then-compute
phases, the SIMT kind's index arithmetic on half types -- so the measured / predicted ratio
of a kind's groups clusters around a kind-specific value (``scripts/calibration.py`` prints
the median and deciles from ``tuned.json`` files).  :data:`FACTORS` holds those medians, and
:func:`calibrated` multiplies a kind's estimates by them, so that estimates of different
kinds -- a fused attention group against its split pieces, a tensor-core tile against a
SIMT one -- compare as the kernels would.  A factor scales every config of its kind alike,
so it never reorders one kind's candidates.

The factors come from the H100 rounds of 2026-11-26 (docs/results.md, "The cost model
against the measurements"); a kind whose median was within 0.9-1.2 keeps 1.  The round at
3471e28 of 2026-11-27 recorded the corrected estimates, and its residuals were on target
for every kind but the mma kind in fp16 (see the note below the factors), and so were
those of the whole table at 3f2de3e (24 rows, the same factors).  ``tuned.json``
records the calibrated prediction, so the next round's ``scripts/calibration.py`` reads the
residual directly.
"""

from __future__ import annotations

from dataclasses import replace

from welder.ir.expr import HALF_DTYPES
from welder.schedule.config import GroupConfig

#: measured / predicted median per (kind, precision of the group's arithmetic: "fp16" for
#: half types, else "fp32"), from the H100's tuned.json files of 2026-11-26.
FACTORS: dict[tuple[str, str], float] = {
    ("attention", "fp16"): 1.8,  # 81 groups: median 1.84, worst decile 2.45
    ("attention_ffma", "fp32"): 1.5,  # 63 groups: 1.53, 2.64 (bert's 1.81, Swin's 1.06)
    ("wgmma", "fp16"): 1.4,  # 374 groups: 1.40, 1.76
    ("simt", "fp16"): 1.4,  # 435 groups: 1.39, 1.77
    ("ffma", "fp32"): 1.3,  # 437 groups: 1.29, 1.72
    ("mma_tf32", "fp32"): 1.6,  # 146 groups: 1.58, 1.71
    ("mma_tf32x3", "fp32"): 1.6,  # not measured yet: mma_tf32's, whose kernels it shares
}
# Not a factor: the mma kind's fp16 groups in the round at 3471e28 (2026-11-27), which
# recorded the estimates above already corrected, had a residual median of 1.41 over 122
# groups, but their products were near 1.1 (bert) and the excess is the gathered
# convolutions of mobilevit_s and mobilenet_v2 (1.5-4.9 per model, worst decile 3.54).  A
# factor for the kind put every fp16 product of a small BERT layer on CUDA cores under the
# cost model; the gathered convolutions need their own term in the estimate.


def precision_of(dtype: str) -> str:
    """The key :data:`FACTORS` uses for a group whose root has ``dtype``."""
    return "fp16" if dtype in HALF_DTYPES else "fp32"


def calibrated(configs: list[GroupConfig], kind: str, precision: str) -> list[GroupConfig]:
    """``configs`` of ``kind`` with their latency estimates scaled by the kind's factor."""
    factor = FACTORS.get((kind, precision), 1.0)
    if factor == 1.0:
        return configs
    return [
        replace(c, estimate=replace(c.estimate, latency_us=round(c.estimate.latency_us * factor, 4)))
        for c in configs
    ]
