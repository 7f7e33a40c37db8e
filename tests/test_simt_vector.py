"""Elementwise SIMT stages in 16-byte vectors (``SimtConfig.vector``): which groups get them,
which loads become vector loads, and every generated form against the interpreter on the CPU
emulator (which also faults a misaligned vector access); the PTX holds 128-bit accesses."""

from __future__ import annotations

import math
import re
import shutil
import subprocess

import numpy as np
import pytest
from onnx import helper
from onnx_util import make_model
from test_codegen import two_layernorms
from test_mma import _context, _whole_group, emulate_configs

from welder.check import error_metric, threshold_for
from welder.codegen import generate_kernel
from welder.frontend.onnx import import_onnx
from welder.graph import Graph
from welder.resources import TEMPLATE_DIR
from welder.runtime.emu import available as emulator_available
from welder.schedule.kinds import simt

needs_emulator = pytest.mark.skipif(not emulator_available(), reason="needs g++")


def _gelu(rows: int, width: int, dtype=np.float16, slice_from: int = 0) -> Graph:
    """y = gelu(b + x[..., s:s+width] + xt^T) with GELU written out as ONNX exports it (Div,
    Erf, Add, Mul, Mul): a bias broadcast along the rows, an input read at an offset along
    the innermost axis, and a transposed input (which no vector load can read)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, rows, width + slice_from)).astype(dtype)
    xt = rng.standard_normal((3, width, rows)).astype(dtype)
    b = rng.standard_normal(width).astype(dtype)
    const = lambda v: np.array(v, dtype)  # noqa: E731
    ends = np.array([width + slice_from], np.int64)
    nodes = [
        helper.make_node("Slice", ["x", "starts", "ends", "axes"], ["xs"]),
        helper.make_node("Add", ["b", "xs"], ["a"]),
        helper.make_node("Transpose", ["xt"], ["t"], perm=[0, 2, 1]),
        helper.make_node("Add", ["a", "t"], ["a2"]),
        helper.make_node("Div", ["a2", "sqrt2"], ["d"]),
        helper.make_node("Erf", ["d"], ["e"]),
        helper.make_node("Add", ["e", "one"], ["f"]),
        helper.make_node("Mul", ["a2", "f"], ["g"]),
        helper.make_node("Mul", ["g", "half"], ["y"]),
    ]
    consts = {
        "b": b,
        "sqrt2": const(1.4142135),
        "one": const(1.0),
        "half": const(0.5),
        "starts": np.array([slice_from], np.int64),
        "ends": ends,
        "axes": np.array([2], np.int64),
    }
    return import_onnx(make_model(nodes, {"x": x, "xt": xt}, ["y"], consts))


def _feeds(graph: Graph) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {t.name: rng.standard_normal(t.shape).astype(t.dtype) for t in graph.inputs}


def _configs(graph: Graph, topk: int = 6):
    group = _whole_group(graph)
    return group, simt.KIND.propose(group, _context(graph, topk=topk))


def _check(graph: Graph, configs) -> None:
    group = _whole_group(graph)
    feeds = _feeds(graph)
    reference = graph.run(feeds)["y"]
    for cfg, runs in zip(configs, emulate_configs(graph, group, configs, feeds)):
        err = error_metric(runs[0]["y"], reference)
        assert err <= threshold_for(reference.dtype.name), (cfg.stages[0], err)


@needs_emulator
@pytest.mark.parametrize(
    ("dtype", "width"), [(np.float16, 8), (np.float32, 4)], ids=["fp16 in 8s", "fp32 in 4s"]
)
def test_elementwise_groups_get_vector_forms_that_match_the_interpreter(dtype, width) -> None:
    graph = _gelu(200, 128, dtype)
    group, configs = _configs(graph)
    forms = [c.stages[-1].vector for c in configs]
    assert forms.count(width) == 3 and forms.count(1) == 3, forms  # both forms get measured
    configs = sorted(configs, key=lambda c: -c.stages[0].vector)
    for cfg in configs:
        st = cfg.stages[0]
        if st.vector > 1:  # the same tile as a scalar config would cover, in vectors
            assert st.thread_shape[-1] * st.reg_tile[-1] * st.vector >= st.tile[-1]
    _check(graph, configs)
    source = generate_kernel(graph, group, configs[0], "vec").source
    loads = re.findall(r"welder_vload<welder_vec<(\w+), (\d+)>>\((\w+),", source)
    # b and x become vector loads, the transposed input does not; one vector store.
    assert len(loads) == 2 and all(int(n) == width for _, n, _ in loads), loads
    assert source.count("welder_vstore(") == 1


@needs_emulator
def test_a_read_offset_by_a_multiple_of_the_width_stays_a_vector_load() -> None:
    aligned = _gelu(160, 64, slice_from=16)
    group, configs = _configs(aligned)
    configs = sorted(configs, key=lambda c: -c.stages[0].vector)
    assert configs[0].stages[0].vector == 8
    source = generate_kernel(aligned, group, configs[0], "vec").source
    assert source.count("welder_vload<") == 2
    _check(aligned, configs)
    # 4 elements in is 8 bytes: the slice's rows are not whole vectors from their start.
    unaligned = _gelu(160, 64, slice_from=4)
    group, configs = _configs(unaligned)
    configs = sorted(configs, key=lambda c: -c.stages[0].vector)
    assert configs[0].stages[0].vector == 8
    source = generate_kernel(unaligned, group, configs[0], "vec").source
    assert source.count("welder_vload<") == 1  # the bias only
    _check(unaligned, configs)


@needs_emulator
def test_reads_in_a_branch_of_a_select_stay_scalar() -> None:
    """A Concat along the innermost axis reads each side only where it is taken; loaded as
    vectors up front, the second side would be read before its start (the emulator faults)."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((4, 64, 64)).astype(np.float16) for _ in range(2))
    nodes = [
        helper.make_node("Concat", ["a", "b"], ["c"], axis=2),
        helper.make_node("Mul", ["c", "two"], ["y"]),
    ]
    graph = import_onnx(make_model(nodes, {"a": a, "b": b}, ["y"], {"two": np.array(2.0, np.float16)}))
    group, configs = _configs(graph, topk=12)
    vectors = [c for c in configs if c.stages[0].vector == 8]
    assert vectors
    source = generate_kernel(graph, group, vectors[0], "vec").source
    assert "welder_vload<" not in source and source.count("welder_vstore(") == 1
    _check(graph, vectors)


@needs_emulator
@pytest.mark.parametrize(
    ("op", "vector_loads"),
    [("LayerNormalization", 3), ("Softmax", 1)],
    ids=["LayerNorm: x, scale, shift", "softmax: x"],
)
def test_the_last_stage_of_a_normalisation_writes_vectors(op: str, vector_loads: int) -> None:
    """The last stage (scale and shift, or the division) reads its row-contiguous global
    inputs as vectors and writes vectors, the reductions' results from shared memory one
    element at a time; the reductions read x one vector at a time only in the twins that
    say so (``SimtConfig.rvector``), one load each."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 768)).astype(np.float16)
    extra = {name: rng.standard_normal(768).astype(np.float16) for name in ("s", "b")}
    inputs = ["x", "s", "b"] if op == "LayerNormalization" else ["x"]
    node = helper.make_node(op, inputs, ["y"], axis=-1)
    graph = import_onnx(make_model([node], {"x": x}, ["y"], extra if op == "LayerNormalization" else {}))
    group, configs = _configs(graph)
    vectors = [c for c in configs if c.stages[-1].vector == 8]
    assert vectors and any(c.stages[-1].vector == 1 for c in configs)
    assert all(st.vector == 1 for c in vectors for st in c.stages[:-1])
    unstaged = [c for c in vectors if not any(st.staged for st in c.stages)]  # staging loads vectors too
    assert {c.stages[0].rvector for c in unstaged} == {1, 8}
    for cfg in unstaged:
        source = generate_kernel(graph, group, cfg, "vec").source
        in_rows = sum(st.rvector > 1 for st in cfg.stages[:-1])
        assert source.count("welder_vload<") == vector_loads + in_rows and source.count("welder_vstore(") == 1
    _check(graph, configs)


def test_rows_of_partial_vectors_and_other_groups_stay_scalar() -> None:
    _, configs = _configs(_gelu(24, 20))  # 20 halves a row: 40 bytes
    assert {c.stages[0].vector for c in configs} == {1}
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 64)).astype(np.float16)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])]
    graph = import_onnx(make_model(nodes, {"x": w}, ["y"], {"w": w}))
    _, configs = _configs(graph)
    assert {c.stages[0].vector for c in configs} == {1}  # a reduction


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_the_vector_form_compiles_to_128_bit_accesses(tmp_path) -> None:
    graph = _gelu(200, 128)
    group, configs = _configs(graph)
    vector = next(c for c in configs if c.stages[0].vector > 1)
    source = tmp_path / "k.cu"
    source.write_text(generate_kernel(graph, group, vector, "vec").source)
    ptx = tmp_path / "k.ptx"
    command = ["nvcc", "-ptx", "-arch=sm_90", f"-I{TEMPLATE_DIR}", str(source), "-o", str(ptx)]
    subprocess.run(command, check=True, timeout=300)
    text = ptx.read_text()
    assert len(re.findall(r"ld\.global(\.nc)?\.v4\.u32", text)) == 2
    assert len(re.findall(r"st\.global\.v4\.u32", text)) == 1


def test_a_large_elementwise_add_gets_full_blocks_of_busy_threads() -> None:
    """A residual add of 8192x768 halves (batch 64 of BERT): blocks of 32 threads over 32 to
    96 elements measured 3 to 10 times slower on an H100 than blocks of 256 threads moving a
    16-byte vector or two each.  Every candidate has a block of at least 128 threads and at
    most 32768 blocks, and every thread of a vectorised one the same whole number of vectors."""
    rng = np.random.default_rng(0)
    x, r = (rng.standard_normal((8192, 768)).astype(np.float16) for _ in range(2))
    graph = import_onnx(make_model([helper.make_node("Add", ["x", "r"], ["y"])], {"x": x, "r": r}, ["y"]))
    _, configs = _configs(graph)
    assert all(c.threads >= 128 and c.estimate.blocks <= 32768 for c in configs), [
        (c.block_tile, c.threads) for c in configs
    ]
    vectors = [c.stages[0] for c in configs if c.stages[0].vector > 1]
    assert vectors
    for st in vectors:
        units = (*st.tile[:-1], st.tile[-1] // st.vector)
        assert all(t * g == u for t, g, u in zip(st.thread_shape, st.reg_tile, units)), st
        assert math.prod(st.thread_shape) == 256, st


def _layer_norm(rows: int, width: int) -> Graph:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((rows, width)).astype(np.float16)
    consts = {"s": np.ones(width, np.float16), "b": np.zeros(width, np.float16)}
    node = helper.make_node("LayerNormalization", ["x", "s", "b"], ["y"], axis=-1)
    return import_onnx(make_model([node], {"x": x}, ["y"], consts))


def test_a_layer_norm_is_offered_its_row_held_in_registers() -> None:
    """Conformer b64 fp16's layer norm (32,768 rows of 512 halves): the kind proposes twins
    whose first reduction holds its row (``simt_held``), each normalising the same vectors at
    the same threads: thread t of the normalisation takes the vectors t + u * reduce_threads
    of its row that thread t of the reduction loaded in pass u."""
    graph = _layer_norm(32768, 512)
    group = _whole_group(graph)
    proposed = simt.KIND.propose(group, _context(graph, topk=20))
    held = [c for c in proposed if c.family == "simt_held"]
    assert held
    for cfg in held:
        red, out = cfg.stages[0], cfg.stages[-1]
        assert red.hold and red.rvector == out.vector == 8
        passes = 512 // 8 // red.reduce_threads
        assert out.reg_tile == (1, passes) and 1 <= passes <= simt.MAX_HELD_VECTORS
        assert out.thread_shape == (red.thread_shape[0], red.reduce_threads)
        assert cfg.threads == math.prod(out.thread_shape)


def test_two_layer_norms_in_a_row_read_and_write_in_vectors() -> None:
    """Conformer's two layer norms in a row, both outputs written (the first as a residual):
    the second norm's reductions read the first's shared-memory tile in vectors, its last
    stage writes vectors although the group has another output, and the first norm's row
    can be held for its own sum of squares."""
    graph = import_onnx(two_layernorms(np.random.default_rng(5), np.float16, 256, 512))
    group = _whole_group(graph)
    proposed = simt.KIND.propose(group, _context(graph, topk=20))
    vectors = [c for c in proposed if c.family in ("simt_vector", "simt_held")]
    assert {c.family for c in vectors} == {"simt_vector", "simt_held"}
    for cfg in vectors:
        assert [st.rvector for st in cfg.stages][3:5] == [8, 8]  # the second norm's reductions
    assert all(c.stages[-1].vector == 8 for c in vectors if c.family == "simt_held")


def test_rows_longer_than_the_registers_hold_get_no_held_twin() -> None:
    """At 4,096 halves a row (512 vectors) blocks of 64 threads or more an output take at
    most eight vectors a thread; at 32,768 (4,096 vectors) none does."""

    def families(width: int) -> set[str]:
        graph = _layer_norm(4, width)
        return {c.family for c in simt.KIND.propose(_whole_group(graph), _context(graph, topk=20))}

    assert "simt_held" in families(4096)
    assert "simt_held" not in families(32768)
