"""Data-dependent indices outside their dimension (docs/ir.md, "Data-dependent indices").

The interpreter and the emulator raise an error naming the node, the value and the range;
``InferenceSession.run`` checks integer inputs that feed indices before any back end runs
and names the input too; a kernel built with the GPU's behaviour (the check compiled out)
clamps and never reads outside a tensor.  In-range negative indices are compared with
onnxruntime (or onnx's reference evaluator where onnxruntime has no kernel).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np
import onnx
import pytest
from onnx import helper
from onnx_util import assert_matches_onnx_reference, assert_matches_ort, make_model

from welder.arch import get_arch
from welder.check import onnxruntime_outputs, random_inputs
from welder.codegen import generate_model
from welder.errors import IndexRangeError, ModelError
from welder.frontend.onnx import import_onnx
from welder.graph import Graph
from welder.index_check import check_index_inputs, index_sites
from welder.ir.expr import DataIndex, walk
from welder.runtime.emu import EmulationError
from welder.runtime.emulate import EmulatedModel
from welder.schedule.plan import plan_model
from welder.session import BACKENDS, InferenceSession

RNG = np.random.default_rng(7)
# A node name that must not break generated C source or the messages (quote, backslash,
# newline, comment delimiters, non-ASCII).
ODD = 'emb"ed\\ */ /* \n é'


def _f32(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def _i64(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def _message(node: str, value: int, n: int) -> str:
    """What every report of a bad index must contain, as a regex."""
    return rf"{re.escape(node)}.*index {value} is out of range \[{-n}, {n - 1}\]"


# -- one model with every operator that takes data-dependent indices -------------------------


def _all_ops_model() -> tuple[onnx.ModelProto, dict[str, np.ndarray], dict[str, int]]:
    """Gather (as an embedding, behind a Reshape), GatherElements and GatherND, each fed by
    its own integer input; returns the model, valid feeds and each input's extent."""
    feeds = {
        "ids": _i64([[1, -2, 9, 0]]),  # Gather rows of a [10, 3] table
        "ge": _i64([[0, -1, 3], [2, 1, -4]]),  # GatherElements along axis 1 of [2, 4]
        "nd": _i64([[4, -1], [-5, 2]]),  # GatherND into [5, 3]
    }
    nodes = [
        helper.make_node("Reshape", ["ids", "flat"], ["ids_flat"], name="reshape_ids"),
        helper.make_node("Gather", ["table", "ids_flat"], ["rows"], name=ODD, axis=0),
        helper.make_node("GatherElements", ["x", "ge"], ["picked"], name="pick", axis=1),
        helper.make_node("GatherND", ["grid", "nd"], ["cells"], name="cells"),
    ]
    inits = {"table": _f32(10, 3), "flat": _i64([4]), "x": _f32(2, 4), "grid": _f32(5, 3)}
    model = make_model(nodes, feeds, ["rows", "picked", "cells"], inits)
    return model, feeds, {"ids": 10, "ge": 4, "nd": 5}


NODE_OF = {
    "ids": "Gather node " + repr(ODD),
    "ge": "GatherElements node 'pick'",
    "nd": "GatherND node 'cells'",
}


def _bad(feeds: Mapping[str, np.ndarray], name: str, value: int) -> dict[str, np.ndarray]:
    out = {k: v.copy() for k, v in feeds.items()}
    out[name].flat[0] = value
    return out


@pytest.fixture(scope="module")
def all_ops(tmp_path_factory):
    model, feeds, extents = _all_ops_model()
    path = tmp_path_factory.mktemp("bounds") / "all_ops.onnx"
    onnx.save(model, path)
    return path, model, feeds, extents


def test_in_range_negative_indices_match_onnxruntime(all_ops):
    _, model, feeds, _ = all_ops
    assert_matches_ort(model, feeds)


@pytest.mark.parametrize("name", ["ids", "ge", "nd"])
@pytest.mark.parametrize("side", ["high", "low"])
def test_interpreter_names_node_value_and_range(all_ops, name, side):
    _, model, feeds, extents = all_ops
    n = extents[name]
    value = n if side == "high" else -n - 1
    graph = import_onnx(model)
    with pytest.raises(IndexRangeError, match=_message(NODE_OF[name], value, n)):
        graph.run(_bad(feeds, name, value))
    # onnxruntime refuses the same input.
    with pytest.raises(Exception, match=r"(?i)out of (range|bounds)|invalid"):
        onnxruntime_outputs(model, _bad(feeds, name, value))


def test_huge_ids_are_not_truncated_to_32_bits(all_ops):
    """2**32 + 1 would read row 1 if the index were narrowed before the check."""
    _, model, feeds, _ = all_ops
    with pytest.raises(IndexRangeError, match=_message(NODE_OF["ids"], 2**32 + 1, 10)):
        import_onnx(model).run(_bad(feeds, "ids", 2**32 + 1))


@pytest.mark.parametrize("backend", ["interpret", "emulate"])
@pytest.mark.parametrize("name", ["ids", "ge", "nd"])
def test_session_checks_inputs_before_any_back_end(all_ops, name, backend, monkeypatch):
    """The host check names the input; a back end that must not see bad input (like the GPU
    runtime, whose kernels only clamp) is never called."""
    path, _, feeds, extents = all_ops
    calls = []

    class Recorder:
        def __init__(self, graph: Graph, **_: object) -> None:
            self.inner = BACKENDS[backend](graph)

        def run(self, f):
            calls.append(f)
            return self.inner.run(f)

    monkeypatch.setitem(BACKENDS, "recorder", Recorder)
    sess = InferenceSession(path, backend="recorder")
    n = extents[name]
    message = rf"input '{name}' feeds {_message(NODE_OF[name], 50257, n)}"
    with pytest.raises(IndexRangeError, match=message):
        sess.run(None, _bad(feeds, name, 50257))
    assert not calls
    sess.run(None, feeds)
    assert len(calls) == 1


@pytest.fixture(scope="module")
def emulated(all_ops):
    """The all-ops model's generated kernels under the emulator, checked and unchecked."""
    _, model, _, _ = all_ops
    graph = import_onnx(model)
    plan = plan_model(graph, get_arch("H100"), topk=1)
    kernels = generate_model(graph, [(p.group, p.configs[0]) for p in plan.groups])
    assert any("welder_index(" in k.source for k in kernels)
    return (
        graph,
        EmulatedModel(graph, kernels),
        EmulatedModel(graph, kernels, defines=["WELDER_UNCHECKED_INDICES"]),
    )


def test_emulated_kernels_match_onnxruntime_on_negative_indices(all_ops, emulated):
    _, model, feeds, _ = all_ops
    _, checked, unchecked = emulated
    reference = onnxruntime_outputs(model, feeds)
    for runner in (checked, unchecked):
        ours = runner.run(feeds)
        for name, expected in reference.items():
            np.testing.assert_allclose(ours[name], expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", ["ids", "ge", "nd"])
@pytest.mark.parametrize("value", [50257, -11, 2**40])
def test_emulator_names_node_value_and_range(all_ops, emulated, name, value):
    _, _, feeds, extents = all_ops
    _, checked, _ = emulated
    n = extents[name]
    with pytest.raises(EmulationError, match=_message(NODE_OF[name], value, n)):
        checked.run(_bad(feeds, name, value))


def _clamped_reference(graph: Graph, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The GPU contract, independently: wrap negative values once, then clamp into range."""

    def fix(values: np.ndarray, n: int | np.ndarray) -> np.ndarray:
        wrapped = np.where(values < 0, values + n, values)
        return np.clip(wrapped, 0, np.asarray(n) - 1)

    # GatherND's columns index the two dimensions of its [5, 3] grid.
    nd = fix(feeds["nd"], np.array([5, 3]))
    return graph.run({"ids": fix(feeds["ids"], 10), "ge": fix(feeds["ge"], 4), "nd": nd})


HOSTILE = [2**31 + 5, 2**62, -(2**62), -(2**31) - 7, 50257, -50257, 10**12]


def test_unchecked_kernels_clamp_hostile_ids_without_touching_other_memory(all_ops, emulated):
    """With the check compiled out (the GPU's behaviour), every hostile value lands inside
    the tensor: the emulator guards every global buffer and would report an access past
    either end, and the result is the clamped gather."""
    _, _, feeds, _ = all_ops
    graph, _, unchecked = emulated
    hostile = {k: np.resize(_i64(HOSTILE), v.shape) for k, v in feeds.items()}
    ours = unchecked.run(hostile)
    expected = _clamped_reference(graph, hostile)
    for name, value in expected.items():
        np.testing.assert_array_equal(ours[name], value)


# -- the IR and the host check -----------------------------------------------------------------


def test_gather_index_is_a_data_index_with_node_and_extent(all_ops):
    _, model, _, _ = all_ops
    graph = import_onnx(model)
    found = {
        (e.origin, e.extent) for node in graph for e in walk(node.compute.body) if isinstance(e, DataIndex)
    }
    assert found == {
        (NODE_OF["ids"], 10),
        ("GatherElements node 'pick'", 4),
        ("GatherND node 'cells'", 5),
        ("GatherND node 'cells'", 3),
    }


def test_host_check_follows_integer_arithmetic_on_inputs():
    """``ids + offset`` reshaped: the site is found, the check evaluates the sum."""
    ids = _i64([[0, 3, 5]])
    nodes = [
        helper.make_node("Add", ["ids", "offset"], ["shifted"]),
        helper.make_node("Unsqueeze", ["shifted", "axes"], ["u"]),
        helper.make_node("Gather", ["table", "u"], ["y"], name="lookup", axis=0),
    ]
    inits = {"offset": _i64([2]), "axes": _i64([0]), "table": _f32(8, 2)}
    graph = import_onnx(make_model(nodes, {"ids": ids}, ["y"], inits))
    sites = index_sites(graph)
    assert [(s.inputs, s.index.extent) for s in sites] == [(("ids",), 8)]
    check_index_inputs(graph, sites, {"ids": ids})
    with pytest.raises(IndexRangeError, match=r"input 'ids' feeds Gather node 'lookup'.*index 8 is"):
        check_index_inputs(graph, sites, {"ids": _i64([[0, 6, 5]])})
    # -10 + 2 = -8 wraps to 0; -11 + 2 does not.
    check_index_inputs(graph, sites, {"ids": _i64([[-10, 0, 0]])})
    with pytest.raises(IndexRangeError, match=r"index -9 is out of range \[-8, 7\]"):
        check_index_inputs(graph, sites, {"ids": _i64([[-11, 0, 0]])})


def test_indices_computed_from_float_data_are_left_to_the_back_end():
    """An index cast from float arithmetic (activations) is not host-checked, one cast
    straight from an input is; the interpreter reports both."""
    x = _f32(2, 3)
    nodes = [
        helper.make_node("Cast", ["x"], ["xi"], to=onnx.TensorProto.INT64),
        helper.make_node("Gather", ["table", "xi"], ["direct"], name="g", axis=0),
        helper.make_node("Mul", ["x", "two"], ["x2"]),
        helper.make_node("Cast", ["x2"], ["x2i"], to=onnx.TensorProto.INT64),
        helper.make_node("Gather", ["table", "x2i"], ["computed"], name="h", axis=0),
    ]
    inits = {"table": _f32(4, 2), "two": np.array(2.0, np.float32)}
    graph = import_onnx(make_model(nodes, {"x": x}, ["direct", "computed"], inits))
    sites = index_sites(graph)
    assert [(s.index.origin, s.inputs) for s in sites] == [("Gather node 'g'", ("x",))]
    with pytest.raises(IndexRangeError, match=r"input 'x' feeds " + _message("Gather node 'g'", 9, 4)):
        check_index_inputs(graph, sites, {"x": np.full((2, 3), 9.5, np.float32)})
    check_index_inputs(graph, sites, {"x": np.full((2, 3), 2.5, np.float32)})  # h gets 5: unchecked
    with pytest.raises(IndexRangeError, match=_message("Gather node 'h'", 5, 4)):
        graph.run({"x": np.full((2, 3), 2.5, np.float32)})


def test_random_inputs_stay_inside_the_dimensions_they_index(all_ops):
    _, model, _, extents = all_ops
    graph = import_onnx(model)
    for seed in range(5):
        feeds = random_inputs(graph, seed)
        check_index_inputs(graph, index_sites(graph), feeds)
        for name, n in extents.items():
            assert feeds[name].min() >= 0 and feeds[name].max() < n


def test_indices_into_an_empty_dimension_are_refused_at_import():
    model = make_model(
        [helper.make_node("Gather", ["table", "ids"], ["y"], name="g", axis=0)],
        {"ids": _i64([0])},
        ["y"],
        {"table": np.zeros((0, 3), np.float32)},
    )
    with pytest.raises(ModelError, match=r"Gather node 'g'.*empty dimension"):
        import_onnx(model)


# -- GatherND and OneHot lowerings -------------------------------------------------------------


@pytest.mark.parametrize(
    ("dshape", "ishape", "batch_dims"),
    [
        ((4, 5), (3, 2), 0),
        ((4, 5, 3), (2, 1), 0),
        ((2, 5, 3), (2, 4, 1), 1),
        ((2, 3, 4, 5), (2, 3, 2), 2),
        ((3, 4), (2,), 0),
    ],
)
def test_gather_nd_matches_onnxruntime(dshape, ishape, batch_dims):
    data = _f32(*dshape)
    k = ishape[-1]
    columns = [RNG.integers(-n, n, ishape[:-1]) for n in dshape[batch_dims : batch_dims + k]]
    indices = np.stack(columns, -1).astype(np.int64)
    node = helper.make_node("GatherND", ["x", "i"], ["y"], batch_dims=batch_dims)
    assert_matches_ort(make_model([node], {"x": data, "i": indices}, ["y"]), {"x": data, "i": indices})


def test_gather_nd_constant_indices_are_checked_at_import():
    node = helper.make_node("GatherND", ["x", "i"], ["y"], name="nd")
    model = make_model([node], {"x": _f32(3, 4)}, ["y"], {"i": _i64([[1, 4]])})
    with pytest.raises(ModelError, match=r"GatherND node 'nd'.*out of range \[-4, 3\]"):
        import_onnx(model)


@pytest.mark.parametrize("axis", [-1, 0, 1])
@pytest.mark.parametrize("index_dtype", [np.int64, np.int32, np.float32])
@pytest.mark.parametrize("constant_values", [True, False])
def test_one_hot_out_of_range_rows_are_all_off(axis, index_dtype, constant_values):
    """ONNX defines an index outside [-depth, depth) as a row of off values, so OneHot
    compares and never addresses memory with it: no error, as in onnxruntime."""
    indices = np.array([[0, -1, 5], [-6, 7, 2]], dtype=index_dtype)
    values = np.array([2.0, 7.0], np.float32)
    inputs, inits = {"i": indices}, {"d": np.array(5, np.int64)}
    (inits if constant_values else inputs)["v"] = values
    model = make_model([helper.make_node("OneHot", ["i", "d", "v"], ["y"], axis=axis)], inputs, ["y"], inits)
    if index_dtype == np.int64:
        assert_matches_ort(model, inputs)
    else:  # onnxruntime's CPU provider has no kernel for these types
        assert_matches_onnx_reference(model, inputs)
