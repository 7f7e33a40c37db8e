"""Checking a back end against onnxruntime on the same seeded random inputs.

The metric is the design's: per output ``max(|a - b| / max(|b|, 1))``, compared with a
threshold that depends on the arithmetic the back end used.  NaN or Inf where the
reference is finite always fails.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import zipfile
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from welder.errors import ModelError
from welder.files import replaced
from welder.graph import Graph
from welder.ir.expr import FLOAT_DTYPES, Cast, Expr, Load, walk
from welder.ir.interpret import np_dtype

# Thresholds by arithmetic: fp32 SIMT kernels, TF32 tensor cores, fp16, bf16.
#
# bf16 keeps 8 significant bits: its unit roundoff is u = 2^-8 = 3.9e-3 (fp16's: 2^-11).
# One K-long product of bf16 operands that were rounded from other values, accumulated in
# fp32 and stored as bf16, is off by at most 2u (the operands) + K * 2^-24 (the fp32 sum)
# + u (the stored result) relative to sum |a_i b_i|: 3u + K * 2^-24 = 1.2e-2 at K = 4096.
# A model stacks such steps: on bf16 BERT-base (12 layers, batch 1, seq 128) torch's own
# bf16 inference and welder's interpreter both end 5.7e-2 from the exact result for the
# same bf16 weights and inputs (and 6.6e-2 from each other).  The limit, 1e-1 (26u), keeps
# over that about the 2x margin fp16's 2e-2 keeps over fp16 BERT's error on the H100 (9.5e-3);
# 5e-2 would fail torch itself there, and a wrong value (a lost or doubled term of a sum, a
# misplaced element) is still off by far more.
#
# TF32 keeps fp16's 11 significant bits in the products' operands only (fp32 sums, fp32
# storage).  Rounding just those operands, in fp32 otherwise (scripts/tf32_error.py: no TF32
# kernel involved), takes BERT-base's last hidden state 2.66e-3 from exact fp32 (batch 8),
# and welder's TF32 kernels ended 2.9e-3 from it on the H100: the first limit, 2e-3, set on
# a one-layer MLP (1.4e-3), failed the arithmetic itself.  5e-3 keeps about the margin fp16's
# limit keeps, and a lost term of a 768-long sum is still off by far more.
THRESHOLDS = {"fp32": 1e-4, "tf32": 5e-3, "fp16": 2e-2, "bf16": 1e-1}
#: The precision name of each 16-bit float dtype: its outputs' limit whatever the kernels.
HALF_PRECISIONS = {"float16": "fp16", "bfloat16": "bf16"}


def threshold_for(dtype: str, precision: str = "fp32") -> float:
    """Allowed metric for an output of ``dtype`` computed with ``precision`` arithmetic.
    Integer and bool outputs must match exactly."""
    if dtype in HALF_PRECISIONS:
        return THRESHOLDS[HALF_PRECISIONS[dtype]]
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
    if precision not in ("fp32", "tf32"):
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
    the fp16 threshold (bf16 values: the bf16 one); a cone of fp32 alone keeps the fp32
    one.  Integer and bool outputs must still match exactly."""
    dtype = graph.tensor(tensor).dtype
    limit = threshold_for(dtype, precision)
    if dtype in FLOAT_DTYPES:
        for half in cone_float_dtypes(graph, tensor, members) & HALF_PRECISIONS.keys():
            limit = max(limit, THRESHOLDS[HALF_PRECISIONS[half]])
    return limit


def output_thresholds(
    graph: Graph,
    outputs: Sequence[str],
    members: Collection[str] | None = None,
    precision: str = "fp32",
) -> dict[str, float]:
    """:func:`output_threshold` of each of ``outputs``."""
    return {o: output_threshold(graph, o, members, precision) for o in outputs}


def _float_like(dtype: np.dtype) -> bool:
    return np.issubdtype(dtype, np.floating) or dtype.name == "bfloat16"


def error_metric(actual: np.ndarray, expected: np.ndarray) -> float:
    """``max(|a - b| / max(|b|, 1))``; inf when a value is non-finite where the reference
    is finite (or the shapes differ)."""
    a = np.asarray(actual)
    b = np.asarray(expected)
    if a.shape != b.shape:
        return float("inf")
    if a.size == 0:
        return 0.0
    # float32 holds every fp16, bf16 and fp32 value exactly, and rounds the metric by 2^-24
    # of itself, far below any limit: half the memory traffic of float64 on the tuner's
    # checks of batch-64 outputs.
    narrow = all(_float_like(x.dtype) and x.dtype.itemsize <= 4 for x in (a, b))
    wide = np.float32 if narrow else np.float64
    a64, b64 = a.astype(wide), b.astype(wide)  # copies: the common case works in place
    finite = np.isfinite(b64)
    if finite.all() and np.isfinite(a64).all():
        a64 -= b64
        np.abs(a64, out=a64)
        np.abs(b64, out=b64)
        np.maximum(b64, 1.0, out=b64)
        a64 /= b64
        return float(a64.max())
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
    reference: str = "onnxruntime"  # what the outputs were compared with (:func:`reference_name`)
    inputs: str = ""  # the file the inputs came from (:func:`saved_inputs`); empty: seeded ones

    @property
    def passed(self) -> bool:
        return all(o.passed for o in self.outputs)

    def format(self) -> str:
        width = max([len(o.name) for o in self.outputs] + [6])
        lines = [
            f"{self.model}: backend={self.backend} "
            f"{f'inputs={self.inputs}' if self.inputs else f'seed={self.seed}'} reference={self.reference}",
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
            feeds[t.name] = normal(rng, t.shape, dt)
    return feeds


def saved_inputs(path: str | os.PathLike, graph: Graph) -> dict[str, np.ndarray]:
    """The inputs kept in the ``.npz`` at ``path`` (an export's ``inputs.npz``: those its
    check against the torch module ran on), which must be the graph's inputs by name,
    shape and dtype; a WelderError names the first that is not."""
    try:
        stored = np.load(path)
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise ModelError(f"cannot read inputs from {path}: {e}") from None
    if not isinstance(stored, np.lib.npyio.NpzFile):
        raise ModelError(f"{path} is one array, not an .npz of the model's inputs by name")
    with stored:
        feeds = {name: stored[name] for name in stored.files}
    for t in graph.inputs:
        if t.name not in feeds:
            held = ", ".join(sorted(feeds)) or "none"
            raise ModelError(f"{path} holds no input {t.name!r} (it holds {held})")
        got, want = feeds[t.name], np_dtype(t.dtype)
        if got.dtype.kind == "V" and got.dtype.itemsize == want.itemsize:
            got = feeds[t.name] = got.view(want)  # numpy stores bfloat16 as raw 2-byte values
        if tuple(got.shape) != tuple(t.shape) or got.dtype != want:
            raise ModelError(
                f"input {t.name!r} in {path} is {got.dtype} {list(got.shape)}; "
                f"the model takes {want} {list(t.shape)}"
            )
    unknown = sorted(set(feeds) - {t.name for t in graph.inputs})
    if unknown:
        raise ModelError(f"{path} holds {', '.join(map(repr, unknown))}, which the model does not take")
    return feeds


#: A random tensor of more elements than this repeats one block of ``REPEAT_PERIOD`` draws
#: (a NeRF layer's input is 500M values, whose draws took longer than timing its kernels);
#: the period is prime, so the repetition lines up with no tile or row length.
REPEAT_ABOVE = 1 << 24
REPEAT_PERIOD = 1_048_583


def normal(rng: np.random.Generator, shape: Sequence[int], dtype: np.dtype) -> np.ndarray:
    """Standard normal values of ``dtype``, drawn in float32 unless ``dtype`` is wider (a
    third of the time of float64 draws); beyond ``REPEAT_ABOVE`` elements, a block repeated."""
    wide = np.dtype(dtype).itemsize > 4
    size = int(np.prod(shape, dtype=np.int64))
    drawn = REPEAT_PERIOD if size > REPEAT_ABOVE else shape
    values = rng.standard_normal(drawn, dtype=np.float64 if wide else np.float32).astype(dtype, copy=False)
    return np.resize(values, shape) if size > REPEAT_ABOVE else values


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


#: How a bfloat16 model is checked where onnxruntime cannot run it (:func:`bfloat16_as_float`).
BF16_AS_FP32 = "onnxruntime on the model in fp32 (bf16 weights and inputs upcast exactly)"


def onnxruntime_outputs(
    model: str | os.PathLike | onnx.ModelProto,
    feeds: Mapping[str, np.ndarray],
    output_names: Sequence[str] | None = None,
) -> dict[str, np.ndarray]:
    """Outputs of the model under onnxruntime's CPU provider.

    A model with bfloat16 tensors runs as it is where the provider has kernels for all its
    nodes (onnxruntime 1.32 has Cast, Transpose, Identity and LayerNormalization in bf16 on
    the CPU, but no arithmetic: not Add, Mul, MatMul, Gemm, Relu, Softmax's ReduceMax), else
    as :func:`bfloat16_as_float` converts it; :func:`reference_name` says which."""
    proto = _bfloat16_model(model)
    if proto is not None:
        native = _run_bfloat16(proto, feeds, output_names)
        if native is not None:
            return native
        wide = {k: v.astype(np.float32) if v.dtype == BFLOAT16 else v for k, v in feeds.items()}
        outputs = _run_ort(bfloat16_as_float(proto).SerializeToString(), wide, output_names)
        narrow = _bfloat16_outputs(proto)
        return {k: v.astype(BFLOAT16) if k in narrow else v for k, v in outputs.items()}
    src = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model_file(model))
    return _run_ort(src, feeds, output_names)


def cached_onnxruntime_outputs(
    model: str | os.PathLike,
    feeds: Mapping[str, np.ndarray],
    outputs: Sequence[str],
    cache: str | os.PathLike | None = None,
) -> dict[str, np.ndarray]:
    """:func:`onnxruntime_outputs` of the model file, kept in the folder ``cache`` (when
    given) under a hash of the model's bytes, the inputs, the outputs asked for and
    onnxruntime's version.  At batch 64 the CPU provider takes minutes: the export's check
    and test_acc's checks of each variant built from one export (welder, ``--nofusion``,
    ``--no-tc``) run on the same inputs, and one run serves them all.  An entry that
    cannot be read is computed again; one is written whole or not at all."""
    if cache is None:
        return onnxruntime_outputs(model, feeds, outputs)
    import onnxruntime

    key = hashlib.sha256(Path(model_file(model)).read_bytes())
    key.update(json.dumps([sorted(outputs), onnxruntime.__version__]).encode())
    for name in sorted(feeds):
        value = np.ascontiguousarray(feeds[name])
        key.update(json.dumps([name, value.dtype.str, value.shape]).encode())
        key.update(value.tobytes())
    entry = Path(cache) / f"{key.hexdigest()[:32]}.npz"
    try:
        with np.load(entry) as stored:
            return {name: stored[name] for name in outputs}
    except (OSError, KeyError, ValueError, zipfile.BadZipFile):
        pass
    reference = onnxruntime_outputs(model, feeds, outputs)
    entry.parent.mkdir(parents=True, exist_ok=True)
    with replaced(entry) as partial:
        np.savez(partial, **reference)
    return reference


def reference_name(model: str | os.PathLike | onnx.ModelProto) -> str:
    """What :func:`onnxruntime_outputs` compares ``model`` with, for reports."""
    proto = _bfloat16_model(model)
    if proto is None or _bfloat16_session(proto) is not None:
        return "onnxruntime"
    return BF16_AS_FP32


def _run_ort(
    src: str | bytes, feeds: Mapping[str, np.ndarray], output_names: Sequence[str] | None
) -> dict[str, np.ndarray]:
    """The outputs of the model file or bytes ``src`` under the CPU provider."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    try:
        sess = ort.InferenceSession(src, opts, providers=["CPUExecutionProvider"])
    except Exception as e:
        raise ModelError(f"onnxruntime cannot load the model: {e}") from None
    names = list(output_names) if output_names else [o.name for o in sess.get_outputs()]
    wanted = {i.name for i in sess.get_inputs()}
    values = sess.run(names, {k: v for k, v in feeds.items() if k in wanted})
    return dict(zip(names, values))


BFLOAT16 = np_dtype("bfloat16")


def _bfloat16_model(model: str | os.PathLike | onnx.ModelProto) -> onnx.ModelProto | None:
    """``model`` loaded, if any of its tensors, values or casts is bfloat16; else None."""
    proto = model if isinstance(model, onnx.ModelProto) else onnx.load(model_file(model))
    bf16 = onnx.TensorProto.BFLOAT16
    graph = proto.graph
    infos = (*graph.input, *graph.output, *graph.value_info)
    if any(i.type.tensor_type.elem_type == bf16 for i in infos):
        return proto
    if any(t.data_type == bf16 for t in graph.initializer):
        return proto
    for node in graph.node:
        for attr in node.attribute:
            if (attr.type == onnx.AttributeProto.INT and attr.name in ("to", "dtype") and attr.i == bf16) or (
                attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == bf16
            ):
                return proto
    return None


def _bfloat16_session(proto: onnx.ModelProto) -> object | None:
    """An onnxruntime session of the bf16 model, or None where the CPU provider lacks a
    kernel for one of its nodes."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 4
    try:
        return ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    except Exception:
        return None


def _run_bfloat16(
    proto: onnx.ModelProto, feeds: Mapping[str, np.ndarray], output_names: Sequence[str] | None
) -> dict[str, np.ndarray] | None:
    """The bf16 model's outputs under onnxruntime itself, or None where it cannot run it.
    Its Python binding takes and returns no bf16 arrays, so they travel as raw bits."""
    import onnxruntime as ort

    sess = _bfloat16_session(proto)
    if sess is None:
        return None
    names = list(output_names) if output_names else [o.name for o in sess.get_outputs()]
    binding = sess.io_binding()
    for i in sess.get_inputs():
        value = np.ascontiguousarray(feeds[i.name])
        if value.dtype == BFLOAT16:
            binding.bind_ortvalue_input(
                i.name,
                ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
                    value.view(np.uint16), onnx.TensorProto.BFLOAT16
                ),
            )
        else:
            binding.bind_cpu_input(i.name, value)
    for name in names:
        binding.bind_output(name)
    sess.run_with_iobinding(binding)
    out = {}
    for name, value in zip(names, binding.get_outputs()):
        if value.data_type() == "tensor(bfloat16)":
            count = int(np.prod(value.shape(), dtype=np.int64))
            raw = (ctypes.c_uint16 * count).from_address(value.data_ptr()) if count else b""
            out[name] = np.frombuffer(bytes(raw), np.uint16).view(BFLOAT16).reshape(value.shape())
        else:
            out[name] = value.numpy()
    return out


def _bfloat16_outputs(model: onnx.ModelProto) -> set[str]:
    """The graph outputs of ``model`` that are bfloat16, as onnx's shape inference types them."""
    try:
        typed = onnx.shape_inference.infer_shapes(model)
    except Exception:
        typed = model
    return {o.name for o in typed.graph.output if o.type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16}


def bfloat16_as_float(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` computed in float32: initializers, constants, inputs and outputs become
    fp32 exactly (every bf16 value is a float32), so its results are the exact ones for the
    bf16 weights and inputs, up to fp32 rounding.  Only an explicit Cast to bfloat16 still
    rounds (a Cast there and back): that rounding is the model's own, not its storage
    type's.  Graph inputs take float32 data: :func:`onnxruntime_outputs` widens bf16 feeds
    and rounds the outputs that are bf16 to bf16.

    Checking against the exact result rather than against another bf16 computation (the
    fp32 model rounded to bf16 at every node's output) measures welder's own rounding only:
    on bf16 BERT-base two such computations differ by more than either differs from the
    exact result."""
    bf16, f32 = onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT
    wide = onnx.ModelProto()
    wide.CopyFrom(model)
    graph = wide.graph

    def widen(tensor: onnx.TensorProto) -> None:
        if tensor.data_type == bf16:
            values = numpy_helper.to_array(tensor).astype(np.float32)
            tensor.CopyFrom(numpy_helper.from_array(values, tensor.name))

    for tensor in graph.initializer:
        widen(tensor)
    nodes = []
    for node in graph.node:
        nodes.append(node)
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                widen(attr.t)
            elif node.op_type == "Cast" and attr.name == "to" and attr.i == bf16:
                out = node.output[0]
                node.output[0] = f"{out}__bf16"
                nodes.append(onnx.helper.make_node("Cast", [node.output[0]], [out], to=f32))
            elif attr.type == onnx.AttributeProto.INT and attr.name == "dtype" and attr.i == bf16:
                attr.i = f32
    del graph.node[:]
    graph.node.extend(nodes)
    for info in (*graph.input, *graph.output, *graph.value_info):
        if info.type.tensor_type.elem_type == bf16:
            info.type.tensor_type.elem_type = f32
    return wide


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
