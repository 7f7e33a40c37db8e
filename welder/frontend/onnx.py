"""ONNX -> Graph.

Stages, each a function so tests and tools can run them one at a time:

1. ``load_model``: parse the file and its external data (never outside the model folder);
   ``check_graph``: one producer per tensor, distinct and existing graph outputs;
   ``upgrade_opset``: models older than opset 11 go through ``onnx.version_converter``;
2. ``fix_input_shapes``: apply ``--input-shape`` overrides, reject symbolic dimensions;
3. ``check_model``: opset range and the list of unsupported operators, before any work;
4. ``simplify``: graph-level rewrites on ONNX (BatchNormalization folded into Conv);
5. ``lower``: one registered lowering per node, constant folding as it goes, shapes
   cross-checked against ONNX shape inference, repeated computations merged, dead nodes
   removed.

Every tensor's size is checked against a :class:`MemoryLimit` as soon as its shape is
known (inputs, weights, each compute a lowering creates, before anything is allocated),
so a model that cannot fit fails at import naming the tensor, not later in numpy or the
kernel's out-of-memory killer.
"""

from __future__ import annotations

import heapq
import math
import os
import re
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper, version_converter

import welder.frontend.ops  # noqa: F401  (registers every lowering)
from welder.errors import ModelError, ShapeError, UnsupportedError
from welder.frontend.passes import constant_values, simplify
from welder.frontend.registry import (
    LOWERINGS,
    LowerContext,
    Tensor,
    array_dtype,
    dtype_from_onnx,
)
from welder.graph import Graph, Node, TensorInfo
from welder.ir.compute import Compute, compute
from welder.ir.interpret import evaluate, np_dtype

MIN_OPSET, MAX_OPSET = 11, 21
DEFAULT_DOMAINS = ("", "ai.onnx")

# Fold a node whose inputs are all constant unless it would blow up the weights: an
# Expand of a scalar to a large activation stays a (cheap, inlinable) compute.
_FOLD_MIN_ELEMENTS = 1 << 16


@dataclass(frozen=True)
class MemoryLimit:
    """The most bytes any one tensor may take, and the initializers together.  ``what``
    names that memory in messages."""

    bytes: int
    what: str


def host_memory() -> MemoryLimit:
    """The interpreter's limit: host memory the kernel says a process can still get --
    Linux's ``MemAvailable`` (free memory plus the cache it can reclaim), elsewhere
    ``sysconf``'s available pages, and the physical memory where neither is known."""
    try:
        with open("/proc/meminfo") as f:
            found = re.search(r"^MemAvailable:\s+(\d+) kB", f.read(), re.M)
        if found:
            return MemoryLimit(int(found.group(1)) * 1024, "available host memory")
    except OSError:
        pass
    for pages, what in (("SC_AVPHYS_PAGES", "available host memory"), ("SC_PHYS_PAGES", "host memory")):
        try:
            return MemoryLimit(os.sysconf(pages) * os.sysconf("SC_PAGE_SIZE"), what)
        except (ValueError, OSError, AttributeError):
            continue
    return MemoryLimit(1 << 62, "host memory")


def format_bytes(n: int) -> str:
    """``2.9 TiB (3,199,999,999,968 bytes)``: binary units, as memory is sized, and the
    exact count, which tells apart sizes that round alike."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit} ({n:,} bytes)"
    return f"{n:,} bytes"


def import_onnx(
    model: str | os.PathLike | onnx.ModelProto,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    name: str | None = None,
    memory: MemoryLimit | None = None,
    merge_limit: int | None = None,
) -> Graph:
    """Import an ONNX model (a path or a loaded ModelProto) into a Graph.

    ``memory`` bounds every tensor (default :func:`host_memory`, where the interpreter runs
    it; ``welder tune`` passes the target GPU's memory).  ``merge_limit`` keeps sibling
    products this large apart (:func:`~welder.frontend.passes.merge_sibling_products`;
    default: every group merges)."""
    if not isinstance(model, onnx.ModelProto):
        name = name or Path(model).stem
        model = load_model(model)
    check_graph(model)
    model = upgrade_opset(model)
    model = fix_input_shapes(model, input_shapes or {})
    check_model(model)
    memory = memory or host_memory()
    check_input_sizes(model, memory, input_shapes or {})
    model = simplify(model, merge_limit)
    return lower(model, name=name or model.graph.name or "model", memory=memory)


# -- 1. loading --------------------------------------------------------------------------


def load_model(path: str | os.PathLike) -> onnx.ModelProto:
    path = Path(path)
    if path.is_dir():
        path = path / "model.onnx"
    if not path.is_file():
        raise ModelError(f"no ONNX model at {str(path)!r}")
    if path.stat().st_size == 0:
        raise ModelError(f"{str(path)!r} is empty (0 bytes); an unfinished download or export?")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf raises a bare DecodeError with no file name
        raise ModelError(f"{str(path)!r} is not a readable ONNX model: {e}") from None
    if not model.HasField("graph") and not model.opset_import:
        # Protobuf accepts many byte strings as a message of unknown fields only.
        raise ModelError(f"{str(path)!r} is not an ONNX model: it holds no graph")
    base = path.resolve().parent
    for t in _external_tensors(model):
        location = next((e.value for e in t.external_data if e.key == "location"), "")
        target = (base / location).resolve()
        if not location or os.path.isabs(location) or not target.is_relative_to(base):
            raise ModelError(
                f"initializer {t.name!r} refers to external data {location!r} outside the "
                f"model folder {str(base)!r}; refusing to read it"
            )
        if not target.is_file():
            raise ModelError(f"initializer {t.name!r}: external data file {str(target)!r} is missing")
    try:
        onnx.external_data_helper.load_external_data_for_model(model, str(base))
    except Exception as e:
        raise ModelError(f"{str(path)!r}: cannot read external data: {e}") from None
    return model


def _external_tensors(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    return [
        t
        for t in onnx.external_data_helper._get_all_tensors(model)
        if t.HasField("data_location") and t.data_location == onnx.TensorProto.EXTERNAL
    ]


def check_graph(model: onnx.ModelProto) -> None:
    """Reject what ONNX forbids in a graph's wiring -- no outputs, a tensor with two
    producers, an output listed twice or produced by nothing -- naming every tensor at
    fault, before the lowering trips over the consequences and names something else."""
    g = model.graph
    if not g.output:
        raise ModelError(
            "the model declares no graph outputs, so it computes nothing; "
            "list the wanted tensors in graph.output"
        )
    problems: list[str] = []
    producer: dict[str, str] = {}
    for vi in g.input:
        if vi.name in producer:
            problems.append(f"graph input {vi.name!r} is listed twice")
        producer[vi.name] = "is a graph input"
    initializers: set[str] = set()
    for t in g.initializer:
        if t.name in initializers:
            problems.append(f"initializer {t.name!r} is listed twice")
        initializers.add(t.name)
        producer.setdefault(t.name, "is an initializer")  # old exporters list weights as inputs too
    for node in g.node:
        for o in node.output:
            if not o:
                continue
            if o in producer:
                problems.append(f"tensor {o!r} {producer[o]} and is also written by {_node_label(node)}")
            else:
                producer[o] = f"is written by {_node_label(node)}"
    listed: set[str] = set()
    for o in g.output:
        if o.name in listed:
            problems.append(f"graph output {o.name!r} is listed twice")
        elif o.name not in producer:
            problems.append(f"graph output {o.name!r} is not produced by any node, input or initializer")
        listed.add(o.name)
    if problems:
        raise ModelError("the graph is malformed:\n" + "\n".join(f"  {p}" for p in problems))


def _node_label(node: onnx.NodeProto) -> str:
    return f"{node.op_type} node {node.name or next((o for o in node.output if o), '?')!r}"


class OpsetUpgradeWarning(UserWarning):
    """The model predates opset 11 and was upgraded with ``onnx.version_converter``."""


def upgrade_opset(model: onnx.ModelProto) -> onnx.ModelProto:
    """A model older than opset :data:`MIN_OPSET` converted to it by
    ``onnx.version_converter`` (the model zoo's opset-9 classics convert and then match
    onnxruntime); newer models are returned as they are.  What the converter cannot
    upgrade is a ModelError naming the opset and the converter's reason."""
    opset = model_opset(model)
    if opset >= MIN_OPSET:
        return model
    foreign = _unsupported_operators(model, opset, foreign_only=True)
    if foreign:  # the converter knows no other domain; they could not be imported anyway
        raise UnsupportedError(foreign)
    for node in model.graph.node:
        try:
            onnx.defs.get_schema(node.op_type, opset, "")
        except onnx.defs.SchemaError:
            raise ModelError(
                f"the model uses opset {opset}, older than welder's {MIN_OPSET} to {MAX_OPSET}, and its "
                f"{_node_label(node)} is no operator of ONNX opset {opset}, so onnx.version_converter "
                "cannot upgrade it"
            ) from None
    try:
        upgraded = version_converter.convert_version(model, MIN_OPSET)
    except Exception as e:  # the converter raises bare RuntimeErrors from C++ assertions
        raise ModelError(
            f"the model uses opset {opset}, older than welder's {MIN_OPSET} to {MAX_OPSET}, and "
            f"onnx.version_converter cannot upgrade it to opset {MIN_OPSET}: {_converter_reason(e)}"
        ) from None
    _keep_pre11_resize_rounding(upgraded)
    warnings.warn(
        f"the model uses opset {opset}; imported after upgrading it to opset {MIN_OPSET} with "
        "onnx.version_converter",
        OpsetUpgradeWarning,
        stacklevel=3,
    )
    return upgraded


def _keep_pre11_resize_rounding(model: onnx.ModelProto) -> None:
    """Give the Resize nodes that ``onnx.version_converter`` made from opset-9 Upsample and
    opset-10 Resize the coordinates those had, in place.  The converter leaves opset 11's
    default (half_pixel), which moves every linear sample.  Before opset 11 the source
    coordinate was ``x / scale``, and nearest rounded down on an upsampled axis and up on
    a downsampled one (as onnxruntime runs them); one opset-11 node has one rounding mode,
    so a nearest resize that does both becomes two nodes, one per direction."""
    values = constant_values(model.graph)
    nodes: list[onnx.NodeProto] = []
    for node in model.graph.node:
        attrs = {a.name: a for a in node.attribute}
        if node.op_type != "Resize" or "coordinate_transformation_mode" in attrs:
            nodes.append(node)
            continue
        node.attribute.append(onnx.helper.make_attribute("coordinate_transformation_mode", "asymmetric"))
        mode = onnx.helper.get_attribute_value(attrs["mode"]).decode() if "mode" in attrs else "nearest"
        if mode != "nearest":
            nodes.append(node)
            continue
        scales = values.get(node.input[2]) if len(node.input) > 2 else None
        if scales is None:
            raise ModelError(
                f"{_node_label(node)} (a nearest resize before opset 11) takes its scales from a "
                "tensor computed at run time; its rounding depends on them, so it cannot be upgraded"
            )
        scales = np.asarray(scales, np.float64).reshape(-1)
        if (scales >= 1).all() or (scales <= 1).all():
            rounding = "floor" if (scales >= 1).all() else "ceil"
            node.attribute.append(onnx.helper.make_attribute("nearest_mode", rounding))
            nodes.append(node)
            continue
        out = node.output[0]
        up, down, middle = f"{out}:scales_up", f"{out}:scales_down", f"{out}:upsampled"
        model.graph.initializer.extend(
            [
                numpy_helper.from_array(np.where(scales >= 1, scales, 1).astype(np.float32), up),
                numpy_helper.from_array(np.where(scales >= 1, 1, scales).astype(np.float32), down),
            ]
        )
        for inputs, output, rounding in ((up, middle, "floor"), (down, out, "ceil")):
            part = onnx.NodeProto()
            part.CopyFrom(node)
            part.name = f"{node.name or out}:{rounding}"
            part.input[0] = node.input[0] if rounding == "floor" else middle
            part.input[2] = inputs
            part.output[0] = output
            part.attribute.append(onnx.helper.make_attribute("nearest_mode", rounding))
            nodes.append(part)
    del model.graph.node[:]
    model.graph.node.extend(nodes)


def _converter_reason(e: Exception) -> str:
    """The converter's message without the C++ file, line and assertion text around it."""
    text = str(e).strip()
    text = text.split("failed: ", 1)[-1] if "failed: " in text else text
    return (text.splitlines() or [type(e).__name__])[0]


# -- 2. input shapes ---------------------------------------------------------------------


def graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """Inputs that are not initializers (old exporters list weights as inputs too)."""
    inits = {t.name for t in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in inits]


def fix_input_shapes(model: onnx.ModelProto, shapes: Mapping[str, Sequence[int]]) -> onnx.ModelProto:
    """Apply shape overrides; every input must end up fully static."""
    model_inputs = {i.name: i for i in graph_inputs(model)}
    unknown = sorted(set(shapes) - set(model_inputs))
    if unknown:
        raise ShapeError(
            f"--input-shape names {', '.join(map(repr, unknown))}, but the model's inputs are "
            f"{', '.join(map(repr, model_inputs)) or 'none'}"
        )
    model = _copy(model) if shapes else model
    symbolic = []
    for vi in graph_inputs(model):
        dims = vi.type.tensor_type.shape.dim
        if vi.name in shapes:
            new = [int(d) for d in shapes[vi.name]]
            if vi.type.tensor_type.HasField("shape") and len(dims) != len(new):
                raise ShapeError(
                    f"--input-shape {vi.name}: the model declares rank {len(dims)} "
                    f"({_fmt_dims(dims)}), got {len(new)} dimensions"
                )
            for k, d in enumerate(dims):
                if d.HasField("dim_value") and d.dim_value != new[k]:
                    raise ShapeError(
                        f"--input-shape {vi.name}: dimension {k} is fixed to {d.dim_value} by "
                        f"the model, got {new[k]}"
                    )
            vi.type.tensor_type.shape.Clear()
            for d in new:
                vi.type.tensor_type.shape.dim.add().dim_value = d
        elif not vi.type.tensor_type.HasField("shape") or any(not d.HasField("dim_value") for d in dims):
            symbolic.append(vi)
    if symbolic:
        lines = [f"  {vi.name}: {_fmt_dims(vi.type.tensor_type.shape.dim)}" for vi in symbolic]
        example = " ".join(
            f"--input-shape {vi.name}="
            + "x".join(_example_dim(d, k) for k, d in enumerate(vi.type.tensor_type.shape.dim))
            for vi in symbolic
        )
        raise ShapeError(
            "these model inputs have symbolic or unknown dimensions:\n"
            + "\n".join(lines)
            + f"\nfix them on the command line, e.g. {example}\n"
            "(with your sizes; Python: input_shapes={'name': (1, 128)})"
        )
    return model


def tensor_bytes(shape: Sequence[int], dtype: str) -> int:
    """Bytes of a dense tensor, in Python integers (no overflow for absurd shapes)."""
    try:
        itemsize = np_dtype(dtype).itemsize
    except KeyError:
        itemsize = 8
    return math.prod(int(d) for d in shape) * itemsize


def check_fits(what: str, shape: Sequence[int], dtype: str, memory: MemoryLimit, fix: str = "") -> None:
    """A ModelError (ShapeError where the user set the shape) when a tensor of this shape
    cannot fit in ``memory``; called before anything of that size is allocated."""
    size = tensor_bytes(shape, dtype)
    if size > memory.bytes:
        error = ShapeError if fix else ModelError
        raise error(
            f"{what} ({dtype} {list(shape)}) takes {format_bytes(size)}, more than the "
            f"{format_bytes(memory.bytes)} of {memory.what}{fix}"
        )


def check_input_sizes(
    model: onnx.ModelProto, memory: MemoryLimit, overridden: Mapping[str, Sequence[int]] | None = None
) -> None:
    """Every (static) model input must fit in ``memory``."""
    for vi in graph_inputs(model):
        tt = vi.type.tensor_type
        shape = [d.dim_value for d in tt.shape.dim]
        dtype = dtype_from_onnx(tt.elem_type, f"model input {vi.name!r}")
        fix = "; pass a smaller --input-shape" if vi.name in (overridden or {}) else ""
        check_fits(f"model input {vi.name!r}", shape, dtype, memory, fix)


def _fmt_dims(dims) -> str:
    return (
        "["
        + ", ".join(str(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?") for d in dims)
        + "]"
    )


def _example_dim(d, axis: int) -> str:
    """A size to paste: the fixed one, 1 for a batch, 128 for anything else symbolic."""
    if d.HasField("dim_value"):
        return str(d.dim_value)
    return "1" if axis == 0 or "batch" in d.dim_param.lower() else "128"


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


# -- 3. up-front checks --------------------------------------------------------------------


def model_opset(model: onnx.ModelProto) -> int:
    for o in model.opset_import:
        if o.domain in DEFAULT_DOMAINS:
            return int(o.version)
    raise ModelError("the model imports no version of the default ONNX domain")


def check_model(model: onnx.ModelProto) -> None:
    """Reject what cannot be imported, listing every problem at once."""
    opset = model_opset(model)
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise UnsupportedError(
            f"the model uses opset {opset}; welder supports opsets {MIN_OPSET} to {MAX_OPSET} "
            f"(older ones are upgraded on import). Convert it with "
            f"onnx.version_converter.convert_version(model, {MAX_OPSET})"
        )
    unsupported = _unsupported_operators(model, opset)
    if unsupported:
        raise UnsupportedError(unsupported)


def _unsupported_operators(model: onnx.ModelProto, opset: int, foreign_only: bool = False) -> str:
    """One message listing every operator type welder has no lowering for (only those of
    domains other than ONNX's with ``foreign_only``), or "" if there is none."""
    missing: dict[tuple[str, str], str] = {}
    for node in model.graph.node:
        domain = node.domain or ""
        if foreign_only and domain in DEFAULT_DOMAINS:
            continue
        if domain not in DEFAULT_DOMAINS or node.op_type not in LOWERINGS:
            key = (node.op_type if domain in DEFAULT_DOMAINS else f"{domain}.{node.op_type}", domain)
            missing.setdefault(key, node.name or node.output[0])
    if not missing:
        return ""
    lines = [
        f"  {op} (opset {opset if dom in DEFAULT_DOMAINS else _domain_version(model, dom)}), "
        f"first at node {first!r}"
        for (op, dom), first in missing.items()
    ]
    return f"the model uses {len(missing)} unsupported operator type(s):\n" + "\n".join(lines)


def _domain_version(model: onnx.ModelProto, domain: str) -> str:
    return next((str(o.version) for o in model.opset_import if o.domain == domain), "?")


# -- 5. lowering ---------------------------------------------------------------------------


class _Builder:
    """The graph under construction; LowerContext appends to it."""

    def __init__(self, reserved: set[str], memory: MemoryLimit) -> None:
        self.memory = memory
        self.computes: dict[str, Compute] = {}
        self.origin: dict[str, tuple[str, str]] = {}
        self.constants: dict[str, np.ndarray] = {}
        self.inputs: dict[str, TensorInfo] = {}
        self.reserved = reserved
        self.used: set[str] = set()

    def fresh_name(self, node: onnx.NodeProto, hint: str) -> str:
        base = next((o for o in node.output if o), node.name or node.op_type)
        stem = f"{base}:{hint}" if hint else f"{base}:tmp"
        name, k = stem, 1
        while name in self.used or name in self.reserved:
            k += 1
            name = f"{stem}{k}"
        self.used.add(name)
        return name

    def add_compute(self, c: Compute, ctx: LowerContext) -> None:
        self.check_fits(f"{ctx.label}: tensor {c.name!r}", c.shape, c.dtype)
        self.computes[c.name] = c
        self.origin[c.name] = (ctx.op_type, ctx.node.name)

    def check_fits(self, what: str, shape: Sequence[int], dtype: str) -> None:
        check_fits(what, shape, dtype, self.memory)

    def add_constant(self, name: str, value: np.ndarray) -> None:
        self.used.add(name)
        self.constants[name] = value

    def constant_value(self, name: str) -> np.ndarray | None:
        return self.constants.get(name)

    def tensor(self, name: str) -> Tensor:
        if name in self.computes:
            c = self.computes[name]
            return Tensor(name, c.shape, c.dtype)
        if name in self.constants:
            v = self.constants[name]
            return Tensor(name, tuple(v.shape), array_dtype(v, name))
        t = self.inputs[name]
        return Tensor(name, t.shape, t.dtype)

    def rename(self, mapping: dict[str, str], readers: Sequence[str] | None = None) -> None:
        """Rename tensors and every load of them.  Only ``readers`` (the computes the
        current node created, the newest in the builder) can load a tensor the node just
        made, so only they are rewritten -- re-inserted in order, keeping the builder's
        order topological -- and import time stays linear in the model size.  None
        rewrites every compute."""
        if not mapping:
            return
        if readers is None:
            self.computes = {
                mapping.get(n, n): c.renamed(mapping.get(n, n), mapping) for n, c in self.computes.items()
            }
        else:
            for name in [n for n in readers if n in self.computes]:
                c = self.computes.pop(name)
                self.computes[mapping.get(name, name)] = c.renamed(mapping.get(name, name), mapping)
        for old, new in mapping.items():
            if old in self.origin:
                self.origin[new] = self.origin.pop(old)
            if old in self.constants:
                self.constants[new] = self.constants.pop(old)
            self.used.add(new)


def lower(model: onnx.ModelProto, name: str = "model", memory: MemoryLimit | None = None) -> Graph:
    """Lower every node of a checked model; returns the Graph free of dead code and of
    repeated computations (:meth:`Graph.eliminate_common_subexpressions`).  Every
    tensor must fit in ``memory`` (default: :func:`host_memory`), and so must the
    initializers together."""
    memory = memory or host_memory()
    opset = model_opset(model)
    g = model.graph
    reserved = {v for n in g.node for v in (*n.input, *n.output)} | {t.name for t in g.initializer}
    b = _Builder(reserved, memory)
    env: dict[str, str] = {}  # ONNX tensor name -> our tensor name

    weights = 0
    for init in g.initializer:
        arr = _to_numpy(init)
        check_fits(f"initializer {init.name!r}", arr.shape, array_dtype(arr, init.name), memory)
        weights += arr.nbytes
        b.add_constant(init.name, arr)
        env[init.name] = init.name
    if weights > memory.bytes:
        raise ModelError(
            f"the model's {len(g.initializer)} initializers take {format_bytes(weights)} together, more "
            f"than the {format_bytes(memory.bytes)} of {memory.what}"
        )
    for vi in graph_inputs(model):
        shape = tuple(d.dim_value for d in vi.type.tensor_type.shape.dim)
        dtype = dtype_from_onnx(vi.type.tensor_type.elem_type, f"model input {vi.name!r}")
        b.inputs[vi.name] = TensorInfo(vi.name, shape, dtype)
        b.used.add(vi.name)
        env[vi.name] = vi.name

    lowered = []
    refused: list[str] = []  # every node whose attributes or inputs a lowering rejects
    blocked: set[str] = set()  # outputs of refused nodes: their readers cannot be lowered
    for node in _topo_sort(g):
        if blocked.intersection(node.input):
            blocked.update(node.output)
            continue
        try:
            lowered.append((node, _lower_node(node, opset, env, b)))
        except UnsupportedError as e:
            refused.append(str(e))
            blocked.update(node.output)
    if refused:
        raise UnsupportedError(
            f"{len(refused)} node(s) use features welder does not support:\n"
            + "\n".join(f"  {line}" for line in refused)
        )
    # Only now, when every node has passed its own validation: ONNX shape inference can
    # loop forever on some malformed attributes (Einsum equations) that a lowering rejects.
    inferred = inferred_types(model)
    for node, label in lowered:
        for onnx_name in node.output:
            if onnx_name:
                _check_against_inference(label, onnx_name, b.tensor(env[onnx_name]), inferred)

    outputs = []
    # A tensor that stands for several graph outputs (an Expand or Reshape that changes
    # nothing makes its input stand for its output), or that is a graph output by name,
    # must keep its name: each other output gets a copy.
    output_names = {o.name for o in g.output}
    standing_for = Counter(env.get(o.name) for o in g.output)
    for o in g.output:
        if o.name not in env:
            raise ModelError(f"graph output {o.name!r} is not produced by any node")
        ours = env[o.name]
        renamable = standing_for[ours] == 1 and ours not in output_names
        outputs.append(_materialise_output(o.name, ours, b, outputs, renamable))
    nodes = [
        Node(c, op_type=b.origin.get(n, ("Copy", ""))[0], source=b.origin.get(n, ("", ""))[1])
        for n, c in b.computes.items()
    ]
    graph = Graph(b.inputs.values(), nodes, outputs, b.constants, name=name)
    return graph.eliminate_common_subexpressions()


def _lower_node(
    node: onnx.NodeProto,
    opset: int,
    env: dict[str, str],
    b: _Builder,
) -> str:
    """Lower one node into the builder; returns the node's label for later messages."""
    inputs: list[Tensor | None] = []
    for name in node.input:
        if not name:
            inputs.append(None)
        elif name not in env:
            raise ModelError(f"{node.op_type} node {node.name!r} reads {name!r}, which nothing produces")
        else:
            inputs.append(b.tensor(env[name]))
    ctx = LowerContext(node, opset, inputs, b)
    result = LOWERINGS[node.op_type].fn(ctx)
    outs = [result] if isinstance(result, Tensor) or result is None else list(result)
    if len(outs) < len(node.output):
        outs += [None] * (len(node.output) - len(outs))

    mapping: dict[str, str] = {}
    for k, onnx_name in enumerate(node.output):
        if not onnx_name:
            continue
        t = outs[k]
        if t is None:
            raise UnsupportedError(f"{ctx.label}: output #{k} ({onnx_name!r}) is not supported")
        if t.name in ctx.created and t.name not in mapping and onnx_name not in b.used:
            mapping[t.name] = onnx_name
    b.rename(mapping, readers=ctx.created)
    created = [mapping.get(n, n) for n in ctx.created]
    for k, onnx_name in enumerate(node.output):
        if onnx_name:
            env[onnx_name] = mapping.get(outs[k].name, outs[k].name)

    if all(t is None or t.name in b.constants for t in inputs):
        _fold_constants(created, inputs, b)
    return ctx.label


def _fold_constants(created: list[str], inputs: list[Tensor | None], b: _Builder) -> None:
    budget = max(_FOLD_MIN_ELEMENTS, 4 * sum(t.size for t in inputs if t is not None))
    for name in created:
        c = b.computes.get(name)
        if c is None:
            continue
        if int(np.prod(c.shape, dtype=np.int64)) > budget:
            return
        if any(t not in b.constants for t in c.inputs):
            return
        b.constants[name] = evaluate(c, b.constants)
        del b.computes[name]
        b.origin.pop(name, None)


def _materialise_output(onnx_name: str, ours: str, b: _Builder, done: list[str], renamable: bool) -> str:
    """Make the graph output carry the ONNX output name, renaming (where ``renamable``)
    or copying as needed."""
    if ours == onnx_name and onnx_name not in done:
        return onnx_name
    if renamable and ours in b.computes and ours not in done and onnx_name not in b.used:
        b.rename({ours: onnx_name})
        return onnx_name
    t = b.tensor(ours)
    copy = compute(onnx_name, t.shape, lambda *i: t[i])
    b.computes[onnx_name] = copy
    b.origin[onnx_name] = ("Identity", onnx_name)
    b.used.add(onnx_name)
    return onnx_name


def inferred_types(model: onnx.ModelProto) -> dict[str, tuple[tuple[int, ...] | None, int]]:
    """Static shapes and element types ONNX shape inference finds, graph inputs and outputs
    included (empty if it fails)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:
        return {}
    out = {}
    g = inferred.graph
    for vi in [*g.input, *g.value_info, *g.output]:
        tt = vi.type.tensor_type
        shape = None
        if tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim):
            shape = tuple(d.dim_value for d in tt.shape.dim)
        out[vi.name] = (shape, tt.elem_type)
    return out


def _check_against_inference(
    label: str, onnx_name: str, t: Tensor, inferred: dict[str, tuple[tuple[int, ...] | None, int]]
) -> None:
    """Shapes disagreeing with ONNX shape inference get a warning, not an error: the
    inference is known to differ from onnxruntime in corner cases (ceil_mode windows
    starting in the padding, ConvTranspose SAME with output_padding), and welder follows
    onnxruntime.  Checking stops there, since every later inferred shape inherits the
    difference.  Element types are reliable and must agree."""
    shape, elem = inferred.get(onnx_name, (None, 0))
    if shape is not None and tuple(shape) != t.shape:
        warnings.warn(
            f"{label}: output {onnx_name!r} has shape {list(t.shape)} here but {list(shape)} by "
            "ONNX shape inference; continuing with welder's (onnxruntime's) shape",
            ShapeInferenceWarning,
            stacklevel=2,
        )
        inferred.clear()
        return
    if elem and elem in _ELEM_CHECKED and dtype_from_onnx(elem, onnx_name) != t.dtype:
        raise ModelError(
            f"{label}: output {onnx_name!r} has dtype {t.dtype} here but "
            f"{dtype_from_onnx(elem, onnx_name)} by ONNX shape inference"
        )


class ShapeInferenceWarning(UserWarning):
    """welder's output shape differs from what ONNX shape inference predicts."""


_ELEM_CHECKED = {
    onnx.TensorProto.FLOAT,
    onnx.TensorProto.FLOAT16,
    onnx.TensorProto.DOUBLE,
    onnx.TensorProto.INT32,
    onnx.TensorProto.INT64,
    onnx.TensorProto.BOOL,
    onnx.TensorProto.INT8,
    onnx.TensorProto.UINT8,
}


def _topo_sort(g: onnx.GraphProto) -> list[onnx.NodeProto]:
    """Nodes in dependency order, file order among ready nodes (ONNX requires a
    topological file order, but some exporters break it)."""
    produced = {o: k for k, n in enumerate(g.node) for o in n.output if o}
    users: dict[int, list[int]] = {}
    pending = [0] * len(g.node)
    for k, n in enumerate(g.node):
        for p in {produced[i] for i in n.input if i in produced}:
            users.setdefault(p, []).append(k)
            pending[k] += 1
    ready = [k for k, c in enumerate(pending) if c == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        k = heapq.heappop(ready)
        order.append(g.node[k])
        for u in users.get(k, []):
            pending[u] -= 1
            if pending[u] == 0:
                heapq.heappush(ready, u)
    if len(order) != len(g.node):
        stuck = next(n for k, n in enumerate(g.node) if pending[k])
        raise ModelError(f"the graph has a cycle through node {stuck.name or stuck.output[0]!r}")
    return order


def _to_numpy(t: onnx.TensorProto) -> np.ndarray:
    dtype = dtype_from_onnx(t.data_type, f"initializer {t.name!r}")
    return np.asarray(numpy_helper.to_array(t)).astype(np_dtype(dtype), copy=False)
