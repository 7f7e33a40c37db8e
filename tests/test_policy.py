"""Scheduling policy: every config respects the arch, tiles the output exactly, and the
planners it relies on are right (checked against brute force)."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
from onnx import helper
from onnx_util import contrast_nodes, make_model

from welder import arch as arch_module
from welder.arch import ARCHS, Arch, get_arch, match_gpu_name
from welder.errors import WelderError
from welder.frontend.onnx import import_onnx
from welder.ir.expr import free_vars
from welder.ir.interpret import np_dtype
from welder.schedule.group import make_group
from welder.schedule.kinds import Options, simt
from welder.schedule.kinds.simt import (
    BLOCK_SIZE_TOLERANCE,
    LINE_BYTES,
    STEP_LINES,
    base_tile,
    few_blocks,
    make_config,
    reduce_vector_twin,
    schedule_group,
    thread_layout,
    tile_configs,
    vector_width,
)
from welder.tile.footprint import Buffer, _run_dims, plan_pool, transaction_bytes
from welder.tile.propagate import Region, propagate_group, read_regions
from welder.tile.region import Affine, Interval

RNG = np.random.default_rng(3)


def _w(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def whole_graph_group(nodes, inputs, outputs, inits=None, opset=17):
    g = import_onnx(make_model(nodes, inputs, outputs, inits, opset))
    return g, make_group(g, [n.name for n in g.topo_order()])


CASES = {
    "matmul": lambda: whole_graph_group(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], {"x": _w(96, 72)}, ["y"], {"w": _w(72, 200)}
    ),
    "conv_relu": lambda: whole_graph_group(
        [
            helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2]),
            helper.make_node("Relu", ["c"], ["y"]),
        ],
        {"x": _w(2, 8, 15, 15)},
        ["y"],
        {"w": _w(16, 8, 3, 3)},
    ),
    "depthwise": lambda: whole_graph_group(
        [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1], group=8)],
        {"x": _w(1, 8, 14, 14)},
        ["y"],
        {"w": _w(8, 1, 3, 3)},
    ),
    "softmax": lambda: whole_graph_group(
        [helper.make_node("Softmax", ["x"], ["y"], axis=-1)], {"x": _w(3, 12, 50)}, ["y"]
    ),
    "layernorm": lambda: whole_graph_group(
        [helper.make_node("LayerNormalization", ["x", "s", "b"], ["y"], axis=-1)],
        {"x": _w(20, 768)},
        ["y"],
        {"s": _w(768), "b": _w(768)},
    ),
    "reduce_outer": lambda: whole_graph_group(
        [helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)],
        {"x": _w(64, 33, 5)},
        ["y"],
        {"axes": np.array([0], np.int64)},
    ),
    "transpose_exp": lambda: whole_graph_group(
        [helper.make_node("Exp", ["x"], ["e"]), helper.make_node("Transpose", ["e"], ["y"], perm=[1, 0])],
        {"x": _w(70, 130)},
        ["y"],
    ),
    "pool": lambda: whole_graph_group(
        [helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])],
        {"x": _w(1, 4, 17, 17)},
        ["y"],
    ),
}


def _shape_dtype(graph):
    return (lambda t: graph.tensor(t).shape), (lambda t: graph.tensor(t).dtype)


def check_config(cfg, group, graph, a):
    """Everything a config promises, recomputed from its own fields rather than trusted:
    the shared-memory plan, the occupancy it claims, the thread layout and the staging."""
    shape_of, dtype_of = _shape_dtype(graph)
    assert cfg.threads % a.warp_size == 0 and a.warp_size <= cfg.threads <= a.max_threads_per_block
    limit = Options().max_threads
    reduces = any(group.computes[s].is_reduction for s in group.stages)
    few = reduces and math.prod(cfg.block_tile) < limit and few_blocks(cfg.estimate.blocks, limit, a)
    assert cfg.threads <= limit or few

    # Shared memory: rebuild every buffer and its live range (stage positions) from the
    # stages: a tile lives until the last stage that reads it, staging buffers and
    # cross-warp reduction slots for their own stage only.
    position = {st.node: k for k, st in enumerate(cfg.stages)}
    buffers = []  # (name, offset, bytes, first stage, last stage)
    for k, st in enumerate(cfg.stages):
        readers = [position[r] for r in position if r != st.node and st.node in group.computes[r].inputs]
        if readers:
            assert st.smem_offset is not None, f"{st.node} is read from shared memory but has no place"
            elem = np_dtype(dtype_of(st.node)).itemsize
            buffers.append((st.node, st.smem_offset, math.prod(st.tile) * elem, k, max(readers)))
        for sd in st.staged:
            elem = np_dtype(dtype_of(sd.tensor)).itemsize
            buffers.append((f"{st.node}/{sd.tensor}", sd.offset, math.prod(sd.extents) * elem, k, k))
        if st.reduce_threads > a.warp_size:
            assert st.reduce_offset is not None
            # kernel.py's layout: 8 value bytes per (output, warp, register), then 4 index bytes.
            slots = math.prod(st.thread_shape) * (st.reduce_threads // a.warp_size) * math.prod(st.reg_tile)
            buffers.append((f"{st.node}/reduce", st.reduce_offset, 12 * slots, k, k))
    for name, offset, size, _, _ in buffers:
        assert offset >= 0 and offset + size <= cfg.smem_bytes, name
    for (na, oa, sa, fa, la), (nb, ob, sb, fb, lb) in itertools.combinations(buffers, 2):
        if fa <= lb and fb <= la:  # live at the same time
            assert oa + sa <= ob or ob + sb <= oa, f"{na} and {nb} overlap"
    assert cfg.smem_bytes <= a.smem_per_block

    # Occupancy: what blocks_per_sm claims must fit every per-SM resource.
    e = cfg.estimate
    assert e.blocks_per_sm >= 1 and e.blocks_per_sm <= a.max_blocks_per_sm
    assert e.regs_per_thread <= a.max_regs_per_thread
    assert e.regs_per_thread * cfg.threads * e.blocks_per_sm <= a.regs_per_sm
    assert cfg.threads * e.blocks_per_sm <= a.max_threads_per_sm
    assert cfg.smem_bytes * e.blocks_per_sm <= a.smem_per_sm
    assert e.smem_bytes == cfg.smem_bytes and e.blocks == cfg.num_blocks

    regions = propagate_group([group.computes[s] for s in group.stages], group.root, cfg.block_tile, shape_of)
    for st in cfg.stages:
        c = group.computes[st.node]
        # Threads: the layout covers the tile; spare threads split the reduction in a power
        # of two that shuffles can combine.
        assert math.prod(st.thread_shape) * st.reduce_threads <= cfg.threads
        assert st.reduce_threads & (st.reduce_threads - 1) == 0
        assert st.reduce_threads == 1 or c.is_reduction
        widths = [1] * (len(st.tile) - 1) + [st.vector]  # a vectorised stage counts vectors innermost
        for ext, t, r, w in zip(st.tile, st.thread_shape, st.reg_tile, widths):
            assert t * r * w >= ext
        if st.vector > 1:
            assert st.node == group.root == group.stages[-1] and not c.is_reduction
            assert st.vector * np.dtype(graph.tensor(st.node).dtype).itemsize == 16
            assert st.tile[-1] % st.vector == 0 and shape_of(st.node)[-1] % st.vector == 0
        # A reduction in vectors: 16 bytes of an input it reads along its innermost reduce
        # axis, a whole number of them in that axis and in the input's rows, one at least per
        # thread that splits it.
        if st.rvector > 1:
            assert c.is_reduction and st.reduce_threads > 1 and not st.staged
            last = c.reduce_axes[-1]
            assert last.extent % st.rvector == 0
            assert math.prod(ax.extent for ax in c.reduce_axes) >= st.rvector * st.reduce_threads
            rows = [
                ld for ld in c.loads() if ld.tensor in group.inputs and last.name in free_vars(ld.indices[-1])
            ]
            assert any(
                np.dtype(graph.tensor(ld.tensor).dtype).itemsize * st.rvector == 16
                and shape_of(ld.tensor)[-1] % st.rvector == 0
                for ld in rows
            )
        # Staging: one step's region of each staged input, as propagation computes it.
        assert len(st.rstep) == len(c.reduce_axes)
        assert all(1 <= r <= ax.extent for r, ax in zip(st.rstep, c.reduce_axes))
        if st.staged:
            assert st.reduce_threads == 1
            per_step = read_regions(c, regions.members[st.node].dims, shape_of, st.rstep)
            for sd in st.staged:
                assert sd.tensor in group.inputs
                assert tuple(sd.extents) == per_step[sd.tensor].extents
                shape = shape_of(sd.tensor)
                assert sd.vector in (1, 2, 4) and sd.extents[-1] % sd.vector == 0
                assert shape[-1] % sd.vector == 0


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_configs_obey_the_arch_and_tile_exactly(case, arch):
    graph, group = CASES[case]()
    a = get_arch(arch)
    shape_of, dtype_of = _shape_dtype(graph)
    configs = schedule_group(group, shape_of, dtype_of, a, Options(topk=6))
    assert configs, f"no config for {case} on {arch}"
    root_shape = shape_of(group.root)
    twins = [reduce_vector_twin(group, c, shape_of, dtype_of, a) for c in configs]
    for cfg in [*configs, *filter(None, twins)]:
        check_config(cfg, group, graph, a)
        # The grid covers the root exactly: no block is wholly outside, none missing.
        for s, t, g in zip(root_shape, cfg.block_tile, cfg.grid):
            assert 1 <= t <= s and g == math.ceil(s / t) and (g - 1) * t < s
        regions = propagate_group(
            [group.computes[s] for s in group.stages], group.root, cfg.block_tile, shape_of
        )
        allowed = {f"b{k}" for k in range(len(root_shape))}
        for st in cfg.stages:
            # One grid for every stage: regions depend on the root's block coordinates only.
            for d in regions.members[st.node].dims:
                names = set(d.lo.coefs) if isinstance(d.lo, Affine) else free_vars(d.lo)
                assert names <= allowed


def _matmul(m, k, n):
    return whole_graph_group(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        {"x": np.zeros((m, k), np.float32)},
        ["y"],
        {"w": np.zeros((k, n), np.float32)},
    )


def test_large_matmul_on_h100_has_high_arithmetic_intensity():
    """4096^3 fp32 on H100: a block tile of M x N reads (M + N) * K floats for 2*M*N*K
    flops.  The policy must pick a tile with at least 32 flop/byte (128 x 128 gives
    exactly 32; 32 x 32 would give 8), and stage both operands in shared memory.

    What it picks today: 128 x 128 on 256 threads of 8 x 8 outputs, K in steps of 64
    (the longest that keeps the 2 blocks per SM the 96 registers per thread allow: 64 KB
    of staging), 2 * 4096^3 = 137.4 GFLOP, estimated at about 3.8 ms -- compute bound at
    60% of the 67 TFLOPS fp32 peak (3.42 ms) plus the last wave's imbalance, plus one
    chain of the 4096 points each thread reduces in turn (0.25 ms)."""
    graph, group = _matmul(4096, 4096, 4096)
    shape_of, dtype_of = _shape_dtype(graph)
    a = get_arch("H100")
    [cfg] = schedule_group(group, shape_of, dtype_of, a, Options(topk=1))
    check_config(cfg, group, graph, a)
    m, n = cfg.block_tile
    intensity = (2 * m * n * 4096) / ((m + n) * 4096 * 4)
    assert intensity >= 32, cfg.block_tile
    st = cfg.stages[0]
    assert {s.tensor for s in st.staged} == {"x", "w"}
    assert math.prod(st.reg_tile) >= 16  # register reuse of each staged value
    assert cfg.estimate.flops == 2 * 4096**3
    roofline_us = 2 * 4096**3 / (a.fp32_tflops * 1e6)
    assert roofline_us < cfg.estimate.latency_us < 2 * roofline_us
    # The step keeps x's rows whole sectors and vectors of 4 floats.
    [rk] = st.rstep
    assert rk % (a.read_transaction // 4) == 0 and 4096 % rk == 0
    assert all(sd.vector == 4 for sd in st.staged)


def test_matmul_flops_count_the_multiply_and_the_add():
    graph, group = _matmul(96, 72, 200)
    shape_of, dtype_of = _shape_dtype(graph)
    for tile in ((32, 40), (48, 100), (8, 8)):
        cfg = make_config(group, tile, shape_of, dtype_of, get_arch("A100"))
        assert cfg.estimate.flops == 2 * 96 * 72 * 200


def test_base_tile_keeps_softmax_rows_whole():
    """Softmax's max and sum are per row: splitting a row over blocks would make every
    block recompute them, so the row is one block wide; other axes start at one."""
    graph, group = CASES["softmax"]()
    shape_of, _ = _shape_dtype(graph)
    assert base_tile(group, shape_of) == (1, 1, 50)
    graph, group = CASES["layernorm"]()
    assert base_tile(group, _shape_dtype(graph)[0]) == (1, 768)
    graph, group = CASES["matmul"]()  # nothing intermediate: any tile
    assert base_tile(group, _shape_dtype(graph)[0]) == (1, 1)
    graph, group = CASES["softmax"]()
    for cfg in schedule_group(group, *_shape_dtype(graph), get_arch("H100"), Options(topk=6)):
        assert cfg.block_tile[-1] == 50


def _row_sum(rows, width):
    return whole_graph_group(
        [helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)],
        {"x": _w(rows, width)},
        ["y"],
        {"axes": np.array([1], np.int64)},
    )


def test_few_rows_split_their_reduction_over_threads():
    """A block of 2 row sums over 4096 columns has 2 outputs for 32 or more threads: the
    idle threads split each row (a power of two per row, combined by shuffles, and through
    shared memory across warps); with enough rows every thread owns its own."""
    graph, group = _row_sum(64, 4096)
    a = get_arch("H100")
    for threads in (32, 64, 256):
        cfg = make_config(group, (2,), *_shape_dtype(graph), a, threads=threads)
        check_config(cfg, group, graph, a)
        [st] = cfg.stages
        assert st.thread_shape == (2,) and st.reduce_threads == threads // 2
        assert (st.reduce_offset is not None) == (threads // 2 > 32)
    cfg = make_config(group, (64,), *_shape_dtype(graph), a, threads=64)
    assert cfg.stages[0].reduce_threads == 1
    # Left to itself the policy splits too: 64 rows cannot fill the machine one per thread.
    [best] = schedule_group(group, *_shape_dtype(graph), a)
    assert best.stages[0].reduce_threads > 1


def test_a_reduction_estimate_counts_the_points_each_thread_combines_in_turn(monkeypatch):
    """A thread's reduction points take ``SERIAL_POINT_CYCLES`` each, one after another: the
    estimate is at least every wave's chain of them, plus one chain, recomputed here from the
    config's own fields.  8 rows of 65536 in blocks of one row take 2048 points a thread at
    32 threads and 256 at 256, so the larger block is estimated faster by at least the
    difference, as the H200 measured such reductions; read in vectors of 4 floats
    (:func:`reduce_vector_twin`), a quarter as many."""
    graph, group = _row_sum(8, 65536)
    shape_of, dtype_of = _shape_dtype(graph)
    a = get_arch("H200")
    per_point = simt.SERIAL_POINT_CYCLES / (a.clock_ghz * 1e3)

    def configs():  # the scalar config and its twin in vectors, at 32 and 256 threads
        plain = [make_config(group, (1,), shape_of, dtype_of, a, threads=t) for t in (32, 256)]
        return {
            (c.threads, v): c
            for p in plain
            for v, c in ((1, p), (4, reduce_vector_twin(group, p, shape_of, dtype_of, a)))
        }

    with_term = configs()
    monkeypatch.setattr(simt, "SERIAL_POINT_CYCLES", 0)
    without = configs()
    for (t, v), cfg in with_term.items():
        [st] = cfg.stages
        points = math.ceil(65536 / (st.reduce_threads * st.rvector))
        assert (st.reduce_threads, st.rvector) == (t, v) and points == 65536 // (t * v)
        chain = points * per_point
        expected = max(without[t, v].estimate.latency_us, cfg.estimate.waves * chain) + chain
        assert cfg.estimate.latency_us == pytest.approx(expected, abs=1e-3)
    gap = with_term[32, 1].estimate.latency_us - with_term[256, 1].estimate.latency_us
    assert gap >= (2048 - 256) * per_point


@pytest.mark.parametrize("dtype, width", [(np.float32, 4), (np.float16, 8)])
def test_a_reduction_split_over_threads_has_a_twin_reading_its_rows_in_vectors(dtype, width):
    """BSRN's contrast over 256 x 256 pixels of 64 channels: every config whose reductions
    are split over threads and stage nothing has a twin with the same tile and block whose
    reductions read 16 bytes of x per load, estimated with a thread's chain of points
    ``width`` times shorter -- so no slower than the original."""
    graph, group = whole_graph_group(
        contrast_nodes("x", "y"), {"x": _w(1, 64, 256, 256).astype(dtype)}, ["y"]
    )
    a = get_arch("H200")
    shape_of, dtype_of = _shape_dtype(graph)
    configs = tile_configs(group, (1, 1, 1, 1), shape_of, dtype_of, a)
    assert all(st.rvector == 1 for c in configs for st in c.stages)
    split = [c for c in configs if all(st.reduce_threads > 1 for st in c.stages[:2])]
    assert split
    for original in split:
        twin = reduce_vector_twin(group, original, shape_of, dtype_of, a)
        check_config(twin, group, graph, a)
        assert (twin.threads, twin.block_tile) == (original.threads, original.block_tile)
        for st, orig in zip(twin.stages, original.stages):
            reduction = group.computes[st.node].is_reduction
            assert st.rvector == (width if reduction else 1) and st.reduce_threads == orig.reduce_threads
        assert twin.stages[0].family == "simt_vector"
        assert twin.estimate.latency_us < original.estimate.latency_us


@pytest.mark.parametrize(
    "case",
    [
        lambda: CASES["reduce_outer"](),  # reduced along the outer axis: no row to walk
        lambda: CASES["matmul"](),  # a product's rows are read for several outputs
        lambda: _row_sum(8, 1002),  # a row of 1002 floats is no whole number of vectors
        lambda: _row_sum(64, 4),  # one vector a row, fewer than the threads splitting it
    ],
)
def test_no_vector_twin_where_rows_do_not_step_in_whole_vectors(case):
    graph, group = case()
    shape_of, dtype_of = _shape_dtype(graph)
    configs = schedule_group(group, shape_of, dtype_of, get_arch("H100"), Options(topk=20))
    assert any(st.reduce_threads > 1 for c in configs for st in c.stages)
    assert not any(reduce_vector_twin(group, c, shape_of, dtype_of, get_arch("H100")) for c in configs)


def _region(origin, extent):
    return Region((Interval(Affine.make(), 8), Interval(origin, extent)))


@pytest.mark.parametrize(
    "origin, extent, row, width",
    [
        (Affine.make({"b0": 64}), 64, 128, 4),  # aligned blocks, whole vectors
        (Affine.make({"b0": 64, "k0": 32}), 32, 4096, 4),  # a reduction step of 32
        (Affine.make({"b0": 64}, 2), 64, 128, 2),  # origin off by 2 elements
        (Affine.make({"b0": 64}, 1), 64, 128, 1),  # off by one: scalar loads only
        (Affine.make({"b0": 6}), 6, 120, 2),  # a 6-wide step: pairs
        (Affine.make({"b0": 64}), 64, 130, 2),  # rows of 130: row starts only even
        (Affine.make({"b0": 64}), 63, 128, 1),  # buffer row of 63
        (Affine.make({"b0": 3}), 4, 128, 1),  # blocks 3 apart
    ],
)
def test_vector_width_needs_alignment_and_whole_vectors(origin, extent, row, width):
    assert vector_width(_region(origin, extent), (8, row), (8, extent)) == width


def test_vector_width_of_an_opaque_origin_is_one():
    from welder.ir.expr import Var, binary

    opaque = binary("floordiv", Var("b0"), 3)
    assert vector_width(Region((Interval(opaque, 8),)), (64,), (8,)) == 1


def test_reduction_step_shrinks_to_fit_shared_memory():
    """A 128 x 128 tile of a matmul with K = 1024 on an H100 steps K by 64: at 96
    registers per thread two blocks fit an SM, and two 64-step stagings (64 KB each) fit
    its 228 KB, while 128 would not.  On the same GPU with 16 KB of shared memory per
    block (32 KB per SM) the step shrinks until the staging fits -- 16 (two 8 KB buffers),
    still whole 32-byte sectors of x's rows; with 16 KB per SM to 8, so two blocks still
    fit; and with 4 KB per block it goes below a sector (4) rather than give the tile up.
    Below what a single point needs there is no config."""
    graph, group = _matmul(256, 1024, 256)
    shape_of, dtype_of = _shape_dtype(graph)
    h100 = get_arch("H100")
    assert STEP_LINES * LINE_BYTES // 4 == 128  # the longest step considered, in fp32 points
    cfg = make_config(group, (128, 128), shape_of, dtype_of, h100, threads=256)
    check_config(cfg, group, graph, h100)
    assert cfg.stages[0].rstep == (64,) and cfg.estimate.blocks_per_sm == 2
    for block, sm, step in ((16, 32, 16), (16, 16, 8), (4, 8, 4)):
        small = dataclasses.replace(h100, smem_per_block=block * 1024, smem_per_sm=sm * 1024)
        cfg = make_config(group, (128, 128), shape_of, dtype_of, small, threads=256)
        check_config(cfg, group, graph, small)
        assert cfg.stages[0].rstep == (step,)
        assert {s.tensor: s.extents for s in cfg.stages[0].staged} == {"x": (128, step), "w": (step, 128)}
    tiny = dataclasses.replace(h100, smem_per_block=512, smem_per_sm=512)
    assert make_config(group, (128, 128), shape_of, dtype_of, tiny, threads=256) is None
    # The search still finds smaller tiles that fit.
    found = schedule_group(group, shape_of, dtype_of, tiny, Options(topk=3))
    assert found and all(math.prod(c.block_tile) < 128 * 128 for c in found)
    for cfg in found:
        check_config(cfg, group, graph, tiny)


def test_reduction_step_keeps_every_block_a_staging_buffer_without_losing_occupancy():
    """The step grows only while the blocks per SM that threads and registers allow still
    fit: a config never trades occupancy for a longer step it does not need."""
    graph, group = _matmul(512, 768, 512)
    shape_of, dtype_of = _shape_dtype(graph)
    a = get_arch("A100")
    for tile in ((16, 96), (64, 64), (32, 128)):
        for cfg in tile_configs(group, tile, shape_of, dtype_of, a):
            e = cfg.estimate
            without_smem = min(
                a.max_blocks_per_sm,
                a.max_threads_per_sm // cfg.threads,
                a.regs_per_sm // (max(e.regs_per_thread, 32) * cfg.threads),
            )
            assert e.blocks_per_sm == without_smem, (tile, cfg.threads, cfg.stages[0].rstep)


def test_block_size_is_chosen_among_warp_multiples():
    """Every power-of-two multiple of the warp size the tile can use is tried; the one
    kept is within BLOCK_SIZE_TOLERANCE of the best estimate, and the others reach the
    top-k only where they add a block size."""
    graph, group = _matmul(96, 72, 200)
    shape_of, dtype_of = _shape_dtype(graph)
    a = get_arch("H100")
    variants = tile_configs(group, (32, 40), shape_of, dtype_of, a)
    # 1280 outputs: 32 threads of 40 outputs up to 256 threads of 5.
    assert sorted(c.threads for c in variants) == [32, 64, 128, 256]
    best = min(c.estimate.latency_us for c in variants)
    assert variants[0].estimate.latency_us <= best * (1 + BLOCK_SIZE_TOLERANCE)
    for c in variants:
        check_config(c, group, graph, a)
    top = schedule_group(group, shape_of, dtype_of, a, Options(topk=6))
    assert len({c.threads for c in top}) >= 2


def _contrast(channels: int, pixels: int):
    return whole_graph_group(contrast_nodes("x", "y"), {"x": _w(1, channels, pixels, pixels)}, ["y"])


@pytest.mark.parametrize(
    "channels, tile, largest",
    [
        (64, (1, 1, 1, 1), 1024),  # 64 blocks of one output: up to the arch's largest block
        (64, (1, 4, 1, 1), 1024),  # 16 blocks of 4 outputs
        (528, (1, 1, 1, 1), 256),  # 528 x 256 threads fill half the H100's thread slots
        (512, (1, 512, 1, 1), 256),  # one block, but of 512 outputs: threads have outputs to own
    ],
)
def test_a_reduction_of_few_blocks_may_use_larger_blocks(channels, tile, largest):
    """Blocks past ``Options.max_threads`` are offered only to a reduction whose tile has
    fewer outputs than that many threads and whose grid would fill less than half the GPU's
    thread slots: a grid that small gains loads in flight only from larger blocks."""
    graph, group = _contrast(channels, 32)
    a = get_arch("H100")
    sizes = {c.threads for c in tile_configs(group, tile, *_shape_dtype(graph), a)}
    assert max(sizes) == largest
    assert Options().max_threads == 256


def test_few_blocks_is_under_half_the_thread_slots():
    """The H100's 132 SMs of 2048 threads hold 270,336: 527 blocks of 256 fill less than
    half, 528 exactly half."""
    a = get_arch("H100")
    assert few_blocks(527, 256, a) and not few_blocks(528, 256, a)
    assert few_blocks(263, 512, a) and not few_blocks(264, 512, a)


def test_thread_layout_prefers_square_register_tiles():
    assert thread_layout((128, 128), 256) == ((16, 16), (8, 8))
    assert thread_layout((1, 768), 256) == ((1, 256), (1, 3))
    shape, reg = thread_layout((7, 10, 12), 128)
    assert all(s * r >= e for s, r, e in zip(shape, reg, (7, 10, 12)))


@pytest.mark.parametrize("trial", range(60))
def test_transaction_bytes_against_brute_force(trial):
    """Sectors touched by every element of a box at an aligned origin, counted one by one."""
    rank = int(RNG.integers(1, 4))
    shape = [int(RNG.integers(1, 40)) for _ in range(rank)]
    ext = [int(RNG.integers(1, s + 1)) for s in shape]
    elem, txn = int(RNG.choice([2, 4])), 32
    strides = np.cumprod([1, *shape[::-1]])[:-1][::-1]
    sectors = set()
    for idx in itertools.product(*(range(e) for e in ext)):
        sectors.add(int(np.dot(idx, strides)) * elem // txn)
    actual = len(sectors) * txn
    modelled = transaction_bytes(ext, shape, elem, txn)
    assert modelled >= actual
    # Exact whenever every run starts on a transaction boundary.
    inner = _run_dims(ext, shape)
    rows = math.prod(ext) // math.prod(ext[len(ext) - inner :])
    if rows == 1 or (elem * math.prod(shape[len(shape) - inner :])) % txn == 0:
        assert modelled == actual


def test_shared_memory_plan_never_overlaps_live_buffers():
    for _ in range(200):
        bufs = []
        for k in range(int(RNG.integers(1, 8))):
            start = int(RNG.integers(0, 6))
            bufs.append(Buffer(f"b{k}", int(RNG.integers(1, 5000)), start, start + int(RNG.integers(0, 3))))
        offsets, total = plan_pool(bufs)
        for a, b in itertools.combinations(bufs, 2):
            if a.start <= b.end and b.start <= a.end:  # live at the same time
                ra = (offsets[a.name], offsets[a.name] + a.nbytes)
                rb = (offsets[b.name], offsets[b.name] + b.nbytes)
                assert ra[1] <= rb[0] or rb[1] <= ra[0]
        assert all(offsets[b.name] % 16 == 0 and offsets[b.name] + b.nbytes <= total for b in bufs)
        assert total <= sum(-(-b.nbytes // 16) * 16 for b in bufs)


def test_shared_memory_is_reused_after_a_buffer_dies():
    offsets, total = plan_pool([Buffer("a", 1024, 0, 0), Buffer("b", 1024, 1, 1)])
    assert total == 1024 and offsets["a"] == offsets["b"] == 0


def test_arch_lookup():
    assert get_arch("h100").sm_arch == "sm_90"
    assert match_gpu_name("NVIDIA H100 80GB HBM3").name == "H100"
    assert match_gpu_name("NVIDIA H100 PCIe", sm_count=114).sm_count == 114
    assert match_gpu_name("NVIDIA GeForce RTX 3090").name == "RTX3090"
    with pytest.raises(WelderError, match="unknown arch"):
        get_arch("K80")
    for a in ARCHS.values():
        assert a.source and a.smem_per_block <= a.smem_per_sm and a.sm_count > 0


def _no_pycuda() -> Arch:
    raise ImportError("No module named 'pycuda'")


def test_auto_arch_without_a_gpu_says_why_and_what_to_pass(monkeypatch, tmp_path):
    monkeypatch.setattr(arch_module, "_from_pycuda", _no_pycuda)
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    with pytest.raises(WelderError) as err:
        get_arch("auto")
    text = str(err.value)
    assert "pycuda is not installed" in text and "nvidia-smi is not on PATH" in text
    assert all(name in text for name in ARCHS)


def test_auto_arch_reads_nvidia_smi(monkeypatch, tmp_path):
    monkeypatch.setattr(arch_module, "_from_pycuda", _no_pycuda)
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert get_arch("auto") is get_arch("H100")
    smi.write_text("#!/bin/sh\nexit 9\n")
    with pytest.raises(WelderError, match="nvidia-smi failed"):
        get_arch("auto")
