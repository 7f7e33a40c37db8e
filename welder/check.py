"""Checking a back end against onnxruntime on the same seeded random inputs.

The metric is the design's: per output ``max(|a - b| / max(|b|, 1))``, compared with a
threshold that depends on the arithmetic the back end used.  NaN or Inf where the
reference is finite always fails.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx

from welder.errors import ModelError
from welder.graph import Graph
from welder.ir.expr import FLOAT_DTYPES, Cast, Expr, Load, walk
from welder.ir.interpret import np_dtype

# Thresholds by arithmetic: fp32 SIMT kernels, TF32 tensor cores, fp16.
THRESHOLDS = {"fp32": 1e-4, "tf32": 2e-3, "fp16": 2e-2}


def threshold_for(dtype: str, precision: str = "fp32") -> float:
    """Allowed metric for an output of ``dtype`` computed with ``precision`` arithmetic.
    Integer and bool outputs must match exactly."""
    if dtype == "float16":
        return THRESHOLDS["fp16"]
    if dtype in ("float32", "float64"):
        return THRESHOLDS[precision]
    return 0.0


#: Where ``welder tune`` records the arithmetic it allowed (``tuned.json``'s ``precision``).
TUNED_JSON = "tuned.json"


def recorded_precision(prefix: str | os.PathLike) -> str:
    """The precision a runtime under ``prefix`` was tuned for: ``"tf32"`` after ``welder tune
    --tf32``, else ``"fp32"`` (also for a folder without ``tuned.json``, or one written before
    tuned.json recorded it).  Its fp32 outputs are checked at that threshold."""
    path = os.path.join(prefix, TUNED_JSON)
    if not os.path.isfile(path):
        return "fp32"
    try:
        with open(path) as f:
            precision = json.load(f).get("precision", "fp32")
    except (OSError, ValueError, AttributeError) as e:
        raise ModelError(f"cannot read the precision the runtime was tuned for from {path}: {e}") from None
    if precision not in THRESHOLDS or precision == "fp16":
        raise ModelError(f"{path} records precision {precision!r}; expected 'fp32' or 'tf32'")
    return precision


def cone_float_dtypes(graph: Graph, tensor: str, members: Collection[str] | None = None) -> set[str]:
    """The floating-point dtypes of ``tensor`` and of every value it is computed from:
    the tensors it loads, and any cast inside their bodies, back through the nodes of
    ``members`` (every node when None).  A tensor outside ``members`` -- a group's input --
    counts with its own dtype and ends the walk: whatever made it is the same for the
    kernel and the reference it is checked against."""
    inside = None if members is None else set(members)
    seen: set[str] = set()
    dtypes: set[str] = set()
    todo = [tensor]
    while todo:
        t = todo.pop()
        if t in seen:
            continue
        seen.add(t)
        dtypes.add(graph.tensor(t).dtype)
        node = graph.nodes.get(t)
        if node is None or (inside is not None and t not in inside):
            continue
        dtypes.update(e.dtype for e in walk(node.compute.body) if isinstance(e, Cast))
        todo.extend(node.inputs)
    return dtypes & FLOAT_DTYPES


def output_threshold(
    graph: Graph, tensor: str, members: Collection[str] | None = None, precision: str = "fp32"
) -> float:
    """The allowed metric of ``tensor`` computed by the nodes ``members`` (a fused group;
    None: the whole model) from their inputs.  It follows the lowest precision the value
    passed through, not only its own dtype: an fp32 output computed from fp16 values
    carries their rounding (a LayerNorm's fp32 statistics of an fp16 convolution differ
    from the reference by ~1e-3 when one fp16 element rounds the other way), so it gets
    the fp16 threshold; a cone of fp32 alone keeps the fp32 one.  Integer and bool outputs
    must still match exactly."""
    dtype = graph.tensor(tensor).dtype
    if dtype in FLOAT_DTYPES and "float16" in cone_float_dtypes(graph, tensor, members):
        return max(THRESHOLDS["fp16"], threshold_for(dtype, precision))
    return threshold_for(dtype, precision)


def output_thresholds(
    graph: Graph,
    outputs: Sequence[str],
    members: Collection[str] | None = None,
    precision: str = "fp32",
) -> dict[str, float]:
    """:func:`output_threshold` of each of ``outputs``."""
    return {o: output_threshold(graph, o, members, precision) for o in outputs}


def error_metric(actual: np.ndarray, expected: np.ndarray) -> float:
    """``max(|a - b| / max(|b|, 1))``; inf when a value is non-finite where the reference
    is finite (or the shapes differ)."""
    a = np.asarray(actual)
    b = np.asarray(expected)
    if a.shape != b.shape:
        return float("inf")
    if a.size == 0:
        return 0.0
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    finite = np.isfinite(b64)
    if np.any(~np.isfinite(a64) & finite):
        return float("inf")
    # Where the reference itself is NaN/Inf the back end must reproduce it exactly.
    same_special = (a64 == b64) | (np.isnan(a64) & np.isnan(b64))
    if np.any(~finite & ~same_special):
        return float("inf")
    if not np.any(finite):
        return 0.0
    diff = np.abs(a64[finite] - b64[finite]) / np.maximum(np.abs(b64[finite]), 1.0)
    return float(diff.max())


@dataclass
class OutputResult:
    name: str
    metric: float
    threshold: float
    shape: tuple[int, ...]
    dtype: str

    @property
    def passed(self) -> bool:
        return self.metric <= self.threshold


@dataclass
class CheckReport:
    model: str
    backend: str
    seed: int
    outputs: list[OutputResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(o.passed for o in self.outputs)

    def format(self) -> str:
        width = max([len(o.name) for o in self.outputs] + [6])
        lines = [
            f"{self.model}: backend={self.backend} seed={self.seed}",
            f"  {'output':<{width}}  {'shape':<18} {'max rel err':>12}  {'limit':>8}  verdict",
        ]
        for o in self.outputs:
            lines.append(
                f"  {o.name:<{width}}  {list(o.shape)!s:<18} {o.metric:>12.3e}  "
                f"{o.threshold:>8.1e}  {'PASS' if o.passed else 'FAIL'}"
            )
        lines.append("PASS" if self.passed else "FAIL")
        return "\n".join(lines)


# -- inputs --------------------------------------------------------------------------------


def random_inputs(graph: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs a model can digest: normal floats; integer inputs below the size of
    the dimension they index (token ids < vocabulary); inputs named like masks are ones."""
    rng = np.random.default_rng(seed)
    bounds = integer_input_bounds(graph)
    feeds = {}
    for t in graph.inputs:
        dt = np_dtype(t.dtype)
        if "mask" in t.name.lower():
            feeds[t.name] = np.ones(t.shape, dtype=dt)
        elif t.dtype == "bool":
            feeds[t.name] = rng.random(t.shape) < 0.5
        elif np.issubdtype(dt, np.integer):
            feeds[t.name] = rng.integers(0, bounds.get(t.name, 2), size=t.shape).astype(dt)
        else:
            feeds[t.name] = rng.standard_normal(t.shape).astype(dt)
    return feeds


def integer_input_bounds(graph: Graph) -> dict[str, int]:
    """For each integer input used (possibly after copies, casts and reshapes) as an
    index into another tensor, the smallest extent it indexes."""
    bounds: dict[str, int] = {}
    integer = [t.name for t in graph.inputs if np.issubdtype(np_dtype(t.dtype), np.integer)]
    for name in integer:
        derived = {name}
        for node in graph.topo_order():
            if node.compute.is_injective and _is_copy_of(node.compute.body, derived):
                derived.add(node.name)
        for node in graph.topo_order():
            for ld in node.compute.loads():
                for dim, idx in enumerate(ld.indices):
                    if any(isinstance(e, Load) and e.tensor in derived for e in walk(idx)):
                        extent = graph.tensor(ld.tensor).shape[dim]
                        bounds[name] = min(bounds.get(name, extent), extent)
    return bounds


def _is_copy_of(body: Expr, tensors: set[str]) -> bool:
    while isinstance(body, Cast):
        body = body.x
    return isinstance(body, Load) and body.tensor in tensors


# -- reference -----------------------------------------------------------------------------


def onnxruntime_outputs(
    model: str | os.PathLike | onnx.ModelProto,
    feeds: Mapping[str, np.ndarray],
    output_names: Sequence[str] | None = None,
) -> dict[str, np.ndarray]:
    """Outputs of the model under onnxruntime's CPU provider."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    src = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model_file(model))
    try:
        sess = ort.InferenceSession(src, opts, providers=["CPUExecutionProvider"])
    except Exception as e:
        raise ModelError(f"onnxruntime cannot load the model: {e}") from None
    names = list(output_names) if output_names else [o.name for o in sess.get_outputs()]
    wanted = {i.name for i in sess.get_inputs()}
    values = sess.run(names, {k: v for k, v in feeds.items() if k in wanted})
    return dict(zip(names, values))


def model_file(path: str | os.PathLike) -> str:
    """The ONNX file of ``path``: ``path/model.onnx`` for a PREFIX folder, else ``path``."""
    return os.path.join(path, "model.onnx") if os.path.isdir(path) else str(path)


def compare(
    actual: Mapping[str, np.ndarray],
    expected: Mapping[str, np.ndarray],
    precision: str = "fp32",
    thresholds: Mapping[str, float] | None = None,
) -> list[OutputResult]:
    """Each expected output against ours.  ``thresholds`` (from :func:`output_thresholds`,
    when the graph is at hand) overrides the limit that the output's dtype alone gives."""
    results = []
    for name, ref in expected.items():
        ref = np.asarray(ref)
        got = actual.get(name)
        dtype = "bool" if ref.dtype == np.bool_ else ref.dtype.name
        metric = float("inf") if got is None else error_metric(got, ref)
        limit = thresholds[name] if thresholds and name in thresholds else threshold_for(dtype, precision)
        results.append(OutputResult(name, metric, limit, tuple(ref.shape), dtype))
    return results
