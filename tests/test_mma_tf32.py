"""fp32 contractions on TF32 tensor cores (``welder tune --tf32``), run on the CPU emulator.

Each graph is fp32; the ``mma_tf32`` kind schedules it under several configs, which are
rendered, emulated and compared with numpy in fp64 twice: with the exact operands, within
TF32's threshold (5e-3), and with the operands rounded to TF32 the way ``cvt.rna`` rounds
them (numpy here, not the emulator's code), far closer -- and the exact comparison must
also miss fp32's threshold, so a kernel that computed exactly (no TF32 at all) fails.
The cases reach every fragment path for 32-bit elements: A with K or M contiguous (ldmatrix
of b16 pairs, or 32-bit shared loads), B with N or K contiguous, batches, ragged M, N and K,
16- and 4-byte copies, an odd N, and later SIMT stages reading the fp32 tile.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import zlib
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper
from onnx_util import make_model
from test_mma import emulate_configs
from test_tuner import EmulatedDevice, ScriptedDevice

from welder.arch import get_arch
from welder.check import THRESHOLDS, error_metric, recorded_precision
from welder.cli import main
from welder.codegen import generate_kernel, model_source
from welder.codegen.kernel import KernelBuilder
from welder.errors import WelderError
from welder.frontend.onnx import import_onnx
from welder.graph import Graph
from welder.resources import TEMPLATE_DIR
from welder.runtime.emu import available
from welder.schedule.config import GroupConfig
from welder.schedule.group import Group, make_group
from welder.schedule.kinds import Options, ScheduleContext, mma, propose
from welder.schedule.kinds.mma import Tf32MmaConfig, config_precision, contraction
from welder.schedule.plan import plan_model
from welder.tune.tuner import cache_key, tune_group

ARCH = get_arch("H100")
ROOT = Path(__file__).resolve().parents[1]
RNG = np.random.default_rng(11)
TF32_KINDS = ("mma_tf32", "mma", "simt")

needs_emulator = pytest.mark.skipif(not available(), reason="the CPU emulator needs Linux and g++")


def _f(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def _seed(label: str) -> None:
    """Each case draws the same data whichever cases a test worker ran before it."""
    global RNG
    RNG = np.random.default_rng(zlib.crc32(label.encode()))


def _matmul(
    m: int, k: int, n: int, trans_a: bool = False, trans_b: bool = False
) -> tuple[onnx.ModelProto, dict]:
    """Gemm with A stored K x M (``trans_a``: M contiguous) and B stored N x K (``trans_b``:
    K contiguous).  B is scaled so that outputs are of order one."""
    x = _f(k, m) if trans_a else _f(m, k)
    w = (_f(n, k) if trans_b else _f(k, n)) / np.float32(np.sqrt(k))
    nodes = [helper.make_node("Gemm", ["x", "w"], ["y"], transA=int(trans_a), transB=int(trans_b))]
    return make_model(nodes, {"x": x}, ["y"], {"w": w}, opset=17), {"x": x}


def _batched(
    batch: tuple[int, ...], m: int, k: int, n: int, a_perm: bool, b_perm: bool
) -> tuple[onnx.ModelProto, dict]:
    """Batched MatMul of two inputs; ``a_perm`` / ``b_perm`` read an operand through a
    Transpose of its last two axes (A then M-contiguous, B then K-contiguous)."""
    a = _f(*batch, k, m) if a_perm else _f(*batch, m, k)
    b = (_f(*batch, n, k) if b_perm else _f(*batch, k, n)) / np.float32(np.sqrt(k))
    perm = [*range(len(batch)), len(batch) + 1, len(batch)]
    nodes, names = [], []
    for name, transposed in (("a", a_perm), ("b", b_perm)):
        if transposed:
            nodes.append(helper.make_node("Transpose", [name], [f"{name}t"], perm=perm))
        names.append(f"{name}t" if transposed else name)
    nodes.append(helper.make_node("MatMul", names, ["y"]))
    return make_model(nodes, {"a": a, "b": b}, ["y"], opset=17), {"a": a, "b": b}


def _bias_relu(m: int, k: int, n: int) -> tuple[onnx.ModelProto, dict]:
    """A later SIMT stage on the fp32 tile in shared memory; the product is an output too."""
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"]),
        helper.make_node("Add", ["mm", "b"], ["a"]),
        helper.make_node("Relu", ["a"], ["y"]),
    ]
    consts = {"w": _f(k, n) / np.float32(np.sqrt(k)), "b": _f(n)}
    x = _f(1, m, k)
    return make_model(nodes, {"x": x}, ["y", "mm"], consts, opset=17), {"x": x}


def _scores_softmax(heads: int, seq: int, dim: int) -> tuple[onnx.ModelProto, dict]:
    """Q K^T (B K-contiguous through a Transpose) under a row softmax: the tile stays whole."""
    nodes = [
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["s"]),
        helper.make_node("Softmax", ["s"], ["y"], axis=-1),
    ]
    q, k = _f(heads, seq, dim), _f(heads, seq, dim) / np.float32(np.sqrt(dim))
    return make_model(nodes, {"q": q, "k": k}, ["y"], opset=17), {"q": q, "k": k}


CASES: dict[str, Callable[[], tuple[onnx.ModelProto, dict]]] = {
    "A k-contiguous, B n-contiguous": lambda: _matmul(64, 64, 64),
    "A m-contiguous, B n-contiguous": lambda: _matmul(32, 48, 40, trans_a=True),
    "A k-contiguous, B k-contiguous": lambda: _matmul(48, 40, 56, trans_b=True),
    "A m-contiguous, B k-contiguous": lambda: _matmul(40, 56, 32, trans_a=True, trans_b=True),
    "ragged M, N, K, 4-byte copies": lambda: _matmul(37, 19, 34),
    "ragged 16-byte copies, several slices": lambda: _matmul(45, 100, 52),
    "odd N, scalar global stores": lambda: _matmul(24, 40, 33, trans_b=True),
    "batched, A and B as stored": lambda: _batched((2, 3), 20, 24, 24, False, False),
    "batched, A m- and B k-contiguous": lambda: _batched((3,), 24, 36, 20, True, True),
    "batched, A m-contiguous, odd N": lambda: _batched((2,), 18, 28, 13, True, False),
    "bias + relu on the tile, product written": lambda: _bias_relu(40, 48, 64),
    "QK^T + softmax, odd N in the tile": lambda: _scores_softmax(2, 35, 16),
}


def tf32(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to TF32 as ``cvt.rna`` does (to nearest, ties away from zero), in numpy."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)
    return np.where(np.isfinite(x), rounded.view(np.float32), x)


def _reference(graph: Graph, feeds: dict, round_operands: bool) -> dict[str, np.ndarray]:
    """The graph in fp64 from the same inputs and constants; with ``round_operands`` the two
    tensors the product reads (inputs or constants, transposes inlined) rounded to TF32 first."""
    group = _whole_group(graph)
    con = contraction(group.computes[group.stages[0]], lambda t: graph.tensor(t).shape)
    assert con is not None
    rounded = {con.a.tensor, con.b.tensor} if round_operands else set()
    values = {**graph.constants, **feeds}
    return _evaluate64(
        graph, {k: (tf32(v) if k in rounded else v).astype(np.float64) for k, v in values.items()}
    )


def _evaluate64(graph: Graph, env: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    from welder.ir.interpret import evaluate

    for node in graph.topo_order():
        env[node.name] = evaluate(node.compute, env)
    return {o: env[o] for o in graph.outputs}


def _whole_group(graph: Graph) -> Group:
    return make_group(graph, list(graph.nodes))


def _context(
    graph: Graph, topk: int = 4, kinds: tuple[str, ...] = TF32_KINDS, arch: str = "H100"
) -> ScheduleContext:
    return ScheduleContext(
        lambda t: graph.tensor(t).shape,
        lambda t: graph.tensor(t).dtype,
        get_arch(arch),
        Options(topk=topk, kinds=kinds),
    )


def _emulate(graph: Graph, group: Group, configs: list[GroupConfig], feeds: dict) -> list[dict]:
    """The outputs of ``group`` (the whole graph) under each config, emulated once."""
    return [runs[0] for runs in emulate_configs(graph, group, configs, feeds)]


@needs_emulator
@pytest.mark.parametrize("label", list(CASES))
def test_tf32_stage_is_within_its_threshold_and_is_not_exact_fp32(label: str) -> None:
    _seed(label)
    model, feeds = CASES[label]()
    graph = import_onnx(model)
    group = _whole_group(graph)
    configs = mma.TF32_KIND.propose(group, _context(graph))
    assert configs, f"{label}: the TF32 rule proposed nothing"
    assert all(isinstance(c.stages[0], Tf32MmaConfig) and config_precision(c) == "tf32" for c in configs)
    exact = _reference(graph, feeds, round_operands=False)
    rounded = _reference(graph, feeds, round_operands=True)
    for cfg, outputs in zip(configs, _emulate(graph, group, configs, feeds)):
        for name, got in outputs.items():
            err_exact = error_metric(got, exact[name])
            err_tf32 = error_metric(got, rounded[name])
            where = f"{label}, {cfg.stages[0]}, {name}"
            assert err_exact <= THRESHOLDS["tf32"], f"{where}: {err_exact:.2e} from exact"
            assert err_exact > THRESHOLDS["fp32"], f"{where}: {err_exact:.2e}, as exact as fp32"
            assert err_tf32 < err_exact / 20, f"{where}: {err_tf32:.2e} from TF32 operands"


@needs_emulator
def test_split_k_on_tf32_matches_tf32_operands() -> None:
    """Split-K with fp32 operands: every split factor the policy allows for the best tiles,
    against numpy with TF32-rounded operands (the partials are fp32 whatever the format)."""
    _seed("split-k")
    model, feeds = _matmul(24, 600, 40, trans_a=True)
    graph = import_onnx(model)
    group = _whole_group(graph)
    ctx = _context(graph, topk=50)
    configs = []
    for cfg in mma.TF32_KIND.propose(group, ctx)[:2]:
        st = cfg.stages[0]
        con = contraction(group.computes[st.node], ctx.shape_of)
        for splits in mma.split_choices(con, st, cfg.num_blocks, ctx):
            configs.append(replace(cfg, stages=[replace(st, splits=splits), *cfg.stages[1:]]))
    assert len({c.stages[0].splits for c in configs}) >= 2
    exact = _reference(graph, feeds, round_operands=False)
    rounded = _reference(graph, feeds, round_operands=True)
    for cfg, outputs in zip(configs, _emulate(graph, group, configs, feeds)):
        for name, got in outputs.items():
            err_exact, err_tf32 = error_metric(got, exact[name]), error_metric(got, rounded[name])
            assert err_exact <= THRESHOLDS["tf32"] and err_tf32 < err_exact / 20, (cfg.stages[0], err_tf32)


def test_both_contiguity_cases_use_their_own_fragment_loads() -> None:
    """A with K contiguous is read by ldmatrix as b16 pairs, with M contiguous by 32-bit
    loads; B likewise (K contiguous: ldmatrix, N contiguous: 32-bit loads); 16-byte copies
    are four floats and need strides that are multiples of four."""
    for trans_a, trans_b, a_ld, b_ld in ((False, False, True, False), (True, True, False, True)):
        graph = import_onnx(_matmul(48, 40, 56, trans_a, trans_b)[0])
        group = _whole_group(graph)
        cfg = mma.TF32_KIND.propose(group, _context(graph))[0]
        source = generate_kernel(graph, group, cfg, "k").source
        loads = re.findall(r"welder_ldmatrix_x4(\w*)\((\w+)", source)
        assert {(trans, operand) for trans, operand in loads} == ({("", "af")} if a_ld else set()) | (
            {("", "r")} if b_ld else set()
        )
        assert "welder_float_to_tf32(" in source and "welder_mma_m16n8k8_tf32(" in source
        assert "welder_mma_m16n8k16" not in source
    con = contraction(_whole_group(graph).computes["y"], lambda t: graph.tensor(t).shape)
    assert con is not None and con.copy_bytes() == 16
    odd = import_onnx(_matmul(37, 19, 34)[0])  # A's rows are 19 floats apart: 4-byte copies
    con = contraction(_whole_group(odd).computes["y"], lambda t: odd.tensor(t).shape)
    assert con is not None and con.copy_bytes() == 4
    six = import_onnx(_matmul(37, 18, 34)[0])  # rows of 18 and 34 floats: 8-byte copies, two floats
    con = contraction(_whole_group(six).computes["y"], lambda t: six.tensor(t).shape)
    assert con is not None and con.copy_bytes() == 8


def test_without_tf32_no_tf32_stage_is_proposed_for_fp32() -> None:
    """Without ``--tf32`` fp32 keeps fp32's accuracy: on CUDA cores, as FMAs in the mma kind's
    tiles (``ffma``) or as any SIMT reduction, or on tensor cores as three TF32 products a
    piece (``mma_tf32x3``), never one."""
    graph = import_onnx(_matmul(512, 768, 768)[0])
    group = _whole_group(graph)
    assert mma.KIND.propose(group, _context(graph)) is None  # the fp16 kind leaves fp32 alone
    exact = {"mma_tf32x3", "ffma", "simt"}
    for kinds, allowed in ((Options.kinds, exact), (("simt",), {"simt"})):
        found = propose(group, _context(graph, kinds=kinds))
        assert found and {st.kind for c in found for st in c.stages} <= allowed
    plan = plan_model(graph, ARCH, topk=2)
    assert {st.kind for g in plan.groups for c in g.configs for st in c.stages} <= exact
    # With TF32 allowed the large product goes to tensor cores; a V100 has none for it.
    assert propose(group, _context(graph))[0].stages[0].kind == "mma_tf32"
    plan = plan_model(graph, ARCH, topk=2, kinds=TF32_KINDS)
    assert plan.groups[0].configs[0].stages[0].kind == "mma_tf32"
    assert mma.TF32_KIND.propose(group, _context(graph, arch="V100")) is None


def test_tf32_configs_fit_the_arch_and_pad_rows_for_their_loads() -> None:
    """Shared memory (4-byte elements), registers and the bank-conflict-free row strides:
    ldmatrix rows start in distinct 16-byte bank groups, and the four k-rows of a 32-bit
    fragment load start 8 banks apart."""
    for trans_a, trans_b in ((False, False), (True, True)):
        graph = import_onnx(_matmul(200, 256, 384, trans_a, trans_b)[0])
        group = _whole_group(graph)
        configs = mma.TF32_KIND.propose(group, _context(graph, topk=40))
        assert configs
        for cfg in configs:
            st = cfg.stages[0]
            assert cfg.smem_bytes <= ARCH.smem_per_block
            assert cfg.estimate.regs_per_thread <= ARCH.max_regs_per_thread
            builder = KernelBuilder(graph, group, cfg, "k")
            builder.render()
            ring = {v["name"]: v for v in builder.views if v["name"].startswith("mma0_")}
            assert {v["ctype"] for v in ring.values()} == {"float"}
            assert all((v["offset"] % 16) == 0 for v in ring.values())
            for operand, k_rows, block in (("a", trans_a, st.block_m), ("b", not trans_b, st.block_n)):
                cols = block if k_rows else st.block_k
                rows = st.block_k if k_rows else block
                ld = ring[f"mma0_{operand}"]["count"] // st.pipeline // rows
                if k_rows:  # 32-bit loads: rows kk + t, t < 4, eight words each
                    assert sorted(t * ld % 32 for t in range(4)) == [0, 8, 16, 24], (cfg, operand)
                else:  # ldmatrix: eight 16-byte rows
                    assert len({j * ld * 4 % 128 for j in range(8)}) == 8, (cfg, operand)
                assert ld > cols


def ptx_of(kernels: list, tmp_path: Path, archs: tuple[str, ...] = ("sm_80", "sm_90")) -> list[str]:
    """The PTX nvcc makes of ``kernels`` for each of ``archs``, any warning an error."""
    source = tmp_path / "kernels.cu"
    source.write_text(model_source(kernels))
    texts = []
    for sm in archs:
        ptx = tmp_path / f"{sm}.ptx"
        command = ["nvcc", "-std=c++17", f"-arch={sm}", "-Werror", "all-warnings", "-I", str(TEMPLATE_DIR)]
        subprocess.run([*command, "-ptx", str(source), "-o", str(ptx)], check=True, capture_output=True)
        texts.append(ptx.read_text())
    return texts


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_tf32_kernels_compile_to_m16n8k8(tmp_path: Path) -> None:
    """nvcc builds TF32 kernels for sm_80 and sm_90 without warnings; their PTX holds the
    m16n8k8 TF32 product, the rounding and both fragment loads."""
    kernels = []
    for j, label in enumerate(("A k-contiguous, B k-contiguous", "A m-contiguous, B n-contiguous")):
        graph = import_onnx(CASES[label]()[0])
        group = _whole_group(graph)
        cfg = mma.TF32_KIND.propose(group, _context(graph))[0]
        kernels.append(generate_kernel(graph, group, cfg, f"tf32_ptx_{j}"))
    for text in ptx_of(kernels, tmp_path):
        assert re.search(r"mma\.sync\.aligned\.m16n8k8\.row\.col\.f32\.tf32\.tf32\.f32", text)
        assert "cvt.rna.tf32.f32" in text
        assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in text and "ld.shared.f32" in text
        assert "m16n8k16" not in text


# -- the tuner and the command line -------------------------------------------------------------


@needs_emulator
def test_the_tuner_holds_tf32_candidates_to_the_tf32_threshold() -> None:
    """On the emulator a TF32 candidate misses fp32's 1e-4 and is kept at 5e-3; the cache
    key tells a TF32 tune from an exact one."""
    graph = import_onnx(_matmul(64, 256, 64)[0])
    group = _whole_group(graph)
    configs = mma.TF32_KIND.propose(group, _context(graph, topk=2))
    device = EmulatedDevice()
    result = tune_group(graph, group, ARCH, 2, None, device, configs=configs, kinds=TF32_KINDS)
    assert result is not None and not result.dropped
    assert config_precision(result.config) == "tf32"
    exact, tf = cache_key("s", ARCH, device, Options.kinds), cache_key("s", ARCH, device, TF32_KINDS)
    assert exact != tf


def test_a_simt_candidate_is_still_held_to_fp32() -> None:
    """The same error that a TF32 candidate may have drops a SIMT one."""
    graph = import_onnx(_matmul(64, 64, 64)[0])
    group = _whole_group(graph)
    tc = mma.TF32_KIND.propose(group, _context(graph, topk=1))
    simt = propose(group, _context(graph, topk=1, kinds=("simt",)))
    device = _Perturbing(graph, 5e-4)
    result = tune_group(graph, group, ARCH, 2, None, device, configs=[*simt, *tc], kinds=TF32_KINDS)
    assert result is not None and result.config.stages[0].kind == "mma_tf32"
    assert [(d.candidate, d.reason) for d in result.dropped] == [(0, "wrong")]


class _Perturbing(ScriptedDevice):
    """Computes through the interpreter, then moves every output by ``rel`` relative, the
    SIMT candidate (index 0) being the fastest."""

    def __init__(self, graph: Graph, rel: float) -> None:
        super().__init__(graph, latency={0: 1.0, 1: 2.0})
        self.rel = rel

    def run(self, program, kernel, inputs, rows=None) -> list[np.ndarray]:
        return [(o * (1 + self.rel)).astype(o.dtype) for o in super().run(program, kernel, inputs, rows)]


def test_tune_flag_puts_fp32_products_on_tf32_and_records_it(tmp_path: Path) -> None:
    """``welder tune --tf32`` (cost model): the fp32 product is an mma stage, its kernel holds
    the TF32 product, and tuned.json records the precision that test_acc and ``welder
    check`` read; without the flag the cost model puts the product on three TF32 products a
    piece (fp32's accuracy, ``mma_tf32x3``) and fp32 is recorded."""
    model, _ = _matmul(512, 768, 768)
    for flags in ([], ["--tf32"]):
        prefix = tmp_path / ("tf32" if flags else "exact")
        prefix.mkdir()
        onnx.save(model, str(prefix / "model.onnx"))
        argv = ["tune", str(prefix), "--arch", "H100", "--cost-model", "--topk", "2", "--no-build", *flags]
        assert main(argv) == 0
        doc = json.loads((prefix / "tuned.json").read_text())
        kinds = {st["kind"] for g in doc["groups"] for st in g["configs"][0]["stages"]}
        sources = "".join(g["kernel"]["source"] for g in doc["groups"])
        assert ("welder_mma_m16n8k8_tf32(" in sources) and ("welder_tf32_split(" in sources) != bool(flags)
        assert kinds == ({"mma_tf32"} if flags else {"mma_tf32x3"})
        assert doc["precision"] == ("tf32" if flags else "fp32")
        assert recorded_precision(prefix) == doc["precision"]


def test_tf32_with_no_tc_is_a_usage_error(tmp_path: Path, capsys) -> None:
    prefix = tmp_path / "m"
    prefix.mkdir()
    onnx.save(_matmul(16, 16, 16)[0], str(prefix / "model.onnx"))
    argv = ["tune", str(prefix), "--arch", "H100", "--cost-model", "--no-build", "--tf32", "--no-tc"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--tf32" in err and "--no-tc" in err and "Traceback" not in err
    assert sorted(p.name for p in prefix.iterdir()) == ["model.onnx"]  # nothing written
    with pytest.raises(SystemExit):
        main(["tune", "--help"])
    assert "--tf32" in capsys.readouterr().out


def test_recorded_precision_reads_tuned_json(tmp_path: Path) -> None:
    assert recorded_precision(tmp_path) == "fp32"  # nothing recorded: exact
    (tmp_path / "tuned.json").write_text(json.dumps({"format": "welder.tuned/3"}))
    assert recorded_precision(tmp_path) == "fp32"  # written before precision was recorded
    (tmp_path / "tuned.json").write_text(json.dumps({"precision": "tf32"}))
    assert recorded_precision(tmp_path) == "tf32"
    for bad in ("{", json.dumps({"precision": "int4"}), json.dumps([1])):
        (tmp_path / "tuned.json").write_text(bad)
        with pytest.raises(WelderError, match=r"tuned\.json"):
            recorded_precision(tmp_path)


@pytest.mark.skipif(not (available() and shutil.which("cmake")), reason="needs g++ and cmake")
def test_test_acc_and_check_apply_the_precision_the_runtime_was_tuned_for(tmp_path: Path, capsys) -> None:
    """A runtime tuned with --tf32, built for the emulator: test_acc and ``welder check
    --backend gpu`` pass it at TF32's 5e-3 without being told; held to fp32's 1e-4 it fails."""
    _seed("end to end")
    prefix = tmp_path / "tf32"
    prefix.mkdir()
    onnx.save(_matmul(256, 512, 512)[0], str(prefix / "model.onnx"))
    assert (
        main(["tune", str(prefix), "--arch", "H100", "--cost-model", "--topk", "1", "--no-build", "--tf32"])
        == 0
    )
    doc = json.loads((prefix / "tuned.json").read_text())
    assert doc["groups"][0]["configs"][0]["stages"][0]["kind"] == "mma_tf32"
    assert main(["build", str(prefix), "--emulate"]) == 0
    capsys.readouterr()
    assert main(["check", str(prefix), "--backend", "gpu"]) == 0
    assert "5.0e-03  PASS" in capsys.readouterr().out
    spec = importlib.util.spec_from_file_location("test_acc", ROOT / "artifacts" / "test_acc.py")
    test_acc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(test_acc)
    assert test_acc.main([str(prefix)]) == 0
    assert "5.0e-03  PASS" in capsys.readouterr().out
    assert test_acc.main([str(prefix), "--precision", "fp32"]) == 1
    assert "1.0e-04  FAIL" in capsys.readouterr().out
