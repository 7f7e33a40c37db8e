"""The ``wgmma`` kernel kind: fp16 contractions on Hopper's warpgroup instructions, run on the
CPU emulator against the IR interpreter.

The graphs are the ``mma`` kind's (tests/test_mma.py) wherever 16-byte copies apply: ragged
M, N and K, A and B in both major-nesses (the swizzled K-major rows and the transposed
MN-major panels), batches, later SIMT stages reading the tile from shared memory, reshaped
roots, M = 1.  Each is emulated under the rule's configs of every block tile (one and two
warpgroups, one and two m64 pieces each), and split-K under every factor the rule allows.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import replace

import pytest
from test_mma import (
    CASES,
    SPLIT_CASES,
    _attention_scores,
    _broadcast_batch,
    _context,
    _matmul,
    _run,
    _whole_group,
    needs_emulator,
)
from test_runtime import needs_gpu, needs_nvcc_build

from welder.arch import get_arch
from welder.codegen import generate_kernel
from welder.frontend.onnx import import_onnx
from welder.resources import TEMPLATE_DIR
from welder.schedule.config import GroupConfig
from welder.schedule.kinds import Options, ScheduleContext, propose, wgmma
from welder.schedule.kinds.mma import contraction, split_choices
from welder.schedule.kinds.wgmma import WgmmaConfig
from welder.tile.propagate import propagate_group

#: The mma cases whose strides allow 16-byte copies (the others have no wgmma config).
WGMMA_CASES = [
    "square 64",
    "ragged 40x72x48",
    "large K, several slices",
    "A transposed (Gemm)",
    "B transposed (Gemm)",
    "A through a Transpose node",
    "bias + GELU, product also written",
    "QK^T + softmax",
    "tokens written out as NCHW",
    "residual add + LayerNorm, sum also written",
    "classifier, M = 1",
    "product concatenated after other rows",
]


def _configs(label_or_model, topk: int = 400) -> tuple:
    model, feeds = CASES[label_or_model]() if isinstance(label_or_model, str) else label_or_model
    graph = import_onnx(model)
    group = _whole_group(graph)
    ctx = replace(_context(graph, topk=topk), options=Options(topk=topk, clusters=True))
    return graph, group, feeds, wgmma.KIND.propose(group, ctx)


def _best_per_tile(
    configs: list[GroupConfig], producer: bool = False, multicast: str = ""
) -> list[GroupConfig]:
    """The best unsplit config of every block tile and warpgroup count, fed by cp.async or
    (``producer``) by a TMA producer warpgroup, one block per tile, its blocks in clusters
    sharing operand ``multicast`` (or in none)."""
    best: dict[tuple, GroupConfig] = {}
    for cfg in configs:
        st = cfg.stages[0]
        if st.splits == 1 and st.producer == producer and st.multicast == multicast and not st.persistent:
            best.setdefault((st.block, st.warps), cfg)
    return list(best.values())


@needs_emulator
@pytest.mark.parametrize("label", WGMMA_CASES)
def test_wgmma_stage_matches_the_interpreter(label: str) -> None:
    graph, group, feeds, configs = _configs(label)
    assert configs, f"{label}: the wgmma rule proposed nothing"
    assert all(isinstance(c.stages[0], WgmmaConfig) for c in configs)
    chosen = _best_per_tile(configs)[:3]
    assert _run(graph, group, chosen, feeds) == []


@needs_emulator
def test_ring_slots_are_reused_across_a_long_k() -> None:
    """Ten slices through rings of four and five slots: every slot is refilled while the
    previous slice's wgmma group may still read its own (the emulator reports an operand
    overwritten before its wait)."""
    graph, group, feeds, configs = _configs(_matmul(72, 640, 136, trans_b=True))
    chosen = {}
    for cfg in configs:
        if cfg.stages[0].splits == 1:
            chosen.setdefault((cfg.stages[0].pipeline, cfg.stages[0].producer), cfg)
    cp_async = {(p, False) for p in wgmma.PIPELINES if p >= wgmma.MIN_CP_ASYNC_PIPELINE}
    assert set(chosen) == cp_async | {(p, True) for p in wgmma.PIPELINES}
    assert _run(graph, group, list(chosen.values()), feeds) == []


@needs_emulator
def test_broadcast_batch() -> None:
    """A batch of products sharing one weight (N and M past one 64-wide tile)."""
    graph, group, feeds, configs = _configs(_broadcast_batch(3, 70, 32, 72))
    assert _run(graph, group, _best_per_tile(configs)[:2], feeds) == []


@needs_emulator
def test_every_block_tile_and_both_majornesses() -> None:
    """A 200 x 136 x 100 product (ragged in every dimension, several slices) under every
    block tile the rule has, with B as a [k][n] weight (MN-major, transposed by the
    instruction) and as [n][k] (K-major), and A as [k][m]."""
    failures = []
    tiles = set()
    for trans_a, trans_b in ((False, False), (False, True), (True, False)):
        graph, group, feeds, configs = _configs(_matmul(200, 104, 136, trans_a=trans_a, trans_b=trans_b))
        chosen = _best_per_tile(configs)
        # Tiles whose slices the cp.async threads cannot split evenly have the producer's only.
        copied = {(c.stages[0].block, c.stages[0].warps) for c in chosen}
        chosen += [
            c
            for c in _best_per_tile(configs, producer=True)
            if (c.stages[0].block, c.stages[0].warps) not in copied
        ]
        tiles |= {(c.stages[0].block, c.stages[0].warps) for c in chosen}
        failures += _run(graph, group, chosen, feeds)
    assert {(bm, bn, wm) for bm, bn, wm, _ in wgmma.BLOCK_TILES} <= {(*b, w[0]) for b, w in tiles}
    assert failures == []


#: Cases for the producer variant: both major-nesses of both operands, ragged edges (the
#: copies zero-fill past the maps' extents), a batch (3-d maps), later stages, M = 1.
PRODUCER_CASES = [
    "ragged 40x72x48",
    "large K, several slices",
    "A transposed (Gemm)",
    "B transposed (Gemm)",
    "QK^T + softmax",
    "residual add + LayerNorm, sum also written",
    "classifier, M = 1",
]


@needs_emulator
@pytest.mark.parametrize("label", PRODUCER_CASES)
def test_producer_variant_matches_the_interpreter(label: str) -> None:
    """TMA copies issued by a producer warpgroup, full/empty mbarriers per slot: the
    emulator reports a slot read before its copies landed or refilled while read."""
    graph, group, feeds, configs = _configs(label)
    chosen = _best_per_tile(configs, producer=True)[:2]
    assert chosen, f"{label}: no producer variant proposed"
    kernel = generate_kernel(graph, group, chosen[0], "probe")
    assert len(kernel.tensor_maps) >= 2 and "welder_tma_load_" in kernel.source
    assert _run(graph, group, chosen, feeds) == []


def test_producer_maps_follow_the_copy_engine_rules() -> None:
    """Every tensor map a producer config asks for is one the driver encodes (16-byte
    strides, boxes of at most 256 and 128 bytes along the swizzled axis), its boxes fill a
    slot exactly, and the variant is neither split nor proposed where a map cannot describe an
    operand."""
    from welder.codegen.tensor_map import tensor_map_problem

    for trans_a, trans_b in ((False, False), (True, True)):
        graph, group, _, configs = _configs(_matmul(200, 136, 328, trans_a=trans_a, trans_b=trans_b))
        producers = [c for c in configs if c.stages[0].producer]
        assert producers and all(c.stages[0].splits == 1 for c in producers)
        for cfg in producers:
            st = cfg.stages[0]
            kernel = generate_kernel(graph, group, cfg, "probe")
            boxes = 0
            for i, m in enumerate(kernel.tensor_maps):
                assert tensor_map_problem(m, 1 << 20 | m.offset) is None, m  # any 16-byte-aligned buffer
                loads = kernel.source.count(f"&p{m.pointer}_map{i}, full + slot")  # loads, not stores
                boxes += loads * m.box_bytes
            # A block of a cluster copies half of the slice the pair shares.
            assert boxes == (st.block_m + st.block_n - st.shared_rows() // st.cluster) * st.block_k * 2
    # A convolution's image is gathered (no map describes a window): cp.async variants only,
    # none shallower than the cp.async ring's minimum.
    from test_mma_conv import _implicit

    graph, group, _, configs = _configs(_implicit("3x3 s1 p1"))
    assert configs and not any(c.stages[0].producer for c in configs)
    assert min(c.stages[0].pipeline for c in configs) == wgmma.MIN_CP_ASYNC_PIPELINE


#: Lone products of several tiles for persistent blocks: both major-nesses of both operands,
#: ragged edges, five slices (rings of 3 to 8 slots wrap inside a tile or across tiles), and
#: a batch.
PERSISTENT_CASES = {
    "ragged, B a [k][n] weight": lambda: _matmul(200, 320, 136),
    "ragged, A and B transposed": lambda: _matmul(136, 320, 200, trans_a=True, trans_b=True),
    "shared-weight batch": lambda: _broadcast_batch(3, 70, 32, 72),
}


def _persistent(cfg: GroupConfig, blocks: int) -> GroupConfig:
    return replace(cfg, stages=[replace(cfg.stages[0], persistent=blocks)])


@needs_emulator
@pytest.mark.parametrize("label", list(PERSISTENT_CASES))
def test_persistent_blocks_match_the_interpreter(label: str) -> None:
    """Two or three blocks walk every tile in turn, the ring and its barriers' phases carrying
    on from tile to tile (a wrong phase deadlocks or reads a slot before its copies land,
    both reported by the emulator), under the shallowest and deepest rings; launched twice
    (the barriers are initialised per launch)."""
    graph, group, feeds, configs = _configs(PERSISTENT_CASES[label]())
    producers = [c for c in configs if c.stages[0].producer and not c.stages[0].persistent]
    assert producers and len(group.stages) == 1
    tiled = [c for c in producers if c.num_blocks == max(c.num_blocks for c in producers)]
    rings = {c.stages[0].pipeline: c for c in reversed(tiled)}
    chosen = [_persistent(rings[min(rings)], 2), _persistent(rings[max(rings)], 3)]
    assert chosen[0].num_blocks > 3, "every block walks more than one tile"
    kernel = generate_kernel(graph, group, chosen[0], "probe")
    assert kernel.grid == 2 and "tile += gridDim.x" in kernel.source
    assert _run(graph, group, chosen, feeds, launches=2) == []


def test_persistent_variant_where_tiles_take_several_waves() -> None:
    """A product of many waves of tiles gets persistent producer configs (one wave of
    resident blocks, estimated no slower than its launch-per-tile twin and in a family of
    its own, so a tune measures both); one wave of tiles, a later stage or a cp.async ring
    gets none."""
    graph, group, _, configs = _configs(_matmul(8192, 768, 3072), topk=1000)
    persistent = [c for c in configs if c.stages[0].persistent]
    assert persistent and all(c.stages[0].producer and c.stages[0].splits == 1 for c in persistent)
    arch = get_arch("H100")
    for cfg in persistent:
        st = cfg.stages[0]
        assert st.persistent % arch.sm_count == 0 and st.persistent < cfg.num_blocks
        assert generate_kernel(graph, group, cfg, "probe").grid == st.persistent
        twin = next(c for c in configs if c.stages[0] == replace(st, persistent=0))
        assert cfg.estimate.latency_us <= twin.estimate.latency_us
        assert st.family == "wgmma/tma+"
        if not (st.multicast or st.tma_store):  # its twin is the plain form: both get measured
            assert twin.stages[0].family == "wgmma/tma"
    for small in ("ragged 40x72x48", "QK^T + softmax", "residual add + LayerNorm, sum also written"):
        assert not any(c.stages[0].persistent for c in _configs(small, topk=1000)[3]), small


#: Products whose blocks pair up in clusters sharing A or B: both major-nesses of both
#: operands (a shared K-major slice is halved by rows, an MN-major one by panels), ragged
#: edges, a batch.
CLUSTER_CASES = {
    "ragged, B a [k][n] weight": lambda: _matmul(200, 320, 136),
    "ragged, A and B transposed": lambda: _matmul(136, 320, 264, trans_a=True, trans_b=True),
    "shared-weight batch": lambda: _broadcast_batch(3, 70, 32, 136),
}


@needs_emulator
@pytest.mark.parametrize("label", list(CLUSTER_CASES))
def test_clusters_share_an_operand_and_match_the_interpreter(label: str) -> None:
    """Two blocks of a cluster each copy half of the slice they share into both rings
    (multicast) and release every slot on both blocks' barriers: a slot refilled before the
    other block's consumers released it, a wrong half, a block that exits while the other
    still reaches into it, all show in the result or are reported by the emulator.  Both
    shared operands where the case has them, launch per tile and persistent (one cluster and
    two walking every pair of tiles), launched twice."""
    graph, group, feeds, configs = _configs(CLUSTER_CASES[label]())
    chosen = []
    for name in ("a", "b"):
        paired = _best_per_tile(configs, producer=True, multicast=name)[:1]
        chosen += paired + [
            _persistent(c, blocks) for c in paired for blocks in (2, 4) if c.num_blocks > blocks
        ]
    assert {c.stages[0].multicast for c in chosen} == {"a", "b"} or label == "shared-weight batch", chosen
    assert chosen and all(c.num_blocks % 2 == 0 for c in chosen)
    for cfg in chosen:
        kernel = generate_kernel(graph, group, cfg, "probe")
        assert "__cluster_dims__(2, 1, 1)" in kernel.source and "_multicast(" in kernel.source
        assert kernel.grid % 2 == 0
    assert _run(graph, group, chosen, feeds, launches=2) == []


def test_cluster_variant_where_tiles_pair_up() -> None:
    """A large product gets clustered producer configs (when asked for), sharing the larger
    slice estimated no slower than sharing the smaller (it saves the more L2 traffic); the
    pairing axis varies fastest in ``blockIdx.x`` and has an even number of blocks.  An odd
    number of tiles along both axes, a cp.async ring or a later stage gets none."""
    graph, group, _, configs = _configs(_matmul(8192, 768, 3072), topk=1000)
    clustered = [c for c in configs if c.stages[0].multicast]
    assert clustered and all(c.stages[0].producer and c.stages[0].cluster == 2 for c in clustered)
    for cfg in clustered:
        st = cfg.stages[0]
        if st.block_m == st.block_n or st.multicast != ("b" if st.block_n > st.block_m else "a"):
            continue
        other = replace(st, multicast="a" if st.multicast == "b" else "b")
        for twin in (c for c in clustered if c.stages[0] == other):
            assert cfg.estimate.latency_us <= twin.estimate.latency_us, (st, other)
    shape_of = lambda t: graph.tensor(t).shape  # noqa: E731
    region = propagate_group([group.computes[group.root]], group.root, clustered[0].block_tile, shape_of)
    for cfg in clustered:
        st = cfg.stages[0]
        fastest = cfg.block_order[-1]
        assert cfg.grid[fastest] % 2 == 0
        moved = [d for d, lo in enumerate(region.members[group.root].dims) if f"b{fastest}" in lo.lo.coefs]
        assert moved == [0 if st.multicast == "b" else 1], (st, moved)
        lone = next(c for c in configs if c.stages[0] == replace(st, multicast=""))
        assert cfg.estimate.latency_us <= lone.estimate.latency_us
    # One tile (square 64), later stages (the other two): no pairs.
    for other in ("square 64", "QK^T + softmax", "residual add + LayerNorm, sum also written"):
        assert not any(c.stages[0].multicast for c in _configs(other, topk=1000)[3]), other


def test_clusters_are_proposed_only_when_asked_for() -> None:
    """Clustered kernels measured slower than their lone twins on the H100, so the search
    leaves them out unless ``Options.clusters`` is set; the lone variants stay the same."""
    graph, group, _, asked = _configs(_matmul(8192, 768, 3072), topk=1000)
    default = wgmma.KIND.propose(group, _context(graph, topk=1000))
    assert any(c.stages[0].multicast for c in asked)
    assert default and not any(c.stages[0].multicast for c in default)
    lone = [c.stages[0] for c in asked if not c.stages[0].multicast]
    assert [c.stages[0] for c in default][:20] == lone[:20]


#: The mma kind's split-K cases that wgmma takes (16-byte copies, N of 64 or more), and a
#: batched QK^T with a 64-long sequence.
WGMMA_SPLIT_CASES = {
    **{s: f for s, f in SPLIT_CASES.items() if "4-byte" not in s and "QK^T" not in s},
    "batched QK^T + softmax": lambda: _attention_scores(2, 2, 64, 256),
}


@needs_emulator
@pytest.mark.parametrize("label", list(WGMMA_SPLIT_CASES))
def test_wgmma_split_k_matches_the_interpreter(label: str) -> None:
    """Every split-K factor the rule allows for the best tile, launched twice (the arrival
    counters are reset by the last block of each tile)."""
    model, feeds = WGMMA_SPLIT_CASES[label]()
    graph = import_onnx(model)
    group = _whole_group(graph)
    ctx = _context(graph, topk=200)
    base = next(c for c in wgmma.KIND.propose(group, ctx) if c.stages[0].splits == 1)
    st = base.stages[0]
    con = contraction(group.computes[st.node], ctx.shape_of)
    configs = [
        replace(base, stages=[replace(st, splits=s), *base.stages[1:]])
        for s in split_choices(con, st, base.num_blocks, ctx)
    ]
    assert len(configs) >= 2, f"{label}: too few split-K factors to test"
    assert _run(graph, group, configs, feeds, launches=2) == []


def test_wgmma_only_on_compute_capability_9_0() -> None:
    """sm_90a code runs on 9.0 alone: an A100 and a B200-like 10.0 get no wgmma config,
    and the search picks it on the H100 for a large product when measured families share."""
    model, _ = _matmul(512, 256, 512)
    graph = import_onnx(model)
    group = _whole_group(graph)
    h100 = _context(graph)
    assert wgmma.KIND.propose(group, h100)
    for name in ("A100",):
        other = ScheduleContext(h100.shape_of, h100.dtype_of, get_arch(name), h100.options)
        assert wgmma.KIND.propose(group, other) is None
    later = replace(get_arch("H100"), compute_capability=(10, 0))
    assert (
        wgmma.KIND.propose(group, ScheduleContext(h100.shape_of, h100.dtype_of, later, h100.options)) is None
    )
    families = {c.stages[0].family for c in propose(group, _context(graph, topk=8))}
    assert "wgmma" in families


def test_ring_slots_are_swizzle_atoms() -> None:
    """Every slot of both operands' rings starts on a 1024-byte atom (the swizzle is of the
    absolute shared address), and the kernel is marked for sm_90a."""
    graph, group, _, configs = _configs("bias + GELU, product also written")
    for cfg in configs:
        st = cfg.stages[0]
        assert st.pipeline_offset % wgmma.ATOM_BYTES == 0
        assert (st.block_m * st.block_k * 2) % wgmma.ATOM_BYTES == 0
        assert (st.block_n * st.block_k * 2) % wgmma.ATOM_BYTES == 0
    kernel = generate_kernel(graph, group, configs[0], "probe")
    assert kernel.arch_specific and "welder_wgmma.cuh" in kernel.source


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_generated_kernels_compile_to_wgmma(tmp_path) -> None:
    """nvcc compiles a generated kernel for sm_90a, and its PTX holds the warpgroup
    instructions the template meant (and no local-memory spills in the SASS statistics)."""
    graph, group, _, configs = _configs(_matmul(256, 256, 256))
    kernel = generate_kernel(graph, group, configs[0], "wg_probe")
    src = tmp_path / "k.cu"
    src.write_text(kernel.source)
    ptx = tmp_path / "k.ptx"
    subprocess.run(
        ["nvcc", "-arch=sm_90a", "-ptx", f"-I{TEMPLATE_DIR}", str(src), "-o", str(ptx)],
        check=True,
        capture_output=True,
    )
    text = ptx.read_text()
    for instruction in (
        "wgmma.mma_async",
        "wgmma.fence",
        "wgmma.commit_group",
        "wgmma.wait_group",
        "cp.async",
    ):
        assert instruction in text, instruction
    done = subprocess.run(
        [
            "nvcc",
            "-arch=sm_90a",
            "-cubin",
            "-Xptxas",
            "-v",
            f"-I{TEMPLATE_DIR}",
            str(src),
            "-o",
            str(tmp_path / "k.cubin"),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    spills = re.findall(r"(\d+) bytes spill stores", done.stderr)
    assert spills and all(int(s) == 0 for s in spills), done.stderr


def test_runtime_with_wgmma_kernels_builds_for_sm_90a(tmp_path) -> None:
    """A runtime holding a wgmma kernel compiles it for sm_90a (its CMakeLists says so) and
    refuses, at configure time and naming the reason, an architecture other than 9.0; one
    without wgmma kernels is unchanged."""
    from welder.runtime.build import emitted_cuda_arch
    from welder.runtime.emit import emit_runtime

    graph, group, _, configs = _configs(_matmul(256, 256, 256))
    kernel = generate_kernel(graph, group, configs[0], "welder_k0_y")
    out = emit_runtime(tmp_path / "auto", graph, [(group, configs[0])], [kernel], None)
    assert emitted_cuda_arch(out) is None  # the GPU present decides, not the sm_90a switch
    out = emit_runtime(tmp_path / "wg", graph, [(group, configs[0])], [kernel], "90")
    assert emitted_cuda_arch(out) == "90"
    cmake = (out / "CMakeLists.txt").read_text()
    assert "arch=compute_90a,code=sm_90a" in cmake and "wgmma" in cmake
    plain_cfg = next(c for c in propose(group, _context(graph, topk=8)) if c.stages[0].kind == "mma")
    plain = generate_kernel(graph, group, plain_cfg, "welder_k0_y")
    assert not plain.arch_specific
    plain_out = emit_runtime(tmp_path / "mma", graph, [(group, plain_cfg)], [plain], "90")
    assert "sm_90a" not in (plain_out / "CMakeLists.txt").read_text()
    if shutil.which("cmake") is None or shutil.which("nvcc") is None:
        return
    # (test_wgmma_kernels_of_several_files_build_for_sm_90a builds such a runtime with nvcc)
    done = subprocess.run(
        [
            "cmake",
            "-S",
            str(tmp_path / "wg" / "nnfusion_rt" / "cuda_codegen"),
            "-B",
            str(tmp_path / "b"),
            "-DCMAKE_CUDA_ARCHITECTURES=80",
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode != 0 and "compute capability 9.0 only" in done.stderr.replace("\n", " ")


#: maps, TMA stores and clusters of two.
CHAIN_VARIANTS = (
    lambda st: not st.producer and st.splits == 1,
    lambda st: not st.producer and st.splits == 2,
    lambda st: st.producer and not st.multicast and not st.tma_store,
    lambda st: st.producer and not st.multicast and st.tma_store,
    lambda st: st.multicast == "a" and not st.tma_store,
    lambda st: st.multicast == "b" and st.tma_store,
    lambda st: st.producer and not st.multicast and not st.tma_store,
    lambda st: not st.producer and st.splits == 1,
)


def _wgmma_chain(prefix):
    """Eight chained fp16 products, each its own group and wgmma kernel (CHAIN_VARIANTS), as a
    runtime emitted for sm_90 into ``prefix``: (graph, feeds, runtime folder, spec)."""
    import numpy as np
    from onnx import helper
    from onnx_util import make_model
    from test_mma import _h

    from welder.codegen import generate_model
    from welder.runtime.emit import emit_runtime
    from welder.runtime.spec import runtime_spec
    from welder.schedule.group import make_group

    x = _h(200, 320)
    weights = {f"w{k}": _h(320, 320) for k in range(len(CHAIN_VARIANTS))}
    nodes = [
        helper.make_node("MatMul", [f"y{k - 1}" if k else "x", f"w{k}"], [f"y{k}"])
        for k in range(len(weights))
    ]
    graph = import_onnx(make_model(nodes, {"x": x}, [f"y{len(nodes) - 1}"], weights, opset=17))
    ctx = replace(_context(graph, topk=400), options=Options(topk=400, clusters=True))
    groups = []
    for node, wanted in zip(graph.nodes, CHAIN_VARIANTS):
        group = make_group(graph, [node])
        cfg = next(c for c in wgmma.KIND.propose(group, ctx) if wanted(c.stages[0]))
        groups.append((group, cfg))
    kernels = generate_model(graph, groups)
    out = emit_runtime(prefix, graph, groups, kernels, "90")
    return graph, {"x": np.asarray(x)}, out, runtime_spec(graph, groups, kernels, "90")


@needs_nvcc_build
def test_wgmma_kernels_of_several_files_build_for_sm_90a(tmp_path) -> None:
    """wgmma kernels spread over several kernel files compile for sm_90a, each file on its
    own, and link with nnfusion_rt.cu, which declares them with their TMA map parameters and
    opts them into their shared memory (no GPU needed)."""
    from welder.runtime.layout import kernel_sources

    _, _, out, spec = _wgmma_chain(tmp_path / "chain")
    assert spec.arch_specific and spec.uses_tma and len(spec.kernel_files) > 1
    kernels = "".join(f.read_text() for f in kernel_sources(out))
    assert kernels.count("WELDER_CLUSTER_DIMS(") == 2 and "_partials[" in kernels
    host = (out / "nnfusion_rt.cu").read_text()
    opt_ins = sum(k.needs_smem_opt_in for k in spec.launches)
    assert host.count("cudaFuncAttributeMaxDynamicSharedMemorySize,") == opt_ins > 0
    assert host.count("const __grid_constant__ CUtensorMap") == sum(len(k.maps) for k in spec.launches) > 0
    build = tmp_path / "build90"
    configure = ["cmake", "-S", str(out), "-B", str(build), "-DCMAKE_CUDA_ARCHITECTURES=90"]
    subprocess.run(configure, check=True, capture_output=True)
    made = subprocess.run(["cmake", "--build", str(build), "--parallel"], capture_output=True, text=True)
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    assert (build / "main_test").is_file()
    flags = (build / "CMakeFiles" / "nnfusion_naive_rt.dir" / "flags.make").read_text()
    assert "arch=compute_90a,code=sm_90a" in flags


@needs_gpu
def test_wgmma_kernels_of_several_files_run_on_the_gpu(tmp_path) -> None:
    """The same runtime on the GPU: launched from nnfusion_rt.cu, the kernels of the other
    translation units get their shared memory, clusters and TMA maps, and the chain's result,
    plain and replayed from a CUDA graph, matches the interpreter."""
    from welder.check import error_metric, threshold_for
    from welder.runtime.build import build_runtime
    from welder.runtime.library import RuntimeLibrary

    graph, feeds, out, _ = _wgmma_chain(tmp_path / "chain")
    build_runtime(out)
    reference = graph.run(feeds)
    with RuntimeLibrary(out) as lib:
        for graph_mode in (False, True):
            lib.use_cuda_graph(graph_mode)
            for name, value in lib.run(feeds).items():
                assert error_metric(value, reference[name]) <= threshold_for("float16"), name


def test_mma_why_explains_the_wgmma_kind(tmp_path) -> None:
    """``scripts/mma_why.py --kind wgmma`` walks the wgmma rule's checks over a tuned plan:
    the product is accepted and gets configs, and ``--all`` lists its block tiles' verdicts
    (the deepest rings of the 256-wide tiles rejected for their shared memory)."""
    import sys
    from pathlib import Path

    import onnx

    from welder.cli import main

    model, _ = _matmul(200, 256, 512)
    onnx.save(model, str(tmp_path / "model.onnx"))
    argv = ["tune", str(tmp_path), "--arch", "H100", "--cost-model", "--topk", "1", "--no-build"]
    assert main(argv) == 0
    script = Path(__file__).resolve().parents[1] / "scripts" / "mma_why.py"
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path), "--kind", "wgmma", "--all"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "1 groups with an accepted contraction, 1 with configs" in done.stdout
    # 256 x 128 is a wgmma tile only (two warpgroups of two m64 pieces); its deepest rings
    # exceed the shared memory
    assert re.search(r"256 x 128 smem: \d+ bytes > \d+", done.stdout), done.stdout


@needs_emulator
@pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake")
@pytest.mark.parametrize("variant", ["lone", "clustered, persistent, TMA-stored"])
def test_runtime_with_producer_kernels_runs_on_the_emulator(tmp_path, variant: str) -> None:
    """A runtime whose kernel takes TMA maps encodes them at each launch (and inside the CUDA
    graph it captures), here built for the emulator: twice through the graph, on new inputs
    the second time, against the interpreter.  The second kernel's maps include one over its
    output (the TMA store), and its launch carries the cluster dims, which the kernel's file
    (kernels_0.cu) registers for the launch in nnfusion_rt.cu, another translation unit."""
    import numpy as np

    from welder.check import error_metric, threshold_for
    from welder.runtime.build import build_runtime
    from welder.runtime.emit import emit_runtime
    from welder.runtime.layout import runtime_sources
    from welder.runtime.library import RuntimeLibrary

    if variant == "lone":
        graph, group, feeds, configs = _configs("A transposed (Gemm)")
        cfg = _best_per_tile(configs, producer=True)[0]
    else:
        graph, group, feeds, configs = _configs(CLUSTER_CASES["ragged, B a [k][n] weight"]())
        paired = next(c for c in configs if c.stages[0].multicast and c.stages[0].tma_store)
        cfg = _persistent(paired, 2)
    kernel = generate_kernel(graph, group, cfg, "welder_k0_y")
    assert kernel.tensor_maps
    out = emit_runtime(tmp_path / "rt", graph, [(group, cfg)], [kernel], "90")
    host, kernels = (path.read_text() for path in runtime_sources(out))  # one kernel, one kernel file
    assert "welder_encode_tensor_map" in host and "const __grid_constant__ CUtensorMap" in host
    if variant != "lone":
        assert "WELDER_CLUSTER_DIMS(welder_k0_y, 2)" in kernels and "welder_tma_store_2d(" in kernels
    build_runtime(out, emulate=True)
    rng = np.random.default_rng(3)
    with RuntimeLibrary(out) as lib:
        for run in range(2):
            if run:
                feeds = {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in feeds.items()}
            ours = lib.run(feeds)
            reference = graph.run(feeds)
            for name, value in ours.items():
                assert error_metric(value, reference[name]) <= threshold_for("float16"), name


@needs_emulator
def test_elementwise_consumers_run_on_the_accumulators() -> None:
    """A product's elementwise consumers -- bias and GELU with the product also written;
    bias, a residual input, ReLU and a cast to fp32 -- become the contraction's epilogue
    under both tensor-core kinds: one stage, no tile in shared memory, each output stored
    from the accumulators, right under several block tiles (ragged edges: the epilogue's
    reads of the bias and the residual stay in range).  A reduction after the product
    (LayerNorm) or a read of other points of it (softmax's row) keeps its SIMT stage."""
    from test_mma import CASES as MMA_CASES

    from welder.schedule.kinds import mma

    for label in ("bias + GELU, product also written", "bias, residual, ReLU, cast to fp32, ragged"):
        model, feeds = MMA_CASES[label]()
        graph = import_onnx(model)
        group = _whole_group(graph)
        for rule in (mma.KIND, wgmma.KIND):
            configs = rule.propose(group, _context(graph, topk=100))
            assert configs, (label, rule.name)
            for cfg in configs:
                st = cfg.stages[0]
                assert len(cfg.stages) == 1 and st.epilogue == group.stages[1:] and st.smem_offset is None
            tiles = {}
            for cfg in configs:
                tiles.setdefault(cfg.stages[0].block, cfg)
            chosen = list(tiles.values())[:3]
            kernel = generate_kernel(graph, group, chosen[0], "probe")
            assert "tile0" not in kernel.source and "res[" in kernel.source
            assert _run(graph, group, chosen, feeds) == [], (label, rule.name)
    for label in ("residual add + LayerNorm, sum also written", "QK^T + softmax"):
        graph, group, _, configs = _configs(label)
        assert configs and all(len(c.stages) == len(group.stages) > 1 for c in configs), label
        assert not any(c.stages[0].epilogue for c in configs), label


def test_a_large_product_with_a_bias_gets_the_lone_contraction_variants() -> None:
    """With its bias and activation on the accumulators, a large fully connected layer is a
    lone contraction: persistent and clustered producer configs apply to it."""
    import numpy as np
    from onnx import helper
    from onnx_util import make_model

    rng = np.random.default_rng(0)
    x = rng.standard_normal((8192, 768)).astype(np.float16)
    consts = {"w": rng.standard_normal((768, 3072)).astype(np.float16), "b": np.ones(3072, np.float16)}
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["m"]),
        helper.make_node("Add", ["m", "b"], ["a"]),
        helper.make_node("Relu", ["a"], ["y"]),
    ]
    model = make_model(nodes, {"x": x}, ["y"], consts, opset=17)
    configs = _configs((model, {"x": x}), 1000)[3]
    assert any(c.stages[0].persistent for c in configs) and any(c.stages[0].multicast for c in configs)
    assert all(c.stages[0].epilogue == ("y",) for c in configs)


#: Outputs through TMA stores: both major-nesses, ragged M and N (the stores clip), an
#: epilogue's output (bias, residual, ReLU), a batch of products (a 3-d output map).
STORE_CASES = {
    "ragged, B a [k][n] weight": lambda: _matmul(200, 320, 136),
    "ragged, A and B transposed": lambda: _matmul(136, 320, 264, trans_a=True, trans_b=True),
    "bias and GELU on the accumulators": lambda: CASES["bias + GELU, product also written"](),
    "shared-weight batch": lambda: _broadcast_batch(3, 70, 32, 136),
}


def _epilogue_only(label: str):
    """The case with only its last epilogue stage as an output (one output: a TMA store's)."""
    model, feeds = STORE_CASES[label]()
    if label == "bias and GELU on the accumulators":
        del model.graph.output[1]  # the product
    return model, feeds


@needs_emulator
@pytest.mark.parametrize("label", list(STORE_CASES))
def test_tma_stores_match_the_interpreter(label: str) -> None:
    """Each consumer warp stages its strips of the tile in swizzled panels and stores them
    with TMA: a wrong swizzle, panel or row, a store issued before the strip is fenced or
    before the warp's lanes meet, a strip rewritten before its stores read it (a persistent
    block's next tile), all show.  Launch per tile, persistent (two blocks walking every
    tile) and in clusters where the tiles pair up; launched twice."""
    graph, group, feeds, configs = _configs(_epilogue_only(label))
    stored = [c for c in configs if c.stages[0].tma_store]
    assert stored and all(c.stages[0].producer for c in stored)
    chosen = _best_per_tile(stored, producer=True)[:2]
    chosen += [_persistent(c, 2) for c in chosen[:1] if c.num_blocks > 2]
    chosen += [c for c in stored if c.stages[0].multicast and not c.stages[0].persistent][:1]
    for cfg in chosen:
        kernel = generate_kernel(graph, group, cfg, "probe")
        assert "welder_tma_store_" in kernel.source and len(kernel.tensor_maps) == 3
    assert _run(graph, group, chosen, feeds, launches=2) == []


def test_tma_stores_only_where_one_16_bit_output_follows_the_contraction() -> None:
    """A later SIMT stage (LayerNorm), two outputs (the product and its GELU) or an fp32
    output (a cast on the accumulators) keep the direct stores; the staging fits shared
    memory after the ring and its barriers, on a swizzle atom."""
    for label in ("residual add + LayerNorm, sum also written", "bias + GELU, product also written"):
        assert not any(c.stages[0].tma_store for c in _configs(label)[3]), label
    from test_mma import CASES as MMA_CASES

    model, _ = MMA_CASES["bias, residual, ReLU, cast to fp32, ragged"]()
    del model.graph.output[1]
    assert not any(c.stages[0].tma_store for c in _configs((model, {}))[3])
    arch = get_arch("H100")
    for cfg in _configs(_matmul(8192, 768, 3072), topk=1000)[3]:
        st = cfg.stages[0]
        if st.tma_store:
            assert st.staging_offset % wgmma.ATOM_BYTES == 0
            assert st.staging_offset >= st.barrier_offset + 2 * st.pipeline * wgmma.MBARRIER_BYTES
            assert cfg.smem_bytes >= st.staging_offset + st.block_m * st.block_n * 2
            assert cfg.smem_bytes <= arch.smem_per_block
