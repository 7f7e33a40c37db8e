"""welder's tensor-core convolutions (implicit GEMM) beside cuDNN on the same fp16 shapes, in one run.

For each shape the cost model's best ``--candidates`` configs of each tensor-core kind named by
``--kinds`` (``mma``, and ``wgmma`` on an H100) are generated, compiled into one cubin and
timed; the fastest is reported beside ``torch.nn.functional.conv2d`` (cuDNN, fp16,
channels-first, ``cudnn.benchmark`` on) on the same inputs, with the floor max(FLOPs / peak,
compulsory bytes / bandwidth) from the arch description.  The protocol is
``scripts/mma_bench.py``'s: 200 launches in one CUDA graph, inputs rotated over enough copies
to exceed twice the L2 cache, median of repeats, every welder kernel checked against cuDNN's
output first.

    python scripts/conv_bench.py [--candidates 4] [--kinds mma,wgmma] [--shapes 0,1] [--simt]
                                 [--match REGEX] [--json out.json] [--profile]

``--match`` adds the proposed configs whose one-line description matches (a tuned model's
choice, say, below the cost model's top ``--candidates``); ``--profile`` launches each
kernel once for Nsight Compute (``BENCH=conv_bench scripts/ncu_mma.sh SHAPES CANDIDATES
KINDS``).

Needs a GPU with torch and cupy.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from mma_bench import describe as bench_label  # noqa: E402
from mma_bench import error_of_one_launch, profiled_once, time_us  # noqa: E402

from welder.arch import match_gpu_name  # noqa: E402
from welder.codegen import generate_kernel, model_source  # noqa: E402
from welder.device.gpu import compile_cubin, sm_arch  # noqa: E402
from welder.frontend.onnx import import_onnx  # noqa: E402
from welder.schedule.group import make_group  # noqa: E402
from welder.schedule.kinds import Options, ScheduleContext, kind, mma, propose  # noqa: E402

#: (label, batch, in channels, size, out channels, kernel, stride, pad): ResNet-50's 3x3
#: layers at batch 1 and 64 (the stride-2 one of v1.5 too), its 7x7 stem, MobileNetV2's stem
#: and a Swin-T patch embedding.
SHAPES = [
    ("resnet50 3x3 64@56", 1, 64, 56, 64, 3, 1, 1),
    ("resnet50 3x3 128@28", 1, 128, 28, 128, 3, 1, 1),
    ("resnet50 3x3 256@14", 1, 256, 14, 256, 3, 1, 1),
    ("resnet50 3x3 512@7", 1, 512, 7, 512, 3, 1, 1),
    ("resnet50 3x3 64@56", 64, 64, 56, 64, 3, 1, 1),
    ("resnet50 3x3 128@28", 64, 128, 28, 128, 3, 1, 1),
    ("resnet50 3x3 256@14", 64, 256, 14, 256, 3, 1, 1),
    ("resnet50 3x3 512@7", 64, 512, 7, 512, 3, 1, 1),
    ("resnet50 3x3 s2 128@56", 64, 128, 56, 128, 3, 2, 1),
    ("resnet50 stem 7x7 s2", 1, 3, 224, 64, 7, 2, 3),
    ("resnet50 stem 7x7 s2", 64, 3, 224, 64, 7, 2, 3),
    ("mobilenetv2 stem 3x3 s2", 1, 3, 224, 32, 3, 2, 1),
    ("mobilenetv2 stem 3x3 s2", 64, 3, 224, 32, 3, 2, 1),
    ("swin-t patch 4x4 s4", 1, 3, 224, 96, 4, 4, 0),
    ("swin-t patch 4x4 s4", 64, 3, 224, 96, 4, 4, 0),
    # mobilevit_s at batch 1: each MobileViT block's local 3x3 convolution (conv_kxk) and
    # its fusion of the block's input with the transformer's output (conv_fusion), whose
    # split-K mma kernels measured 3-5x their estimate in the H100 rounds.
    ("mobilevit_s conv_kxk 96@32", 1, 96, 32, 96, 3, 1, 1),
    ("mobilevit_s conv_fusion 192>96@32", 1, 192, 32, 96, 3, 1, 1),
    ("mobilevit_s conv_kxk 128@16", 1, 128, 16, 128, 3, 1, 1),
    ("mobilevit_s conv_fusion 256>128@16", 1, 256, 16, 128, 3, 1, 1),
    ("mobilevit_s conv_kxk 160@8", 1, 160, 8, 160, 3, 1, 1),
    ("mobilevit_s conv_fusion 320>160@8", 1, 320, 8, 160, 3, 1, 1),
]
LIMIT = 2e-2  # welder.check.THRESHOLDS["fp16"]


@dataclass
class Row:
    shape: str
    floor_us: float
    welder_us: float
    cudnn_us: float
    ratio: float  # welder / cuDNN: 1.0 is parity, above is slower
    welder_tflops: float
    cudnn_tflops: float
    config: str
    max_error: float
    timings: list
    best_by_kind: dict


def describe(cfg) -> str:
    """mma_bench's one-line config, after its kind for a tensor-core stage."""
    st = cfg.stages[0]
    return f"{st.kind} {bench_label(cfg)}" if isinstance(st, mma.MmaConfig) else bench_label(cfg)


def conv_model(batch: int, cin: int, size: int, cout: int, k: int, s: int, p: int, seed: int = 0):
    """``Conv(x, w)`` with constant weights, and the weights."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((cout, cin, k, k)) / math.sqrt(cin * k * k)).astype(np.float16)
    out = (size + 2 * p - k) // s + 1
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], strides=[s, s], pads=[p] * 4)],
        "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [batch, cin, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [batch, cout, out, out])],
        [numpy_helper.from_array(w, "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), w, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--candidates", type=int, default=4, help="configs timed per kind and shape")
    parser.add_argument("--kinds", default="mma,wgmma", help="tensor-core kinds (wgmma needs an H100)")
    parser.add_argument("--simt", action="store_true", help="also time the SIMT kind's best configs")
    parser.add_argument("--shapes", help="comma-separated indices into the shape list (default: all)")
    parser.add_argument(
        "--match",
        help="also time every proposed tensor-core config whose description (as printed, e.g. "
        "'mma 64x32x128 w2x1 p4 s6 cp16') matches this regular expression",
    )
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="launch each kernel (and cuDNN) once inside a profiler range instead of timing it: "
        "run under `ncu --profile-from-start off` (BENCH=conv_bench scripts/ncu_mma.sh)",
    )
    args = parser.parse_args(argv)

    import cupy
    import torch
    import torch.nn.functional as F

    torch.backends.cudnn.benchmark = True
    name = torch.cuda.get_device_name()
    arch = match_gpu_name(name)
    capability = torch.cuda.get_device_capability()
    rules = [r for r in (kind(n) for n in args.kinds.split(",")) if r.runs_on(capability)]
    print(f"device: {name}; cost model {arch.name}; torch {torch.__version__}", flush=True)
    work_dir = Path(tempfile.mkdtemp(prefix="welder-conv-bench-"))
    shapes = [SHAPES[int(i)] for i in args.shapes.split(",")] if args.shapes else SHAPES
    rows = []
    for label, batch, cin, size, cout, k, s, p in shapes:
        model, weights, out = conv_model(batch, cin, size, cout, k, s, p)
        graph = import_onnx(model)
        group = make_group(graph, list(graph.nodes))
        ctx = ScheduleContext(
            lambda t, g=graph: g.tensor(t).shape,
            lambda t, g=graph: g.tensor(t).dtype,
            arch,
            Options(topk=10_000),
        )
        configs = []
        for rule in rules:
            proposed = rule.propose(group, ctx) or []
            configs += proposed[: args.candidates]
            if args.match:
                configs += [c for c in proposed[args.candidates :] if re.search(args.match, describe(c))]
        if args.simt:
            simt_ctx = ScheduleContext(
                ctx.shape_of, ctx.dtype_of, arch, Options(topk=args.candidates, kinds=("simt",))
            )
            configs += propose(group, simt_ctx)
        if not configs:
            print(f"{label} batch {batch}: no config", flush=True)
            continue
        kernels = [generate_kernel(graph, group, cfg, f"conv_bench_{j}") for j, cfg in enumerate(configs)]
        target = sm_arch(capability, arch_specific=any(kn.arch_specific for kn in kernels))
        path = work_dir / f"shape{len(rows)}.cubin"
        path.write_bytes(compile_cubin(model_source(kernels), target))
        module = cupy.RawModule(path=str(path))

        x_elems = batch * cin * size * size
        copies = max(1, math.ceil(2 * arch.l2_bytes / (x_elems * 2)))
        gen = torch.Generator(device="cuda").manual_seed(0)
        xs = [torch.randn(batch, cin, size, size, device="cuda", generator=gen).half() for _ in range(copies)]
        w = torch.from_numpy(weights).cuda()
        y = torch.empty(batch, cout, out, out, device="cuda", dtype=torch.half)
        reference = F.conv2d(xs[0], w, stride=s, padding=p)
        turn = [0]
        operands = {"x": xs, "y": [y] * copies}
        for t, value in graph.constants.items():
            operands[t] = [torch.from_numpy(np.ascontiguousarray(value)).cuda()] * copies

        def cudnn_launch(xs=xs, w=w, y=y, s=s, p=p, turn=turn, copies=copies):
            i = turn[0] = (turn[0] + 1) % copies
            F.conv2d(xs[i], w, stride=s, padding=p)

        cudnn_launch()  # cudnn.benchmark picks its algorithm here, outside the profiled range
        timer = profiled_once if args.profile else time_us
        cudnn_us = timer(cudnn_launch)
        best, best_by_kind, timings = None, {}, []
        for kernel, cfg in zip(kernels, configs):
            fn = module.get_function(kernel.name)
            if kernel.smem_bytes > 48 * 1024:
                fn.max_dynamic_shared_size_bytes = kernel.smem_bytes
            params = [q.tensor for q in kernel.params]

            def launch(fn=fn, kernel=kernel, params=params, operands=operands, turn=turn, copies=copies):
                i = turn[0] = (turn[0] + 1) % copies
                ptrs = tuple(cupy.uint64(operands[t][i].data_ptr()) for t in params)
                fn(
                    (kernel.grid,),
                    (kernel.threads,),
                    ptrs,
                    shared_mem=kernel.smem_bytes,
                    stream=cupy.cuda.get_current_stream(),
                )

            err = error_of_one_launch(launch, y, reference, turn, copies)
            st, desc = cfg.stages[0], describe(cfg)
            if not math.isfinite(err) or err > LIMIT:
                print(f"  {desc}: WRONG (error {err:.3e})", flush=True)
                continue
            us = timer(launch)
            timings.append(
                {"config": desc, "measured_us": round(us, 2), "predicted_us": cfg.estimate.latency_us}
            )
            print(f"  {desc}: {us:.2f} us, predicted {cfg.estimate.latency_us:.2f}", flush=True)
            best_by_kind[st.kind] = round(min(us, best_by_kind.get(st.kind, math.inf)), 2)
            if best is None or us < best[0]:
                best = (us, desc, err)
        flops = 2 * batch * cout * out * out * cin * k * k
        nbytes = 2 * (x_elems + weights.size + batch * cout * out * out)
        floor = max(flops / (arch.fp16_tc_tflops * 1e12), nbytes / (arch.global_bw_gbs * 1e9)) * 1e6
        if best is None:
            print(f"{label} batch {batch}: no correct welder kernel", flush=True)
            continue
        row = Row(
            f"{label} n{batch}",
            round(floor, 2),
            round(best[0], 2),
            round(cudnn_us, 2),
            round(best[0] / cudnn_us, 3),
            round(flops / best[0] / 1e6, 1),
            round(flops / cudnn_us / 1e6, 1),
            best[1],
            best[2],
            timings,
            best_by_kind,
        )
        rows.append(row)
        print(
            f"{row.shape}: welder {row.welder_us} us ({row.config}), cuDNN {row.cudnn_us} us; {best_by_kind}",
            flush=True,
        )

    head = ("shape", "floor us", "welder us", "cuDNN us", "ratio", "welder TF/s", "cuDNN TF/s")
    print(f"\n{head[0]:<32} " + " ".join(f"{h:>11}" for h in head[1:]) + "  config")
    for r in rows:
        print(
            f"{r.shape:<32} {r.floor_us:>11} {r.welder_us:>11} {r.cudnn_us:>11} {r.ratio:>11} "
            f"{r.welder_tflops:>11} {r.cudnn_tflops:>11}  {r.config}"
        )
    if args.json:
        args.json.write_text(json.dumps({"device": name, "rows": [asdict(r) for r in rows]}, indent=1))
    return 0 if len(rows) == len(shapes) else 1


if __name__ == "__main__":
    sys.exit(main())
