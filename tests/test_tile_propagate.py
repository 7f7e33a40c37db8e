"""Tile propagation against brute force: evaluate every index expression at every point of
a tile (reduce axes whole, or one step) and compare the bounding box with the region."""

from __future__ import annotations

import numpy as np
import pytest
from node_cases import importable
from onnx import helper
from onnx_util import make_model

from welder.frontend.onnx import import_onnx
from welder.frontend.registry import Tensor
from welder.graph import Graph
from welder.ir.compute import Compute, compute, reduce, reduce_axis
from welder.ir.expr import Load, cast, in_range, logical_and, select, walk
from welder.ir.interpret import _Evaluator
from welder.tile.propagate import (
    Region,
    partitions_output,
    propagate_group,
    read_regions,
    root_region,
)

RNG = np.random.default_rng(1)


# -- brute force --------------------------------------------------------------------------


def brute_force_boxes(c: Compute, box: list[tuple[int, int]], rbox: list[tuple[int, int]] | None = None):
    """Per tensor and dimension, (min, max+1) of every index value at every point, or
    None for a data-dependent index (which must propagate as the whole dimension)."""
    axes = list(c.axes) + list(c.reduce_axes)
    ranges = list(box) + (rbox if rbox is not None else [(0, a.extent) for a in c.reduce_axes])
    domain = {}
    for k, (a, (lo, hi)) in enumerate(zip(axes, ranges)):
        shape = [1] * len(axes)
        shape[k] = hi - lo
        domain[a.name] = np.arange(lo, hi).reshape(shape)
    ev = _Evaluator(domain, {}, len(axes))
    out: dict[str, list] = {}
    for ld in c.loads():
        dims = out.setdefault(ld.tensor, [(np.inf, -np.inf)] * len(ld.indices))
        for d, idx in enumerate(ld.indices):
            if dims[d] is None or any(isinstance(n, Load) for n in walk(idx)):
                dims[d] = None
                continue
            v = np.asarray(ev(idx))
            dims[d] = (min(dims[d][0], int(v.min())), max(dims[d][1], int(v.max()) + 1))
    return out


def check_region(region: Region, expected, shape, env, exact: bool):
    for d, (iv, want, size) in enumerate(zip(region.dims, expected, shape)):
        lo, hi = iv.at(env)
        if want is None:
            assert (lo, hi) == (0, size) or hi - lo >= size, f"dim {d}: data-dependent index must cover all"
            continue
        # Clip both to the tensor: positions outside are guarded and never loaded.
        wlo, whi = max(want[0], 0), min(want[1], size)
        glo, ghi = max(lo, 0), min(hi, size)
        if wlo >= whi:
            continue
        assert glo <= wlo and whi <= ghi, f"dim {d}: region [{lo},{hi}) misses [{want[0]},{want[1]})"
        if exact:
            assert (glo, ghi) == (wlo, whi), f"dim {d}: region [{lo},{hi}) is looser than [{wlo},{whi})"


def random_tile(shape):
    return tuple(int(RNG.integers(1, s + 1)) if s > 0 else 1 for s in shape)


def check_compute(c: Compute, shape_of, tiles: int = 3, exact: bool = False, rstep=None):
    for _ in range(tiles):
        tile = random_tile(c.shape)
        grid = [-(-s // t) for s, t in zip(c.shape, tile)]
        env = {f"b{k}": int(RNG.integers(0, g)) for k, g in enumerate(grid)}
        box = [
            (env[f"b{k}"] * t, min(env[f"b{k}"] * t + t, s)) for k, (t, s) in enumerate(zip(tile, c.shape))
        ]
        rbox = None
        if rstep is not None:
            env.update(
                {
                    f"k{k}": int(RNG.integers(0, -(-a.extent // r)))
                    for k, (a, r) in enumerate(zip(c.reduce_axes, rstep))
                }
            )
            rbox = [
                (env[f"k{k}"] * r, min(env[f"k{k}"] * r + r, a.extent))
                for k, (a, r) in enumerate(zip(c.reduce_axes, rstep))
            ]
        regions = read_regions(c, root_region(tile).dims, shape_of, rstep)
        for tensor, expected in brute_force_boxes(c, box, rbox).items():
            # The last block of a non-dividing tile is partial: compare against the full tile.
            check_region(
                regions[tensor],
                expected,
                shape_of(tensor),
                env,
                exact and all(s % t == 0 for s, t in zip(c.shape, tile)),
            )


# -- single computes written by hand ------------------------------------------------------------


def test_matmul_regions_are_exact_with_and_without_steps():
    a, b = Tensor("A", (40, 24), "float32"), Tensor("B", (24, 56), "float32")

    def fn(i, j):
        k = reduce_axis(24)
        return reduce("sum", a[i, k] * b[k, j], k)

    c = compute("C", (40, 56), fn)
    shapes = {"A": a.shape, "B": b.shape}
    check_compute(c, shapes.__getitem__, tiles=10, exact=True)
    check_compute(c, shapes.__getitem__, tiles=10, exact=True, rstep=(8,))


@pytest.mark.parametrize("stride,dilation,pad", [(1, 1, 0), (2, 1, 1), (1, 2, 2), (3, 2, 1)])
def test_conv_halo_is_exact(stride, dilation, pad):
    x, w = Tensor("X", (2, 3, 17, 13), "float32"), Tensor("W", (4, 3, 3, 3), "float32")
    oh = (17 + 2 * pad - dilation * 2 - 1) // stride + 1
    ow = (13 + 2 * pad - dilation * 2 - 1) // stride + 1

    def fn(n, co, h, ww):
        ci, kh, kw = reduce_axis(3), reduce_axis(3), reduce_axis(3)
        y, z = h * stride + kh * dilation - pad, ww * stride + kw * dilation - pad
        inside = logical_and(in_range(y, 0, 17), in_range(z, 0, 13))
        return reduce("sum", select(inside, x[n, ci, y, z], 0.0) * w[co, ci, kh, kw], [ci, kh, kw])

    c = compute("O", (2, 4, oh, ow), fn)
    check_compute(c, {"X": x.shape, "W": w.shape}.__getitem__, tiles=10, exact=True)


def test_reshape_split_merge_and_transpose():
    x = Tensor("X", (6, 64), "float32")
    split = compute("S", (6, 4, 16), lambda i, j, k: x[i, j * 16 + k])
    merge_src = Tensor("Y", (6, 4, 16), "float32")
    merge = compute("M", (6, 64), lambda i, j: merge_src[i, j // 16, j % 16])
    trans = compute("T", (64, 6), lambda i, j: x[j, i])
    shapes = {"X": x.shape, "Y": merge_src.shape}
    for c in (split, merge, trans):
        check_compute(c, shapes.__getitem__, tiles=15)
    # Tiles aligned with the 16-element groups give exact floordiv/mod regions.
    regions = read_regions(merge, root_region((2, 32)).dims, shapes.__getitem__)
    assert regions["Y"].extents == (2, 2, 16)


def test_gather_is_whole_dimension():
    table, ids = Tensor("T", (50, 8), "float32"), Tensor("I", (4,), "int64")
    c = compute("G", (4, 8), lambda i, d: table[cast(ids[i], "index"), d])
    regions = read_regions(c, root_region((2, 4)).dims, {"T": table.shape, "I": ids.shape}.__getitem__)
    assert regions["T"].extents == (50, 4) and regions["I"].extents == (2,)


# -- every lowering, through the ONNX node test models -----------------------------------------


@pytest.mark.parametrize("seed", [0])
def test_every_lowering_against_brute_force(seed):
    """All node-test models that import: every compute, random tiles and blocks."""
    checked = set()
    for _case, graph in importable():
        for node in graph.topo_order():
            c = node.compute
            points = int(np.prod(c.shape or (1,))) * int(np.prod([a.extent for a in c.reduce_axes] or [1]))
            if points > 200_000 or 0 in c.shape:
                continue
            check_compute(c, lambda t, g=graph: g.tensor(t).shape, tiles=2)
            checked.add(node.op_type)
    # A floor on coverage so a broken importer does not pass vacuously.
    assert len(checked) >= 15, sorted(checked)


# -- whole groups -------------------------------------------------------------------------------


def _graph(nodes, inputs, outputs, inits=None, opset=17) -> Graph:
    return import_onnx(make_model(nodes, inputs, outputs, inits, opset))


def group_brute_force(graph: Graph, members: list[str], root: str, tile, env):
    """Actual boxes per block, walking consumers' actual boxes backwards."""
    comp = {m: graph.nodes[m].compute for m in members}
    shape = graph.tensor(root).shape
    boxes = {
        root: [(env[f"b{k}"] * t, min(env[f"b{k}"] * t + t, s)) for k, (t, s) in enumerate(zip(tile, shape))]
    }
    for m in reversed(members):
        found = brute_force_boxes(comp[m], boxes[m])
        for tensor, dims in found.items():
            if tensor not in comp:
                continue
            size = graph.tensor(tensor).shape
            dims = [(0, s) if d is None else (max(d[0], 0), min(d[1], s)) for d, s in zip(dims, size)]
            old = boxes.get(tensor)
            boxes[tensor] = (
                dims if old is None else [(min(a[0], b[0]), max(a[1], b[1])) for a, b in zip(old, dims)]
            )
    return boxes


def _check_group(graph: Graph, tile, exact=True):
    members = [n.name for n in graph.topo_order()]
    root = members[-1]
    comps = [graph.nodes[m].compute for m in members]
    shape_of = lambda t: graph.tensor(t).shape  # noqa: E731
    regions = propagate_group(comps, root, tile, shape_of)
    shape = graph.tensor(root).shape
    grid = [-(-s // t) for s, t in zip(shape, tile)]
    for _ in range(5):
        env = {f"b{k}": int(RNG.integers(0, g)) for k, g in enumerate(grid)}
        want = group_brute_force(graph, members, root, tile, env)
        for m in members:
            check_region(regions.members[m], want[m], graph.tensor(m).shape, env, exact)
    return regions


def test_matmul_bias_gelu_chain():
    x = RNG.standard_normal((32, 16)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"]),
        helper.make_node("Add", ["mm", "b"], ["biased"]),
        helper.make_node("Gelu", ["biased"], ["y"]),
    ]
    g = _graph(
        nodes,
        {"x": x},
        ["y"],
        {
            "w": RNG.standard_normal((16, 48)).astype(np.float32),
            "b": RNG.standard_normal((48,)).astype(np.float32),
        },
        opset=20,
    )
    regions = _check_group(g, (8, 16))
    assert regions.inputs["w"].extents == (16, 16)


def test_softmax_stages_need_whole_rows():
    x = RNG.standard_normal((4, 6, 10)).astype(np.float32)
    g = _graph([helper.make_node("Softmax", ["x"], ["y"], axis=-1)], {"x": x}, ["y"])
    regions = _check_group(g, (1, 2, 10))
    assert regions.inputs["x"].extents == (1, 2, 10)


def test_layernorm_stages():
    x = RNG.standard_normal((6, 12)).astype(np.float32)
    node = helper.make_node("LayerNormalization", ["x", "s", "b"], ["y"], axis=-1)
    g = _graph([node], {"x": x}, ["y"], {"s": np.ones(12, np.float32), "b": np.zeros(12, np.float32)})
    _check_group(g, (2, 12))


def test_conv_chain_halo_grows_backwards():
    x = RNG.standard_normal((1, 2, 12, 12)).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2"], ["y"], pads=[1, 1, 1, 1]),
    ]
    inits = {
        "w1": RNG.standard_normal((3, 2, 3, 3)).astype(np.float32),
        "w2": RNG.standard_normal((2, 3, 3, 3)).astype(np.float32),
    }
    g = _graph(nodes, {"x": x}, ["y"], inits)
    regions = _check_group(g, (1, 2, 4, 4))
    assert regions.members["c1"].extents == (1, 3, 6, 6)  # a 4x4 tile needs a 1-pixel halo
    assert regions.inputs["x"].extents == (1, 2, 8, 8)


def test_transposed_intermediate_partitions_by_block_order():
    x = RNG.standard_normal((8, 12)).astype(np.float32)
    nodes = [helper.make_node("Exp", ["x"], ["e"]), helper.make_node("Transpose", ["e"], ["y"], perm=[1, 0])]
    g = _graph(nodes, {"x": x}, ["y"])
    comps = [n.compute for n in g.topo_order()]
    regions = propagate_group(comps, "y", (4, 2), lambda t: g.tensor(t).shape)
    # e's rows follow the root's second block coordinate: still an exact partition.
    assert partitions_output(regions.members["e"], (8, 12), (4, 2), (3, 4))
    # Row statistics of a softmax tiled across its row: both column blocks would write them.
    softmax = _graph([helper.make_node("Softmax", ["x"], ["y"], axis=-1)], {"x": x}, ["y"])
    comps = [n.compute for n in softmax.topo_order()]
    regions = propagate_group(comps, "y", (2, 6), lambda t: softmax.tensor(t).shape)
    row_max = next(m for m in regions.members if softmax.nodes[m].compute.reduce_op == "max")
    assert not partitions_output(regions.members[row_max], (8,), (2, 6), (4, 2))
    assert partitions_output(regions.members[row_max], (8,), (2, 12), (4, 1))
