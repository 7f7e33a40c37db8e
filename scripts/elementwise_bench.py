"""welder's elementwise kernels, scalar and in 16-byte vectors, beside PyTorch on the same
tensors, in one run.

    source .device/setup.sh; python scripts/elementwise_bench.py [--candidates 4] [--json OUT]

Each case is a group as the models export it -- BERT's GELU after the FFN-in product (bias
add, then ``x * (erf(x / sqrt 2) + 1) * 0.5`` written out) and a residual add -- at batch 64
in fp16.  The SIMT kind's best configs of each form (vectorised twins and scalar ones) are
generated, compiled into one cubin and timed as 200 launches captured in one CUDA graph, on
input copies rotated past twice the L2; PyTorch eager computes the same in its own kernels.
Every kernel's output is checked against PyTorch's.  The floor is the compulsory bytes over
the DRAM bandwidth of the arch description.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import onnx
from onnx import helper

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from mma_bench import bench_device, error_of_one_launch, generated_kernel_launch, report, time_us  # noqa: E402

from welder.codegen import generate_kernel, model_source  # noqa: E402
from welder.device.gpu import compile_cubin  # noqa: E402
from welder.frontend.onnx import import_onnx  # noqa: E402
from welder.schedule.group import make_group  # noqa: E402
from welder.schedule.kinds import Options, ScheduleContext, simt  # noqa: E402

ROWS, WIDTH = 64 * 128, 3072


def gelu_model() -> onnx.ModelProto:
    """h [8192, 3072] + b [3072], then GELU as torch.onnx writes it."""
    f16 = onnx.TensorProto.FLOAT16
    const = lambda name, v: helper.make_tensor(name, f16, [], [v])  # noqa: E731
    nodes = [
        helper.make_node("Add", ["b", "h"], ["a"]),
        helper.make_node("Div", ["a", "sqrt2"], ["d"]),
        helper.make_node("Erf", ["d"], ["e"]),
        helper.make_node("Add", ["e", "one"], ["f"]),
        helper.make_node("Mul", ["a", "f"], ["g"]),
        helper.make_node("Mul", ["g", "half"], ["y"]),
    ]
    inputs = [
        helper.make_tensor_value_info("h", f16, [ROWS, WIDTH]),
        helper.make_tensor_value_info("b", f16, [WIDTH]),
    ]
    graph = helper.make_graph(
        nodes,
        "gelu",
        inputs,
        [helper.make_tensor_value_info("y", f16, [ROWS, WIDTH])],
        [const("sqrt2", 1.4142135), const("one", 1.0), const("half", 0.5)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def residual_model() -> onnx.ModelProto:
    f16 = onnx.TensorProto.FLOAT16
    nodes = [helper.make_node("Add", ["x", "r"], ["y"])]
    inputs = [helper.make_tensor_value_info(n, f16, [ROWS, 768]) for n in ("x", "r")]
    graph = helper.make_graph(
        nodes, "residual", inputs, [helper.make_tensor_value_info("y", f16, [ROWS, 768])]
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


CASES = {
    "gelu 8192x3072": (gelu_model, lambda t, h, b: t.nn.functional.gelu(h + b)),
    "residual add 8192x768": (residual_model, lambda t, x, r: x + r),
}


@dataclass
class Row:
    case: str
    floor_us: float
    torch_us: float
    best_scalar_us: float
    best_vector_us: float
    timings: list  # per candidate: config, measured us, max error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--candidates", type=int, default=4, help="configs of each form per case")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)

    import cupy
    import torch

    name, arch, target = bench_device()
    work = Path(tempfile.mkdtemp(prefix="welder-elementwise-bench-"))
    rows = []
    for case, (build, reference_fn) in CASES.items():
        graph = import_onnx(build())
        group = make_group(graph, list(graph.nodes))
        ctx = ScheduleContext(
            lambda t, g=graph: g.tensor(t).shape, lambda t, g=graph: g.tensor(t).dtype, arch, Options(topk=64)
        )
        proposed = simt.KIND.propose(group, ctx)
        configs = [c for c in proposed if c.stages[0].vector > 1][: args.candidates]
        configs += [c for c in proposed if c.stages[0].vector == 1][: args.candidates]
        kernels = [generate_kernel(graph, group, cfg, f"ew_{j}") for j, cfg in enumerate(configs)]
        path = work / f"{len(rows)}.cubin"
        path.write_bytes(compile_cubin(model_source(kernels), target))
        module = cupy.RawModule(path=str(path))

        names = [t.name for t in graph.inputs]
        set_bytes = sum(math.prod(t.shape) * 2 for t in graph.inputs)
        copies = max(1, math.ceil(2 * arch.l2_bytes / set_bytes))
        gen = torch.Generator(device="cuda").manual_seed(0)
        feeds = [
            {n: torch.randn(*graph.tensor(n).shape, device="cuda", generator=gen).half() for n in names}
            for _ in range(copies)
        ]
        out_shape = graph.tensor(graph.outputs[0]).shape
        out = torch.empty(*out_shape, device="cuda", dtype=torch.half)
        turn = [0]
        reference = reference_fn(torch, *(feeds[0][n] for n in names))

        def torch_launch(turn=turn, feeds=feeds, names=names, fn=reference_fn):
            i = turn[0] = (turn[0] + 1) % len(feeds)
            fn(torch, *(feeds[i][n] for n in names))

        torch_us = time_us(torch_launch)
        timings = []
        for kernel, cfg in zip(kernels, configs):
            launch = generated_kernel_launch(module, kernel, graph, feeds, out, turn)
            err = error_of_one_launch(launch, out, reference, turn, len(feeds))
            us = time_us(launch) if err <= 2e-2 else math.nan
            st = cfg.stages[0]
            label = f"tile {'x'.join(map(str, cfg.block_tile))} threads {cfg.threads} vector {st.vector}"
            timings.append({"config": label, "measured_us": us, "max_error": err, "vector": st.vector})
            print(f"  {case}: {label}: {us:.2f} us (error {err:.2e})", flush=True)
        floor = (set_bytes + math.prod(out_shape) * 2) / (arch.global_bw_gbs * 1e3)

        measured = [t for t in timings if not math.isnan(t["measured_us"])]
        scalar = min((t["measured_us"] for t in measured if t["vector"] == 1), default=math.nan)
        vector = min((t["measured_us"] for t in measured if t["vector"] > 1), default=math.nan)
        rows.append(Row(case, floor, torch_us, scalar, vector, timings))
    columns = {
        "floor us": "floor_us",
        "torch us": "torch_us",
        "scalar us": "best_scalar_us",
        "vector us": "best_vector_us",
    }
    report(name, rows, columns, "best_vector_us", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
