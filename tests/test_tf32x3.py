"""fp32 contractions as three TF32 products a piece (the ``mma_tf32x3`` kind), run on the CPU
emulator against numpy in fp64.

The cases are the TF32 suite's (tests/test_mma_tf32.py): every fragment path for 32-bit
elements, batches, ragged edges, split-K, later SIMT stages on the tile.  Every result must
be as close to the exact one as an fp32 FMA kernel's (the ffma suite's bound), where one
TF32 product a piece is some 1e-3 away: a kernel that dropped either small term, or took
the operands as plain TF32, fails.  The emulator's tensor core forms each K step's sum in
double and rounds it once; the GPU's adder rounds its own way, which the GPU test and the
tuner's check at the fp32 limit measure.
"""

from __future__ import annotations

import math
import re
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from onnx import helper
from onnx_util import make_model
from test_ffma import (
    EXACT,
    FFMA_KINDS,
    PADDED_SHAPES,
    assert_case_exact,
    assert_exact,
    assert_gathered_exact,
    split_k_case,
)
from test_mma_tf32 import (
    CASES,
    _context,
    _emulate,
    _matmul,
    _reference,
    _seed,
    _whole_group,
    needs_emulator,
    ptx_of,
)

from welder.check import error_metric
from welder.codegen import generate_kernel
from welder.frontend.onnx import import_onnx
from welder.graph import Graph
from welder.schedule.config import GroupConfig
from welder.schedule.group import Group
from welder.schedule.kinds import Options, mma, propose, tf32x3

SPLIT_KINDS = ("mma_tf32x3", "simt")


@needs_emulator
@pytest.mark.parametrize("label", list(CASES))
def test_three_tf32_products_reach_fp32_accuracy(label: str) -> None:
    assert_case_exact(tf32x3.KIND, label, SPLIT_KINDS)


@needs_emulator
def test_split_k_with_three_products_is_as_exact() -> None:
    assert_exact(*split_k_case(tf32x3.KIND, SPLIT_KINDS, "tf32x3 split-k"))


@needs_emulator
@pytest.mark.parametrize("shape", PADDED_SHAPES)
def test_gathered_operands_are_split_as_well(shape: tuple[int, ...]) -> None:
    """A padded A (a convolution's image, a window partition) reaches the ring by rows or
    in float pairs as the ffma kind's does, and is split as any other operand."""
    assert_gathered_exact(tf32x3.KIND, SPLIT_KINDS, shape)


@needs_emulator
def test_large_operands_stay_exact_and_an_infinite_one_is_not_finite() -> None:
    """Elements far from 1 split as well as small ones.  An infinite element's products are
    NaN where exact fp32's are infinite (its lo is NaN, and its hi meets the other operand's
    lo, often 0): exactly the outputs it reaches are not finite, so the check still sees it."""
    _seed("tf32x3 special values")
    model, feeds = _matmul(32, 32, 16)
    graph = import_onnx(model)
    (name,) = feeds
    x = feeds[name].copy()
    x[3, :] *= 1e30
    x[5, 7] = np.inf
    feeds = {name: x}
    group = _whole_group(graph)
    configs = tf32x3.KIND.propose(group, _context(graph, topk=1, kinds=SPLIT_KINDS))
    exact = _reference(graph, feeds, round_operands=False)
    (outputs,) = _emulate(graph, group, configs[:1], feeds)
    for out, ref in zip(outputs.values(), exact.values()):
        assert np.array_equal(np.isfinite(out), np.isfinite(ref)) and not np.isfinite(ref).all()
        finite = np.isfinite(ref)
        assert error_metric(out[finite] / 1e30, ref[finite] / 1e30) <= EXACT


def deep_positive_product(
    configs: int = 1, m: int = 32, n: int = 16
) -> tuple[Graph, Group, list[GroupConfig], dict, np.ndarray]:
    """BERT's 3072-deep product with every term positive, so that the running sum only
    grows: the graph, its group, the best config of each of the kind's ``configs`` largest
    block and warp tiles that sum all of K in one chain (no split-K), the inputs and the
    product in fp64.  A tensor core's adder truncates (the emulator rounds each mma's sum
    towards zero), and an mma into the accumulator every product would lose about half an
    ulp of the sum each, 1,152 times: some 5e-5 of it, all one way.  Each K step's three
    products go into a partial that an FADD (to nearest) adds to the accumulator, which
    leaves fp32's own rounding of the sum: a few ulp, unbiased, within :data:`DEEP_LIMIT`
    of the exact value (relative)."""
    rng = np.random.default_rng(3072)
    x = rng.uniform(0.5, 1.0, (m, 3072)).astype(np.float32)
    w = rng.uniform(0.5, 1.0, (3072, n)).astype(np.float32)
    product = helper.make_node("MatMul", ["x", "w"], ["y"])
    graph = import_onnx(make_model([product], {"x": x}, ["y"], {"w": w}, opset=17))
    group = _whole_group(graph)
    whole: dict[tuple, GroupConfig] = {}  # the best config of each block and warp tile
    for c in tf32x3.KIND.propose(group, _context(graph, topk=256, kinds=SPLIT_KINDS)):
        if c.stages[0].splits == 1:
            whole.setdefault((c.stages[0].block, c.stages[0].warps), c)
    # the largest first: the tiles deep products are tuned to
    chosen = sorted(whole.values(), key=lambda c: -math.prod(c.stages[0].block))[:configs]
    assert len(chosen) == configs
    return graph, group, chosen, {"x": x}, x.astype(np.float64) @ w.astype(np.float64)


#: The relative error allowed a deep product of positive terms: the truncating chain is
#: 2.6e-5 off on the emulator, the partials 9e-7.
DEEP_LIMIT = 1e-5


@needs_emulator
def test_a_deep_product_of_positive_terms_does_not_drift_towards_zero() -> None:
    """:func:`deep_positive_product` on the emulator (the GPU test runs it natively)."""
    graph, group, configs, feeds, exact = deep_positive_product()
    (outputs,) = _emulate(graph, group, configs, feeds)
    assert exact.min() > 1000
    assert np.max(np.abs(outputs["y"] - exact) / exact) <= DEEP_LIMIT


def test_fp32_products_are_offered_as_three_tf32_products_by_default() -> None:
    """The kind is in the default kinds beside ffma and simt (each a family the tuner
    measures); its estimate is three TF32 products'; fp16 products and a GPU without
    mma.sync get none."""
    graph = import_onnx(_matmul(512, 768, 768)[0])
    group = _whole_group(graph)
    found = propose(group, _context(graph, topk=12, kinds=Options.kinds))
    assert {c.stages[0].kind for c in found} == {"mma_tf32x3", "ffma", "simt"}
    split = tf32x3.KIND.propose(group, _context(graph, topk=1, kinds=SPLIT_KINDS))[0]
    single = mma.TF32_KIND.propose(group, _context(graph, topk=1, kinds=("mma_tf32",)))[0]
    assert split.estimate.latency_us > single.estimate.latency_us
    assert split.estimate.regs_per_thread > single.estimate.regs_per_thread
    assert tf32x3.KIND.propose(group, _context(graph, arch="V100")) is None
    assert tf32x3.KIND.propose(group, _context(graph, topk=4, kinds=FFMA_KINDS)) is not None
    x = np.ones((64, 64), np.float16)
    product = helper.make_node("MatMul", ["x", "w"], ["y"])
    half = import_onnx(make_model([product], {"x": x}, ["y"], {"w": x}, opset=17))
    assert tf32x3.KIND.propose(_whole_group(half), _context(half)) is None


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_split_kernels_compile_to_three_m16n8k8_a_piece(tmp_path: Path) -> None:
    """nvcc builds the kernels for sm_80 and sm_90 without warnings; their PTX holds three
    TF32 mma.sync for every one a plain TF32 kernel of the same config holds, and no
    cvt.rna.tf32 (the split rounds with integer instructions) where the TF32 kernel rounds
    every fragment element with one."""
    graph = import_onnx(_matmul(128, 64, 128)[0])
    group = _whole_group(graph)
    cfg = tf32x3.KIND.propose(group, _context(graph, topk=1, kinds=SPLIT_KINDS))[0]
    plain = replace(cfg, stages=[mma.Tf32MmaConfig(**vars(cfg.stages[0])), *cfg.stages[1:]])
    for j in (0, 1):
        (tmp_path / f"{j}").mkdir()
    split_ptx, plain_ptx = (
        ptx_of([generate_kernel(graph, group, c, f"k{j}")], tmp_path / f"{j}", archs=("sm_80", "sm_90"))[-1]
        for j, c in enumerate((cfg, plain))
    )
    count = lambda pattern, text: len(re.findall(pattern, text))  # noqa: E731
    mma_op = r"mma\.sync\.aligned\.m16n8k8\.row\.col\.f32\.tf32\.tf32\.f32"
    assert count(mma_op, split_ptx) == 3 * count(mma_op, plain_ptx) > 0
    assert count(r"cvt\.rna\.tf32\.f32", split_ptx) == 0 < count(r"cvt\.rna\.tf32\.f32", plain_ptx)
