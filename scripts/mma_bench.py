"""welder's matrix-product kernels beside cuBLAS (``torch.matmul``) on the same shapes, in one run:
the tensor-core kinds in fp16 or TF32; in fp32 the ``ffma`` kind and ``mma_tf32x3`` (three TF32
products a piece, fp32's accuracy) beside cuBLAS's exact SGEMM.

For each shape the best ``--candidates`` configs (cost model order) of each tensor-core kind
named by ``--kinds`` (``mma``, and ``wgmma`` on an H100) are
generated, compiled into one cubin with nvcc and timed; the fastest is reported beside
``torch.matmul`` on the same inputs, with the floor max(FLOPs / peak, bytes / bandwidth)
from the arch description.  Timing: 200 back-to-back launches captured in one CUDA graph,
replayed between one pair of CUDA events, inputs rotated over enough copies to exceed twice
the L2 cache (so weights come from DRAM as in a model), median of repeats.  Every welder
kernel's output is checked against torch's first.  ``--json`` writes the rows; ``--ptxas``
prints registers and spills.

    python scripts/mma_bench.py [--candidates 8] [--kinds mma,wgmma] [--shapes 0,1,2] [--dtype fp16|tf32|fp32]
                                [--json out.json]

Needs a GPU with torch and cupy (the GPU machine has both).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import onnx
from onnx import TensorProto, helper

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from welder.arch import match_gpu_name  # noqa: E402
from welder.codegen import generate_kernel, model_source  # noqa: E402
from welder.device.gpu import RawModule, compile_cubin, nvcc_path, sm_arch  # noqa: E402
from welder.frontend.onnx import import_onnx  # noqa: E402
from welder.resources import TEMPLATE_DIR  # noqa: E402
from welder.schedule.group import make_group  # noqa: E402
from welder.schedule.kinds import Options, ScheduleContext, ffma, kind, mma, propose, tf32x3  # noqa: E402

#: (batch, M, K, N): BERT-base at sequence 128, batch 1 (QKV, FFN up and down) and batch 64
#: (8192 rows), and attention's per-head products (12 heads of 128 x 64 x 128).
SHAPES = [
    (1, 128, 768, 2304),
    (1, 128, 768, 3072),
    (1, 128, 3072, 768),
    (1, 8192, 768, 3072),
    (1, 8192, 3072, 768),
    (12, 128, 64, 128),
    (1, 50, 384, 1152),
    (1, 50, 1536, 384),
    # Swin-T at batch 64: stage 1's QKV (200704 tokens of 96 channels), stage 3's FFN.
    (1, 200704, 96, 288),
    (1, 12544, 384, 1536),
    (1, 12544, 1536, 384),
    # ViT-S/32 at batch 64 as one flat product (3200 tokens): FFN up.
    (1, 3200, 384, 1536),
]


@dataclass
class Row:
    shape: str
    floor_us: float
    welder_us: float
    cublas_us: float
    ratio: float  # welder / cuBLAS: 1.0 is parity, above is slower
    welder_tflops: float
    cublas_tflops: float
    config: str
    max_error: float
    candidates: int
    timings: list  # every candidate: kind, config, measured and predicted microseconds
    best_by_kind: dict  # kind: its fastest candidate's microseconds


#: Per --dtype: the ONNX element type, the kinds (fp16: --kinds), torch's dtype name, element
#: bytes, the arch's peak field and the check's threshold (welder.check.THRESHOLDS).
FORMATS = {
    "fp16": (TensorProto.FLOAT16, (mma.KIND,), "half", 2, "fp16_tc_tflops", 2e-2),
    "tf32": (TensorProto.FLOAT, (mma.TF32_KIND,), "float", 4, "tf32_tc_tflops", 2e-3),
    "fp32": (TensorProto.FLOAT, (ffma.KIND, tf32x3.KIND), "float", 4, "fp32_tflops", 1e-4),
}


def model(batch: int, m: int, k: int, n: int, dtype: str = "fp16") -> onnx.ModelProto:
    a_shape = [batch, m, k] if batch > 1 else [m, k]
    b_shape = [batch, k, n] if batch > 1 else [k, n]
    c_shape = [batch, m, n] if batch > 1 else [m, n]
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "b"], ["c"])],
        "mm",
        [
            helper.make_tensor_value_info("a", FORMATS[dtype][0], a_shape),
            helper.make_tensor_value_info("b", FORMATS[dtype][0], b_shape),
        ],
        [helper.make_tensor_value_info("c", FORMATS[dtype][0], c_shape)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def bench_configs(kind_name: str, proposed: list, candidates: int, tiles: int) -> list:
    """Of one kind's proposals (best first), the configs to time: the best ``candidates`` of
    each family (the TMA family's persistent or launch-per-tile, clustered or lone,
    TMA-stored or directly stored ones apart; split-K; the ffma kind's sixteen-warp
    blocks), then the best of ``tiles`` other block and warp
    tiles, beyond the model's favourites."""
    configs = [c for c in proposed if c.stages[0].family == kind_name][:candidates]
    tma: dict[tuple[bool, int, bool], list] = {}
    for c in proposed:
        st = c.stages[0]
        if "/tma" in st.family:
            tma.setdefault((bool(st.persistent), st.cluster, st.tma_store), []).append(c)
    for variant in tma.values():
        configs += variant[:candidates]
    configs += [c for c in proposed if c.stages[0].splits > 1][:candidates]
    others = {c.stages[0].family for c in proposed} - {kind_name}
    for family in sorted(f for f in others if "/tma" not in f and not f.endswith("/split-k")):
        configs += [c for c in proposed if c.stages[0].family == family][:candidates]
    seen = {tile_of(c) for c in configs}
    for c in proposed if tiles else ():
        if tile_of(c) not in seen and len(seen) < candidates + tiles:
            seen.add(tile_of(c))
            configs.append(c)
    return configs


def tile_of(cfg) -> tuple:
    """A config's block tile, warp grid and splits: what sets its register and shared-memory use."""
    st = cfg.stages[0]
    return (st.block_m, st.block_n, tuple(st.warps), st.splits)


def describe(cfg) -> str:
    """A config in one line: a tensor-core stage's tiles, warps, ring depth, split, copy
    width and Hopper options, or the SIMT block tile."""
    st = cfg.stages[0]
    if not isinstance(st, mma.MmaConfig):
        return f"simt tile {'x'.join(map(str, cfg.block_tile))} threads {cfg.threads}"
    return (
        f"{st.block_m}x{st.block_n}x{st.block_k} w{st.warps[0]}x{st.warps[1]} "
        f"p{st.pipeline} s{st.splits} cp{st.copy_bytes}"
        + (" tma" if getattr(st, "producer", False) else "")
        + (f" persistent {st.persistent}" if st.persistent else "")
        + (f" cluster {st.cluster} shares {st.multicast.upper()}" if st.cluster > 1 else "")
        + (" tma-store" if getattr(st, "tma_store", False) else "")
    )


def max_error(value, reference) -> float:
    """The design's metric: max |a - b| / max(|b|, 1)."""
    return ((value.float() - reference.float()).abs() / reference.float().abs().clamp(min=1)).max().item()


def error_of_one_launch(launch, out, reference, turn: list[int], copies: int) -> float:
    """:func:`max_error` of ``out`` after one ``launch`` on the first input copy (the one
    ``reference`` was computed from); ``out`` is filled with NaN first, so every element
    must be written."""
    import torch

    out.fill_(float("nan"))
    turn[0] = copies - 1  # launches advance the turn before reading
    launch()
    torch.cuda.synchronize()
    return max_error(out, reference)


def bench_device() -> tuple[str, object, str]:
    """The GPU's name, the arch description matching it and its nvcc target; printed."""
    import torch

    name = torch.cuda.get_device_name()
    arch = match_gpu_name(name)
    target = sm_arch(torch.cuda.get_device_capability())
    print(f"device: {name} ({target}); cost model {arch.name}", flush=True)
    return name, arch, target


def report(name: str, rows: list, columns: dict, best: str, json_path: str | None) -> None:
    """Prints one line per row (``columns``: heading -> field, microseconds; then ``best``
    as a share of the floor) and writes the rows to ``json_path`` where given."""
    import dataclasses

    print(f"\n{'case':<24}" + "".join(f" {h:>10}" for h in columns) + f" {'of floor':>9}")
    for r in rows:
        cells = "".join(f" {getattr(r, f):>10.2f}" for f in columns.values())
        print(f"{r.case:<24}{cells} {r.floor_us / getattr(r, best):>9.0%}")
    if json_path:
        rows_json = [dataclasses.asdict(r) for r in rows]
        Path(json_path).write_text(json.dumps({"device": name, "rows": rows_json}, indent=1))


def generated_kernel_launch(module, kernel, graph, feeds: list[dict], out, turn: list[int]):
    """A launch of generated ``kernel`` (of ``module``, a cupy RawModule) on the next of the
    rotated input copies ``feeds`` (tensors by name; ``turn[0]`` is the copy last used),
    writing ``out``; the model's constants among its parameters are uploaded once."""
    import cupy
    import numpy as np
    import torch

    fn = module.get_function(kernel.name)
    if kernel.smem_bytes > 48 * 1024:
        fn.max_dynamic_shared_size_bytes = kernel.smem_bytes
    constants = {
        p.tensor: torch.from_numpy(np.array(graph.constants[p.tensor])).cuda()
        for p in kernel.params
        if p.tensor in graph.constants
    }

    def launch() -> None:
        i = turn[0] = (turn[0] + 1) % len(feeds)
        tensors = [
            out if p.is_output else constants.get(p.tensor, feeds[i].get(p.tensor)) for p in kernel.params
        ]
        fn(
            (kernel.grid,),
            (kernel.threads,),
            tuple(cupy.uint64(t.data_ptr()) for t in tensors),
            shared_mem=kernel.smem_bytes,
            stream=cupy.cuda.get_current_stream(),
        )

    return launch


def profiled_once(launch) -> float:
    """One launch between cudaProfilerStart and cudaProfilerStop, so that ``ncu
    --profile-from-start off`` sees each kernel once; no time (NaN)."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    launch()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return math.nan


def time_us(launch, count: int = 200, repeats: int = 7) -> float:
    """Median per-launch time of ``count`` launches captured in one CUDA graph, replayed
    between one pair of events (a host loop would time Python and the launch path, not the
    kernel: a small product takes a few microseconds, a Python call about ten)."""
    import cupy
    import torch

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), cupy.cuda.ExternalStream(stream.cuda_stream):
        launch()  # warm-up: module load, cuBLAS handle and workspace, outside the capture
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream), cupy.cuda.ExternalStream(stream.cuda_stream):
            for _ in range(count):
                launch()
        graph.replay()
        stream.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        samples = []
        for _ in range(repeats):
            start.record(stream)
            graph.replay()
            end.record(stream)
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3 / count)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--candidates",
        type=int,
        default=8,
        help="mma configs timed per shape: the cost model's best unsplit and best split-K, this many of each",
    )
    parser.add_argument(
        "--tiles",
        type=int,
        default=0,
        help="also time the best config of this many other block and warp tiles (the cost model's "
        "ranking of tiles is what a kernel study checks)",
    )
    parser.add_argument(
        "--simt", action="store_true", help="also time the SIMT kind's best --candidates configs"
    )
    parser.add_argument(
        "--kinds",
        default="mma",
        help="comma-separated tensor-core kinds to time side by side (fp16: mma, wgmma); default mma",
    )
    parser.add_argument("--shapes", help="comma-separated indices into the shape list (default: all)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--ptxas", action="store_true", help="print ptxas' register and spill report")
    parser.add_argument(
        "--clusters",
        action="store_true",
        help="also time the clustered (TMA multicast) variants, which the search leaves out by default",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="launch each kernel (and cuBLAS) once inside a profiler range instead of timing it: "
        "run under `ncu --profile-from-start off` (scripts/ncu_mma.sh)",
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(FORMATS),
        default="fp16",
        help="fp16 (default); tf32: fp32 operands on the mma_tf32 kind beside cuBLAS with TF32 allowed; "
        "fp32: the exact ffma kind (CUDA cores) beside cuBLAS's exact SGEMM",
    )
    args = parser.parse_args(argv)

    import cupy
    import torch

    _, base_kinds, tname, item, peak, limit = FORMATS[args.dtype]
    kinds = list(base_kinds) if args.dtype != "fp16" else [kind(name) for name in args.kinds.split(",")]
    tdtype = getattr(torch, tname)
    torch.backends.cuda.matmul.allow_tf32 = args.dtype == "tf32"

    name = torch.cuda.get_device_name()
    arch = match_gpu_name(name)
    capability = torch.cuda.get_device_capability()
    sm = sm_arch(capability)
    l2 = arch.l2_bytes
    print(f"device: {name} ({sm}); cost model {arch.name}; torch {torch.__version__}", flush=True)
    rows = []
    work_dir = Path(tempfile.mkdtemp(prefix="welder-mma-bench-"))
    shapes = [SHAPES[int(i)] for i in args.shapes.split(",")] if args.shapes else SHAPES
    for batch, m, k, n in shapes:
        graph = import_onnx(model(batch, m, k, n, args.dtype))
        group = make_group(graph, list(graph.nodes))
        ctx = ScheduleContext(
            lambda t, g=graph: g.tensor(t).shape,
            lambda t, g=graph: g.tensor(t).dtype,
            arch,
            Options(topk=100_000, clusters=args.clusters),
        )
        configs = []
        for rule in kinds:
            configs += bench_configs(rule.name, rule.propose(group, ctx) or [], args.candidates, args.tiles)
        if args.simt:  # the SIMT kind's best too: the cross-kind ranking is the cost model's weakest
            simt_ctx = ScheduleContext(
                ctx.shape_of, ctx.dtype_of, arch, Options(topk=args.candidates, kinds=("simt",))
            )
            configs += propose(group, simt_ctx)
        kernels = [generate_kernel(graph, group, cfg, f"mma_bench_{j}") for j, cfg in enumerate(configs)]
        source = model_source(kernels)
        target = sm_arch(capability, arch_specific=any(kn.arch_specific for kn in kernels))
        cubin = compile_cubin(source, target)
        raw = RawModule(cubin)  # kernels with tensor maps, launched from torch's context
        if args.ptxas:
            with tempfile.TemporaryDirectory() as work:
                src = Path(work) / "k.cu"
                src.write_text(source)
                report = subprocess.run(
                    [
                        nvcc_path(),
                        "-cubin",
                        "-O3",
                        f"-arch={target}",
                        f"-I{TEMPLATE_DIR}",
                        "-Xptxas",
                        "-v",
                        str(src),
                        "-o",
                        str(Path(work) / "k.cubin"),
                    ],
                    capture_output=True,
                    text=True,
                ).stderr
            print("\n".join(ln for ln in report.splitlines() if re.search(r"registers|spill", ln)))
        path = work_dir / f"shape{len(rows)}.cubin"  # cupy loads the module lazily: keep the file
        path.write_bytes(cubin)
        module = cupy.RawModule(path=str(path))

        a_elems, b_elems = batch * m * k, batch * k * n
        copies = max(1, math.ceil(2 * l2 / ((a_elems + b_elems) * item)))
        gen = torch.Generator(device="cuda").manual_seed(0)
        a = [torch.randn(batch, m, k, device="cuda", generator=gen).to(tdtype) for _ in range(copies)]
        b = [
            torch.randn(batch, k, n, device="cuda", generator=gen).to(tdtype) / math.sqrt(k)
            for _ in range(copies)
        ]
        c = torch.empty(batch, m, n, device="cuda", dtype=tdtype)
        reference = torch.matmul(a[0], b[0])
        turn = [0]
        operands = {"a": a, "b": b, "c": [c] * copies}

        def torch_launch(turn=turn, a=a, b=b, c=c, copies=copies):
            i = turn[0] = (turn[0] + 1) % copies
            torch.matmul(a[i], b[i], out=c)

        timer = profiled_once if args.profile else time_us
        cublas_us = timer(torch_launch)

        best = None
        best_by_kind: dict[str, float] = {}
        timings: list[dict] = []
        for kernel, cfg in zip(kernels, configs):
            fn = module.get_function(kernel.name)
            if kernel.smem_bytes > 48 * 1024:
                fn.max_dynamic_shared_size_bytes = kernel.smem_bytes
            params = [p.tensor for p in kernel.params]

            def launch(
                fn=fn, kernel=kernel, params=params, operands=operands, turn=turn, copies=copies, raw=raw
            ):
                i = turn[0] = (turn[0] + 1) % copies
                if kernel.tensor_maps:  # parameters by pointer (see welder.device.gpu.RawModule)
                    pointers = [operands[t][i].data_ptr() for t in params]
                    args = [*pointers, *kernel.tensor_maps]
                    stream = cupy.cuda.get_current_stream().ptr
                    raw.launch(kernel.name, kernel.grid, kernel.threads, kernel.smem_bytes, args, stream)
                    return
                ptrs = tuple(cupy.uint64(operands[t][i].data_ptr()) for t in params)
                fn(
                    (kernel.grid,),
                    (kernel.threads,),
                    ptrs,
                    shared_mem=kernel.smem_bytes,
                    stream=cupy.cuda.get_current_stream(),
                )

            err = error_of_one_launch(launch, c, reference, turn, copies)
            if not math.isfinite(err) or err > limit:
                print(f"  {kernel.name}: WRONG (error {err:.3e}), config {cfg.stages[0]}", flush=True)
                continue
            us = timer(launch)
            # still right after 1400 launches (the split-K counters reset)
            again = error_of_one_launch(launch, c, reference, turn, copies)
            if not math.isfinite(again) or again > limit:
                print(f"  {kernel.name}: WRONG after timing ({again:.3e}), {cfg.stages[0]}", flush=True)
                continue
            st, label = cfg.stages[0], describe(cfg)
            predicted = cfg.estimate.latency_us
            timings.append(
                {"kind": st.kind, "config": label, "measured_us": round(us, 2), "predicted_us": predicted}
            )
            best_by_kind[st.kind] = round(min(us, best_by_kind.get(st.kind, math.inf)), 2)
            if isinstance(st, mma.MmaConfig) and (best is None or us < best[0]):
                best = (us, f"{st.kind} {label}", err)
        flops = 2 * batch * m * n * k
        nbytes = item * batch * (m * k + k * n + m * n)
        floor = max(flops / (getattr(arch, peak) * 1e12), nbytes / (arch.global_bw_gbs * 1e9)) * 1e6
        if best is None:
            print(f"{batch}x{m}x{k}x{n}: no correct welder kernel", flush=True)
            continue
        row = Row(
            f"{batch}x({m}x{k}x{n})" if batch > 1 else f"{m}x{k}x{n}",
            round(floor, 2),
            round(best[0], 2),
            round(cublas_us, 2),
            round(best[0] / cublas_us, 3),
            round(flops / best[0] / 1e6, 1),
            round(flops / cublas_us / 1e6, 1),
            best[1],
            best[2],
            len(configs),
            timings,
            best_by_kind,
        )
        rows.append(row)
        print(
            f"{row.shape}: welder {row.welder_us} us ({row.config}), cuBLAS {row.cublas_us} us; "
            f"best per kind {best_by_kind}",
            flush=True,
        )
        time.sleep(0.1)

    print(
        f"\n{'shape (MxKxN)':<22} {'floor us':>9} {'welder us':>10} {'cuBLAS us':>10} {'ratio':>6} "
        f"{'welder TF/s':>11} {'cuBLAS TF/s':>11}  config"
    )
    for r in rows:
        print(
            f"{r.shape:<22} {r.floor_us:>9} {r.welder_us:>10} {r.cublas_us:>10} {r.ratio:>6} "
            f"{r.welder_tflops:>11} {r.cublas_tflops:>11}  {r.config}"
        )
    if args.json:
        args.json.write_text(json.dumps({"device": name, "rows": [asdict(r) for r in rows]}, indent=1))
    return 0 if len(rows) == len(shapes) else 1


if __name__ == "__main__":
    sys.exit(main())
