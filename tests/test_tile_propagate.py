"""Tile propagation against brute force: evaluate every index expression at every point of
a tile (reduce axes whole, or one step) and compare the bounding box with the region.

Two properties are checked per dimension of every region:

* containment, always: every index the block evaluates lies inside the region;
* tightness, as far as one static extent for every block allows: the bounding box itself
  for affine indices, at most a stated relaxation of it otherwise (see :func:`tightness`).
"""

from __future__ import annotations

import functools
import itertools
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import pytest
from node_cases import importable, node_cases
from onnx import helper, numpy_helper, version_converter
from onnx_util import make_model, single_op

from welder.errors import WelderError
from welder.frontend.onnx import MAX_OPSET, MIN_OPSET, import_onnx, model_opset
from welder.frontend.ops.shape import reshape_index
from welder.frontend.registry import LOWERINGS, Tensor
from welder.graph import Graph
from welder.ir.compute import Compute, compute, reduce, reduce_axis
from welder.ir.expr import (
    Binary,
    Const,
    Expr,
    Load,
    Var,
    binary,
    cast,
    in_range,
    logical_and,
    lt,
    rewrite,
    select,
    walk,
)
from welder.ir.interpret import _Evaluator
from welder.tile.propagate import (
    GroupRegions,
    Region,
    partitions_output,
    propagate_group,
    read_regions,
    root_region,
)

Box = list[tuple[int, int]]
Boxes = dict[str, list[tuple[int, int] | None]]
ShapeOf = Callable[[str], tuple[int, ...]]

# -- brute force --------------------------------------------------------------------------


def relax(e: Expr, counter: Iterator[int], fresh: dict[str, int]) -> Expr:
    """``e`` with every ``x % d`` replaced by a free residue in ``[0, d)`` and every
    ``x // d`` allowed one more quotient, the new variables and their extents added to
    ``fresh``: the values one static extent must cover at any alignment of the tile."""

    def widen(n: Expr) -> Expr | None:
        if not isinstance(n, Binary) or n.op not in ("floordiv", "mod") or not isinstance(n.b, Const):
            return None
        name = f"_relaxed{next(counter)}"
        if n.op == "mod":
            fresh[name] = int(n.b.value)
            return Var(name)
        fresh[name] = 2
        return binary("add", n, Var(name))

    return rewrite(e, widen)


def brute_force_boxes(c: Compute, box: Box, rbox: Box | None = None, relaxed: bool = False) -> Boxes:
    """Per tensor and dimension, (min, max+1) of every index value at every point, or
    None for a data-dependent index (which must propagate as the whole dimension).
    ``relaxed`` evaluates :func:`relax` of every index instead.

    Guards are ignored on purpose: propagation bounds the index expressions, not the
    subset of points a ``select`` lets through, and positions outside the tensor are
    clipped away by the comparison."""
    counter = itertools.count()
    fresh: dict[str, int] = {}
    per_load = []
    for ld in c.loads():
        per_load.append((ld, [relax(i, counter, fresh) if relaxed else i for i in ld.indices]))
    names = [a.name for a in (*c.axes, *c.reduce_axes)] + list(fresh)
    ranges = list(box) + (rbox if rbox is not None else [(0, a.extent) for a in c.reduce_axes])
    ranges += [(0, n) for n in fresh.values()]
    domain = {}
    for k, (name, (lo, hi)) in enumerate(zip(names, ranges)):
        shape = [1] * len(names)
        shape[k] = hi - lo
        domain[name] = np.arange(lo, hi).reshape(shape)
    ev = _Evaluator(domain, {}, len(names))
    out: Boxes = {}
    for ld, indices in per_load:
        dims = out.setdefault(ld.tensor, [(np.inf, -np.inf)] * len(indices))
        for d, idx in enumerate(indices):
            if dims[d] is None or any(isinstance(n, Load) for n in walk(idx)):
                dims[d] = None
                continue
            v = np.asarray(ev(idx))
            dims[d] = (min(dims[d][0], int(v.min())), max(dims[d][1], int(v.max()) + 1))
    return out


# -- how tight a region must be ------------------------------------------------------------


@dataclass(frozen=True)
class Tightness:
    """What a region may hold beyond the bounding box along one dimension (both clipped
    to the tensor): nothing (``exact``), or at most the box of the relaxed indices
    (``relaxed``, see :func:`relax`); and in either case the whole dimension instead
    when ``whole_ok``."""

    exact: bool = True
    relaxed: bool = False
    whole_ok: bool = False


EXACT = Tightness()
RELAXED = Tightness(exact=False, relaxed=True)
EXACT_OR_WHOLE = Tightness(whole_ok=True)


def linear_form(e: Expr) -> dict[str, int] | None:
    """Coefficients of ``e`` if it is built from axis variables, index constants, ``+``,
    ``-`` and products with constants, each variable used once; else None.

    Every variable then ranges over its interval independently, so the bounding box of the
    values is the interval sum: interval arithmetic is exact."""
    seen: list[str] = []

    def walk_linear(x: Expr, scale: int, acc: dict[str, int]) -> bool:
        if isinstance(x, Var):
            seen.append(x.name)
            acc[x.name] = acc.get(x.name, 0) + scale
            return True
        if isinstance(x, Const):
            return isinstance(x.value, (int, np.integer))
        if not isinstance(x, Binary):
            return False
        if x.op in ("add", "sub"):
            return walk_linear(x.a, scale, acc) and walk_linear(x.b, -scale if x.op == "sub" else scale, acc)
        if x.op == "mul":
            for f, g in ((x.a, x.b), (x.b, x.a)):
                if isinstance(g, Const):
                    return walk_linear(f, scale * int(g.value), acc)
        return False

    acc: dict[str, int] = {}
    if not walk_linear(e, 1, acc) or len(seen) != len(set(seen)):
        return None
    return {v: c for v, c in acc.items() if c}


def tightness(indices: Sequence[Expr]) -> Tightness:
    """The bound for one dimension of a tensor, from the index expressions of all loads of
    that tensor along it (found by experiment over every lowering, then explained):

    * linear indices sharing their coefficients (the loads differ by constants, like a
      halo or two parts of a Concat): the union is the exact hull, so the region must
      equal the bounding box -- for every block and tile, dividing or not, as the brute
      force evaluates the tile's full nominal box;
    * one linear index under ``//`` and ``%`` by constants (reshapes, DepthToSpace, Tile,
      wrap padding, integer resizes, transposed convs): aligned tiles are exact, but
      otherwise one static extent must serve the block at the worst alignment.  So a
      quotient may be one more than this block reads and a remainder that wraps around
      in some block covers every residue: the region lies between the bounding box and
      the box of :func:`relax`-ed indices.  That bound is independent of the propagation
      and tight: a reshape's ``j % 64`` is the whole head exactly when tiles may straddle
      heads;
    * anything else (``select`` or ``min``/``max`` in an index, casts from floats, indices
      that load data, loads whose intervals move with different block coordinates): the
      region is the bounding box or the whole dimension -- never anything in between.
    """
    forms = [linear_form(e) for e in indices]
    if all(f is not None for f in forms) and all(f == forms[0] for f in forms):
        return EXACT
    ops = {n.op if isinstance(n, Binary) else type(n).__name__ for e in indices for n in walk(e)}
    if ops <= {"add", "sub", "mul", "floordiv", "mod", "Var", "Const"} and len(set(indices)) == 1:
        return RELAXED
    return EXACT_OR_WHOLE


def dimension_rules(c: Compute) -> dict[str, list[Tightness]]:
    """:func:`tightness` for every dimension of every tensor ``c`` reads."""
    per_dim: dict[str, list[list[Expr]]] = {}
    for ld in c.loads():
        dims = per_dim.setdefault(ld.tensor, [[] for _ in ld.indices])
        for d, idx in enumerate(ld.indices):
            dims[d].append(idx)
    return {t: [tightness(idx) for idx in dims] for t, dims in per_dim.items()}


def check_region(
    region: Region,
    expected: Sequence[tuple[int, int] | None],
    shape: Sequence[int],
    env: Mapping[str, int],
    rules: Sequence[Tightness],
    relaxed: Sequence[tuple[int, int] | None] | None = None,
    what: str = "",
) -> None:
    """One region against the brute-force boxes of one block (``relaxed``: the boxes of
    the relaxed indices, needed where a rule is ``relaxed``)."""
    for d, (iv, want, size, rule) in enumerate(zip(region.dims, expected, shape, rules)):
        lo, hi = iv.at(env)
        where = f"{what} dim {d}: region [{lo},{hi}) ({iv})"
        if want is None:
            assert (lo, hi) == (0, size) or hi - lo >= size, f"{where}: a data-dependent index must cover all"
            continue
        # Clip both to the tensor: positions outside are guarded and never loaded.
        wlo, whi = max(want[0], 0), min(want[1], size)
        glo, ghi = max(lo, 0), min(hi, size)
        if wlo >= whi:
            continue
        assert glo <= wlo and whi <= ghi, f"{where} misses [{want[0]},{want[1]})"
        if rule.whole_ok and (glo, ghi) == (0, size):
            continue
        if rule.exact:
            assert (glo, ghi) == (wlo, whi), f"{where} is looser than [{wlo},{whi}) ({rule})"
        if rule.relaxed:
            assert relaxed is not None and relaxed[d] is not None, f"{where}: no relaxed box"
            rlo, rhi = max(relaxed[d][0], 0), min(relaxed[d][1], size)
            assert rlo <= glo and ghi <= rhi, f"{where} is looser than the relaxed [{rlo},{rhi})"


# -- single computes against brute force ---------------------------------------------------------


def random_tile(shape: Sequence[int], rng: np.random.Generator) -> tuple[int, ...]:
    return tuple(int(rng.integers(1, s + 1)) if s > 0 else 1 for s in shape)


def check_compute(
    c: Compute,
    shape_of: ShapeOf,
    rng: np.random.Generator,
    tiles: int = 3,
    rstep: Sequence[int] | str | None = None,
) -> None:
    """Random tiles of ``c``, each at a random block (and reduction step): every region
    against the brute force of the tile's nominal box.  The last block of a tile that
    does not divide the shape reaches past the output; the static extent must still
    hold its whole nominal tile, so the nominal box is the one to compare with.
    ``rstep='random'`` draws a reduction step per tile."""
    rules = dimension_rules(c)
    needs_relaxed = any(r.relaxed for dims in rules.values() for r in dims)
    for _ in range(tiles):
        tile = random_tile(c.shape, rng)
        grid = [-(-s // t) for s, t in zip(c.shape, tile)]
        env = {f"b{k}": int(rng.integers(0, g)) for k, g in enumerate(grid)}
        box = [(env[f"b{k}"] * t, env[f"b{k}"] * t + t) for k, t in enumerate(tile)]
        step = random_tile([a.extent for a in c.reduce_axes], rng) if rstep == "random" else rstep
        rbox = None
        if step is not None:
            for k, (a, r) in enumerate(zip(c.reduce_axes, step)):
                env[f"k{k}"] = int(rng.integers(0, -(-a.extent // r))) if r < a.extent else 0
            rbox = [
                (env[f"k{k}"] * r, env[f"k{k}"] * r + r) if r < a.extent else (0, a.extent)
                for k, (a, r) in enumerate(zip(c.reduce_axes, step))
            ]
        regions = read_regions(c, root_region(tile).dims, shape_of, step)
        relaxed = brute_force_boxes(c, box, rbox, relaxed=True) if needs_relaxed else {}
        for tensor, expected in brute_force_boxes(c, box, rbox).items():
            what = f"{c.name} tile {tile} step {step} at {env}: {tensor}"
            rule = rules[tensor]
            check_region(regions[tensor], expected, shape_of(tensor), env, rule, relaxed.get(tensor), what)


def test_matmul_regions_are_exact_with_and_without_steps():
    rng = np.random.default_rng(1)
    a, b = Tensor("A", (40, 24), "float32"), Tensor("B", (24, 56), "float32")

    def fn(i, j):
        k = reduce_axis(24)
        return reduce("sum", a[i, k] * b[k, j], k)

    c = compute("C", (40, 56), fn)
    shapes = {"A": a.shape, "B": b.shape}
    check_compute(c, shapes.__getitem__, rng, tiles=10)
    check_compute(c, shapes.__getitem__, rng, tiles=10, rstep=(8,))
    check_compute(c, shapes.__getitem__, rng, tiles=10, rstep="random")


@pytest.mark.parametrize("stride,dilation,pad", [(1, 1, 0), (2, 1, 1), (1, 2, 2), (3, 2, 1)])
def test_conv_halo_is_exact(stride, dilation, pad):
    rng = np.random.default_rng(2)
    x, w = Tensor("X", (2, 3, 17, 13), "float32"), Tensor("W", (4, 3, 3, 3), "float32")
    oh = (17 + 2 * pad - dilation * 2 - 1) // stride + 1
    ow = (13 + 2 * pad - dilation * 2 - 1) // stride + 1

    def fn(n, co, h, ww):
        ci, kh, kw = reduce_axis(3), reduce_axis(3), reduce_axis(3)
        y, z = h * stride + kh * dilation - pad, ww * stride + kw * dilation - pad
        inside = logical_and(in_range(y, 0, 17), in_range(z, 0, 13))
        return reduce("sum", select(inside, x[n, ci, y, z], 0.0) * w[co, ci, kh, kw], [ci, kh, kw])

    c = compute("O", (2, 4, oh, ow), fn)
    assert all(r == EXACT for rules in dimension_rules(c).values() for r in rules)  # held to equality
    check_compute(c, {"X": x.shape, "W": w.shape}.__getitem__, rng, tiles=10)
    check_compute(c, {"X": x.shape, "W": w.shape}.__getitem__, rng, tiles=10, rstep="random")


def test_reshape_split_merge_and_transpose():
    rng = np.random.default_rng(3)
    x = Tensor("X", (6, 64), "float32")
    split = compute("S", (6, 4, 16), lambda i, j, k: x[i, j * 16 + k])
    merge_src = Tensor("Y", (6, 4, 16), "float32")
    merge = compute("M", (6, 64), lambda i, j: merge_src[i, j // 16, j % 16])
    trans = compute("T", (64, 6), lambda i, j: x[j, i])
    shapes = {"X": x.shape, "Y": merge_src.shape}
    for c in (split, merge, trans):
        check_compute(c, shapes.__getitem__, rng, tiles=15)
    # Tiles aligned with the 16-element groups give exact floordiv/mod regions.
    regions = read_regions(merge, root_region((2, 32)).dims, shapes.__getitem__)
    assert regions["Y"].extents == (2, 2, 16)


@pytest.mark.parametrize(
    "tile,extents",
    [
        # A tile of half a head (or of a divisor of it) never straddles a head: one quotient,
        # and the remainders are one run inside it, not the whole head.
        (32, (1, 32)),
        (16, (1, 16)),
        # 48 = 16 * 3 elements from a multiple of 16 cross at most one head boundary.
        (48, (2, 64)),
        # 24 from multiples of 8 may straddle a boundary: every remainder, two quotients.
        (24, (2, 64)),
    ],
)
def test_merged_heads_with_tiles_inside_a_head(tile, extents):
    """``[S, H, D] -> [S, H*D]`` read with a tile along the merged axis smaller than (or
    not a multiple of) D: the quotient and remainder regions follow the tile's alignment,
    not just the worst case over every possible start."""
    src = Tensor("Y", (4, 12, 64), "float32")
    merge = compute("M", (4, 768), lambda s, j: src[s, j // 64, j % 64])
    regions = read_regions(merge, root_region((1, tile)).dims, {"Y": src.shape}.__getitem__)
    assert regions["Y"].extents[1:] == extents
    check_compute(merge, {"Y": src.shape}.__getitem__, np.random.default_rng(tile), tiles=20)


def _factors(n: int, rng: np.random.Generator) -> tuple[int, ...]:
    """A random shape of ``n`` elements, at most four dimensions."""
    out: list[int] = []
    while n > 1 and len(out) < 3:
        d = int(rng.choice([k for k in range(2, n + 1) if n % k == 0]))
        out.append(d)
        n //= d
    return (*out, n) if n > 1 else tuple(out)


def test_random_reshapes_against_brute_force():
    """The node tests' reshapes are a handful of small shapes; reshapes between random
    factorisations mix splits and merges of several dimensions, whose nested ``//`` and
    ``%`` are where the relaxed bound is tested hardest."""
    rng = np.random.default_rng(4)
    for _ in range(120):
        n = int(rng.choice([24, 36, 60, 64, 96, 210, 256, 768]))
        x = Tensor("X", _factors(n, rng), "float32")
        shape = _factors(n, rng)
        c = compute("R", shape, lambda *i, x=x, shape=shape: x[reshape_index(i, shape, x.shape)])
        check_compute(c, {"X": x.shape}.__getitem__, rng, tiles=3)


def test_gather_is_whole_dimension():
    table, ids = Tensor("T", (50, 8), "float32"), Tensor("I", (4,), "int64")
    c = compute("G", (4, 8), lambda i, d: table[cast(ids[i], "index"), d])
    regions = read_regions(c, root_region((2, 4)).dims, {"T": table.shape, "I": ids.shape}.__getitem__)
    assert regions["T"].extents == (50, 4) and regions["I"].extents == (2,)


@pytest.mark.parametrize("limit", [200_000, 1])
def test_remembered_regions_follow_the_shapes_read_and_not_the_compute_object(limit, monkeypatch):
    """read_regions remembers its answers by a compute's axes and loads and the shapes it
    reads: the same compute over a longer table reads the longer dimension, and an equal
    compute built again is answered alike -- also where the memo starts again at every call."""
    import welder.tile.propagate as propagate

    monkeypatch.setattr(propagate, "MEMO_LIMIT", limit)
    table, ids = Tensor("T", (50, 8), "float32"), Tensor("I", (4,), "int64")

    def gather() -> Compute:
        return compute("G", (4, 8), lambda i, d: table[cast(ids[i], "index"), d])

    out = root_region((2, 4)).dims
    short, long = {"T": (50, 8), "I": (4,)}, {"T": (70, 8), "I": (4,)}
    c = gather()
    assert read_regions(c, out, short.__getitem__)["T"].extents == (50, 4)
    assert read_regions(c, out, long.__getitem__)["T"].extents == (70, 4)
    again = gather()
    assert again is not c
    assert read_regions(again, out, short.__getitem__) == read_regions(c, out, short.__getitem__)
    assert read_regions(again, out, short.__getitem__) is not read_regions(c, out, short.__getitem__)


def test_tightness_rules():
    """The classification and the relaxed indices it leans on."""
    i, j, k = Var("i0"), Var("i1"), Var("r0")
    assert linear_form(i * 2 + k * 3 - 1) == {"i0": 2, "r0": 3}
    assert linear_form(i - i) is None  # one variable twice: intervals overestimate
    assert tightness([i + 1, i - 1]) == EXACT
    assert tightness([i, j]) == EXACT_OR_WHOLE
    assert tightness([(i * 4 + j) // 8 % 3]) == RELAXED
    assert tightness([select(lt(i, 0), 0 - i, i)]) == EXACT_OR_WHOLE
    # Over j in [8, 10): j // 4 is {2}, relaxed also 3; j % 4 is {0, 1}, relaxed every residue.
    x = Tensor("X", (8, 4), "float32")
    c = compute("M", (32,), lambda j: x[j // 4, j % 4])
    assert brute_force_boxes(c, [(8, 10)]) == {"X": [(2, 3), (0, 2)]}
    assert brute_force_boxes(c, [(8, 10)], relaxed=True) == {"X": [(2, 4), (0, 4)]}


# -- every lowering ----------------------------------------------------------------------------

# Lowerings that never produce a compute reading anything, so there is no index to check:
# they fold to constants at import or are fills, or alias their input.
NO_INDEX_EXPRESSIONS = {
    "Constant": "a constant",
    "Shape": "a constant from static shapes",
    "Size": "a constant from static shapes",
    "Range": "needs constant inputs, so it folds to a constant",
    "ConstantOfShape": "a fill without loads (or a folded constant)",
    "Dropout": "aliases its input; the mask output is a fill without loads",
}


def _convert(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model at an opset the importer accepts (onnx 1.2x builds its node tests at
    the newest opsets)."""
    if MIN_OPSET <= model_opset(model) <= MAX_OPSET:
        return model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return version_converter.convert_version(model, MAX_OPSET)


def _freeze_parameters(case) -> onnx.ModelProto:
    """The case's model with its small non-data inputs (Slice starts, Pad pads, Resize
    sizes, reduction axes...) turned into initializers holding the test's own values:
    welder needs them constant, the node tests feed them as graph inputs.  Inputs that
    are the first operand of a node stay inputs, or the whole model would fold away."""
    model = onnx.ModelProto()
    model.CopyFrom(case.model)
    data = {n.input[0] for n in model.graph.node if n.input}
    values = case.data_sets[0][0] if case.data_sets else []
    keep = []
    for vi, arr in zip(list(model.graph.input), values):
        if vi.name not in data and isinstance(arr, np.ndarray) and arr.dtype.kind in "iuf" and arr.size <= 64:
            model.graph.initializer.append(numpy_helper.from_array(arr, vi.name))
        else:
            keep.append(vi)
    keep += list(model.graph.input)[len(values) :]
    del model.graph.input[:]
    model.graph.input.extend(keep)
    return model


def _converted_node_tests() -> Iterator[tuple[str, Graph]]:
    """Node tests the importer rejects as they are but accepts converted to opset 21, or
    with their parameters frozen.  The ``_expanded`` variants are skipped: they repeat the
    plain cases' operators in function bodies and would double the conversion time."""
    imported = {case.name for case, _ in importable()}
    for case in node_cases():
        if case.name in imported or case.name.endswith("_expanded"):
            continue
        if not all(n.op_type in LOWERINGS for n in case.model.graph.node):
            continue
        for variant, build in (("opset21", lambda c: c.model), ("frozen", _freeze_parameters)):
            try:
                model = _convert(build(case))
            except Exception:  # the converter's own assertions, whatever onnx version raises them
                continue
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    graph = import_onnx(model)
            except WelderError:  # refused with a reason: another variant may still import
                continue
            if graph.nodes:
                yield f"{case.name} ({variant})", graph
            break


def _f32(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def _ints(*values: int) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def _op(
    op: str, inputs: dict, attrs: dict | None = None, consts: dict | None = None, **kw
) -> onnx.ModelProto:
    """One node at the newest opset the importer takes; ``consts`` become initializers."""
    return single_op(op, inputs, attrs, consts, opset=MAX_OPSET, **kw)


def _hand_built() -> Iterator[tuple[str, onnx.ModelProto]]:
    """Small graphs for what the node tests miss (GlobalMaxPool has no opset converter)
    and for geometry their 3x3 to 5x5 images are too small to exercise: groups, strides
    and dilations together, overhanging ceil-mode windows, every pad mode on a longer
    axis, heads merged by a reshape, integer and fractional resizes, negative steps."""
    rng = np.random.default_rng(7)
    image = {"x": _f32(rng, 1, 4, 13, 11)}
    yield "GlobalMaxPool", _op("GlobalMaxPool", {"x": _f32(rng, 2, 3, 5, 7)})
    conv = {"group": 2, "strides": [2, 1], "dilations": [1, 2], "pads": [1, 0, 2, 1]}
    yield "Conv grouped", _op("Conv", image, conv, {"w": _f32(rng, 6, 2, 3, 3)})
    deconv = {
        "group": 2,
        "strides": [3, 2],
        "dilations": [2, 1],
        "pads": [1, 0, 0, 1],
        "output_padding": [1, 0],
    }
    yield (
        "ConvTranspose",
        _op("ConvTranspose", {"x": _f32(rng, 1, 4, 5, 6)}, deconv, {"w": _f32(rng, 4, 3, 3, 2)}),
    )
    pool = {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 0, 0], "dilations": [1, 2]}
    yield "MaxPool ceil", _op("MaxPool", {"x": _f32(rng, 1, 2, 11, 10)}, {**pool, "ceil_mode": 1})
    avg = {"kernel_shape": [3, 2], "strides": [2, 3], "pads": [1, 1, 1, 1], "count_include_pad": 0}
    yield "AveragePool", _op("AveragePool", {"x": _f32(rng, 1, 2, 11, 10)}, avg)
    for mode in ("constant", "edge", "reflect", "wrap"):
        yield f"Pad {mode}", _op("Pad", {"x": _f32(rng, 3, 10)}, {"mode": mode}, {"pads": _ints(1, 3, 2, 4)})
    yield "Pad crop", _op("Pad", {"x": _f32(rng, 3, 10)}, {"mode": "edge"}, {"pads": _ints(0, -2, 1, 3)})
    yield "Reshape merge", _op("Reshape", {"x": _f32(rng, 2, 6, 4, 16)}, None, {"shape": _ints(2, 6, 64)})
    yield "Flatten", _op("Flatten", {"x": _f32(rng, 2, 3, 4, 5)}, {"axis": 2})
    for mode in ("DCR", "CRD"):
        yield (
            f"DepthToSpace {mode}",
            _op("DepthToSpace", {"x": _f32(rng, 1, 8, 3, 4)}, {"blocksize": 2, "mode": mode}),
        )
    yield "SpaceToDepth", _op("SpaceToDepth", {"x": _f32(rng, 1, 2, 6, 9)}, {"blocksize": 3})
    for mode, scale in (("nearest", 2.0), ("linear", 0.5), ("linear", 1.5)):
        scales = {"roi": np.zeros(0, np.float32), "scales": np.asarray([1, 1, scale, scale], np.float32)}
        yield f"Resize {mode} x{scale}", _op("Resize", {"x": _f32(rng, 1, 2, 6, 8)}, {"mode": mode}, scales)
    steps = {"starts": _ints(8, 1), "ends": _ints(0, 12), "axes": _ints(0, 1), "steps": _ints(-2, 3)}
    yield "Slice steps", _op("Slice", {"x": _f32(rng, 9, 12)}, None, steps)
    yield "Tile", _op("Tile", {"x": _f32(rng, 3, 5)}, None, {"repeats": _ints(2, 3)})
    yield "Expand", _op("Expand", {"x": _f32(rng, 3, 1)}, None, {"shape": _ints(2, 3, 4)})
    qk = {"q": _f32(rng, 2, 3, 5, 4), "k": _f32(rng, 2, 3, 6, 4)}
    yield "Einsum", _op("Einsum", qk, {"equation": "bhqd,bhkd->bhqk"})
    yield "Gather range", _op("Gather", {"x": _f32(rng, 10, 6)}, {"axis": 0}, {"i": _ints(1, 3, 5, 7)})
    yield "Gather table", _op("Gather", {"x": _f32(rng, 10, 6)}, {"axis": 1}, {"i": _ints(5, 0, 0, 2)})
    hot = {"depth": _ints(7), "values": np.asarray([0.5, 2.0], np.float32)}
    yield "OneHot", _op("OneHot", {"i": np.asarray([[1, 6], [0, 3], [9, 2]], np.int64)}, {"axis": 1}, hot)
    cat = helper.make_node("Concat", ["a", "b", "a"], ["y"], axis=1)
    yield "Concat", make_model([cat], {"a": _f32(rng, 4, 3), "b": _f32(rng, 4, 5)}, ["y"], opset=MAX_OPSET)
    split = {"split": _ints(2, 5, 3)}
    yield "Split", _op("Split", {"x": _f32(rng, 4, 10)}, {"axis": 1}, split, n_outputs=3)
    squeeze = helper.make_node("Squeeze", ["x", "ax"], ["s"])
    unsqueeze = helper.make_node("Unsqueeze", ["s", "ax2"], ["y"])
    inits = {"ax": _ints(1), "ax2": _ints(0, 3)}
    yield "Squeeze", make_model([squeeze, unsqueeze], {"x": _f32(rng, 4, 1, 6)}, ["y"], inits, MAX_OPSET)


@functools.cache
def lowering_graphs() -> tuple[tuple[str, Graph], ...]:
    """Every graph the every-lowering test checks, built once per process."""
    graphs = [(case.name, graph) for case, graph in importable()]
    graphs += list(_converted_node_tests())
    graphs += [(label, import_onnx(model)) for label, model in _hand_built()]
    return tuple(graphs)


def test_every_lowering_against_brute_force():
    """Every compute of every node test (as is, converted to opset 21, or with its
    parameters frozen) and of the hand-built graphs: random tiles and blocks, reduction
    steps for reductions, every dimension held to :func:`tightness`."""
    rng = np.random.default_rng(0)
    checked: set[str] = set()
    for _label, graph in lowering_graphs():
        for node in graph.topo_order():
            c = node.compute
            if not c.loads():
                continue
            points = int(np.prod(c.shape or (1,))) * int(np.prod([a.extent for a in c.reduce_axes] or [1]))
            if points > 200_000 or 0 in c.shape:
                continue
            shape_of = lambda t, g=graph: g.tensor(t).shape  # noqa: E731
            check_compute(c, shape_of, rng, tiles=2)
            if c.reduce_axes:
                check_compute(c, shape_of, rng, tiles=1, rstep="random")
            checked.add(node.op_type)
    assert set(NO_INDEX_EXPRESSIONS) <= set(LOWERINGS), "stale entries in NO_INDEX_EXPRESSIONS"
    # An exempt lowering that starts reading its inputs must be checked like the rest.
    assert not checked & set(NO_INDEX_EXPRESSIONS), sorted(checked & set(NO_INDEX_EXPRESSIONS))
    required = set(LOWERINGS) - set(NO_INDEX_EXPRESSIONS)
    assert required <= checked, f"lowerings never checked: {sorted(required - checked)}"


# -- whole groups -------------------------------------------------------------------------------


def _graph(
    nodes: Sequence[onnx.NodeProto],
    inputs: Mapping[str, np.ndarray],
    outputs: Sequence[str],
    inits: Mapping[str, np.ndarray] | None = None,
    opset: int = 17,
) -> Graph:
    return import_onnx(make_model(nodes, inputs, outputs, inits, opset))


def group_brute_force(
    graph: Graph, members: Sequence[str], root: str, tile: Sequence[int], env: Mapping[str, int]
) -> dict[str, Box]:
    """Boxes per block of every member and every external input, walking the consumers'
    boxes backwards from the root's nominal tile.  Boxes are not clipped on the way: a
    member's region is one static extent, so at the border it holds positions outside
    the tensor (guarded, never stored), and its producers' regions follow from those --
    the comparison clips only at the end.  Data-dependent dimensions are whole."""
    comp = {m: graph.nodes[m].compute for m in members}
    boxes: dict[str, Box] = {root: [(env[f"b{k}"] * t, env[f"b{k}"] * t + t) for k, t in enumerate(tile)]}
    for m in reversed(members):
        for tensor, dims in brute_force_boxes(comp[m], boxes[m]).items():
            size = graph.tensor(tensor).shape
            found = [(0, s) if d is None else d for d, s in zip(dims, size)]
            old = boxes.get(tensor)
            boxes[tensor] = (
                found if old is None else [(min(a[0], b[0]), max(a[1], b[1])) for a, b in zip(old, found)]
            )
    return boxes


def _check_group(graph: Graph, tile: Sequence[int], rng: np.random.Generator | None = None) -> GroupRegions:
    """Members' and external inputs' regions of random blocks against brute force.  The
    chains here index through halos, strides, transposes and aligned reshapes: affine,
    so every region must equal the brute-force box."""
    rng = np.random.default_rng(5) if rng is None else rng
    members = [n.name for n in graph.topo_order()]
    root = members[-1]
    comps = [graph.nodes[m].compute for m in members]
    shape_of = lambda t: graph.tensor(t).shape  # noqa: E731
    regions = propagate_group(comps, root, tile, shape_of)
    shape = graph.tensor(root).shape
    grid = [-(-s // t) for s, t in zip(shape, tile)]
    assert set(regions.inputs) == {t for c in comps for t in c.inputs} - set(members)
    for _ in range(5):
        env = {f"b{k}": int(rng.integers(0, g)) for k, g in enumerate(grid)}
        want = group_brute_force(graph, members, root, tile, env)
        for tensor, region in [*regions.members.items(), *regions.inputs.items()]:
            size = graph.tensor(tensor).shape
            check_region(region, want[tensor], size, env, [EXACT] * len(size), what=f"{tensor} at {env}")
    return regions


def test_matmul_bias_gelu_chain():
    rng = np.random.default_rng(10)
    x = _f32(rng, 32, 16)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"]),
        helper.make_node("Add", ["mm", "b"], ["biased"]),
        helper.make_node("Gelu", ["biased"], ["y"]),
    ]
    g = _graph(nodes, {"x": x}, ["y"], {"w": _f32(rng, 16, 48), "b": _f32(rng, 48)}, opset=20)
    regions = _check_group(g, (8, 16))
    assert regions.inputs["w"].extents == (16, 16)
    assert regions.inputs["x"].extents == (8, 16) and regions.inputs["b"].extents == (16,)


def test_softmax_stages_need_whole_rows():
    x = _f32(np.random.default_rng(11), 4, 6, 10)
    g = _graph([helper.make_node("Softmax", ["x"], ["y"], axis=-1)], {"x": x}, ["y"])
    regions = _check_group(g, (1, 2, 10))
    assert regions.inputs["x"].extents == (1, 2, 10)


def test_layernorm_stages():
    x = _f32(np.random.default_rng(12), 6, 12)
    node = helper.make_node("LayerNormalization", ["x", "s", "b"], ["y"], axis=-1)
    g = _graph([node], {"x": x}, ["y"], {"s": np.ones(12, np.float32), "b": np.zeros(12, np.float32)})
    regions = _check_group(g, (2, 12))
    assert regions.inputs["x"].extents == (2, 12) and regions.inputs["s"].extents == (12,)


def test_conv_chain_halo_grows_backwards():
    rng = np.random.default_rng(13)
    x = _f32(rng, 1, 2, 12, 12)
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2"], ["y"], pads=[1, 1, 1, 1]),
    ]
    inits = {"w1": _f32(rng, 3, 2, 3, 3), "w2": _f32(rng, 2, 3, 3, 3)}
    g = _graph(nodes, {"x": x}, ["y"], inits)
    regions = _check_group(g, (1, 2, 4, 4))
    assert regions.members["c1"].extents == (1, 3, 6, 6)  # a 4x4 tile needs a 1-pixel halo
    assert regions.inputs["x"].extents == (1, 2, 8, 8)
    assert regions.inputs["w1"].extents == (3, 2, 3, 3)


def test_strided_conv_after_pad_and_pool():
    """Pad -> strided, dilated conv -> max pool: the halos compose through a stride."""
    rng = np.random.default_rng(14)
    nodes = [
        helper.make_node("Pad", ["x", "pads"], ["p"]),
        helper.make_node("Conv", ["p", "w"], ["c"], strides=[2, 2], dilations=[1, 2]),
        helper.make_node("MaxPool", ["c"], ["y"], kernel_shape=[2, 2], strides=[1, 1], pads=[0, 0, 1, 1]),
    ]
    inits = {"pads": _ints(0, 0, 1, 2, 0, 0, 2, 1), "w": _f32(rng, 4, 3, 3, 3)}
    g = _graph(nodes, {"x": _f32(rng, 1, 3, 21, 19)}, ["y"], inits)
    _check_group(g, (1, 2, 3, 4), rng=rng)


def test_attention_heads_merge_into_projection():
    """Context ``[B, H, S, D]`` transposed and reshaped to ``[B, S, H*D]``, then projected:
    the projection's tile of the merged axis maps back to whole heads."""
    rng = np.random.default_rng(15)
    nodes = [
        helper.make_node("Transpose", ["ctx"], ["t"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["t", "shape"], ["m"]),
        helper.make_node("MatMul", ["m", "w"], ["y"]),
    ]
    inits = {"shape": _ints(2, 8, 64), "w": _f32(rng, 64, 32)}
    g = _graph(nodes, {"ctx": _f32(rng, 2, 4, 8, 16)}, ["y"], inits)
    regions = _check_group(g, (1, 4, 16), rng=rng)
    assert regions.inputs["ctx"].extents == (1, 4, 4, 16)


def test_input_read_by_two_members_is_their_union():
    """A central difference ``x[2:] - x[:-2]``: two slices of the same external input
    read it at offsets two apart, so the block needs the union of both windows."""
    nodes = [
        helper.make_node("Slice", ["x", "two", "end", "axis"], ["ahead"]),
        helper.make_node("Slice", ["x", "zero", "minus_two", "axis"], ["behind"]),
        helper.make_node("Sub", ["ahead", "behind"], ["y"]),
    ]
    inits = {"two": _ints(2), "end": _ints(40), "zero": _ints(0), "minus_two": _ints(-2), "axis": _ints(1)}
    g = _graph(nodes, {"x": _f32(np.random.default_rng(17), 3, 40)}, ["y"], inits)
    regions = _check_group(g, (1, 8))
    assert regions.inputs["x"].extents == (1, 10)


def test_transposed_intermediate_partitions_by_block_order():
    x = _f32(np.random.default_rng(16), 8, 12)
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
