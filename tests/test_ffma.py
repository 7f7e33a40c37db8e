"""Exact fp32 contractions as FMAs in the mma kind's tiles (the ``ffma`` kind), run on the CPU
emulator against numpy in fp64.

The cases are the TF32 suite's (tests/test_mma_tf32.py): every operand layout (A with K or M
contiguous, B with N or K contiguous), batches, ragged M, N and K, 16- and 4-byte copies, an
odd N, split-K, and later SIMT stages reading the tile.  The kernels must be exact fp32: far
inside fp32's threshold, where TF32 operands would miss it.
"""

from __future__ import annotations

import re
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from onnx import helper
from onnx_util import make_model
from test_mma import rolled_product
from test_mma_tf32 import (
    CASES,
    _context,
    _emulate,
    _evaluate64,
    _matmul,
    _reference,
    _seed,
    _whole_group,
    ptx_of,
)

from welder.arch import get_arch
from welder.check import THRESHOLDS, error_metric
from welder.codegen import generate_kernel
from welder.frontend.onnx import import_onnx
from welder.runtime.emu import available
from welder.schedule.kinds import Options, ffma, mma, propose
from welder.schedule.kinds.mma import config_precision, contraction
from welder.schedule.plan import plan_model

ARCH = get_arch("H100")
FFMA_KINDS = ("ffma", "simt")
#: Exact fp32 products of order-one values over up to a few hundred terms stay within a few
#: units of fp32's rounding; TF32 operands would be some 1e-3 away.
EXACT = 1e-5

RNG_PAD = np.random.default_rng(5)

needs_emulator = pytest.mark.skipif(not available(), reason="the CPU emulator needs Linux and g++")


def case_configs(rule: mma.MmaKind, label: str, kinds: tuple[str, ...], topk: int = 4):
    """The graph, group and feeds of the TF32 suite's case ``label``, and ``rule``'s configs."""
    _seed(label)
    model, feeds = CASES[label]()
    graph = import_onnx(model)
    group = _whole_group(graph)
    return graph, group, feeds, rule.propose(group, _context(graph, topk=topk, kinds=kinds))


def split_k_case(rule: mma.MmaKind, kinds: tuple[str, ...], seed: str):
    """A 600-deep product of few tiles under every split-K factor the policy allows for
    ``rule``'s two best configs."""
    _seed(seed)
    model, feeds = _matmul(24, 600, 40, trans_a=True)
    graph = import_onnx(model)
    group = _whole_group(graph)
    ctx = _context(graph, topk=50, kinds=kinds)
    configs = []
    for cfg in rule.propose(group, ctx)[:2]:
        st = cfg.stages[0]
        con = rule.contraction_of(group.computes[st.node], ctx.shape_of)
        for splits in mma.split_choices(con, st, cfg.num_blocks, ctx):
            configs.append(replace(cfg, stages=[replace(st, splits=splits), *cfg.stages[1:]]))
    assert len({c.stages[0].splits for c in configs}) >= 2
    return graph, group, feeds, configs


def assert_case_exact(rule: mma.MmaKind, label: str, kinds: tuple[str, ...]) -> None:
    """``rule``'s configs of case ``label`` are its own kind's, held to fp32, and exact."""
    graph, group, feeds, configs = case_configs(rule, label, kinds)
    assert configs, f"{label}: the {rule.name} rule proposed nothing"
    assert all(isinstance(c.stages[0], rule.config_type) and config_precision(c) == "fp32" for c in configs)
    assert_exact(graph, group, feeds, configs, label)


def assert_exact(graph, group, feeds: dict, configs: list, label: str = "") -> None:
    """Every config's emulated outputs within :data:`EXACT` of numpy's fp64 result."""
    exact = _reference(graph, feeds, round_operands=False)
    for cfg, outputs in zip(configs, _emulate(graph, group, configs, feeds)):
        for name, got in outputs.items():
            err = error_metric(got, exact[name])
            assert err <= EXACT < THRESHOLDS["fp32"], f"{label}, {cfg.stages[0]}, {name}: {err:.2e}"


@needs_emulator
@pytest.mark.parametrize("label", list(CASES))
def test_ffma_stage_computes_exact_fp32(label: str) -> None:
    assert_case_exact(ffma.KIND, label, FFMA_KINDS)


@needs_emulator
def test_split_k_on_ffma_is_exact() -> None:
    assert_exact(*split_k_case(ffma.KIND, FFMA_KINDS, "ffma split-k"))


@needs_emulator
def test_sixteen_warp_tiles_are_exact() -> None:
    """The 128 x 256 and 256 x 128 blocks of 16 warps (512 threads, 64 x 32 warp tiles), which
    only this kind offers; never split (their split-K code spills)."""
    _seed("ffma sixteen warps")
    model, feeds = _matmul(256, 40, 256)
    graph = import_onnx(model)
    group = _whole_group(graph)
    found = ffma.KIND.propose(group, _context(graph, topk=400, kinds=("ffma",)))
    wide = [c for c in found if c.threads == 512]
    assert wide and all(c.stages[0].splits == 1 for c in wide)
    configs = list({(c.stages[0].block_m, c.stages[0].block_n): c for c in wide}.values())
    assert len(configs) == 2
    exact = _reference(graph, feeds, round_operands=False)
    for cfg, outputs in zip(configs, _emulate(graph, group, configs, feeds)):
        for name, got in outputs.items():
            assert error_metric(got, exact[name]) <= EXACT, cfg.stages[0]


def _padded_product(m: int, pad: int, k: int, n: int, axis: int = 0):
    """A product whose A is a zero-padded copy of x (a guarded load: not affine), as a window
    partition pads an image: along M (``axis`` 0) the guard reads the row only, and A's rows
    are gathered whole; along K (``axis`` 1) it reads K too, and A is gathered element by
    element."""
    x = RNG_PAD.standard_normal((m, k)).astype(np.float32)
    depth = k + pad if axis == 1 else k
    w = (RNG_PAD.standard_normal((depth, n)) / np.sqrt(depth)).astype(np.float32)
    nodes = [
        helper.make_node("Pad", ["x", "pads"], ["xp"]),
        helper.make_node("MatMul", ["xp", "w"], ["y"]),
    ]
    pads = np.array([0, 0, pad, 0] if axis == 0 else [0, 0, 0, pad], np.int64)
    return make_model(nodes, {"x": x}, ["y"], {"w": w, "pads": pads}, opset=17), {"x": x}


#: Padded products: (m, pad, k, n, axis).
PADDED_SHAPES = [(40, 8, 48, 40, 0), (61, 3, 100, 24, 0), (40, 4, 45, 40, 1), (61, 3, 97, 24, 1)]


@needs_emulator
@pytest.mark.parametrize("shape", PADDED_SHAPES)
def test_a_gathered_fp32_operand_is_copied_by_rows_or_in_pairs_and_exact(shape: tuple[int, ...]) -> None:
    """Padded along M, A's rows are copied with cp.async from starts worked out once (for
    the tensor-core kinds too: nothing is gathered element by element); padded along K, A
    is gathered in float pairs, which the plain TF32 kind leaves to 16-bit types.  Both
    exact under each config."""
    assert_gathered_exact(ffma.KIND, FFMA_KINDS, shape)


def assert_gathered_exact(rule: mma.MmaKind, kinds: tuple[str, ...], shape: tuple[int, ...]) -> None:
    """``rule``'s configs of a product padded as ``shape`` says copy A by rows or in pairs,
    and are exact."""
    model, feeds = _padded_product(*shape)
    by_rows = shape[-1] == 0
    graph = import_onnx(model)
    group = _whole_group(graph)
    con = contraction(group.computes[group.stages[0]], lambda t: graph.tensor(t).shape, gather_32bit=True)
    assert con is not None and (con.gathered_rows if by_rows else con.gathered) is con.a  # the padded A
    plain = contraction(group.computes[group.stages[0]], lambda t: graph.tensor(t).shape)
    assert (plain is not None and plain.gathered_rows is plain.a) if by_rows else plain is None
    configs = rule.propose(group, _context(graph, topk=4, kinds=kinds))
    assert configs
    source = generate_kernel(graph, group, configs[0], "k").source
    if by_rows:
        assert "a_starts[" in source and "a_element(" not in source
    else:
        assert "float2 a_pairs[" in source and "make_float2(a_element(" in source
    exact = _evaluate64(graph, {k: v.astype(np.float64) for k, v in {**graph.constants, **feeds}.items()})
    for cfg, outputs in zip(configs, _emulate(graph, group, configs, feeds)):
        assert error_metric(outputs["y"], exact["y"]) <= EXACT, cfg.stages[0]


def test_exact_fp32_products_get_ffma_beside_simt_candidates() -> None:
    """By default an fp32 product is offered as FMAs beside SIMT reductions (and three TF32
    products, tests/test_tf32x3.py; the tuner measures each family); fp16 products and a GPU
    without cp.async get no ffma stage."""
    graph = import_onnx(_matmul(512, 768, 768)[0])
    group = _whole_group(graph)
    found = propose(group, _context(graph, topk=8, kinds=Options.kinds))
    assert {"ffma", "simt"} <= {c.stages[0].kind for c in found}
    plan = plan_model(graph, ARCH, topk=8)
    assert "ffma" in {c.stages[0].kind for c in plan.groups[0].configs}
    assert ffma.KIND.propose(group, _context(graph, arch="V100")) is None


def test_large_products_take_large_warp_tiles() -> None:
    """Shared memory, not the FMA units, bounds a small warp tile (smem_share): the best
    estimates of a BERT-sized product give every warp at least 64 x 32 of it, and every
    config fits the H100's registers and shared memory."""
    graph = import_onnx(_matmul(8192, 768, 3072)[0])
    group = _whole_group(graph)
    configs = ffma.KIND.propose(group, _context(graph, topk=20, kinds=("ffma",)))
    assert configs
    for cfg in configs:
        st = cfg.stages[0]
        warp_m, warp_n = st.block_m // st.warps[0], st.block_n // st.warps[1]
        assert warp_m * warp_n >= 64 * 32, st
        assert cfg.smem_bytes <= ARCH.smem_per_block
        assert cfg.estimate.regs_per_thread <= ARCH.max_regs_per_thread
    small = replace(configs[0].stages[0], block=(16, 32), warps=(1, 1))
    assert ffma.smem_share(small) < ffma.smem_share(configs[0].stages[0]) == 1.0


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_ffma_kernels_compile_to_fmas_and_vector_shared_loads(tmp_path: Path) -> None:
    """nvcc builds the kernels for sm_80 and sm_90 without warnings; their PTX multiplies
    with fp32 FMAs only (no tensor-core product, no TF32 rounding), reads A's rows four K
    steps at a time and B's columns (its N axis contiguous) four at a time: no 8-byte shared
    load is left.  With A transposed (its M axis contiguous), its rows come four at a time
    too, where the warp's rows are pieces in pairs: no scalar shared load is left either."""
    for trans_a in (False, True):
        graph = import_onnx(_matmul(256, 64, 128, trans_a=trans_a)[0])
        group = _whole_group(graph)
        found = ffma.KIND.propose(group, _context(graph, topk=40, kinds=("ffma",)))
        configs = [c for c in found if c.stages[0].block_m // c.stages[0].warps[0] % 32 == 0][:2]
        assert configs
        kernels = [generate_kernel(graph, group, cfg, f"ffma_ptx_{j}") for j, cfg in enumerate(configs)]
        for text in ptx_of(kernels, tmp_path):
            assert "fma.rn.f32" in text and "ld.shared.v4.f32" in text and "ld.shared.v2.f32" not in text
            assert not re.search(r"ld\.shared\.f32", text)
        assert "cp.async.cg.shared.global" in text
        assert not re.search(r"mma\.sync|cvt\.rna\.tf32|wgmma", text)


def _conv32(x: np.ndarray, w: np.ndarray, stride: int):
    """An fp32 Conv with windows of ``w``'s size, ``stride`` apart, unpadded."""
    size = list(w.shape[2:])
    node = helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=size, strides=[stride, stride])
    return make_model([node], {"x": x}, ["y"], {"w": w}, opset=17), {"x": x}


@needs_emulator
def test_an_fp32_patch_embedding_is_an_exact_product() -> None:
    """Disjoint windows make an fp32 Conv a flat product, which the ffma kind computes with
    the image gathered; an overlapping 3x3 window keeps the image form (the SIMT kind's)."""
    x = RNG_PAD.standard_normal((2, 8, 16, 16)).astype(np.float32)
    w = RNG_PAD.standard_normal((32, 8, 4, 4)).astype(np.float32)
    model, feeds = _conv32(x, w, stride=4)
    graph = import_onnx(model)
    shape_of = lambda t: graph.tensor(t).shape  # noqa: E731
    found = [c for n in graph.nodes.values() if (c := contraction(n.compute, shape_of, gather_32bit=True))]
    assert len(found) == 1 and (found[0].m, found[0].n, found[0].k_extent) == (32, 16, 128)
    assert found[0].gathered is found[0].b
    group = _whole_group(graph)
    configs = ffma.KIND.propose(group, _context(graph, topk=4, kinds=FFMA_KINDS))
    assert configs and all(cfg.stages[0].kind == "ffma" for cfg in configs)
    exact = _evaluate64(graph, {k: v.astype(np.float64) for k, v in {**graph.constants, **feeds}.items()})
    for cfg, outputs in zip(configs, _emulate(graph, group, configs, feeds)):
        assert outputs["y"].shape == (2, 32, 4, 4)
        assert error_metric(outputs["y"], exact["y"]) <= EXACT, cfg.stages[0]
    image = import_onnx(_conv32(x, w, stride=2)[0])
    assert all(len(n.compute.shape) == 4 for n in image.nodes.values())


def _deep_conv32(shape: tuple[int, int, int, int], out: int, kernel: int, pad: int):
    """An fp32 Conv with a bias and a ReLU after it."""
    x = RNG_PAD.standard_normal(shape).astype(np.float32)
    w = (RNG_PAD.standard_normal((out, shape[1], kernel, kernel)) / np.sqrt(shape[1] * kernel**2)).astype(
        np.float32
    )
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[kernel] * 2, pads=[pad] * 4),
        helper.make_node("Relu", ["c"], ["y"]),
    ]
    consts = {"w": w, "b": RNG_PAD.standard_normal(out).astype(np.float32)}
    return make_model(nodes, {"x": x}, ["y"], consts, opset=17), {"x": x}


#: (input, output channels, kernel, pad): reductions of at least FP32_PRODUCT_MIN_DEPTH.
DEEP_CONVS = {
    "3x3 p1 over 32 channels (K = 288)": ((2, 32, 10, 10), 32, 3, 1),
    "1x1 over 256 channels (K = 256)": ((1, 256, 6, 6), 32, 1, 0),
}


@needs_emulator
@pytest.mark.parametrize("label", list(DEEP_CONVS))
def test_a_deep_fp32_conv_is_an_exact_ffma_product(label: str) -> None:
    """An fp32 Conv reducing over at least FP32_PRODUCT_MIN_DEPTH products per output is a
    flat product (an implicit GEMM, or a batched product for a 1x1), which the ffma kind
    computes with the bias and ReLU after it, exact; a shallower one keeps the image form."""
    from welder.frontend.ops.nn import FP32_PRODUCT_MIN_DEPTH

    shape, out, kernel, pad = DEEP_CONVS[label]
    assert shape[1] * kernel * kernel >= FP32_PRODUCT_MIN_DEPTH
    model, feeds = _deep_conv32(shape, out, kernel, pad)
    graph = import_onnx(model)
    shape_of = lambda t: graph.tensor(t).shape  # noqa: E731
    found = [c for n in graph.nodes.values() if (c := contraction(n.compute, shape_of, gather_32bit=True))]
    assert len(found) == 1 and (found[0].m, found[0].k_extent) == (out, shape[1] * kernel * kernel)
    group = _whole_group(graph)
    configs = ffma.KIND.propose(group, _context(graph, topk=4, kinds=FFMA_KINDS))
    assert configs and all(cfg.stages[0].kind == "ffma" for cfg in configs)
    exact = _evaluate64(graph, {k: v.astype(np.float64) for k, v in {**graph.constants, **feeds}.items()})
    for cfg, outputs in zip(configs[:2], _emulate(graph, group, configs[:2], feeds)):
        assert outputs["y"].shape == exact["y"].shape
        assert error_metric(outputs["y"], exact["y"]) <= EXACT, cfg.stages[0]
    shallow = import_onnx(_deep_conv32((2, 16, 10, 10), 32, 3, 1)[0])  # K = 144
    assert all(len(n.compute.shape) == 4 for n in shallow.nodes.values())


@needs_emulator
def test_a_rolled_fp32_operand_is_gathered_and_exact() -> None:
    """Swin's shifted windows in fp32: A read through a roll gathers whole rows."""
    model, feeds = rolled_product(np.float32)
    graph = import_onnx(model)
    group = _whole_group(graph)
    con = contraction(group.computes[group.stages[0]], lambda t: graph.tensor(t).shape, gather_32bit=True)
    assert con is not None and con.gathered_rows is con.a
    configs = ffma.KIND.propose(group, _context(graph, topk=4, kinds=FFMA_KINDS))
    assert configs
    exact = _evaluate64(graph, {k: v.astype(np.float64) for k, v in {**graph.constants, **feeds}.items()})
    for cfg, outputs in zip(configs, _emulate(graph, group, configs, feeds)):
        assert error_metric(outputs["y"], exact["y"]) <= EXACT, cfg.stages[0]


def test_the_kernel_study_times_every_family_of_the_kind() -> None:
    """``scripts/mma_bench.py --dtype fp32`` times the best of each ffma family -- the
    plain tiles, the sixteen-warp blocks, split-K where tiles are few -- then other tiles."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from mma_bench import bench_configs, tile_of

    graph = import_onnx(_matmul(1024, 256, 768)[0])
    group = _whole_group(graph)
    proposed = ffma.KIND.propose(group, _context(graph, topk=100_000, kinds=("ffma",)))
    chosen = bench_configs("ffma", proposed, candidates=2, tiles=3)
    families = [c.stages[0].family for c in chosen]
    assert families.count("ffma") >= 2 and families.count("ffma/16-warps") == 2
    assert len({tile_of(c) for c in chosen}) >= 2 + 3
    assert len({id(c) for c in chosen}) == len(chosen)  # none timed twice
