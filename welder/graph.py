"""The operator graph: Computes connected by the tensors they produce and load.

Every node owns exactly one Compute and is named after the tensor it produces.  Model
inputs and constants (weights) are tensors without a producing node.  The graph is kept
in topological order; networkx provides the graph algorithms the scheduler needs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace

import networkx as nx
import numpy as np

from welder.errors import ModelError
from welder.files import write_json
from welder.ir.compute import Compute, Reduce, compute, reduce, reduce_axis
from welder.ir.expr import (
    INDEX,
    Binary,
    Const,
    Expr,
    Load,
    binary,
    cast,
    format_expr,
    is_float,
    is_half,
    substitute,
)
from welder.ir.interpret import evaluate, np_dtype


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * np_dtype(self.dtype).itemsize

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}


@dataclass
class Node:
    """One Compute plus where it came from (for messages and reports)."""

    compute: Compute
    op_type: str = ""
    source: str = ""
    attrs: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.compute.name

    @property
    def inputs(self) -> tuple[str, ...]:
        return self.compute.inputs

    @property
    def info(self) -> TensorInfo:
        return TensorInfo(self.name, self.compute.shape, self.compute.dtype)


class Graph:
    def __init__(
        self,
        inputs: Iterable[TensorInfo],
        nodes: Iterable[Node],
        outputs: Iterable[str],
        constants: Mapping[str, np.ndarray] | None = None,
        name: str = "model",
    ) -> None:
        self.name = name
        self.inputs = list(inputs)
        self.outputs = list(outputs)
        self.constants: dict[str, np.ndarray] = dict(constants or {})
        self.nodes: dict[str, Node] = {}
        self._nx = nx.DiGraph()
        self._order: list[Node] | None = None  # topo_order, computed once per set of nodes
        self._rank: dict[str, int] = {}
        for n in nodes:
            self.add(n)
        self.validate()

    # -- construction ---------------------------------------------------------------

    def add(self, node: Node) -> None:
        if node.name in self.nodes or node.name in self.constants or node.name in self.input_names:
            raise ModelError(f"tensor {node.name!r} is defined twice")
        for t in node.inputs:
            if t not in self.nodes and t not in self.constants and t not in self.input_names:
                raise ModelError(f"node {node.name!r} reads undefined tensor {t!r}")
        self.nodes[node.name] = node
        self._order = None
        self._nx.add_node(node.name)
        for t in node.inputs:
            if t in self.nodes:
                self._nx.add_edge(t, node.name, tensor=t)

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    def validate(self) -> None:
        for o in self.outputs:
            if o not in self.nodes and o not in self.constants and o not in self.input_names:
                raise ModelError(f"graph output {o!r} is not produced by any node")
        for n in self.nodes.values():
            for ld in n.compute.loads():
                rank = len(self.tensor(ld.tensor).shape)
                if len(ld.indices) != rank:
                    raise ModelError(
                        f"node {n.name!r} indexes {ld.tensor!r} with {len(ld.indices)} "
                        f"indices but it has rank {rank}"
                    )

    # -- queries ----------------------------------------------------------------------

    def tensor(self, name: str) -> TensorInfo:
        if name in self.nodes:
            return self.nodes[name].info
        if name in self.constants:
            c = self.constants[name]
            return TensorInfo(name, tuple(c.shape), _dtype_name(c.dtype))
        for t in self.inputs:
            if t.name == name:
                return t
        raise KeyError(f"unknown tensor {name!r}")

    def producer(self, tensor: str) -> Node | None:
        return self.nodes.get(tensor)

    def consumers(self, tensor: str) -> list[Node]:
        if tensor in self.nodes:
            return [self.nodes[s] for s in self._nx.successors(tensor)]
        return [n for n in self.nodes.values() if tensor in n.inputs]

    def topo_order(self) -> list[Node]:
        """Nodes in a deterministic topological order (insertion order breaks ties).  The
        fusion search asks for it thousands of times, so it is sorted once per set of nodes."""
        if self._order is None:
            insertion = {name: k for k, name in enumerate(self.nodes)}
            order = nx.lexicographical_topological_sort(self._nx, key=insertion.__getitem__)
            self._order = [self.nodes[n] for n in order]
            self._rank = {n.name: k for k, n in enumerate(self._order)}
        return list(self._order)

    def topo_rank(self, name: str) -> int:
        """The position of node ``name`` in :meth:`topo_order`."""
        if self._order is None:
            self.topo_order()
        return self._rank[name]

    def __iter__(self) -> Iterator[Node]:
        return iter(self.topo_order())

    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def nx(self) -> nx.DiGraph:
        """Read-only view of the node-to-node dependency graph."""
        return self._nx.copy(as_view=True)

    # -- transformations --------------------------------------------------------------

    def subgraph(self, names: Iterable[str], name: str | None = None) -> Graph:
        """The nodes ``names`` as a graph of their own: tensors they read from outside
        become inputs (constants stay constants) and tensors used outside (or graph
        outputs) become outputs."""
        keep = [n for n in self.topo_order() if n.name in set(names)]
        inside = {n.name for n in keep}
        inputs: dict[str, TensorInfo] = {}
        consts: dict[str, np.ndarray] = {}
        for n in keep:
            for t in n.inputs:
                if t in inside:
                    continue
                if t in self.constants:
                    consts[t] = self.constants[t]
                else:
                    inputs.setdefault(t, self.tensor(t))
        outputs = [
            n.name
            for n in keep
            if n.name in self.outputs or any(c.name not in inside for c in self.consumers(n.name))
        ]
        return Graph(inputs.values(), keep, outputs, consts, name=name or self.name)

    def eliminate_dead_nodes(self) -> Graph:
        """A copy without the nodes and constants no output depends on."""
        live: set[str] = set()
        stack = [o for o in self.outputs]
        while stack:
            t = stack.pop()
            if t in live:
                continue
            live.add(t)
            if t in self.nodes:
                stack.extend(self.nodes[t].inputs)
        nodes = [n for n in self.topo_order() if n.name in live]
        consts = {k: v for k, v in self.constants.items() if k in live}
        return Graph(self.inputs, nodes, self.outputs, consts, name=self.name)

    def eliminate_common_subexpressions(self, max_constant_bytes: int = 1 << 16) -> Graph:
        """A copy in which a node computing what an earlier node computes -- the same
        compute on the same tensors -- is dropped and its readers read the earlier one.

        Constants count as the same tensor when their values are equal (up to
        ``max_constant_bytes`` each: exporters copy small ones -- masks' fill values,
        scales -- into every layer; weights are not compared).  A graph output keeps its
        node.  Exporters repeat work per layer that depends on the inputs alone (BERT's
        attention mask is turned into additive form in each of its twelve layers), and
        every copy would be a kernel."""
        same: dict[str, str] = {}
        by_value: dict[tuple[str, tuple[int, ...], bytes], str] = {}
        for name, value in self.constants.items():
            if value.nbytes <= max_constant_bytes:
                same[name] = by_value.setdefault((value.dtype.str, value.shape, value.tobytes()), name)
        seen: dict[str, str] = {}
        nodes: list[Node] = []
        for node in self.topo_order():
            c = node.compute.renamed(inputs={t: same[t] for t in node.inputs if t in same})
            key = f"{c.axes!r}|{c.reduce_axes!r}|{c.reduce_op}|{c.dtype}|{format_expr(c.body)}"
            first = seen.setdefault(key, c.name)
            if first != c.name and c.name not in self.outputs:
                same[c.name] = first
                continue
            nodes.append(replace(node, compute=c))
        return Graph(self.inputs, nodes, self.outputs, self.constants, name=self.name).eliminate_dead_nodes()

    def move_scales_past_products(self) -> Graph:
        """A copy in which a product of a scaled operand -- ``(x * c) . y`` or ``(x / c) .
        y``, ``c`` a scalar constant, the scaled tensor read by nothing else -- sums ``x .
        y`` into ``<name>:unscaled`` and the node ``<name>`` scales that sum.

        Exporters scale attention's queries and keys before their product (PyTorch's
        ``scaled_dot_product_attention`` multiplies each by the square root of the scale):
        scaled, each is an elementwise kernel's output of its own; unscaled, both are views
        of the projection that the attention kernel loads directly, and the scale joins the
        row stages it already computes in registers."""
        nodes: list[Node] = []
        for node in self.topo_order():
            c = node.compute
            if not c.is_product:
                nodes.append(node)
                continue
            operands, factors = [], []
            for load in (c.body.a, c.body.b):
                found = self._unscaled(load, node.name)
                operands.append(load if found is None else found[0])
                factors += [] if found is None else [found[1:]]
            if not factors:
                nodes.append(node)
                continue
            sum_name = f"{node.name}:unscaled"
            body = Binary("mul", *operands)
            nodes.append(replace(node, compute=replace(c, name=sum_name, body=body)))
            unscaled = Load(sum_name, tuple(a.var for a in c.axes), c.dtype)
            nodes.append(
                Node(Compute(node.name, c.axes, _scaled(unscaled, factors), c.dtype), "Mul", node.source)
            )
        return Graph(self.inputs, nodes, self.outputs, self.constants, name=self.name).eliminate_dead_nodes()

    def split_long_reductions(self) -> Graph:
        """A copy in which a reduction of few outputs over many elements each -- a global
        average pool of a large image at batch 1 -- is computed in two: ``<name>:part``
        reduces each of ``S`` slices of the outermost reduced axis (a new last axis of
        ``S``), and the node ``<name>`` reduces the ``S`` partial results (a half sum's
        partials and their total, ``<name>:total``, are fp32, and ``<name>`` casts it).

        A reduction's outputs are what a kernel spreads over blocks: NAFNet's 16-channel
        pool over 256 x 256 pixels gave 16 blocks of the 132 SMs a 4 MB read, and measured
        31 us where its bytes take 2.  Split, 512 blocks read it and 16 sum 32 partials.
        Only the order of the additions changes (a maximum not at all).  A reduction paired
        with another through elementwise nodes (:meth:`_in_statistics`) is left whole."""
        nodes: list[Node] = []
        for node in self.topo_order():
            split = _split_reduction(node.compute)
            if split is None or self._in_statistics(node):
                nodes.append(node)
                continue
            *halves, whole = split
            nodes += [Node(h, node.op_type, node.source) for h in halves] + [replace(node, compute=whole)]
        return Graph(self.inputs, nodes, self.outputs, self.constants, name=self.name)

    def _in_statistics(self, node: Node) -> bool:
        """Whether ``node`` is one of two reductions joined by elementwise nodes -- a mean
        and the variance around it (BSRN's contrast, a norm): the scheduler computes such a
        pair in one kernel, which two halves each would break apart."""

        def reaches(start: Iterable[str], step: Callable[[Node], list[str]]) -> bool:
            seen, todo = set(), list(start)
            while todo:
                n = self.nodes.get(todo.pop())
                if n is None or n.name in seen:
                    continue
                seen.add(n.name)
                if n.compute.is_reduction:
                    if not n.compute.is_product:
                        return True
                    continue
                todo += step(n)
            return False

        def consumers(n: Node) -> list[str]:
            return [c.name for c in self.consumers(n.name)]

        return reaches(consumers(node), consumers) or reaches(node.inputs, lambda n: list(n.inputs))

    def _unscaled(self, load: Expr, reader: str) -> tuple[Load, str, Expr] | None:
        """``load``'s tensor unscaled (``x`` of ``x * c`` or ``x / c``, loaded at the same
        point) with the op and the scalar ``c``, where only ``reader`` reads the tensor."""
        if not isinstance(load, Load) or load.tensor not in self.nodes or load.tensor in self.outputs:
            return None
        if [c.name for c in self.consumers(load.tensor)] != [reader]:
            return None
        p = self.nodes[load.tensor].compute
        body = p.body
        if (
            p.is_reduction
            or not is_float(p.dtype)
            or not isinstance(body, Binary)
            or body.op not in ("mul", "div")
        ):
            return None  # integers' division truncates: (x / c) . y is not (x . y) / c
        pairs = [(body.a, body.b)] + ([(body.b, body.a)] if body.op == "mul" else [])
        for x, factor in pairs:
            if isinstance(x, Load) and x.dtype == p.dtype and self._is_scalar(factor):
                at = {a.name: i for a, i in zip(p.axes, load.indices)}
                return substitute(x, at), body.op, factor
        return None

    def _is_scalar(self, e: Expr) -> bool:
        """A float constant, or a one-element constant tensor loaded at a fixed point."""
        if isinstance(e, Const):
            return e.dtype != INDEX
        return (
            isinstance(e, Load)
            and e.tensor in self.constants
            and self.constants[e.tensor].size == 1
            and all(isinstance(i, Const) for i in e.indices)
        )

    # -- evaluation & serialisation -----------------------------------------------------

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Evaluate the graph with the reference interpreter; returns every output."""
        env: dict[str, np.ndarray] = dict(self.constants)
        for t in self.inputs:
            if t.name not in feeds:
                raise ModelError(f"missing input {t.name!r}")
            env[t.name] = np.asarray(feeds[t.name])
        remaining = {name: len(self.consumers(name)) for name in self.nodes}
        for node in self.topo_order():
            env[node.name] = evaluate(node.compute, env)
            for t in node.inputs:
                if t in remaining:
                    remaining[t] -= 1
                    if remaining[t] == 0 and t not in self.outputs:
                        del env[t]
        return {o: env[o] for o in self.outputs}

    def to_json(self) -> dict:
        """Readable, stable description (model.json)."""
        order = self.topo_order()
        return {
            "format": "welder.graph/1",
            "name": self.name,
            "inputs": [t.to_json() for t in self.inputs],
            "outputs": [self.tensor(o).to_json() for o in self.outputs],
            "constants": [self.tensor(k).to_json() for k in sorted(self.constants)],
            "nodes": [
                {
                    "name": n.name,
                    "op_type": n.op_type,
                    "source": n.source,
                    "kind": "reduction" if n.compute.is_reduction else "injective",
                    "shape": list(n.compute.shape),
                    "dtype": n.compute.dtype,
                    "flops": n.compute.flops,
                    "inputs": list(n.inputs),
                    "compute": str(n.compute),
                }
                for n in order
            ],
            "edges": [
                {"src": t, "dst": n.name, "tensor": t} for n in order for t in n.inputs if t in self.nodes
            ],
        }

    def write_json(self, path: str) -> None:
        write_json(self.to_json(), path)

    def summary(self) -> str:
        kinds = {"reduction": 0, "injective": 0}
        for n in self.nodes.values():
            kinds["reduction" if n.compute.is_reduction else "injective"] += 1
        return (
            f"{self.name}: {len(self.nodes)} computes ({kinds['reduction']} reductions, "
            f"{kinds['injective']} injective), {len(self.constants)} constants, "
            f"{sum(self.tensor(c).nbytes for c in self.constants) / 2**20:.1f} MiB of weights"
        )


def _dtype_name(dt: np.dtype) -> str:
    dt = np.dtype(dt)
    return "bool" if dt == np.bool_ else dt.name


#: A reduction is split when each output reduces at least this many elements ...
SPLIT_MIN_REDUCED = 16384
#: ... and it has at most this many outputs (a block each, at most, in the SIMT kind).
SPLIT_MAX_OUTPUTS = 256
#: Elements a partial result reduces, at least.
SPLIT_PART = 2048


def _split_reduction(c: Compute) -> list[Compute] | None:
    """``c`` as [partial reduction, reduction of the partials (, cast of a half sum's fp32
    total to its type)], or None where it is not a long sum, maximum or minimum of few
    outputs (a product keeps its kernels' split-K)."""
    if c.reduce_op not in ("sum", "max", "min") or c.is_product:
        return None
    reduced = int(np.prod([a.extent for a in c.reduce_axes]))
    if reduced < SPLIT_MIN_REDUCED or int(np.prod(c.shape, dtype=np.int64)) > SPLIT_MAX_OUTPUTS:
        return None
    outer = c.reduce_axes[0]
    fits = [d for d in range(2, outer.extent + 1) if outer.extent % d == 0 and reduced // d >= SPLIT_PART]
    if not fits:
        return None
    slices = max(fits)
    step = outer.extent // slices
    # Half sums add up in fp32: a slice's sum of thousands of halves can pass 65504.
    acc = "float32" if c.reduce_op == "sum" and is_half(c.dtype) else c.dtype

    def partial(*idx: Expr) -> Reduce:
        *kept, piece = idx
        inner, rest = reduce_axis(step), [reduce_axis(a.extent) for a in c.reduce_axes[1:]]
        mapping: dict[str, Expr] = {a.name: i for a, i in zip(c.axes, kept)}
        mapping[outer.name] = binary("add", binary("mul", piece, step), inner)
        mapping.update({a.name: r for a, r in zip(c.reduce_axes[1:], rest)})
        return reduce(c.reduce_op, cast(substitute(c.body, mapping), acc), [inner, *rest])

    part = compute(f"{c.name}:part", (*c.shape, slices), partial, acc)
    total = c.name if acc == c.dtype else f"{c.name}:total"

    def combined(*idx: Expr) -> Reduce:
        r = reduce_axis(slices)
        return reduce(c.reduce_op, Load(part.name, (*idx, r), acc), [r])

    computes = [part, compute(total, c.shape, combined, acc)]
    if total != c.name:
        computes.append(compute(c.name, c.shape, lambda *idx: cast(Load(total, idx, acc), c.dtype), c.dtype))
    return computes


def _scaled(x: Expr, factors: list[tuple[str, Expr]]) -> Expr:
    """``x`` times its scalar factors' product, over their divisors' (``(op, factor)``,
    ``op`` mul or div): one operation an element, the factors combined once.  Both operands
    of attention's product move their scales here, and ``(x * c) * c`` was two
    multiplies of every score."""
    muls = [f for op, f in factors if op == "mul"]
    divs = [f for op, f in factors if op == "div"]

    def product(fs: list[Expr]) -> Expr:
        return functools.reduce(lambda a, b: Binary("mul", a, b), fs)

    if muls and divs:
        return Binary("mul", x, Binary("div", product(muls), product(divs)))
    return Binary("mul", x, product(muls)) if muls else Binary("div", x, product(divs))
