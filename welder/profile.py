"""``welder profile PREFIX``: where a tuned model's time goes, kernel by kernel, against what the
device could do.

It reads what ``welder tune`` wrote -- ``model.json`` (each node's shape, dtype and arithmetic)
and ``tuned.json`` (the plan's groups: members, inputs, outputs, kinds, the tuner's
measurements) -- and times every step of the built runtime on the GPU, each on its own as
back-to-back launches replayed in one CUDA graph (``measure_steps``).  Without a GPU, or when
asked, the times are the tuner's measurements of each group or, failing those, the cost
model's predictions; every report says which.

Per group it gives the time and its share, the arithmetic (FLOPs, from the IR) and the
compulsory bytes (every tensor the kernel reads or writes, once), the rates they make over
the time, and the group's floor: the larger of FLOPs over the ceiling of the arithmetic it
runs on and bytes over DRAM bandwidth.  The model's floor is the same bound for the whole
model: its FLOPs at the best ceiling each operation has (tensor cores for half-precision
contractions) and its compulsory bytes (inputs, weights, outputs) over DRAM bandwidth.  The
achieved DRAM rate here is compulsory bytes over time: a lower bound of the true traffic,
which ncu measures.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from welder.arch import Arch, get_arch
from welder.errors import WelderError
from welder.ir.expr import HALF_DTYPES
from welder.ir.interpret import np_dtype

#: Where the times come from: the built runtime on the GPU, the tuner's measurements, the cost model.
SOURCES = ("run", "tuning", "predicted")
#: Kinds whose arithmetic runs on tensor cores (for 16-bit operands; TF32 has its own kinds;
#: ``attention_ffma`` and ``ffma`` run on CUDA cores).
TENSOR_CORE_KINDS = {"mma", "wgmma", "mma_tf32", "mma_tf32x3", "attention"}


class ProfileError(WelderError):
    """A PREFIX that cannot be profiled (nothing tuned there, an unreadable file)."""


@dataclass(frozen=True)
class GroupProfile:
    """One group of the plan: one kernel, or one library call (several launches)."""

    index: int
    root: str
    kind: str  # its stages' kinds ("wgmma+simt"), or "library"
    ops: str  # its ONNX operators in order, repeats folded ("MatMul+Add+Gelu")
    launches: int
    time_us: float
    share: float  # of the sum over groups
    flops: int
    bytes: int  # compulsory: every tensor read or written, once
    ceiling_tflops: float  # of the arithmetic the kind runs on
    floor_us: float
    bound: str  # "compute" or "memory": which term sets the floor

    @property
    def tflops(self) -> float:
        return self.flops / self.time_us / 1e6 if self.time_us > 0 else 0.0

    @property
    def gbs(self) -> float:
        return self.bytes / self.time_us / 1e3 if self.time_us > 0 else 0.0

    @property
    def efficiency(self) -> float:
        """Floor over time: 1 means the group runs at its ceiling."""
        return self.floor_us / self.time_us if self.time_us > 0 else 0.0


@dataclass(frozen=True)
class Profile:
    model: str
    device: str  # the GPU timed, or the arch whose figures the ceilings are
    source: str  # one of SOURCES, in words
    arch: Arch
    groups: list[GroupProfile]
    end_to_end_us: float | None  # the whole run replayed as a CUDA graph, when timed
    model_flops: int
    model_bytes: int
    model_floor_us: float
    plan_floor_us: float  # the sum of the groups' floors: what this fusion could reach

    @property
    def total_us(self) -> float:
        return sum(g.time_us for g in self.groups)

    def to_json(self) -> dict:
        return {
            "format": "welder.profile/1",
            "model": self.model,
            "device": self.device,
            "source": self.source,
            "ceilings": {
                "dram_gbs": self.arch.global_bw_gbs,
                "fp32_tflops": self.arch.fp32_tflops,
                "fp16_tensor_core_tflops": self.arch.fp16_tc_tflops,
                "tf32_tensor_core_tflops": self.arch.tf32_tc_tflops,
            },
            "total_us": self.total_us,
            "end_to_end_us": self.end_to_end_us,
            "model_flops": self.model_flops,
            "model_bytes": self.model_bytes,
            "model_floor_us": self.model_floor_us,
            "plan_floor_us": self.plan_floor_us,
            "groups": [
                {
                    **asdict(g),
                    "tflops": g.tflops,
                    "gbs": g.gbs,
                    "efficiency": g.efficiency,
                }
                for g in self.groups
            ],
        }


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise ProfileError(f"no {path.name} in {path.parent}: run `welder tune {path.parent}` first ({what})")
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ProfileError(f"cannot read {path}: {e}") from None


def _fold(ops: Sequence[str]) -> str:
    """``MatMul+Add+Add+Gelu`` -> ``MatMul+Add x2+Gelu``."""
    out: list[list] = []
    for op in ops:
        if out and out[-1][0] == op:
            out[-1][1] += 1
        else:
            out.append([op, 1])
    return "+".join(op if n == 1 else f"{op} x{n}" for op, n in out)


def _kind(group: Mapping) -> str:
    if group.get("library"):
        return "library"
    kinds = [st["kind"] for st in group["configs"][0]["stages"]]
    return "+".join(dict.fromkeys(kinds))


def _ceiling(kind: str, half: bool, arch: Arch) -> float:
    """TFLOP/s of the arithmetic a group of ``kind`` runs on (the library computes 16-bit
    products on tensor cores and fp32 ones without)."""
    first = kind.split("+")[0]
    if first == "mma_tf32":
        return arch.tf32_tc_tflops
    if first == "mma_tf32x3":  # each of its products is three TF32 ones
        return arch.tf32_tc_tflops / 3
    if half and (first in TENSOR_CORE_KINDS or first == "library"):
        return arch.fp16_tc_tflops
    return arch.fp32_tflops


def _floor(flops: int, nbytes: int, tflops: float, arch: Arch) -> tuple[float, str]:
    compute = flops / (tflops * 1e6)
    memory = nbytes / (arch.global_bw_gbs * 1e3)
    return max(compute, memory), "compute" if compute >= memory else "memory"


def profile_prefix(
    prefix: str | Path,
    source: str | None = None,
    number: int = 20,
    warmup: int = 2,
    arch: str | None = None,
) -> Profile:
    """Profiles the model tuned into ``prefix``.  ``source``: ``run`` (time the built runtime;
    needs a GPU), ``tuning`` (tuned.json's measurements), ``predicted`` (the cost model's);
    None picks ``run`` where a GPU is present, else ``tuning`` where tuned.json has
    measurements, else ``predicted``.  ``arch`` names the ceilings' GPU (default: the GPU
    timed, else the arch the plan was tuned for)."""
    prefix = Path(prefix)
    if not prefix.is_dir():
        raise ProfileError(f"{str(prefix)!r} is not a folder that `welder tune` wrote")
    if source is not None and source not in SOURCES:
        raise ProfileError(f"unknown source {source!r}; choose one of {', '.join(SOURCES)}")
    model = _read_json(prefix / "model.json", "the graph")
    tuned = _read_json(prefix / "tuned.json", "the plan")
    nodes = {n["name"]: n for n in model["nodes"]}
    tensors = {t["name"]: t for key in ("inputs", "outputs", "constants") for t in model[key]}
    tensors.update({n["name"]: n for n in model["nodes"]})
    groups = tuned["groups"]
    _check_same_model(prefix, groups, tensors)
    measured = all(g.get("measured_latency_us") is not None for g in groups)
    if source is None:
        source = "run" if _gpu_present() else "tuning" if measured else "predicted"
    if source == "tuning" and not measured:
        raise ProfileError(
            f"{prefix / 'tuned.json'} holds no measurements (tuned without a GPU): use --source predicted"
        )

    times_us: dict[str, float] = {}
    launches: dict[str, int] = {}
    end_to_end = None
    device = None
    if source == "run":
        device, end_to_end, steps = _time_runtime(prefix, number, warmup)
        for group, ms in steps:
            times_us[group] = times_us.get(group, 0.0) + ms * 1e3
            launches[group] = launches.get(group, 0) + 1
    else:
        key = "measured_latency_us" if source == "tuning" else "predicted_latency_us"
        times_us = {g["root"]: float(g[key]) for g in groups}
    described = get_arch(arch or _arch_of(device, tuned))
    total = sum(times_us.values()) or 1.0

    def nbytes(names: Sequence[str]) -> int:
        return _bytes(tensors[t] for t in names)

    profiled = []
    for g in groups:
        if g["root"] not in times_us:
            continue  # a view, or a concatenation laid out in place: no step runs it
        kind = _kind(g)
        flops = sum(int(nodes[m].get("flops", 0)) for m in g["members"])
        moved = nbytes([*g["inputs"], *g["outputs"]])
        half = any(tensors[t]["dtype"] in HALF_DTYPES for t in g["inputs"])
        ceiling = _ceiling(kind, half, described)
        floor, bound = _floor(flops, moved, ceiling, described)
        time = times_us[g["root"]]
        profiled.append(
            GroupProfile(
                index=g["index"],
                root=g["root"],
                kind=kind,
                ops=_fold(g["ops"]),
                launches=launches.get(g["root"], 1),
                time_us=time,
                share=time / total,
                flops=flops,
                bytes=moved,
                ceiling_tflops=ceiling,
                floor_us=floor,
                bound=bound,
            )
        )
    floor = model_floor(model, described, str(tuned.get("precision", "fp32")))
    return Profile(
        model=tuned.get("model", model.get("name", prefix.name)),
        device=device or f"{described.name} (figures of the arch; nothing timed)",
        source={
            "run": f"each step timed apart on the GPU ({number} launches per CUDA graph)",
            "tuning": "the tuner's measurements of each group (tuned.json)",
            "predicted": "the cost model's predictions (nothing measured)",
        }[source],
        arch=described,
        groups=sorted(profiled, key=lambda p: -p.time_us),
        end_to_end_us=end_to_end,
        model_flops=floor.flops,
        model_bytes=floor.bytes,
        model_floor_us=floor.floor_us,
        plan_floor_us=sum(p.floor_us for p in profiled),
    )


def _bytes(tensors: Iterable[Mapping]) -> int:
    """Bytes of model.json's tensor entries (a shape and a dtype each)."""
    return sum(math.prod(t["shape"]) * np_dtype(t["dtype"]).itemsize for t in tensors)


def _check_same_model(prefix: Path, groups: Sequence[Mapping], tensors: Mapping[str, Mapping]) -> None:
    """A ProfileError unless every tensor tuned.json's groups name is in model.json: files of
    two different tunes (or exports) cannot be read together."""
    for g in groups:
        unknown = [t for t in (*g["members"], *g["inputs"], *g["outputs"]) if t not in tensors]
        if unknown:
            raise ProfileError(
                f"{prefix / 'tuned.json'} names tensors that {prefix / 'model.json'} lacks "
                f"({', '.join(repr(t) for t in unknown[:3])}{', ...' if len(unknown) > 3 else ''}): "
                "the two files come from different tunes; run `welder tune` again"
            )


@dataclass(frozen=True)
class ModelFloor:
    """The least time any plan of a model can take on an arch: its FLOPs at the best
    ceiling of each operation against its compulsory DRAM bytes."""

    floor_us: float
    flops: int
    bytes: int  # the model's inputs, weights and outputs, each once
    bound: str  # "compute" or "memory"


def model_floor(model: Mapping, arch: Arch, precision: str = "fp32") -> ModelFloor:
    """The floor of the graph ``model`` (model.json's dict): every operation at its best
    ceiling -- tensor cores for a half-precision contraction, whatever kind a plan chose,
    and for an fp32 one where ``precision`` is ``tf32`` (a tune that allows TF32, as
    tuned.json's ``precision`` says) -- and the model's own inputs, weights and outputs read
    or written once."""
    tf32 = precision == "tf32" and arch.tf32_tc_tflops > 0
    tensors = {t["name"]: t for key in ("inputs", "outputs", "constants") for t in model[key]}
    tensors.update({n["name"]: n for n in model["nodes"]})
    flops_total = 0
    compute_us = 0.0
    for n in model["nodes"]:
        flops = int(n.get("flops", 0))
        flops_total += flops
        half = any(tensors[t]["dtype"] in HALF_DTYPES for t in n["inputs"] if t in tensors)
        contraction = n["kind"] == "reduction"
        best = arch.fp32_tflops
        if contraction and half:
            best = arch.fp16_tc_tflops
        elif contraction and tf32:
            best = arch.tf32_tc_tflops
        compute_us += flops / (best * 1e6)
    nbytes = _bytes(t for key in ("inputs", "outputs", "constants") for t in model[key])
    memory_us = nbytes / (arch.global_bw_gbs * 1e3)
    bound = "compute" if compute_us >= memory_us else "memory"
    return ModelFloor(max(compute_us, memory_us), flops_total, nbytes, bound)


def prefix_floor(prefix: str | Path, arch: str | None = None) -> ModelFloor:
    """:func:`model_floor` of the model ``welder tune`` (or ``welder import``) wrote into
    ``prefix``, on ``arch`` (default: the arch tuned.json names, else the H100), at the
    precision tuned.json names (fp32 without one)."""
    prefix = Path(prefix)
    model = _read_json(prefix / "model.json", "the graph")
    path = prefix / "tuned.json"
    tuned = _read_json(path, "the plan") if path.is_file() else {}
    arch = arch or (_arch_of(None, tuned) if tuned else "H100")
    return model_floor(model, get_arch(arch), str(tuned.get("precision", "fp32")))


def _arch_of(device: str | None, tuned: Mapping) -> str:
    from welder.arch import match_gpu_name

    if device is not None:
        try:
            return match_gpu_name(device).name
        except WelderError:  # a GPU welder does not describe, or the emulator
            pass
    return str(tuned.get("arch", "H100"))


def _gpu_present() -> bool:
    from welder.device.gpu import gpu_available

    return gpu_available()


def _time_runtime(prefix: Path, number: int, warmup: int) -> tuple[str, float, list[tuple[str, float]]]:
    """The GPU's name, the end-to-end time (us) of a graph replay, and each step's group and
    milliseconds, from the runtime built under ``prefix`` on seeded inputs."""
    from welder.device.gpu import GpuError, device_name
    from welder.runtime.library import RuntimeLibrary

    with RuntimeLibrary(prefix) as lib:
        lib.run(lib.sample_inputs(seed=0))
        whole = lib.time(iters=20, warmup=3, number=5)
        times = lib.time_steps(number=number, warmup=warmup)
        steps = [(s.group, t) for s, t in zip(lib.steps, times)]
    try:
        name = device_name()
    except GpuError:  # a runtime built with --emulate
        name = "the CPU emulator (wall-clock times of emulation, not a GPU's)"
    return name, whole.median * 1e3, steps


#: The table's columns: title, width, alignment.
COLUMNS = (
    ("#", 4, ">"),
    ("kind", 12, "<"),
    ("ops", 34, "<"),
    ("us", 9, ">"),
    ("share", 6, ">"),
    ("GFLOP", 8, ">"),
    ("MB", 8, ">"),
    ("TFLOP/s", 8, ">"),
    ("GB/s", 7, ">"),
    ("floor us", 9, ">"),
    ("of floor", 8, ">"),
    ("bound", 7, "<"),
)


def _row(cells: Sequence[str]) -> str:
    return " ".join(f"{c:{align}{width}}" for c, (_, width, align) in zip(cells, COLUMNS)).rstrip()


def format_profile(p: Profile, top: int | None = 25) -> str:
    """The report: one row per group, slowest first (the rest folded into one row past
    ``top``), then the totals and floors."""
    total = p.total_us or 1.0
    lines = [
        f"profile of {p.model} on {p.device}",
        f"times: {p.source}",
        f"ceilings: DRAM {p.arch.global_bw_gbs:.0f} GB/s, fp32 {p.arch.fp32_tflops:.0f} TFLOP/s, "
        f"fp16 tensor cores {p.arch.fp16_tc_tflops:.0f} TFLOP/s, TF32 {p.arch.tf32_tc_tflops:.0f} TFLOP/s",
        "",
        _row([c[0] for c in COLUMNS]),
    ]
    shown = p.groups if top is None else p.groups[:top]
    for g in shown:
        ops = g.ops if len(g.ops) <= 34 else g.ops[:31] + "..."
        lines.append(
            _row(
                [
                    str(g.index),
                    g.kind,
                    ops,
                    f"{g.time_us:.2f}",
                    f"{g.share:.1%}",
                    f"{g.flops / 1e9:.3f}",
                    f"{g.bytes / 1e6:.2f}",
                    f"{g.tflops:.2f}",
                    f"{g.gbs:.0f}",
                    f"{g.floor_us:.2f}",
                    f"{g.efficiency:.1%}",
                    g.bound,
                ]
            )
        )
    rest = p.groups[len(shown) :]
    if rest:
        time = sum(g.time_us for g in rest)
        floor = sum(g.floor_us for g in rest)
        flops = sum(g.flops for g in rest) / 1e9
        moved = sum(g.bytes for g in rest) / 1e6
        cells = ["", "", f"{len(rest)} more groups", f"{time:.2f}", f"{time / total:.1%}", f"{flops:.3f}"]
        share = floor / time if time else 0.0
        lines.append(_row([*cells, f"{moved:.2f}", "", "", f"{floor:.2f}", f"{share:.1%}"]))
    launches = sum(g.launches for g in p.groups)
    lines += ["", f"kernels: {len(p.groups)} groups, {launches} launches, {p.total_us:.1f} us one by one"]
    if p.end_to_end_us is not None:
        lines.append(f"end to end (CUDA graph replay): {p.end_to_end_us:.1f} us")
    lines.append(f"floor of this plan: {p.plan_floor_us:.1f} us ({p.plan_floor_us / total:.0%} of the time)")
    lines.append(
        f"floor of the model: {p.model_floor_us:.1f} us ({p.model_flops / 1e9:.2f} GFLOP; "
        f"{p.model_bytes / 1e6:.1f} MB of inputs, weights and outputs)"
    )
    return "\n".join(lines)
