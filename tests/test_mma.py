"""The ``mma`` kernel kind: fp16 contractions on tensor cores, run on the CPU emulator.

Every graph here is half precision; each group is scheduled by the tensor-core rule under
several of its configs (block tiles, copy widths), rendered, emulated and compared with the
interpreter.  The shapes are chosen to reach every path of the template: ragged M, N and K,
16-, 8- and 4-byte copies, both contiguity cases of each operand (A row- or column-major,
B row-major or transposed), batches with broadcast operands, later SIMT stages (a bias and
activation, a row softmax) reading the tile from shared memory, and the tile written both
to shared memory and to global memory.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import onnx
import pytest
from onnx import helper
from onnx_util import make_model

from welder.arch import get_arch
from welder.check import error_metric, threshold_for
from welder.codegen import generate_kernel, model_source
from welder.codegen.kernel import KernelBuilder
from welder.device.cubin import text_instructions
from welder.device.gpu import compile_cubin
from welder.frontend.onnx import import_onnx
from welder.graph import Graph
from welder.ir.interpret import np_dtype
from welder.resources import TEMPLATE_DIR
from welder.runtime.emu import available, compile_kernels
from welder.schedule.config import GroupConfig
from welder.schedule.group import Group, make_group
from welder.schedule.kinds import Options, ScheduleContext, mma, propose
from welder.schedule.kinds.mma import MmaConfig, contraction
from welder.schedule.plan import plan_model

ARCH = get_arch("H100")
#: The kinds that put an fp16 product on tensor cores on the H100.
TENSOR_CORE_KINDS = {"mma", "wgmma", "attention"}
RNG = np.random.default_rng(7)

needs_emulator = pytest.mark.skipif(not available(), reason="the CPU emulator needs Linux and g++")


def _h(*shape: int) -> np.ndarray:
    return (RNG.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float16)


def _matmul(
    m: int, k: int, n: int, trans_a: bool = False, trans_b: bool = False
) -> tuple[onnx.ModelProto, dict]:
    x = _h(k, m) if trans_a else _h(m, k)
    w = _h(n, k) if trans_b else _h(k, n)
    nodes = [helper.make_node("Gemm", ["x", "w"], ["y"], transA=int(trans_a), transB=int(trans_b))]
    return make_model(nodes, {"x": x}, ["y"], {"w": w}, opset=17), {"x": x}


def _transposed_input(m: int, k: int, n: int) -> tuple[onnx.ModelProto, dict]:
    """A read through a Transpose node inlined into the product: A is column-major."""
    x = _h(k, m)
    nodes = [
        helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0]),
        helper.make_node("MatMul", ["xt", "w"], ["y"]),
    ]
    return make_model(nodes, {"x": x}, ["y"], {"w": _h(k, n)}, opset=17), {"x": x}


def _bias_gelu(m: int, k: int, n: int) -> tuple[onnx.ModelProto, dict]:
    """Later stages on the tile: bias, tanh-free GELU via Erf; the product is also an output."""
    x = _h(1, m, k)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"]),
        helper.make_node("Add", ["mm", "b"], ["a"]),
        helper.make_node("Mul", ["a", "half"], ["ah"]),
        helper.make_node("Mul", ["a", "rsqrt2"], ["as"]),
        helper.make_node("Erf", ["as"], ["e"]),
        helper.make_node("Add", ["e", "one"], ["e1"]),
        helper.make_node("Mul", ["ah", "e1"], ["y"]),
    ]
    consts = {
        "w": _h(k, n),
        "b": _h(n),
        "half": np.array(0.5, np.float16),
        "rsqrt2": np.array(0.7071, np.float16),
        "one": np.array(1.0, np.float16),
    }
    return make_model(nodes, {"x": x}, ["y", "mm"], consts, opset=17), {"x": x}


def _epilogue_chain(m: int, k: int, n: int) -> tuple[onnx.ModelProto, dict]:
    """Elementwise consumers of the product only, each at the same point: bias, a residual
    input, ReLU, then the result cast to float32 (outputs: the fp16 sum before the ReLU and
    the float32 result; the ReLU itself is not an output)."""
    x, res = _h(1, m, k), _h(1, m, n)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"]),
        helper.make_node("Add", ["mm", "b"], ["a"]),
        helper.make_node("Add", ["a", "res"], ["s"]),
        helper.make_node("Relu", ["s"], ["r"]),
        helper.make_node("Cast", ["r"], ["y"], to=onnx.TensorProto.FLOAT),
    ]
    return make_model(nodes, {"x": x, "res": res}, ["y", "s"], {"w": _h(k, n), "b": _h(n)}, opset=17), {
        "x": x,
        "res": res,
    }


def _concat_after(before: int, m: int, k: int, n: int) -> tuple[onnx.ModelProto, dict]:
    """A product written after another tensor's rows (Concat along M, as MobileViT joins a
    convolution's channels to a skip's): the product's origins run negative in the blocks
    that hold the other tensor, whose copies and stores must stay off memory before it."""
    x, other = _h(1, m, k), _h(1, before, n)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"]),
        helper.make_node("Relu", ["mm"], ["r"]),
        helper.make_node("Concat", ["other", "r"], ["y"], axis=1),
    ]
    return make_model(nodes, {"x": x, "other": other}, ["y"], {"w": _h(k, n)}, opset=17), {
        "x": x,
        "other": other,
    }


def _attention_scores(batch: int, heads: int, seq: int, dim: int) -> tuple[onnx.ModelProto, dict]:
    """softmax(Q K^T * scale): B is K transposed (K-contiguous rows), a row softmax after it."""
    q, k = _h(batch, heads, seq, dim), _h(batch, heads, seq, dim)
    nodes = [
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["s"]),
        helper.make_node("Mul", ["s", "scale"], ["ss"]),
        helper.make_node("Softmax", ["ss"], ["y"], axis=-1),
    ]
    consts = {"scale": np.array(dim**-0.5, np.float16)}
    return make_model(nodes, {"q": q, "k": k}, ["y"], consts, opset=17), {"q": q, "k": k}


def _broadcast_batch(batch: int, m: int, k: int, n: int) -> tuple[onnx.ModelProto, dict]:
    """A batched A times one B shared by every matrix (batch stride 0).  B is [1, K, N]: a
    2-D B would be lowered as one flat product (``_flat_product``), with no batch at all."""
    x = _h(batch, 2, m, k)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])]
    return make_model(nodes, {"x": x}, ["y"], {"w": _h(1, k, n)}, opset=17), {"x": x}


def _tokens_to_nchw(h: int, w: int, k: int, c: int) -> tuple[onnx.ModelProto, dict]:
    """A product over tokens written out as an image: [1, H*W, C] -> [1, C, H, W] (the root
    walks channels and rows of pixels, the contraction tokens and channels)."""
    x = _h(1, h * w, k)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"]),
        helper.make_node("Add", ["mm", "b"], ["a"]),
        helper.make_node("Reshape", ["a", "shape"], ["r"]),
        helper.make_node("Transpose", ["r"], ["y"], perm=[0, 3, 1, 2]),
    ]
    consts = {"w": _h(k, c), "b": _h(c), "shape": np.array([1, h, w, c], np.int64)}
    return make_model(nodes, {"x": x}, ["y"], consts, opset=17), {"x": x}


def _qkv_heads(tokens: int, k: int, heads: int, dim: int) -> tuple[onnx.ModelProto, dict]:
    """A QKV projection split into heads: [1, T, 3*H*D] -> [3, 1, H, T, D].  With ``dim`` 12
    a head's columns start 12 halves apart: a one-head tile needs 8-byte copies."""
    x = _h(1, tokens, k)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"]),
        helper.make_node("Add", ["mm", "b"], ["a"]),
        helper.make_node("Reshape", ["a", "shape"], ["r"]),
        helper.make_node("Transpose", ["r"], ["y"], perm=[2, 0, 3, 1, 4]),
    ]
    n = 3 * heads * dim
    consts = {"w": _h(k, n), "b": _h(n), "shape": np.array([1, tokens, 3, heads, dim], np.int64)}
    return make_model(nodes, {"x": x}, ["y"], consts, opset=17), {"x": x}


def _residual_layernorm(
    m: int, k: int, n: int, nchw: tuple[int, int] | None = None
) -> tuple[onnx.ModelProto, dict]:
    """A transformer block's output projection: bias, residual add, LayerNorm over the row;
    the residual sum is an output too.  With ``nchw`` = (H, W) the normalised tokens are
    written out as an image [1, N, H, W] instead (and the sum is not an output)."""
    x, res = _h(1, m, k), _h(1, m, n)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"]),
        helper.make_node("Add", ["mm", "b"], ["a"]),
        helper.make_node("Add", ["res", "a"], ["s"]),
        helper.make_node("LayerNormalization", ["s", "gamma", "beta"], ["ln"], axis=-1, epsilon=1e-5),
    ]
    consts = {
        "w": _h(k, n),
        "b": _h(n),
        "gamma": (1 + RNG.standard_normal(n) / 4).astype(np.float16),
        "beta": _h(n),
    }
    outputs = ["ln", "s"]
    if nchw is not None:
        nodes.append(helper.make_node("Reshape", ["ln", "shape"], ["r"]))
        nodes.append(helper.make_node("Transpose", ["r"], ["y"], perm=[0, 3, 1, 2]))
        consts["shape"] = np.array([1, *nchw, n], np.int64)
        outputs = ["y"]
    return make_model(nodes, {"x": x, "res": res}, outputs, consts, opset=17), {"x": x, "res": res}


def _classifier(k: int, n: int) -> tuple[onnx.ModelProto, dict]:
    """A batch-1 classifier: Gemm of one row by a transposed weight, plus bias (M = 1)."""
    x = _h(1, k)
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1)]
    return make_model(nodes, {"x": x}, ["y"], {"w": _h(n, k), "b": _h(n)}, opset=17), {"x": x}


CASES: dict[str, Callable[[], tuple[onnx.ModelProto, dict]]] = {
    "square 64": lambda: _matmul(64, 64, 64),
    "ragged 40x72x48": lambda: _matmul(40, 72, 48),
    "ragged K and N, 4-byte copies": lambda: _matmul(37, 18, 34),
    "rows of 40 and 88 bytes, 8-byte copies": lambda: _matmul(36, 20, 44),
    "large K, several slices": lambda: _matmul(48, 200, 40),
    "A transposed (Gemm)": lambda: _matmul(32, 48, 40, trans_a=True),
    "B transposed (Gemm)": lambda: _matmul(24, 40, 56, trans_b=True),
    "A through a Transpose node": lambda: _transposed_input(32, 72, 48),
    "bias + GELU, product also written": lambda: _bias_gelu(50, 64, 96),
    "bias, residual, ReLU, cast to fp32, ragged": lambda: _epilogue_chain(70, 48, 72),
    "product concatenated after other rows": lambda: _concat_after(96, 72, 64, 64),
    "QK^T + softmax": lambda: _attention_scores(2, 3, 40, 16),
    "broadcast batch": lambda: _broadcast_batch(3, 20, 32, 24),
    "odd N, scalar global stores": lambda: _matmul(24, 40, 33, trans_b=True),
    "odd N under a softmax, scalar tile stores": lambda: _attention_scores(1, 2, 35, 16),
    "tokens written out as NCHW": lambda: _tokens_to_nchw(4, 6, 32, 40),
    "QKV split into heads of 12": lambda: _qkv_heads(20, 32, 2, 12),
    "residual add + LayerNorm, sum also written": lambda: _residual_layernorm(40, 32, 48),
    "residual add + LayerNorm written as NCHW": lambda: _residual_layernorm(24, 32, 48, nchw=(4, 6)),
    "classifier, M = 1": lambda: _classifier(1280, 1000),
}


def copy_width_named(label: str) -> int | None:
    """The cp.async width a case's label says its configs copy at ("..., 8-byte copies")."""
    found = re.search(r"(\d+)-byte copies", label)
    return int(found[1]) if found else None


def _whole_group(graph: Graph) -> Group:
    return make_group(graph, list(graph.nodes))


def _context(graph: Graph, topk: int = 4) -> ScheduleContext:
    return ScheduleContext(
        lambda t: graph.tensor(t).shape, lambda t: graph.tensor(t).dtype, ARCH, Options(topk=topk)
    )


def emulate_configs(
    graph: Graph, group: Group, configs: list[GroupConfig], feeds: dict, launches: int = 1
) -> list[list[dict[str, np.ndarray]]]:
    """The outputs of ``group`` (the whole graph) under each config, emulated ``launches``
    times in a row: per config, per launch, each output (NaN-filled before the launch, so
    an element left unwritten shows)."""
    kernels = [generate_kernel(graph, group, cfg, f"mma_case_{j}") for j, cfg in enumerate(configs)]
    module = compile_kernels(
        model_source(kernels), [k.name for k in kernels], extra_flags=[f"-I{TEMPLATE_DIR}"]
    )
    env = {**graph.constants, **feeds}
    results = []
    for kernel in kernels:
        per_launch = []
        for _ in range(launches):
            outputs, args = {}, []
            for p in kernel.params:
                if p.is_output:
                    outputs[p.tensor] = np.full(p.shape, np.nan, np_dtype(p.dtype))
                    args.append(outputs[p.tensor])
                else:
                    args.append(np.require(env[p.tensor], requirements="C"))
            args += kernel.tensor_maps  # encoded by the emulator over the arrays they name
            module.launch(kernel.name, kernel.grid, kernel.threads, kernel.smem_bytes, args)
            per_launch.append(outputs)
        results.append(per_launch)
    return results


def _run(graph: Graph, group: Group, configs: list[GroupConfig], feeds: dict, launches: int = 1) -> list[str]:
    """Emulate ``group`` (the whole graph) under each config, ``launches`` times in a row
    (state a kernel keeps between launches must not change its result); the failures."""
    reference = graph.run(feeds)
    failures = []
    for cfg, runs in zip(configs, emulate_configs(graph, group, configs, feeds, launches)):
        for launch, outputs in enumerate(runs):
            for name, value in outputs.items():
                err = error_metric(value, reference[name])
                if err > threshold_for("float16"):
                    failures.append(f"{cfg.stages[0]} launch {launch}: {name} error {err:.3e}")
    return failures


@needs_emulator
@pytest.mark.parametrize("label", list(CASES))
def test_tensor_core_stage_matches_the_interpreter(label: str) -> None:
    model, feeds = CASES[label]()
    graph = import_onnx(model)
    group = _whole_group(graph)
    configs = mma.KIND.propose(group, _context(graph))
    assert configs, f"{label}: the tensor-core rule proposed nothing"
    assert all(isinstance(c.stages[0], MmaConfig) for c in configs)
    width = copy_width_named(label)
    if width:
        assert {c.stages[0].copy_bytes for c in configs} == {width}
    assert _run(graph, group, configs, feeds) == []


RESHAPED_ROOTS = (
    "tokens written out as NCHW",
    "QKV split into heads of 12",
    "residual add + LayerNorm written as NCHW",
)


@needs_emulator
@pytest.mark.parametrize("label", RESHAPED_ROOTS)
def test_reshaped_roots_under_every_block_tile(label: str) -> None:
    """Products whose root reshapes and transposes the tile: each block tile places the root
    differently (whole rows of pixels, one head or two), so the best unsplit config of every
    block tile and copy width is emulated; a one-head tile of 12 columns needs 8-byte copies."""
    model, feeds = CASES[label]()
    graph = import_onnx(model)
    group = _whole_group(graph)
    con = contraction(group.computes[group.stages[0]], lambda t: graph.tensor(t).shape)
    assert graph.tensor(group.root).shape != con.compute.shape
    best: dict[tuple, GroupConfig] = {}
    for cfg in mma.KIND.propose(group, _context(graph, topk=500)):
        if cfg.stages[0].splits == 1:
            best.setdefault((cfg.stages[0].block, cfg.stages[0].copy_bytes), cfg)
    configs = list(best.values())
    assert len({c.block_tile for c in configs}) >= 2
    if label.startswith("QKV"):
        assert {c.stages[0].copy_bytes for c in configs} == {8, 16}
    assert _run(graph, group, configs, feeds) == []


SPLIT_CASES: dict[str, Callable[[], tuple[onnx.ModelProto, dict]]] = {
    "K of 7 slices, the last split shorter": lambda: _matmul(48, 200, 40),
    "ragged K, 4-byte copies": lambda: _matmul(37, 230, 34),
    "B transposed": lambda: _matmul(24, 160, 56, trans_b=True),
    "bias and GELU on the reduced accumulators": lambda: _bias_gelu(50, 160, 96),
    "batched QK^T + softmax": lambda: _attention_scores(2, 2, 24, 96),
}


@needs_emulator
@pytest.mark.parametrize("label", list(SPLIT_CASES))
def test_split_k_matches_the_interpreter(label: str) -> None:
    """Every split-K factor the policy allows for the proposed tiles, launched twice: the
    second launch finds the arrival counters the first one reset."""
    model, feeds = SPLIT_CASES[label]()
    graph = import_onnx(model)
    group = _whole_group(graph)
    ctx = _context(graph, topk=200)
    unsplit = {}  # the best unsplit config of each slice depth
    for cfg in mma.KIND.propose(group, ctx):
        if cfg.stages[0].splits == 1:
            unsplit.setdefault(cfg.stages[0].block_k, cfg)
    configs, uneven = [], False
    for cfg in unsplit.values():
        st = cfg.stages[0]
        con = contraction(group.computes[st.node], ctx.shape_of)
        k_tiles = -(-con.k_extent // st.block_k)
        for splits in mma.split_choices(con, st, cfg.num_blocks, ctx):
            configs.append(replace(cfg, stages=[replace(st, splits=splits), *cfg.stages[1:]]))
            uneven |= k_tiles % splits != 0
    assert len({c.stages[0].splits for c in configs}) >= 2, f"{label}: too few split-K factors to test"
    assert uneven, f"{label}: no split leaves the last block fewer slices"
    assert _run(graph, group, configs, feeds, launches=2) == []


@needs_emulator
def test_both_copy_loops_match_the_interpreter() -> None:
    """Operand copies with addresses set up once per thread (a thread's rows one step
    apart) and copies dealt out one by one (a 1-warp block whose 4-byte copies make a
    128-deep row longer than the warp) -- for A and for B."""
    model, feeds = _matmul(37, 302, 34, trans_b=True)  # rows of 604 bytes: 4-byte copies
    graph = import_onnx(model)
    group = _whole_group(graph)
    configs, seen = [], set()
    for cfg in mma.KIND.propose(group, _context(graph, topk=400)):
        source = generate_kernel(graph, group, cfg, "probe").source
        paths = ("a_row0" in source, "b_row0" in source, source.count("for (int c = tid;"))
        if paths not in seen:
            seen.add(paths)
            configs.append(cfg)
    assert {p[0] for p in seen} == {True, False} and {p[1] for p in seen} == {True, False}
    assert _run(graph, group, configs, feeds) == []


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_the_sum_over_the_splits_is_a_loop_not_straight_line_code() -> None:
    """One config split 2 and 16 ways: nvcc's instruction counts differ by less than four
    instructions an accumulator.  Unrolled whole, the last block's sum took a load, a select
    and an add an accumulator for every split (2,000 more instructions at 16 splits here),
    code a run fetches cold (docs/codegen.md)."""
    graph = import_onnx(_matmul(128, 3072, 768)[0])
    group = _whole_group(graph)
    cfg = next(c for c in mma.KIND.propose(group, _context(graph, topk=8)) if c.stages[0].splits > 1)
    counts = {}
    for splits in (2, 16):
        split = replace(cfg, stages=[replace(cfg.stages[0], splits=splits), *cfg.stages[1:]])
        kernel = generate_kernel(graph, group, split, f"k{splits}")
        counts[splits] = text_instructions(compile_cubin(kernel.source, "sm_90"))[kernel.name]
    accumulators = math.prod(cfg.block_tile) // cfg.threads
    assert counts[16] - counts[2] < 4 * accumulators, counts


def test_split_k_is_proposed_where_tiles_leave_sms_idle() -> None:
    """A weight-streaming product (128 rows, long K) gets split-K among its best configs on
    the H100; a product with more tiles than SMs never does."""
    few = import_onnx(_matmul(128, 3072, 768)[0])
    best = mma.KIND.propose(_whole_group(few), _context(few, topk=8))
    assert best[0].stages[0].splits > 1
    assert all(c.num_blocks < ARCH.sm_count for c in best if c.stages[0].splits > 1)
    many = import_onnx(_matmul(2048, 256, 2048)[0])
    configs = mma.KIND.propose(_whole_group(many), _context(many, topk=500))
    assert configs and all(c.stages[0].splits == 1 for c in configs if c.num_blocks >= ARCH.sm_count)


def test_contraction_reads_strides_and_contiguity_from_the_ir() -> None:
    """Operand roles and strides, against the layouts numpy gives the same tensors."""
    graph = import_onnx(_matmul(24, 40, 56, trans_b=True)[0])
    group = _whole_group(graph)
    con = contraction(group.computes[group.stages[0]], lambda t: graph.tensor(t).shape)
    assert con is not None
    assert (con.m, con.n, con.k_extent) == (24, 56, 40)
    w = np.empty((56, 40), np.float16)  # B stored N x K: K runs contiguously
    x = np.empty((24, 40), np.float16)
    assert con.b.contiguous == "k" and con.stride(con.b, "n") == w.strides[0] // 2
    assert con.a.contiguous == "k" and con.stride(con.a, "m") == x.strides[0] // 2
    assert con.copy_bytes() == 16


@needs_emulator
def test_an_operand_no_aligned_copy_reaches_is_gathered_and_matches() -> None:
    """A's rows 33 halves apart leave no 4- or 16-byte copy width: A is gathered element by
    element, as a convolution's image is, and every config still matches the interpreter."""
    model, feeds = _matmul(33, 40, 80, trans_a=True)
    graph = import_onnx(model)
    group = _whole_group(graph)
    con = contraction(group.computes[group.stages[0]], lambda t: graph.tensor(t).shape)
    assert con is not None and con.gathered is con.a and con.b.tensor == "w"
    configs = mma.KIND.propose(group, _context(graph, topk=4))
    assert configs
    assert _run(graph, group, configs, feeds) == []


@needs_emulator
@pytest.mark.parametrize("fixed", [True, False], ids=["one column a thread", "a column a pair"])
def test_a_gathered_operand_matches_with_or_without_one_column_a_thread(monkeypatch, fixed: bool) -> None:
    """Where a block's threads are a whole number of a slice row's pairs (every config of
    the tiles offered today), each thread keeps one column for all its pairs, set once so
    that nvcc shares its index arithmetic; elsewhere the column follows the pair (forced
    here).  Both match the interpreter, for the mma and the wgmma kind."""
    from welder.codegen import generate_kernel
    from welder.codegen import mma as mma_codegen
    from welder.schedule.kinds import wgmma

    if not fixed:
        monkeypatch.setattr(mma_codegen, "pair_rows", lambda threads, cols: 0)
        monkeypatch.setattr("welder.codegen.wgmma.pair_rows", lambda threads, cols: 0)
    model, feeds = _matmul(33, 40, 80, trans_a=True)
    graph = import_onnx(model)
    group = _whole_group(graph)
    for kind in (mma.KIND, wgmma.KIND):
        configs = kind.propose(group, _context(graph, topk=3))
        assert configs
        for cfg in configs:
            source = generate_kernel(graph, group, cfg, "k").source
            assert ("row = row0 + j *" in source) == fixed and ("row = e /" in source) != fixed
        assert _run(graph, group, configs, feeds) == []


def rolled_product(dtype: type, batch: int = 2, m: int = 40, k: int = 64, n: int = 48, shift: int = 3):
    """``roll(x, -shift, axis=1) @ w`` as Swin exports its shifted windows: a Concat of two
    Slices, which A reads through ``select(m < M - shift, x[m + shift], x[m - M + shift])``."""
    rng = np.random.default_rng(21)
    x = rng.standard_normal((batch, m, k)).astype(dtype)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(dtype)
    ints = {name: np.array([v], np.int64) for name, v in (("s", shift), ("e", m), ("z", 0), ("ax", 1))}
    nodes = [
        helper.make_node("Slice", ["x", "s", "e", "ax"], ["tail"]),
        helper.make_node("Slice", ["x", "z", "s", "ax"], ["head"]),
        helper.make_node("Concat", ["tail", "head"], ["rolled"], axis=1),
        helper.make_node("MatMul", ["rolled", "w"], ["y"]),
    ]
    return make_model(nodes, {"x": x}, ["y"], {"w": w, **ints}, opset=17), {"x": x}


def window_product(dtype: type, side: int = 8, window: int = 4, k: int = 32, n: int = 48):
    """Swin's window partition then its QKV product: ``x`` of ``[1, side, side, k]`` cut into
    windows of ``window x window`` tokens (Reshape, Transpose, Reshape), times ``w``; A reads
    token ``(i0 // w^2, i0 % w^2)`` of the windows through ``//`` and ``%``, K its last axis."""
    rng = np.random.default_rng(22)
    x = rng.standard_normal((1, side, side, k)).astype(dtype)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(dtype)
    tiles = side // window
    shapes = {
        "s1": np.array([1, tiles, window, tiles, window, k], np.int64),
        "s2": np.array([-1, k], np.int64),
    }
    nodes = [
        helper.make_node("Reshape", ["x", "s1"], ["cut"]),
        helper.make_node("Transpose", ["cut"], ["win"], perm=[0, 1, 3, 2, 4, 5]),
        helper.make_node("Reshape", ["win", "s2"], ["tokens"]),
        helper.make_node("MatMul", ["tokens", "w"], ["y"]),
    ]
    return make_model(nodes, {"x": x}, ["y"], {"w": w, **shapes}, opset=17), {"x": x}


@needs_emulator
@pytest.mark.parametrize("kind", ["mma", "wgmma"])
@pytest.mark.parametrize("product", [rolled_product, window_product])
def test_a_rolled_operand_is_gathered_and_matches(kind: str, product) -> None:
    """A read through a roll (two loads of one tensor under a select) or a window partition
    (``//`` and ``%`` of the token), K the last axis, gathers whole rows: each row's slices
    are copied with cp.async from a start worked out once per block, not element by
    element, and the product with the gather fused in front matches the interpreter under
    each config."""
    from welder.schedule.kinds import wgmma

    model, feeds = product(np.float16)
    graph = import_onnx(model)
    group = _whole_group(graph)
    con = contraction(group.computes[group.stages[0]], lambda t: graph.tensor(t).shape)
    assert con is not None and con.gathered is None and con.gathered_rows is con.a and con.a.tensor == "x"
    configs = {"mma": mma.KIND, "wgmma": wgmma.KIND}[kind].propose(group, _context(graph, topk=4))
    assert configs and all(cfg.stages[0].kind == kind for cfg in configs)
    source = generate_kernel(graph, group, configs[0], "k").source
    assert "a_starts[j]" in source and "a_gather" not in source
    assert _run(graph, group, configs, feeds) == []


def test_contraction_refuses_what_tensor_cores_cannot_compute() -> None:
    fp32 = make_model(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        {"x": np.ones((16, 16), np.float32)},
        ["y"],
        {"w": np.ones((16, 16), np.float32)},
        opset=17,
    )
    square = make_model(
        [helper.make_node("ReduceSumSquare", ["x"], ["y"], keepdims=0)],
        {"x": np.ones((16, 16), np.float16)},
        ["y"],
        {},
        opset=17,
    )
    for model in (fp32, square):
        graph = import_onnx(model)
        group = _whole_group(graph)
        assert mma.KIND.propose(group, _context(graph)) is None
    graph = import_onnx(_matmul(64, 64, 64)[0])  # what works on an H100 has no m16n8k16 on a V100
    volta = ScheduleContext(
        lambda t: graph.tensor(t).shape, lambda t: graph.tensor(t).dtype, get_arch("V100"), Options(topk=4)
    )
    assert mma.KIND.propose(_whole_group(graph), volta) is None


def test_explain_names_the_check_that_rejects_each_tile() -> None:
    """``explain`` walks the rule's own search: for a batch-1 classifier every tile of 32 or
    more rows is padding and the 16-row tiles carry exactly the configs ``propose`` ranks; a
    root that flattens the product (``b // 40`` rows per block) is refused at the root tile."""
    graph = import_onnx(_classifier(1280, 1000)[0])
    group = _whole_group(graph)
    ctx = _context(graph, topk=1000)
    verdicts = mma.KIND.explain(group, ctx)
    for v in verdicts:
        if v.block[0] >= 32:
            assert v.reason is not None and v.reason.startswith("padding") and not v.configs
    ranked = [c for v in verdicts for c in v.configs]
    assert ranked and all(c.stages[0].block_m == 16 for c in ranked)
    assert len(mma.KIND.propose(group, ctx)) == len(ranked)

    x = _h(1, 24, 32)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"]),
        helper.make_node("Reshape", ["mm", "shape"], ["r"]),
        helper.make_node("Sigmoid", ["r"], ["y"]),
    ]
    consts = {"w": _h(32, 40), "shape": np.array([1, 960], np.int64)}
    graph = import_onnx(make_model(nodes, {"x": x}, ["y"], consts, opset=17))
    group = _whole_group(graph)
    verdicts = mma.KIND.explain(group, _context(graph))
    assert verdicts and all(not v.configs for v in verdicts)
    assert any("not affine" in v.reason for v in verdicts)
    assert mma.KIND.propose(group, _context(graph)) == []


def test_configs_respect_the_arch() -> None:
    """Shared memory from the views the kernels declare, registers, threads, whole warps."""
    graph = import_onnx(_bias_gelu(200, 256, 384)[0])
    group = _whole_group(graph)
    configs = mma.KIND.propose(group, _context(graph, topk=50))
    assert configs
    for cfg in configs:
        st = cfg.stages[0]
        assert isinstance(st, MmaConfig)
        # Every shared view the rendered kernel declares lies inside the pool, 16-byte aligned
        # where cp.async writes, and the operand ring overlaps no other view.
        builder = KernelBuilder(graph, group, cfg, "k")
        builder.render()
        size = {"__half": 2, "float": 4, "int": 4, "long long": 8, "double": 8}
        views = {v["name"]: (v["offset"], v["offset"] + v["count"] * size[v["ctype"]]) for v in builder.views}
        assert all(end <= cfg.smem_bytes for _, end in views.values())
        ring = [span for name, span in views.items() if name.startswith("mma0_")]
        assert len(ring) == 2 and all(start % 16 == 0 for start, _ in ring)
        # The contraction's own tile is written while the ring is live; later stages'
        # buffers may take the ring's place (checked in the test below).
        if "tile0" in views:
            start, end = views["tile0"]
            assert all(end <= r0 or start >= r1 for r0, r1 in ring)
        assert cfg.smem_bytes <= ARCH.smem_per_block
        assert cfg.threads == st.warps[0] * st.warps[1] * 32 <= ARCH.max_threads_per_block
        assert (st.block_m // st.warps[0]) % 16 == 0 and (st.block_n // st.warps[1]) % 16 == 0
        assert st.tile[-2] <= st.block_m and st.tile[-1] <= st.block_n
        assert cfg.estimate.regs_per_thread <= ARCH.max_regs_per_thread


@needs_emulator
def test_later_stages_reuse_the_operand_ring() -> None:
    """A softmax after QK^T whose buffers fit where the operand ring was: shared memory is
    the larger of the two phases, not their sum, and the kernel still computes the right
    thing (the barrier after the contraction orders the ring's reads before the reuse)."""
    model, feeds = _attention_scores(1, 2, 64, 64)
    graph = import_onnx(model)
    group = _whole_group(graph)
    configs = []
    for cfg in mma.KIND.propose(group, _context(graph, topk=100)):
        builder = KernelBuilder(graph, group, cfg, "k")
        builder.render()
        size = {"__half": 2, "float": 4, "int": 4, "long long": 8, "double": 8}
        spans = {v["name"]: (v["offset"], v["offset"] + v["count"] * size[v["ctype"]]) for v in builder.views}
        ring = [span for name, span in spans.items() if name.startswith("mma0_")]
        later = [span for name, span in spans.items() if not name.startswith("mma0_") and name != "tile0"]
        if any(s < r1 and e > r0 for s, e in later for r0, r1 in ring):
            configs.append(cfg)
    assert configs, "no config puts a later stage's buffer where the ring was"
    assert _run(graph, group, configs[:4], feeds) == []


def test_the_search_prefers_tensor_cores_for_large_products_and_can_be_told_not_to() -> None:
    graph = import_onnx(_matmul(512, 768, 768)[0])
    group = _whole_group(graph)
    best = propose(group, _context(graph))[0]
    assert best.stages[0].kind in TENSOR_CORE_KINDS
    simt_only = ScheduleContext(
        lambda t: graph.tensor(t).shape,
        lambda t: graph.tensor(t).dtype,
        ARCH,
        Options(topk=4, kinds=("simt",)),
    )
    assert all(c.stages[0].kind == "simt" for c in propose(group, simt_only))
    plan = plan_model(graph, ARCH, topk=2)
    assert plan.groups[0].configs[0].stages[0].kind in TENSOR_CORE_KINDS


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_generated_kernels_compile_to_tensor_core_instructions(tmp_path) -> None:
    """nvcc builds the kernels for sm_80 and sm_90 without warnings, and their PTX holds the
    instructions the template means: mma.sync, ldmatrix (plain and .trans), cp.async."""
    kernels = []
    for j, label in enumerate(("ragged 40x72x48", "A through a Transpose node", "QK^T + softmax")):
        graph = import_onnx(CASES[label]()[0])
        group = _whole_group(graph)
        cfg = mma.KIND.propose(group, _context(graph))[0]
        kernels.append(generate_kernel(graph, group, cfg, f"mma_ptx_{j}"))
    graph = import_onnx(_matmul(128, 3072, 768)[0])
    group = _whole_group(graph)
    split = next(c for c in mma.KIND.propose(group, _context(graph, topk=50)) if c.stages[0].splits > 1)
    kernels.append(generate_kernel(graph, group, split, "mma_ptx_split"))
    source = tmp_path / "kernels.cu"
    source.write_text(model_source(kernels))
    for sm in ("sm_80", "sm_90"):
        ptx = tmp_path / f"{sm}.ptx"
        subprocess.run(
            [
                "nvcc",
                "-std=c++17",
                f"-arch={sm}",
                "-Werror",
                "all-warnings",
                "-I",
                str(TEMPLATE_DIR),
                "-ptx",
                str(source),
                "-o",
                str(ptx),
            ],
            check=True,
            capture_output=True,
        )
        text = ptx.read_text()
        assert len(re.findall(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.f16\.f16\.f32", text)) > 0
        assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in text
        assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in text
        assert "cp.async.cg.shared.global" in text and "cp.async.wait_group" in text
        # split-K: partials stored and read back through L2, one atomic arrival per block
        assert "st.global.cg.f32" in text and "ld.global.cg.f32" in text and "atom.global.add.u32" in text


def test_tune_uses_tensor_cores_unless_told_not_to(tmp_path) -> None:
    """``welder tune`` (cost model) puts the product of an fp16 model on tensor cores; with
    ``--no-tc`` no stage of any group is an mma stage, and no kernel holds mma.sync."""
    import json

    from welder.cli import main

    model, _ = _bias_gelu(512, 768, 768)
    kinds = {}
    for flags in ([], ["--no-tc"]):
        prefix = tmp_path / ("no_tc" if flags else "tc")
        prefix.mkdir()
        onnx.save(model, str(prefix / "model.onnx"))
        argv = ["tune", str(prefix), "--arch", "H100", "--cost-model", "--topk", "2", "--no-build", *flags]
        assert main(argv) == 0
        doc = json.loads((prefix / "tuned.json").read_text())
        kinds[bool(flags)] = {st["kind"] for g in doc["groups"] for st in g["configs"][0]["stages"]}
        sources = "".join(g["kernel"]["source"] for g in doc["groups"])
        on_tensor_cores = "welder_mma_m16n8k16_f16f32(" in sources or "welder_wgmma_m64k16_f16f32<" in sources
        assert on_tensor_cores == (not flags)
    assert kinds[False] & TENSOR_CORE_KINDS
    assert kinds[True] == {"simt"}
