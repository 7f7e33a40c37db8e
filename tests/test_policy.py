"""Scheduling policy: every config respects the arch, tiles the output exactly, and the
planners it relies on are right (checked against brute force)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from onnx import helper
from onnx_util import make_model

from welder.arch import ARCHS, get_arch, match_gpu_name
from welder.errors import WelderError
from welder.frontend.onnx import import_onnx
from welder.ir.expr import free_vars
from welder.schedule.group import make_group
from welder.schedule.policy import Options, schedule_group, thread_layout
from welder.tile.footprint import Buffer, _run_dims, plan_pool, transaction_bytes
from welder.tile.propagate import propagate_group
from welder.tile.region import Affine

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


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_configs_obey_the_arch_and_tile_exactly(case, arch):
    graph, group = CASES[case]()
    a = get_arch(arch)
    shape_of = lambda t: graph.tensor(t).shape  # noqa: E731
    configs = schedule_group(group, shape_of, lambda t: graph.tensor(t).dtype, a, Options(topk=6))
    assert configs, f"no config for {case} on {arch}"
    root_shape = shape_of(group.root)
    for cfg in configs:
        assert cfg.smem_bytes <= a.smem_per_block
        assert cfg.threads % a.warp_size == 0 and cfg.threads <= a.max_threads_per_block
        assert cfg.estimate.regs_per_thread <= a.max_regs_per_thread
        assert cfg.estimate.blocks_per_sm >= 1
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
            assert math.prod(st.thread_shape) * st.reduce_threads <= cfg.threads
            for e, t, r in zip(st.tile, st.thread_shape, st.reg_tile):
                assert t * r >= e
            for sd in st.staged:
                assert 0 <= sd.offset < cfg.smem_bytes


def test_large_matmul_on_h100_has_high_arithmetic_intensity():
    """4096^3 fp32 on H100: a block tile of M x N reads (M + N) * K floats for 2*M*N*K
    flops.  The policy must pick a tile with at least 32 flop/byte (128 x 128 gives
    exactly 32; 32 x 32 would give 8), and stage both operands in shared memory."""
    graph, group = whole_graph_group(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        {"x": np.zeros((4096, 4096), np.float32)},
        ["y"],
        {"w": np.zeros((4096, 4096), np.float32)},
    )
    [cfg] = schedule_group(
        group,
        lambda t: graph.tensor(t).shape,
        lambda t: graph.tensor(t).dtype,
        get_arch("H100"),
        Options(topk=1),
    )
    m, n = cfg.block_tile
    intensity = (2 * m * n * 4096) / ((m + n) * 4096 * 4)
    assert intensity >= 32, cfg.block_tile
    assert {s.tensor for s in cfg.stages[0].staged} == {"x", "w"}
    assert math.prod(cfg.stages[0].reg_tile) >= 16  # register reuse of each staged value


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
