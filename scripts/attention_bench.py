"""welder's attention kernels beside PyTorch on the same tensors, in one run.

    source .device/setup.sh; python scripts/attention_bench.py [--candidates 4] [--json OUT] [--tuner]

Each case is the attention of one layer as the models export it, fp16: Q, K and V as
``[batch, tokens, heads x width]`` split into heads, ``softmax(Q K^T * scale + bias) V`` and
the heads merged back -- BERT-base at batch 64 (an additive mask per sequence), ViT-S/32 at
batch 64 (no mask, 50 tokens) and Swin-T's first stage at batch 64 (4096 windows of 49
tokens, a relative-position bias per head).  The ``attention`` kind's configs are
generated, compiled into one cubin, checked against PyTorch and timed as 200 launches
captured in one CUDA graph, on input copies rotated past twice the L2.  PyTorch computes
the same from the same tensors twice: eager (a product, softmax, a product: the scores
in memory) and ``scaled_dot_product_attention`` (its fused kernels).  The floor is the
larger of the products' FLOPs over the tensor-core peak and the compulsory bytes (Q, K,
V, the output, the bias) over the DRAM bandwidth.  ``--tuner`` also times every config as
``welder tune`` times a candidate (:func:`tuner_times`): the two harnesses disagreed on
BERT's persistent blocks (docs/codegen.md, "Attention across heads").

    python scripts/attention_bench.py --group PREFIX [--layer 0] [--candidates 8]

times the attention group a tune planned instead (PREFIX: the folder ``welder tune``
wrote, with model.onnx and tuned.json): the model's own group, with whatever the export
put around the softmax, on the inputs the tuner makes for it.  Each config the attention
kind proposes for it is timed both ways -- graph replays and the tuner's harness --
beside the time the tune recorded for it (tuned.json's ``timed``), so that a config the
tune timed slower than the bench does shows which of the two differs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from mma_bench import bench_device, error_of_one_launch, generated_kernel_launch, report, time_us  # noqa: E402

from welder.codegen import generate_kernel, model_source  # noqa: E402
from welder.device.gpu import compile_cubin  # noqa: E402
from welder.frontend.onnx import import_onnx  # noqa: E402
from welder.ir.interpret import np_dtype  # noqa: E402
from welder.schedule.group import make_group  # noqa: E402
from welder.schedule.kinds import Options, ScheduleContext, attention  # noqa: E402


@dataclass(frozen=True)
class Case:
    batch: int
    heads: int
    tokens: int
    width: int
    bias: str  # "mask" (per sequence and key), "relative" (per head, query and key) or "none"


CASES = {
    "bert b64": Case(64, 12, 128, 64, "mask"),
    "vit_small_p32 b64": Case(64, 6, 50, 64, "none"),
    "swin_tiny stage 1 b64": Case(64 * 64, 3, 49, 32, "relative"),
}


def bias_shape(case: Case) -> tuple[int, ...] | None:
    if case.bias == "mask":
        return (case.batch, 1, 1, case.tokens)
    if case.bias == "relative":
        return (1, case.heads, case.tokens, case.tokens)
    return None


def attention_model(
    case: Case, seed: int = 0, dtype: type = np.float16, sdpa: bool = False
) -> onnx.ModelProto:
    """One layer's attention as torch.onnx writes it (see the module docstring); a relative
    bias is a constant of the model, a mask an input; in fp16, or in ``dtype``.  ``sdpa``
    scales as ``scaled_dot_product_attention``'s export does: the queries and the keys
    each by the scale's square root, before their product."""
    elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    b, h, n, d = case.batch, case.heads, case.tokens, case.width
    heads = numpy_helper.from_array(np.array([b, n, h, d], np.int64), "heads")
    merged = numpy_helper.from_array(np.array([b, n, h * d], np.int64), "merged")
    scale = numpy_helper.from_array(np.array(d ** (-0.25 if sdpa else -0.5), dtype), "scale")
    consts = [heads, merged, scale]
    nodes = []
    for x, perm in (("q", [0, 2, 1, 3]), ("k", [0, 2, 3, 1]), ("v", [0, 2, 1, 3])):
        nodes += [
            helper.make_node("Reshape", [x, "heads"], [f"{x}4"]),
            helper.make_node("Transpose", [f"{x}4"], [f"{x}h"], perm=perm),
        ]
    if sdpa:
        nodes += [
            helper.make_node("Mul", ["qh", "scale"], ["qs"]),
            helper.make_node("Mul", ["kh", "scale"], ["ks"]),
            helper.make_node("MatMul", ["qs", "ks"], ["scaled"]),
        ]
    else:
        nodes += [
            helper.make_node("MatMul", ["qh", "kh"], ["s"]),
            helper.make_node("Mul", ["s", "scale"], ["scaled"]),
        ]
    inputs = [helper.make_tensor_value_info(x, elem, [b, n, h * d]) for x in ("q", "k", "v")]
    logits = "scaled"
    if case.bias != "none":
        shape = bias_shape(case)
        assert shape is not None
        if case.bias == "mask":
            inputs.append(helper.make_tensor_value_info("bias", elem, list(shape)))
        else:
            rng = np.random.default_rng(seed)
            consts.append(numpy_helper.from_array(rng.standard_normal(shape).astype(dtype), "bias"))
        nodes.append(helper.make_node("Add", ["scaled", "bias"], ["biased"]))
        logits = "biased"
    nodes += [
        helper.make_node("Softmax", [logits], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "vh"], ["o"]),
        helper.make_node("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["ot", "merged"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "attention", inputs, [helper.make_tensor_value_info("y", elem, [b, n, h * d])], consts
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@dataclass
class Row:
    case: str
    floor_us: float
    eager_us: float
    sdpa_us: float
    best_us: float
    timings: list  # per candidate: config, measured us, max error


def bench_case(label: str, candidates: int, arch, target: str, work: Path, tuner: bool = False) -> Row | None:
    """One case: the attention kind's ``candidates`` best configs beside PyTorch (None where
    the kind proposes nothing)."""
    import cupy
    import torch

    case = CASES[label]
    graph = import_onnx(attention_model(case))
    group = make_group(graph, list(graph.nodes))
    ctx = ScheduleContext(
        lambda t, g=graph: g.tensor(t).shape, lambda t, g=graph: g.tensor(t).dtype, arch, Options(topk=64)
    )
    configs = (attention.KIND.propose(group, ctx) or [])[:candidates]
    if not configs:
        print(f"  {label}: the attention kind proposed nothing", flush=True)
        return None
    kernels = [generate_kernel(graph, group, cfg, f"attn_{j}") for j, cfg in enumerate(configs)]
    path = work / f"{label.replace(' ', '_')}.cubin"
    path.write_bytes(compile_cubin(model_source(kernels), target))
    module = cupy.RawModule(path=str(path))

    b, h, n, d = case.batch, case.heads, case.tokens, case.width
    names = [t.name for t in graph.inputs]
    set_bytes = sum(math.prod(graph.tensor(t).shape) * 2 for t in names)
    copies = max(1, math.ceil(2 * arch.l2_bytes / set_bytes))
    gen = torch.Generator(device="cuda").manual_seed(0)

    def feed() -> dict:
        found = {x: torch.randn(b, n, h * d, device="cuda", generator=gen).half() for x in ("q", "k", "v")}
        if "bias" in names:
            keep = torch.rand(b, 1, 1, n, device="cuda", generator=gen) < 0.9
            found["bias"] = torch.where(keep, 0.0, -10000.0).half()
        return found

    feeds = [feed() for _ in range(copies)]
    bias = (
        torch.from_numpy(np.ascontiguousarray(graph.constants["bias"])).cuda()
        if case.bias == "relative"
        else None
    )

    def split(x):
        return x.view(b, n, h, d).transpose(1, 2)

    def eager(f):
        s = split(f["q"]) @ split(f["k"]).transpose(-1, -2) * d**-0.5
        s = s + f.get("bias", bias) if case.bias != "none" else s
        return (torch.softmax(s, -1) @ split(f["v"])).transpose(1, 2).reshape(b, n, h * d)

    def sdpa(f):
        mask = f.get("bias", bias) if case.bias != "none" else None
        o = torch.nn.functional.scaled_dot_product_attention(
            split(f["q"]), split(f["k"]), split(f["v"]), attn_mask=mask
        )
        return o.transpose(1, 2).reshape(b, n, h * d)

    turn = [0]
    reference = eager(feeds[0])

    def rotated(fn, turn=turn, feeds=feeds):
        def launch():
            i = turn[0] = (turn[0] + 1) % len(feeds)
            fn(feeds[i])

        return launch

    eager_us = time_us(rotated(eager))
    sdpa_us = time_us(rotated(sdpa))
    print(f"  {label}: eager {eager_us:.2f} us, sdpa {sdpa_us:.2f} us", flush=True)
    out = torch.empty(b, n, h * d, device="cuda", dtype=torch.half)
    timings = []
    for kernel, cfg in zip(kernels, configs):
        launch = generated_kernel_launch(module, kernel, graph, feeds, out, turn)
        err = error_of_one_launch(launch, out, reference, turn, len(feeds))
        us = time_us(launch) if err <= 2e-2 else math.nan
        config = config_label(cfg)
        timings.append(
            {
                "config": config,
                "measured_us": us,
                "max_error": err,
                "predicted_us": cfg.estimate.latency_us,
            }
        )
        print(
            f"  {label}: {config}: {us:.2f} us (predicted {cfg.estimate.latency_us:.2f}, error {err:.2e})",
            flush=True,
        )
    if tuner:
        for t, us in zip(timings, tuner_times(graph, group, kernels)):
            t["tuner_us"] = us
            print(f"  {label}: {t['config']}: {us:.2f} us as the tuner times it", flush=True)
    flops = 2 * b * h * n * n * d * 2
    io = set_bytes + b * n * h * d * 2 + (bias.numel() * 2 if bias is not None else 0)
    floor = max(flops / (arch.fp16_tc_tflops * 1e6), io / (arch.global_bw_gbs * 1e3))
    best = min((t["measured_us"] for t in timings if not math.isnan(t["measured_us"])), default=math.nan)
    return Row(label, floor, eager_us, sdpa_us, best, timings)


def config_label(cfg) -> str:
    """A config as the rows name it: warps, block tile, vector width, persistent blocks."""
    st = cfg.stages[0]
    label = f"{st.warps} warps, tile {'x'.join(map(str, cfg.block_tile))}, vector {cfg.stages[-1].vector}"
    if getattr(st, "persistent", 0):
        label += f", {st.persistent} persistent blocks"
    return label


def _attention(stage: dict) -> bool:
    return stage["kind"].startswith("attention")


def model_group(prefix: Path, layer: int = 0):
    """The ``layer``-th attention group of the plan ``welder tune`` wrote into ``prefix``,
    on the graph it planned: (graph, group, the times its tune recorded by config label)."""
    import json

    from welder.pipeline import planned_graph
    from welder.schedule.kinds import config_from_json

    tuned = json.loads((prefix / "tuned.json").read_text())
    found = [g for g in tuned["groups"] if any(_attention(st) for st in g["configs"][0]["stages"])]
    if layer >= len(found):
        raise SystemExit(f"{prefix}/tuned.json has {len(found)} attention groups, no layer {layer}")
    entry = found[layer]
    graph = planned_graph(import_onnx(str(prefix / "model.onnx")))
    group = make_group(graph, entry["members"])
    timed = tuned.get("timed", {}).get(entry["signature"], [])
    recorded = {config_label(config_from_json(t["config"])): t["measured_us"] for t in timed}
    return graph, group, recorded


def bench_group(prefix: Path, layer: int, candidates: int, arch, target: str, work: Path) -> list[dict]:
    """Every config the attention kind proposes for a tuned model's attention group (the
    first ``candidates``), timed by graph replays on rotated copies of the tuner's inputs
    and by the tuner's harness, beside what the tune recorded; each output's largest
    difference from the first config's, a check that the kernels compute one thing."""
    import cupy
    import torch

    from welder.tune.measure import group_inputs

    graph, group, recorded = model_group(prefix, layer)
    ctx = ScheduleContext(
        lambda t, g=graph: g.tensor(t).shape, lambda t, g=graph: g.tensor(t).dtype, arch, Options(topk=64)
    )
    configs = (attention.KIND.propose(group, ctx) or [])[:candidates]
    if not configs or len(group.outputs) != 1:
        print(f"  {prefix}: no single-output attention group the kind proposes for", flush=True)
        return []
    kernels = [generate_kernel(graph, group, cfg, f"attn_{j}") for j, cfg in enumerate(configs)]
    path = work / "group.cubin"
    path.write_bytes(compile_cubin(model_source(kernels), target))
    module = cupy.RawModule(path=str(path))
    inputs = group_inputs(graph, group)
    set_bytes = sum(v.nbytes for t, v in inputs.items() if t not in graph.constants)
    copies = max(1, math.ceil(2 * arch.l2_bytes / max(set_bytes, 1)))
    on_gpu = {t: torch.from_numpy(np.ascontiguousarray(v)).cuda() for t, v in inputs.items()}
    feeds = [on_gpu] + [{t: v.clone() for t, v in on_gpu.items()} for _ in range(copies - 1)]
    info = graph.tensor(group.outputs[0])
    out = torch.empty(info.shape, device="cuda", dtype=getattr(torch, np.dtype(np_dtype(info.dtype)).name))
    turn = [0]
    launches = [generated_kernel_launch(module, k, graph, feeds, out, turn) for k in kernels]
    launches[0]()
    first = out.float().clone()
    rows = []
    for cfg, launch, us in zip(configs, launches, tuner_times(graph, group, kernels)):
        launch()
        label = config_label(cfg)
        row = {
            "config": label,
            "tune_us": recorded.get(label, math.nan),
            "tuner_us": us,
            "bench_us": time_us(launch),
            "predicted_us": cfg.estimate.latency_us,
            "difference": float((out.float() - first).abs().max()),
        }
        rows.append(row)
        print(
            f"  {label}: tune {row['tune_us']:.2f} us, tuner's harness {us:.2f}, graph replays "
            f"{row['bench_us']:.2f} (predicted {row['predicted_us']:.2f}; "
            f"output within {row['difference']:.1e})",
            flush=True,
        )
    return rows


def tuner_times(graph, group, kernels) -> list[float]:
    """Each kernel timed the way ``welder tune`` times a candidate: one program of all the
    kernels, launched by :class:`welder.device.gpu.GpuDevice` in a worker process of its own
    on the group's inputs as the tuner makes them -- for comparing the two harnesses on the
    same configs."""
    from welder.device.gpu import GpuDevice
    from welder.tune.measure import group_inputs

    feeds = group_inputs(graph, group)
    inputs = [feeds[t] for t in group.inputs]
    with GpuDevice() as device:
        program = device.compile(kernels)
        return [device.time(program, k, inputs) for k in kernels]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--candidates", type=int, default=6, help="configs per case")
    parser.add_argument("--cases", default=",".join(CASES), help="comma list of " + ", ".join(CASES))
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument(
        "--tuner", action="store_true", help="also time each config as `welder tune` does (GpuDevice)"
    )
    parser.add_argument("--group", type=Path, metavar="PREFIX", help="time a tuned model's attention group")
    parser.add_argument("--layer", type=int, default=0, help="which of its attention groups (0: the first)")
    args = parser.parse_args(argv)

    name, arch, target = bench_device()
    work = Path(tempfile.mkdtemp(prefix="welder-attention-bench-"))
    if args.group is not None:
        rows = bench_group(args.group, args.layer, args.candidates, arch, target, work)
        if args.json:
            record = {"device": name, "group": str(args.group), "rows": rows}
            Path(args.json).write_text(json.dumps(record, indent=1))
        return 0 if rows else 1
    rows = [
        row
        for label in args.cases.split(",")
        if (row := bench_case(label, args.candidates, arch, target, work, args.tuner))
    ]
    columns = {"floor us": "floor_us", "eager us": "eager_us", "sdpa us": "sdpa_us", "welder us": "best_us"}
    report(name, rows, columns, "best_us", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
