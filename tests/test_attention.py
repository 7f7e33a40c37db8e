"""The ``attention`` kernel kind: two fp16 products joined by a softmax, in one kernel.

Each case is one layer's attention as the models export it (``scripts/attention_bench.py``
builds them): BERT's with an additive mask, ViT's with 50 tokens (ragged rows and keys),
Swin's windows of 49 tokens with a relative-position bias per head, and a sequence longer
than a block holds (300 keys: the online softmax, in chunks).  Every config the
rule proposes is rendered, run on the CPU emulator and compared with the interpreter.
Besides: the rule recognises the structure whatever the ops are called and refuses what
it cannot compute; the fusion search finds the group in a graph where greedy growth
would hand the scores to the projection before them; the tuner's check inputs keep
scores of unit variance.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper
from onnx_util import make_model
from test_mma import _context, _matmul, emulate_configs, needs_emulator

from welder.arch import get_arch
from welder.check import error_metric, threshold_for
from welder.codegen import generate_kernel, model_source
from welder.device.cubin import text_instructions
from welder.device.gpu import compile_cubin
from welder.frontend.onnx import import_onnx
from welder.resources import TEMPLATE_DIR
from welder.schedule.engine import CostModel, fuse
from welder.schedule.group import make_group
from welder.schedule.kinds import attention, config_from_json, mma
from welder.schedule.kinds.attention import AttentionConfig, AttentionFfmaConfig
from welder.tune.measure import group_inputs

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from attention_bench import Case, attention_model

CASES = {
    "bert: mask, 40 tokens": Case(2, 2, 40, 64, "mask"),
    "bert: mask, 128 tokens": Case(1, 2, 128, 64, "mask"),
    "vit: 50 tokens": Case(2, 3, 50, 64, "none"),
    "swin: windows of 49, relative bias": Case(3, 3, 49, 32, "relative"),
    "bert: mask, 300 tokens (online softmax)": Case(1, 1, 300, 64, "mask"),
}


def _feeds(graph, seed: int = 0, dtype: type = np.float16) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for t in graph.inputs:
        if t.name == "bias":
            feeds[t.name] = np.where(rng.random(t.shape) < 0.8, 0.0, -10000.0).astype(dtype)
        else:
            feeds[t.name] = (rng.standard_normal(t.shape) * 0.5).astype(dtype)
    return feeds


@needs_emulator
@pytest.mark.parametrize("label", list(CASES))
def test_attention_matches_the_interpreter(label: str) -> None:
    graph = import_onnx(attention_model(CASES[label]))
    group = make_group(graph, list(graph.nodes))
    configs = attention.KIND.propose(group, _context(graph, topk=8))
    assert configs, f"{label}: the attention rule proposed nothing"
    assert all(isinstance(c.stages[0], AttentionConfig) for c in configs)
    if CASES[label].tokens > attention.MAX_KEYS:  # only in chunks; shorter softmaxes both ways
        assert all(c.stages[0].chunk > 0 for c in configs)
    _assert_matches(graph, group, configs)


def _assert_matches(graph, group, configs) -> None:
    """Every config, launched twice on the emulator, within fp16's threshold of the interpreter."""
    feeds = _feeds(graph)
    reference = graph.run(feeds)["y"]
    for cfg, runs in zip(configs, emulate_configs(graph, group, configs, feeds, launches=2)):
        for launch, outputs in enumerate(runs):
            err = error_metric(outputs["y"], reference)
            assert err <= threshold_for("float16"), f"{cfg.stages[0]} launch {launch}: error {err:.3e}"


def _through_a_split(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with q, k and v read as thirds of one input's last axis: what the attention
    group sees once the import has merged the three projections into one product."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    q = next(i for i in g.input if i.name == "q")
    dims = [d.dim_value for d in q.type.tensor_type.shape.dim]
    elem = q.type.tensor_type.elem_type
    kept = [i for i in g.input if i.name not in ("q", "k", "v")]
    del g.input[:]
    g.input.extend([helper.make_tensor_value_info("qkv", elem, [*dims[:-1], 3 * dims[-1]]), *kept])
    g.node.insert(0, helper.make_node("Split", ["qkv"], ["q", "k", "v"], axis=-1, num_outputs=3))
    out.opset_import[0].version = 18
    return out


@needs_emulator
@pytest.mark.parametrize("label", ["bert: mask, 40 tokens", "vit: 50 tokens"])
def test_attention_reads_its_operands_through_a_split(label: str) -> None:
    """Queries, keys and values as thirds of one tensor (rows three heads' widths apart): the
    kernel's loads take the Split's offsets and row stride, and every config still matches."""
    graph = import_onnx(_through_a_split(attention_model(CASES[label])))
    assert "Split" in {n.op_type for n in graph}
    group = make_group(graph, list(graph.nodes))
    configs = attention.KIND.propose(group, _context(graph, topk=4))
    assert configs, f"{label}: the attention rule proposed nothing through the Split"
    _assert_matches(graph, group, configs)


@needs_emulator
@pytest.mark.parametrize("label", ["bert: mask, 128 tokens", "bert: mask, 300 tokens (online softmax)"])
def test_keys_split_across_warps_match_the_interpreter(label: str) -> None:
    """Few rows make few warps, so the rule also offers warps that share each ring slot's
    keys (``splits``), combining their rows' maxima, sums and ``O`` at the end: two and four
    of them, against the interpreter (the emulator checks the combine's shared memory for
    races too)."""
    graph = import_onnx(attention_model(CASES[label]))
    group = make_group(graph, list(graph.nodes))
    configs = attention.KIND.propose(group, _context(graph, topk=64))
    split = [c for c in configs if c.stages[0].key_splits > 1]
    assert {c.stages[0].key_splits for c in split} == set(attention.SPLITS), label
    assert all(c.stages[0].family == "attention/split" and c.stages[0].chunk for c in split)
    assert all(c.threads == 32 * c.stages[0].warps * c.stages[0].key_splits for c in split)
    chosen = [
        min(split, key=lambda c: (c.stages[0].key_splits != n, c.estimate.latency_us))
        for n in attention.SPLITS
    ]
    _assert_matches(graph, group, chosen)


#: The one-pass cases a persistent block walks (the 300-key one runs in chunks only).
ONE_PASS = [label for label, case in CASES.items() if case.tokens <= attention.MAX_KEYS]


@needs_emulator
@pytest.mark.parametrize("label", [*ONE_PASS, "transposed operands, O the output"])
def test_persistent_blocks_match_the_interpreter(label: str) -> None:
    """Two blocks walk every tile, each copying its next tile's Q, K and V into the other
    ring slot while it multiplies this one's (4 to 36 tiles: each block takes several, an
    odd count leaves one block a tile more, ragged rows and windows included, and ``O`` as
    the group's output, where no later stage's barrier orders the slot's reuse)."""
    if label in CASES:
        model = attention_model(CASES[label])
    else:
        model = _transposed_operands(elem=onnx.TensorProto.FLOAT16)
    graph = import_onnx(model)
    group = make_group(graph, list(graph.nodes))
    configs = attention.persistent_configs(group, _context(graph, topk=8), resident=2)
    by_warps = {c.stages[0].warps: c for c in configs}  # one store form a block size
    assert len(by_warps) >= 2, label
    for cfg in by_warps.values():
        st = cfg.stages[0]
        assert st.persistent == 2 and st.family == "attention/persistent"
        assert cfg.num_blocks >= attention.MIN_TILES_PER_BLOCK * st.persistent
        kernel = generate_kernel(graph, group, cfg, "probe")
        assert kernel.grid == st.persistent, (kernel.grid, st)
    _assert_matches(graph, group, list(by_warps.values()))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_attention_kernels_compile_without_warnings(tmp_path) -> None:
    """nvcc builds BERT's attention kernels, one block a tile and persistent, for sm_90 with
    every warning an error: a row stage's row and key indices are declared for the
    expressions that may read them, and an unused one must not warn."""
    graph = import_onnx(attention_model(CASES["bert: mask, 128 tokens"]))
    group = make_group(graph, list(graph.nodes))
    context = _context(graph, topk=4)
    configs = [*attention.KIND.propose(group, context), *attention.persistent_configs(group, context, 2)[:2]]
    kernels = [generate_kernel(graph, group, c, f"att_warn{i}") for i, c in enumerate(configs)]
    source = tmp_path / "kernels.cu"
    source.write_text(model_source(kernels))
    command = ["nvcc", "-std=c++17", "-arch=sm_90", "-Werror", "all-warnings", "-I", str(TEMPLATE_DIR)]
    done = subprocess.run(
        [*command, "-ptx", str(source), "-o", str(tmp_path / "k.ptx")], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_persistent_blocks_are_offered_where_tiles_outnumber_the_blocks_twice() -> None:
    """BERT-base's attention at batch 64 (1,536 tiles of 64 rows) gets persistent twins of
    its one-pass configs, as many blocks as fit the SMs and never fewer than eight warps
    an SM (its 1- and 2-warp twins leave two or four), a family of their own that the
    tuner measures beside the rest; a batch of one (24 tiles) gets none."""
    for batch, offered in ((64, True), (1, False)):
        graph = import_onnx(attention_model(Case(batch, 12, 128, 64, "mask")))
        group = make_group(graph, list(graph.nodes))
        context = _context(graph, topk=20)
        configs = attention.KIND.propose(group, context)
        persistent = [c for c in configs if c.stages[0].persistent]
        assert bool(persistent) == offered, batch
        if offered:
            assert {c.stages[0].warps for c in persistent} == {4, 8}
        att = attention.attention(group, context.shape_of)
        assert att is not None
        for c in persistent:
            st = c.stages[0]
            assert st.chunk == 0 and st.key_splits == 1 and st.family == "attention/persistent"
            assert st.persistent == c.estimate.blocks_per_sm * context.arch.sm_count
            assert c.estimate.blocks_per_sm * st.warps >= 8
            assert c.smem_bytes <= context.arch.smem_per_block
            # Q, K and V in two slots each: twice the one-slot config's operands.
            alone = attention.operand_bytes(att, st.warps)
            assert attention.operand_bytes(att, st.warps, persistent=True) == 2 * alone


def test_kernels_launch_the_blocks_their_estimates_priced() -> None:
    """Warps splitting keys are warps of one block, and split-K is blocks of one tile: a
    kernel launches the blocks its config's estimate counted.  Until the attention field
    was named ``key_splits`` the kernel builder read it as split-K's ``splits`` and
    launched a block per split, each computing the whole tile -- outputs right, work
    doubled or quadrupled, which no comparison of outputs shows.  The builder now asks
    each stage's ``blocks_per_tile``."""
    graph = import_onnx(attention_model(CASES["bert: mask, 128 tokens"]))
    group = make_group(graph, list(graph.nodes))
    split = [c for c in attention.KIND.propose(group, _context(graph, topk=64)) if c.stages[0].key_splits > 1]
    model, _ = _matmul(24, 600, 40)
    product = import_onnx(model)
    split_k = [
        c
        for c in mma.KIND.propose(make_group(product, list(product.nodes)), _context(product, topk=50))
        if c.stages[0].splits > 1
    ]
    assert split and split_k
    for g, configs in ((graph, split), (product, split_k)):
        for cfg in configs:
            kernel = generate_kernel(g, make_group(g, list(g.nodes)), cfg, "probe")
            assert kernel.grid == cfg.estimate.blocks, (cfg.stages[0], kernel.grid)
    assert any(c.estimate.blocks > c.num_blocks for c in split_k)


def test_tuned_files_of_the_old_field_name_still_read() -> None:
    """tuned.json files of search version 12 name ``key_splits`` ``splits``: read back, a
    config keeps its split keys (and launches one block a tile)."""
    graph = import_onnx(attention_model(CASES["bert: mask, 128 tokens"]))
    group = make_group(graph, list(graph.nodes))
    cfg = next(
        c for c in attention.KIND.propose(group, _context(graph, topk=64)) if c.stages[0].key_splits > 1
    )
    old = cfg.to_json()
    old["stages"][0]["splits"] = old["stages"][0].pop("key_splits")
    read = config_from_json(old)
    assert read.stages[0] == cfg.stages[0] and read.stages[0].blocks_per_tile == 1


def test_keys_are_split_only_where_the_rows_make_few_warps() -> None:
    """At batch 1 BERT's 128 rows of 2 heads are a few warps: split keys are offered; at
    batch 64 (1,536 blocks of rows) they are not."""
    for batch, expected in ((1, True), (64, False)):
        graph = import_onnx(attention_model(Case(batch, 12, 128, 64, "mask")))
        group = make_group(graph, list(graph.nodes))
        configs = attention.KIND.propose(group, _context(graph, topk=64))
        assert any(c.stages[0].key_splits > 1 for c in configs) == expected, batch


def _transposed_operands(tokens: int = 24, width: int = 16, elem: int = onnx.TensorProto.FLOAT) -> tuple:
    """Attention whose Q, K and V come in ``[batch, head, width, token]`` (tokens
    contiguous): Q's rows and V's columns run along the product's K, K's along its N -- the
    operand layouts that models' exports leave untested.  ``O`` is the output: no stage
    follows the attention."""
    shape = [2, 2, width, tokens]
    nodes = [
        helper.make_node("Transpose", ["q"], ["qt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["qt", "k"], ["s"]),
        helper.make_node("Softmax", ["s"], ["p"], axis=-1),
        helper.make_node("Transpose", ["v"], ["vt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["p", "vt"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "transposed",
        [helper.make_tensor_value_info(x, elem, shape) for x in ("q", "k", "v")],
        [helper.make_tensor_value_info("y", elem, [2, 2, tokens, width])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


FP32_CASES = {
    **{label: lambda case=case: attention_model(case, dtype=np.float32) for label, case in CASES.items()},
    "mobilevit: 256 keys, head 36": lambda: attention_model(Case(1, 1, 256, 36, "none"), dtype=np.float32),
    "transposed operands": _transposed_operands,
}


@needs_emulator
@pytest.mark.parametrize("label", list(FP32_CASES))
def test_fp32_attention_is_exact_on_ffma(label: str) -> None:
    """The ``attention_ffma`` kind: the same kernel with both products as FMAs, every config
    within fp32's threshold of the interpreter (TF32 operands would miss it by far)."""
    graph = import_onnx(FP32_CASES[label]())
    group = make_group(graph, list(graph.nodes))
    assert attention.KIND.propose(group, _context(graph, topk=8)) is None  # fp16 and bf16 only
    configs = attention.FFMA_KIND.propose(group, _context(graph, topk=8))
    assert configs, f"{label}: the attention_ffma rule proposed nothing"
    assert all(isinstance(c.stages[0], AttentionFfmaConfig) for c in configs)
    feeds = _feeds(graph, dtype=np.float32)
    reference = graph.run(feeds)["y"]
    for cfg, runs in zip(configs, emulate_configs(graph, group, configs, feeds, launches=2)):
        for launch, outputs in enumerate(runs):
            err = error_metric(outputs["y"], reference)
            assert err <= 1e-5 < threshold_for("float32"), f"{cfg.stages[0]} launch {launch}: error {err:.3e}"


#: Instructions an exact-fp32 attention kernel of ViT-S/32's heads (50 keys, 64 wide) may
#: hold: half of the 7,304 its largest config held fully unrolled.  Its code runs once in each
#: of 6 blocks; ViT's kernel of 6,352 spent 56% of its cycles waiting on instruction fetch in
#: a run, where the kernels before it had taken the SMs' instruction caches (ncu), and took
#: 24 us there against 10.4 us launched alone.
FFMA_ATTENTION_INSTRUCTIONS = 3652


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_fp32_attention_code_stays_small_enough_to_run_from_a_cold_instruction_cache() -> None:
    """The head loop of S and each piece's key loop of O stay rolled: every config of ViT's
    attention compiles to at most FFMA_ATTENTION_INSTRUCTIONS instructions for sm_90."""
    graph = import_onnx(attention_model(Case(1, 6, 50, 64, "none"), dtype=np.float32))
    group = make_group(graph, list(graph.nodes))
    configs = attention.FFMA_KIND.propose(group, _context(graph, topk=4))
    assert configs
    kernels = [generate_kernel(graph, group, cfg, f"att_probe{i}") for i, cfg in enumerate(configs)]
    sizes = text_instructions(compile_cubin([k.source for k in kernels], "sm_90"))
    assert sorted(sizes) == sorted(k.name for k in kernels)
    assert max(sizes.values()) <= FFMA_ATTENTION_INSTRUCTIONS, sizes


def test_the_rule_reads_structure_not_names() -> None:
    """Scores, row reductions and a product with V: found with the stages' own names, the
    row stages in order, V's strides read from the IR (heads split from tokens)."""
    graph = import_onnx(attention_model(Case(2, 3, 50, 64, "none")))
    group = make_group(graph, list(graph.nodes))
    att = attention.attention(group, lambda t: graph.tensor(t).shape)
    assert att is not None
    assert att.stages == (group.stages[0], *group.stages[1:3], group.stages[3])
    assert [group.computes[r].reduce_op for r in att.rows] == ["max", "sum"]
    assert att.values.contiguous == "n"  # V's width runs along heads x width, stride 1
    assert att.values.strides[att.key] == 3 * 64  # a token's row of every head


def _scores_then_sum(out_op: str) -> tuple:
    """Q K^T, a softmax, then ``out_op`` of the probabilities with V (MatMul: attention)."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 32, 64)).astype(np.float16) for _ in range(3))
    nodes = [
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["s"]),
        helper.make_node("Softmax", ["s"], ["p"], axis=-1),
    ]
    if out_op == "MatMul":
        nodes.append(helper.make_node("MatMul", ["p", "v"], ["y"]))
    else:
        nodes.append(helper.make_node("ReduceSum", ["p"], ["y"], keepdims=0))
    return make_model(nodes, {"q": q, "k": k, "v": v}, ["y"], {}, opset=13)


def test_the_rule_refuses_what_is_not_two_products_joined_by_rows() -> None:
    for op, expected in (("MatMul", True), ("ReduceSum", False)):
        graph = import_onnx(_scores_then_sum(op))
        group = make_group(graph, list(graph.nodes))

        def shape_of(t, graph=graph):
            return graph.tensor(t).shape

        assert (attention.attention(group, shape_of) is not None) is expected, op
    # The scores as a group output (read after the group) cannot stay in registers.
    model = _scores_then_sum("MatMul")
    model.graph.output.append(helper.make_value_info("s", model.graph.output[0].type))
    graph = import_onnx(model)
    group = make_group(graph, list(graph.nodes))
    assert "s" in group.outputs
    assert attention.attention(group, lambda t: graph.tensor(t).shape) is None


def _normalised(tokens: int, softmax: bool) -> tuple:
    """Attention over ``tokens`` keys whose probabilities are a softmax, or ``exp(s) /
    sum(exp(s))`` without the maximum: the same values, but no running maximum to rescale by."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, tokens, 32)).astype(np.float16) for _ in range(3))
    nodes = [
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["s"]),
    ]
    if softmax:
        nodes.append(helper.make_node("Softmax", ["s"], ["p"], axis=-1))
    else:
        nodes += [
            helper.make_node("Exp", ["s"], ["e"]),
            helper.make_node("ReduceSum", ["e", "axes"], ["l"], keepdims=0),
            helper.make_node("Unsqueeze", ["l", "axes"], ["lk"]),
            helper.make_node("Div", ["e", "lk"], ["p"]),
        ]
    nodes.append(helper.make_node("MatMul", ["p", "v"], ["y"]))
    return make_model(nodes, {"q": q, "k": k, "v": v}, ["y"], {"axes": np.array([-1], np.int64)}, opset=13)


def test_beyond_one_block_of_keys_only_a_softmax_is_taken() -> None:
    """Past MAX_KEYS the kernel walks the keys in chunks, which only a softmax's maximum and
    sum allow; within them any row stages do, a softmax in one pass or in chunks."""
    for tokens in (64, 300):
        for softmax in (True, False):
            graph = import_onnx(_normalised(tokens, softmax))
            group = make_group(graph, list(graph.nodes))
            att = attention.attention(group, lambda t, graph=graph: graph.tensor(t).shape)
            if softmax or tokens <= attention.MAX_KEYS:
                assert att is not None and att.online == softmax, (tokens, softmax)
                chunks = attention.chunk_choices(att)
                assert (0 in chunks) == (tokens <= attention.MAX_KEYS) and (len(chunks) > 1) == softmax
            else:
                assert att is None, (tokens, softmax)


def _projected_attention() -> tuple:
    """A projection computes the keys, then attention: greedy growth from the projection
    would take the scores as its later stage; the span from scores to values keeps them."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 64, 64)).astype(np.float16)
    wk = (rng.standard_normal((64, 64)) / 8).astype(np.float16)
    q, v = (rng.standard_normal((4, 64, 64)).astype(np.float16) for _ in range(2))
    nodes = [
        helper.make_node("MatMul", ["x", "wk"], ["k"]),
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["s"]),
        helper.make_node("Mul", ["s", "scale"], ["ss"]),
        helper.make_node("Softmax", ["ss"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["y"]),
    ]
    consts = {"wk": wk, "scale": np.array(0.125, np.float16)}
    return make_model(nodes, {"x": x, "q": q, "v": v}, ["y"], consts, opset=13)


def test_fusion_finds_the_attention_group_behind_a_projection() -> None:
    graph = import_onnx(_projected_attention())
    cm = CostModel(graph, get_arch("H100"))
    result = fuse(graph, cm)
    (group,) = [g for g in result.groups if g.root == "y"]
    # An attention group (whether its kernel beats the SIMT kind's at 4 x 64 tokens is the
    # calibrated estimates' call).
    assert attention.KIND.propose(group, _context(graph, topk=4)), sorted(group.members)
    # The projection (the flat product "k:tmp"; "k" is its reshape) is a group of its own.
    assert "s" in group.members and "k:tmp" not in group.members
    assert graph.nodes["k:tmp"].compute.reduce_axes


@needs_emulator
def test_queries_and_keys_scaled_before_their_product_are_one_attention_kernel() -> None:
    """The scaled queries and keys are views again once their scales follow the product
    (Graph.move_scales_past_products): the fusion search makes the layer one group, the
    attention rule takes it, and every config it proposes computes softmax(q k^T / sqrt(d)) v
    (numpy, in fp32)."""
    graph = import_onnx(attention_model(Case(2, 2, 40, 32, "none"), sdpa=True)).move_scales_past_products()
    (group,) = fuse(graph, CostModel(graph, get_arch("H100"))).groups
    assert {"scaled:unscaled", "o"} <= set(group.members)
    configs = attention.KIND.propose(group, _context(graph, topk=4))
    assert configs and all(isinstance(c.stages[0], AttentionConfig) for c in configs)
    feeds = _feeds(graph)
    q, k, v = (feeds[x].astype(np.float32).reshape(2, 40, 2, 32).transpose(0, 2, 1, 3) for x in "qkv")
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(32)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    expected = ((p / p.sum(-1, keepdims=True)) @ v).transpose(0, 2, 1, 3).reshape(2, 40, 64)
    for cfg, (outputs,) in zip(configs, emulate_configs(graph, group, configs, feeds)):
        err = error_metric(outputs["y"], expected.astype(np.float16))
        assert err <= threshold_for("float16"), f"{cfg.stages[0]}: error {err:.3e}"


def test_check_inputs_of_a_product_of_two_inputs_have_unit_variance() -> None:
    """Queries and keys from the tuner's random inputs: scaled by K^-1/4 each, so that their
    scores have unit variance; a product with a weight keeps its input as drawn."""
    graph = import_onnx(attention_model(Case(4, 2, 128, 64, "none")))
    group = make_group(graph, list(graph.nodes))
    feeds = group_inputs(graph, group)
    q = feeds["q"].astype(np.float32).reshape(4, 128, 2, 64)
    k = feeds["k"].astype(np.float32).reshape(4, 128, 2, 64)
    scores = np.einsum("bihd,bjhd->bhij", q, k)
    assert 0.8 < scores.std() < 1.2
    assert 0.9 < feeds["v"].astype(np.float32).std() < 1.1
    projection = import_onnx(_projected_attention())
    first = make_group(projection, ["k:tmp"])
    assert 0.9 < group_inputs(projection, first)["x"].astype(np.float32).std() < 1.1


def test_fusion_takes_the_copies_feeding_a_span() -> None:
    """Swin's keys transposed to [windows, heads, width, 49] as a node of their own: a row of
    49 halves, which no copy width divides, so the span must inline the transpose (and the
    reshape before it) to read the keys through strides."""
    graph = import_onnx(attention_model(Case(2, 3, 49, 32, "relative")))
    cm = CostModel(graph, get_arch("H100"))
    result = fuse(graph, cm)
    (group,) = [g for g in result.groups if g.root == "y"]
    assert {"kh", "k4", "s"} <= set(group.members)
    assert attention.KIND.propose(group, _context(graph, topk=4))  # it reads the keys through strides


def test_only_copies_join_a_span() -> None:
    """A transpose feeding only the span joins it; a reduction whose body is one load (a
    ReduceMax of the keys) is not a copy and stays out, though only the span reads it."""
    from welder.schedule.engine import _with_copies_in

    rng = np.random.default_rng(0)
    q, k = (rng.standard_normal((2, 16, 32)).astype(np.float16) for _ in range(2))
    nodes = [
        helper.make_node("ReduceMax", ["q"], ["qm"], axes=[0], keepdims=1),
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["qm", "kt"], ["s"]),
    ]
    graph = import_onnx(make_model(nodes, {"q": q, "k": k}, ["s"], {}, opset=13))
    assert _with_copies_in(graph, {"s"}, set()) == {"s", "kt"}


def _mlp(rows: int) -> onnx.ModelProto:
    """A NeRF's last two layers over ``rows`` points: 64 wide, then 3 outputs, with biases
    and a ReLU between; the input declared, not given, so that two million rows cost
    nothing to build."""
    rng = np.random.default_rng(0)
    weights = [("a", [64, 64]), ("c", [64]), ("b", [3, 64]), ("d", [3])]
    inits = [
        helper.make_tensor(n, onnx.TensorProto.FLOAT, s, rng.standard_normal(int(np.prod(s))))
        for n, s in weights
    ]
    nodes = [
        helper.make_node("Gemm", ["x", "a", "c"], ["h"], transB=1),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Gemm", ["r", "b", "d"], ["y"], transB=1),
    ]
    io = [
        helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [rows, w]) for n, w in (("x", 64), ("y", 3))
    ]
    graph = helper.make_graph(nodes, "mlp", [io[0]], [io[1]], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _root_tile_one_by_one(group, att, bm, shape_of):
    """root_tile's search with each axis shrunk one element at a time: the reference."""
    from welder.tile.propagate import propagate_group

    members = [group.computes[s] for s in group.stages]
    s_name, o_name = att.scores.compute.name, att.out.name

    def regions(tile):
        return propagate_group(members, group.root, tuple(tile), shape_of)

    def one_matrix(r):
        return all(e == 1 for n in (s_name, o_name) for e in r.members[n].extents[:-2])

    shape = shape_of(group.root)
    tile = [1] * len(shape)
    for k, size in enumerate(shape):
        unit = [1] * len(shape)
        tile[k] = next(
            t
            for t in range(size, 0, -1)
            if size % t == 0 and one_matrix(regions([*unit[:k], t, *unit[k + 1 :]]))
        )
    for k in range(len(shape)):
        for t in range(tile[k], 0, -1):
            tile[k] = t
            found = regions(tile)
            if one_matrix(found) and found.members[s_name].extents[-2] <= bm:
                break
    return tuple(tile)


@pytest.mark.parametrize("rows", [300, 2_073_600])
def test_the_root_tile_is_found_in_few_propagations(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rows a block takes are bisected, not counted down: a NeRF's two million points
    took its plan minutes.  The tile is the one a one-by-one search finds (for 300 rows,
    where that search is cheap), and the propagations grow with the log of the rows."""
    graph = import_onnx(_mlp(rows))
    group = make_group(graph, ["h:product", "h", "r", "y:product"])  # the bias and ReLU inlined

    def shape_of(t):
        return graph.tensor(t).shape

    att = attention.attention(group, shape_of, fp32=True)
    assert att is not None
    calls = []
    real = attention.propagate_group
    monkeypatch.setattr(attention, "propagate_group", lambda *a: calls.append(1) or real(*a))
    for bm in (16, 64, 100, 128):
        calls.clear()
        found = attention.root_tile(group, att, bm, shape_of)
        assert found is not None and len(calls) < 80, (bm, len(calls))
        if rows < 1000:
            assert found[0] == _root_tile_one_by_one(group, att, bm, shape_of), bm
        else:
            assert found[0] == (bm, 3)


def test_largest_agrees_with_counting_down() -> None:
    for hi in (1, 2, 3, 17, 64, 1000):
        for bound in range(0, hi + 2):
            expected = next((t for t in range(hi, 0, -1) if t <= bound), 1)
            assert attention._largest(hi, lambda t, bound=bound: t <= bound) == expected, (hi, bound)


def test_the_bench_finds_a_tuned_models_attention_group(tmp_path: Path) -> None:
    """``attention_bench.py --group PREFIX`` times the attention group a tune planned: the
    group it rebuilds from tuned.json is the plan's (its members, its inputs), on the graph
    the tune planned, and the attention kind proposes configs for it; a layer the plan does
    not have is named."""
    from attention_bench import model_group
    from models import bert_encoder_layer
    from onnx_util import to_half

    from welder.cli import main
    from welder.schedule.kinds import Options, ScheduleContext

    model, _ = bert_encoder_layer(batch=2, seq=32, hidden=128, heads=2, layers=2)
    prefix = tmp_path / "bert"
    prefix.mkdir()
    onnx.save(to_half(model), prefix / "model.onnx")
    assert main(["tune", str(prefix), "--cost-model", "--arch", "H100", "--topk", "2", "--no-build"]) == 0
    tuned = json.loads((prefix / "tuned.json").read_text())
    planned = [g for g in tuned["groups"] if g["configs"][0]["stages"][0]["kind"] == "attention"]
    assert len(planned) == 2
    graph, group, recorded = model_group(prefix, layer=1)
    assert sorted(group.members) == sorted(planned[1]["members"])
    assert list(group.inputs) == planned[1]["inputs"] and list(group.outputs) == planned[1]["outputs"]
    assert recorded == {}  # a cost-model plan times nothing
    ctx = ScheduleContext(
        lambda t: graph.tensor(t).shape, lambda t: graph.tensor(t).dtype, get_arch("H100"), Options(topk=8)
    )
    assert attention.KIND.propose(group, ctx)
    with pytest.raises(SystemExit, match="2 attention groups, no layer 2"):
        model_group(prefix, layer=2)
