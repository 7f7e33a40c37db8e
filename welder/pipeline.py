"""``welder tune``: the whole compiler, from an ONNX file to a built runtime.

import -> fuse and choose configs (cost model, or measured on the GPU with the tuning
cache) -> generate kernels -> emit the runtime -> build it -> ``tuned.json``.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from welder.arch import Arch, get_arch, match_gpu_name
from welder.codegen import Kernel, generate_model
from welder.errors import WelderError
from welder.frontend.onnx import import_onnx, load_model
from welder.gpu import GpuDevice, gpu_available
from welder.graph import Graph
from welder.runtime.build import build_runtime, find_nvcc
from welder.runtime.emit import emit_runtime
from welder.schedule.cache import TuningCache
from welder.schedule.plan import Plan, plan_model, tuned_json, write_json
from welder.schedule.tuner import tune_model


@dataclass
class TuneOptions:
    arch: str = "auto"
    topk: int = 20
    cost_model: bool = False
    nofusion: bool = False
    measure_fusion: bool = False
    skip_dot: bool = False  # matrix products to cuBLAS
    cuda_arch: str | None = None  # e.g. "90"; default: the GPU present
    build: bool = True
    input_shapes: Mapping[str, Sequence[int]] = field(default_factory=dict)


@dataclass
class TuneResult:
    prefix: Path
    graph: Graph
    plan: Plan
    kernels: list[Kernel]
    built: Path | None
    seconds: float
    notes: list[str]


def output_folder(model: str | os.PathLike, output: str | os.PathLike | None) -> Path:
    """Where ``tune`` writes: ``output``, the PREFIX folder, or ``<dir>/<stem>`` for an
    ``.onnx`` file (``<dir>`` itself when the file is called model.onnx)."""
    if output:
        return Path(output)
    p = Path(model)
    if p.is_dir():
        return p
    return p.parent if p.name == "model.onnx" else p.with_suffix("")


def tune(
    model: str | os.PathLike,
    out: Path,
    options: TuneOptions,
    progress: Callable[[int, int], None] | None = None,
) -> TuneResult:
    if options.topk < 1:
        raise WelderError("--topk must be at least 1")
    start = time.perf_counter()
    notes: list[str] = []
    out.mkdir(parents=True, exist_ok=True)
    _place_model(Path(model), out)
    arch = get_arch(options.arch)
    graph = import_onnx(out / "model.onnx", options.input_shapes, name=Path(model).stem)
    graph.write_json(str(out / "model.json"))
    if options.cost_model:
        plan = plan_model(
            graph,
            arch,
            topk=options.topk,
            nofusion=options.nofusion,
            model=str(model),
            progress=progress,
            skip_dot=options.skip_dot,
        )
    else:
        plan = _tune_on_gpu(graph, arch, options, str(model), notes)
    groups = [(g.group, g.configs[0]) for g in plan.groups]
    kernels = generate_model(graph, groups)
    emit_runtime(out, graph, groups, kernels, options.cuda_arch)
    built = _build(out, options, notes)
    doc = tuned_json(plan, graph)
    generated = iter(kernels)
    for entry in doc["groups"]:
        if entry["library"] is None:
            kernel = next(generated)
            entry["kernel"] = {
                "name": kernel.name,
                "grid": kernel.grid,
                "threads": kernel.threads,
                "smem_bytes": kernel.smem_bytes,
                "source": kernel.source,
            }
    doc["totals"]["tuning_seconds"] = round(time.perf_counter() - start, 2)
    write_json(doc, str(out / "tuned.json"))
    return TuneResult(out, graph, plan, kernels, built, time.perf_counter() - start, notes)


def _place_model(model: Path, out: Path) -> None:
    """PREFIX must hold model.onnx (test_acc and the session read it there); a model from
    elsewhere is copied in, with its external-data files."""
    source = model / "model.onnx" if model.is_dir() else model
    target = out / "model.onnx"
    if target.exists() and source.resolve() == target.resolve():
        return
    proto = load_model(source)  # validates, and refuses external data outside its folder
    if any(
        t.HasField("data_location") and t.data_location == onnx.TensorProto.EXTERNAL
        for t in onnx.load(str(source), load_external_data=False).graph.initializer
    ):
        onnx.save(proto, str(target), save_as_external_data=True, location="model.onnx.data")
    else:
        shutil.copyfile(source, target)


def _tune_on_gpu(graph: Graph, arch: Arch, options: TuneOptions, model: str, notes: list[str]) -> Plan:

    if not gpu_available():
        raise WelderError(
            "tuning measures kernels on a GPU and none is usable here (needs pycuda and a "
            "driver); pass --cost-model to choose configs by the cost model instead"
        )
    logger = logging.getLogger("welder.tune")
    if not logger.handlers:
        logger.addHandler(logging.StreamHandler(sys.stderr))
        logger.setLevel(logging.INFO)
    with GpuDevice() as device:
        present = match_gpu_name(device.name)
        if present.name != arch.name:
            notes.append(
                f"tuning with the {arch.name} cost model on a {device.name}: configs are "
                f"ranked for {arch.name}, measured and compiled for the GPU present ({device.arch})"
            )
        return tune_model(
            graph,
            arch,
            topk=options.topk,
            cache=TuningCache(),
            device=device,
            measure_fusion=options.measure_fusion,
            nofusion=options.nofusion,
            model=model,
            progress_stream=sys.stderr,
            skip_dot=options.skip_dot,
        )


def _build(out: Path, options: TuneOptions, notes: list[str]) -> Path | None:
    """Build when it can work: cmake and nvcc present, and a GPU or an explicit arch."""
    if not options.build:
        return None
    missing = [] if shutil.which("cmake") else ["cmake"]
    try:
        find_nvcc()
    except WelderError:
        missing.append("nvcc")
    if missing:
        notes.append(f"runtime not built: {' and '.join(missing)} not found; run `welder build` later")
        return None
    if options.cuda_arch is None and shutil.which("nvidia-smi") is None:
        notes.append("runtime not built: no GPU here; pass --cuda-arch (e.g. 90) or run `welder build`")
        return None
    return build_runtime(out, options.cuda_arch)
