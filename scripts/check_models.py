"""The fp16 benchmark models through the whole compiler without a GPU: tensor-core
instructions in the runtime's PTX, and the emulated kernels against onnxruntime.

    nice python scripts/check_models.py runs/cpu-models [--models bert nerf_large] [--bs 1] \\
        [--option nerf_large:points=4096] [--skip-check bert:"reason"]

For each model, one after another, in ``WORKDIR/<model>``:

1. ``welder export MODEL --fp16 --bs BS`` (kept when an export with the same batch and
   options is already there);
2. ``welder tune --cost-model --arch H100 --topk 1 --cuda-arch 90 --no-build``: the H100's
   plan, configs ranked by the cost model alone, runtime sources emitted but not built;
3. ``nvcc -ptx -arch=sm_90`` (``sm_90a`` where it holds ``wgmma`` kernels) on the runtime's
   sources (``nnfusion_rt.cu`` and the kernel files ``kernels_N.cu``, each on its own) and a
   count of the tensor-core instructions in the PTX (``mma.sync``, ``wgmma``, ``ldmatrix``,
   ``cp.async``; static counts, unrolled loops counted as written),
   beside how many of the plan's groups hold a contraction the ``mma`` kind takes and how
   many a tensor-core kind was chosen for;
4. the plan that ``welder check --backend emulate`` makes (the H100's, ``topk=1``) made
   again here and its kernel sources compared with the runtime's, so that what the PTX
   shows and what the emulator runs are the same kernels;
5. ``welder check --backend emulate``: every kernel on the CPU emulator, outputs compared
   with onnxruntime on random inputs at welder's thresholds; PASS/FAIL, the metric and the
   limit per output, and the wall time.

Results go to ``WORKDIR/results.json`` after every model (the run resumes: a model whose
result is recorded there for the same batch and options is skipped unless ``--redo``) and
to a markdown table, ``WORKDIR/results.md``.  A model too large to emulate can be shrunk
with ``--option`` (recorded and shown in the table) or left unchecked with ``--skip-check``
(its row says why); ``--check-timeout`` stops an emulation that runs too long.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from welder.errors import WelderError  # noqa: E402
from welder.runtime.layout import runtime_sources  # noqa: E402

#: The fp16 benchmark set, in the order of docs/results.md (whose NeRF rows are the MLP
#: now named ``nerf_large``; ``--models nerf`` checks the original's small one).
MODELS = ("bert", "vit_small_p32", "swin_tiny", "mobilenet_v2", "mobilevit_s", "nerf_large")
#: Instruction families counted in the PTX; a family is every opcode starting with its name
#: (``cp.async`` counts the copies and their commit/wait instructions).
FAMILIES = ("mma.sync", "wgmma", "ldmatrix", "cp.async")
#: The families that are a tensor-core product.
PRODUCTS = ("mma.sync", "wgmma")
#: The kinds that put a stage on tensor cores.
TENSOR_CORE_KINDS = ("mma", "mma_tf32", "mma_tf32x3", "wgmma", "attention")
ARCH = "H100"
CUDA_ARCH = "90"
RESULTS_JSON = "results.json"
RESULTS_MD = "results.md"
FORMAT = 1


class CheckModelsError(WelderError):
    """Bad arguments or a results file this script cannot read."""


# -- PTX -----------------------------------------------------------------------------------------

_FUNCTION = re.compile(
    r"^\s*(?:\.visible\s+|\.weak\s+|\.extern\s+)*\.(entry|func)\s+(?:\([^)]*\)\s*)?([\w$]+)"
)
_PREDICATE = re.compile(r"^@!?%\w+\s+")


@dataclass
class PtxCounts:
    """Tensor-core instructions in one PTX file.  ``families`` counts each of FAMILIES over
    the whole file, ``opcodes`` every full opcode of those families (``mma.sync.aligned.m16n8k16
    .row.col.f32.f16.f16.f32``), ``kernels`` the ``.entry`` functions and ``mma_kernels``
    those holding at least one product (``mma.sync`` or ``wgmma``) themselves."""

    kernels: int = 0
    mma_kernels: int = 0
    families: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAMILIES, 0))
    opcodes: dict[str, int] = field(default_factory=dict)


def count_ptx(text: str) -> PtxCounts:
    """Counts instructions, not mentions: comments, directives and names are skipped, and a
    guard predicate (``@%p1 cp.async...``) does not hide the opcode after it."""
    counts = PtxCounts()
    entry = False
    entry_has_mma = False

    def close() -> None:
        if entry and entry_has_mma:
            counts.mma_kernels += 1

    for raw in text.splitlines():
        line = raw.split("//", 1)[0].strip()
        if not line:
            continue
        head = _FUNCTION.match(line)
        if head:
            close()
            entry = head.group(1) == "entry"
            entry_has_mma = False
            counts.kernels += entry
            continue
        opcode = _PREDICATE.sub("", line).split(None, 1)[0].rstrip(";")
        family = next((f for f in FAMILIES if opcode == f or opcode.startswith(f + ".")), None)
        if family is None:
            continue
        counts.families[family] += 1
        counts.opcodes[opcode] = counts.opcodes.get(opcode, 0) + 1
        entry_has_mma = entry_has_mma or family in PRODUCTS
    close()
    counts.opcodes = dict(sorted(counts.opcodes.items()))
    return counts


def compile_ptx(runtime: Path, ptx: Path, nvcc: str, cuda_arch: str = CUDA_ARCH) -> None:
    """The runtime's device code as PTX, compiled as its CMake build would (C++17, -O3; for
    the arch-specific target where it holds wgmma kernels): each of its sources (nnfusion_rt.cu
    and the kernel files) on its own and in parallel, as the build does, their PTX written one
    after another into ``ptx``."""
    sources = [path for path in runtime_sources(runtime) if path.is_file()]
    wgmma = any("welder_wgmma.cuh" in path.read_text() for path in sources)
    arch = f"-arch=sm_{cuda_arch}{'a' if wgmma and not cuda_arch.endswith('a') else ''}"
    ptx.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory() as scratch:

        def compile_one(source: Path) -> subprocess.CompletedProcess[str]:
            command = [nvcc, "-std=c++17", "-O3", arch, "-I", str(runtime), "-ptx", str(source)]
            out = Path(scratch) / f"{source.stem}.ptx"
            return subprocess.run([*command, "-o", str(out)], capture_output=True, text=True)

        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            done = list(pool.map(compile_one, sources))
        failed = next((d for d in done if d.returncode != 0), None)
        if failed is not None:
            raise StageError("ptx", _tail(failed.stderr or failed.stdout))
        ptx.write_text("".join((Path(scratch) / f"{source.stem}.ptx").read_text() for source in sources))


# -- welder check's report -----------------------------------------------------------------------


@dataclass
class OutputCheck:
    """One output's line of ``welder check``: max relative error against onnxruntime."""

    name: str
    shape: list[int]
    metric: float
    limit: float
    passed: bool


_REPORT_LINE = re.compile(
    r"^\s+(?P<name>\S+)\s+(?P<shape>\[[^\]]*\])\s+(?P<metric>\S+)\s+(?P<limit>\S+)\s+(?P<verdict>PASS|FAIL)\s*$"
)


def parse_check_report(text: str) -> tuple[bool, list[OutputCheck]]:
    """``welder check``'s printed report -> (passed, outputs).  The verdict is the report's
    last line; a report without one or without any output line is an error, so a crash
    can never read as a pass."""
    lines = [line for line in text.splitlines() if line.strip()]
    outputs = []
    for line in lines:
        m = _REPORT_LINE.match(line)
        if m:
            shape = json.loads(m["shape"])
            outputs.append(
                OutputCheck(m["name"], shape, float(m["metric"]), float(m["limit"]), m["verdict"] == "PASS")
            )
    if not lines or lines[-1].strip() not in ("PASS", "FAIL") or not outputs:
        raise ValueError("no check report in the output")
    passed = lines[-1].strip() == "PASS"
    if passed != all(o.passed for o in outputs):
        raise ValueError("the report's verdict disagrees with its outputs")
    return passed, outputs


# -- the plan ------------------------------------------------------------------------------------


@dataclass
class PlanFacts:
    """What the tuned plan does with the model's contractions, per group of the plan.
    ``contractions``: first stage a sum of products (MatMul, Gemm, Conv, ...);
    ``mma_form``: of those, the ones whose product has the form the ``mma`` kind computes
    (fp16 operands with affine layouts); ``mma_proposed``: groups the kind proposes a config
    for (the rest of the group must fit its tile too: a reshape after the product or a row
    wider than a block rules it out); ``mma_groups``: groups the plan put on tensor cores;
    ``mma_best_us`` / ``chosen_us``: summed over the proposed groups left on CUDA cores, the
    cost model's best tensor-core estimate against the chosen config's (why it said no)."""

    groups: int
    contractions: int
    mma_form: int
    mma_proposed: int
    mma_groups: int
    mma_best_us: float = 0.0
    chosen_us: float = 0.0
    same_kernels_as_emulated: bool | None = None


def group_facts(prefix: Path, arch: str = ARCH) -> PlanFacts:
    """The counts of :class:`PlanFacts` for the plan in ``prefix/tuned.json``."""
    from welder.arch import get_arch
    from welder.ir.expr import Binary
    from welder.pipeline import planned_import
    from welder.schedule.group import make_group
    from welder.schedule.kinds import Options, mma
    from welder.schedule.kinds.base import ScheduleContext

    tuned = json.loads((prefix / "tuned.json").read_text())
    graph = planned_import(prefix / "model.onnx", get_arch(tuned["arch"]))
    ctx = ScheduleContext(
        lambda t: graph.tensor(t).shape, lambda t: graph.tensor(t).dtype, get_arch(arch), Options(topk=1)
    )
    facts = PlanFacts(len(tuned["groups"]), 0, 0, 0, 0)
    for entry in tuned["groups"]:
        if entry["library"] is not None:
            continue
        group = make_group(graph, entry["members"])
        first = group.computes[group.stages[0]]
        if first.reduce_op == "sum" and isinstance(first.body, Binary) and first.body.op == "mul":
            facts.contractions += 1
            facts.mma_form += mma.contraction(first, ctx.shape_of) is not None
        chosen = entry["configs"][0]
        if any(st["kind"] in TENSOR_CORE_KINDS for st in chosen["stages"]):
            facts.mma_groups += 1
            facts.mma_proposed += 1
            continue
        proposed = mma.KIND.propose(group, ctx)
        if proposed:
            facts.mma_proposed += 1
            facts.mma_best_us += proposed[0].estimate.latency_us
            facts.chosen_us += chosen["estimate"]["latency_us"]
    facts.mma_best_us = round(facts.mma_best_us, 3)
    facts.chosen_us = round(facts.chosen_us, 3)
    return facts


def same_kernels_as_emulated(prefix: Path, arch: str = ARCH) -> bool:
    """Whether the plan ``welder check --backend emulate`` makes (welder.session.EmulateBackend:
    the arch's cost model, ``topk=1``), made again here, generates the runtime's kernels."""
    from welder.arch import get_arch
    from welder.codegen import generate_model
    from welder.frontend.onnx import import_onnx
    from welder.schedule.plan import plan_model

    tuned = json.loads((prefix / "tuned.json").read_text())
    graph = import_onnx(prefix / "model.onnx")
    plan = plan_model(graph, get_arch(arch), topk=1)
    kernels = generate_model(graph, [(p.group, p.configs[0]) for p in plan.groups])
    return [k.source for k in kernels] == [
        g["kernel"]["source"] for g in tuned["groups"] if g["library"] is None
    ]


def plan_facts(prefix: Path, arch: str = ARCH) -> PlanFacts:
    facts = group_facts(prefix, arch)
    facts.same_kernels_as_emulated = same_kernels_as_emulated(prefix, arch)
    return facts


def tensor_core_note(facts: PlanFacts) -> str:
    """Why a model has no kernel on tensor cores (empty when it has some)."""
    if facts.mma_groups:
        return ""
    if facts.mma_proposed == 0:
        return (
            f"no kernel on tensor cores: the mma kind takes none of the {facts.contractions} "
            f"contractions ({facts.mma_form} of the product form, for whose groups it proposes no config)"
            if facts.mma_form
            else f"no kernel on tensor cores: none of the {facts.contractions} contractions is of the form "
            "the mma kind takes"
        )
    return (
        f"no kernel on tensor cores: the mma kind proposes configs for {facts.mma_proposed} groups, "
        f"estimated at {facts.mma_best_us:.1f} us against {facts.chosen_us:.1f} us on CUDA cores"
    )


# -- one model -----------------------------------------------------------------------------------


class StageError(Exception):
    """A stage of one model failed; the run records it and goes on with the next model."""

    def __init__(self, stage: str, detail: str) -> None:
        super().__init__(f"{stage}: {detail}")
        self.stage = stage
        self.detail = detail


@dataclass
class ModelResult:
    """One row of the results.  ``status``: PASS or FAIL (the emulated check's verdict),
    NOT RUN (the check was skipped, ``note`` says why), TIMEOUT, or ERROR (a stage failed,
    ``error`` says which and how)."""

    model: str
    batch: int
    options: dict[str, Any]
    status: str
    seconds: dict[str, float] = field(default_factory=dict)
    plan: dict[str, Any] | None = None
    ptx: dict[str, Any] | None = None
    outputs: list[dict[str, Any]] = field(default_factory=list)
    note: str = ""
    error: str = ""
    date: str = ""
    commit: str = ""


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _welder(args: Sequence[str], log: Path, timeout: float | None = None) -> tuple[int, str, float]:
    """``python -m welder.cli ARGS`` from this checkout; (exit status, stdout+stderr, seconds)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    start = time.perf_counter()
    with open(log, "w") as out:
        try:
            rc = subprocess.run(
                [sys.executable, "-m", "welder.cli", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env=env,
                timeout=timeout,
            ).returncode
        except subprocess.TimeoutExpired:
            rc = None
    seconds = time.perf_counter() - start
    text = log.read_text()
    if rc is None:
        raise TimeoutError(seconds)
    return rc, text, seconds


def model_folder(name: str, options: Mapping[str, Any]) -> str:
    """``name``, or ``name-key=value-...`` for a shrunk export, so both can be kept."""
    parts = [f"{k}={json.dumps(v)}" for k, v in sorted(options.items())]
    return re.sub(r"[^\w.=,-]+", "_", "-".join([name, *parts]))


def _export_matches(prefix: Path, batch: int, options: Mapping[str, Any]) -> bool:
    info = prefix / "export.json"
    if not (prefix / "model.onnx").is_file() or not info.is_file():
        return False
    data = json.loads(info.read_text())
    return (
        data.get("batch") == batch and data.get("dtype") == "float16" and data.get("options") == dict(options)
    )


@dataclass
class RunSettings:
    workdir: Path
    batch: int
    arch: str
    cuda_arch: str
    nvcc: str | None
    check_timeout: float | None
    commit: str


def check_model(
    name: str, options: Mapping[str, Any], skip_reason: str | None, settings: RunSettings
) -> ModelResult:
    """Export, tune, count and check ``name``; every failure lands in the result."""
    result = ModelResult(
        name,
        settings.batch,
        dict(options),
        "ERROR",
        date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        commit=settings.commit,
    )
    folder = model_folder(name, options)
    prefix = settings.workdir / folder
    logs = settings.workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    try:
        if not _export_matches(prefix, settings.batch, options):
            if prefix.exists():
                shutil.rmtree(prefix)
            args = ["export", name, "--prefix", str(prefix), "--fp16", "--bs", str(settings.batch)]
            args += [a for k, v in options.items() for a in ("--option", f"{k}={json.dumps(v)}")]
            rc, text, result.seconds["export"] = _welder(args, logs / f"{folder}.export.log")
            if rc != 0:
                raise StageError("export", _tail(text))
        args = ["tune", str(prefix), "--cost-model", "--arch", settings.arch, "--topk", "1"]
        args += ["--cuda-arch", settings.cuda_arch, "--no-build"]
        rc, text, result.seconds["tune"] = _welder(args, logs / f"{folder}.tune.log")
        if rc != 0:
            raise StageError("tune", _tail(text))
        if settings.nvcc is not None:
            start = time.perf_counter()
            ptx = prefix / "runtime.ptx"
            compile_ptx(prefix / "nnfusion_rt" / "cuda_codegen", ptx, settings.nvcc, settings.cuda_arch)
            result.ptx = asdict(count_ptx(ptx.read_text()))
            result.seconds["ptx"] = time.perf_counter() - start
        start = time.perf_counter()
        facts = plan_facts(prefix, settings.arch)
        result.plan = asdict(facts)
        result.seconds["replan"] = time.perf_counter() - start
        result.note = tensor_core_note(facts)
        if skip_reason is not None:
            result.status = "NOT RUN"
            result.note = "; ".join(filter(None, [result.note, f"emulated check not run: {skip_reason}"]))
            return result
        try:
            rc, text, seconds = _welder(
                ["check", str(prefix), "--backend", "emulate"],
                logs / f"{folder}.check.log",
                settings.check_timeout,
            )
        except TimeoutError as e:
            result.seconds["check"] = e.args[0]
            result.status = "TIMEOUT"
            result.note = "; ".join(filter(None, [result.note, f"emulation stopped after {e.args[0]:.0f} s"]))
            return result
        result.seconds["check"] = seconds
        try:
            passed, outputs = parse_check_report(text)
        except ValueError:
            raise StageError("check", _tail(text)) from None
        if rc not in (0, 1) or passed != (rc == 0):
            raise StageError("check", f"exit status {rc}\n{_tail(text)}")
        result.outputs = [asdict(o) for o in outputs]
        result.status = "PASS" if passed else "FAIL"
    except StageError as e:
        result.error = str(e)
    return result


# -- results -------------------------------------------------------------------------------------


def result_key(name: str, batch: int, options: Mapping[str, Any]) -> str:
    """A model at a batch with its export options: the same model shrunk is another row."""
    return ":".join([name, str(batch), *(f"{k}={json.dumps(v)}" for k, v in sorted(options.items()))])


def load_results(path: Path) -> dict[str, Any]:
    """The results file, or a fresh one; a file of another format is an error, not replaced."""
    if not path.is_file():
        return {"format": FORMAT, "machine": {}, "models": {}}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckModelsError(
            f"{path} is not JSON ({e}); move it away or pass another work directory"
        ) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("models"), dict):
        raise CheckModelsError(f"{path} is not a results file of this script (format {FORMAT})")
    return data


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _fmt_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _options_text(options: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={json.dumps(v)}" for k, v in options.items()) or "as exported"


def markdown_table(results: Mapping[str, Any]) -> str:
    """The rows of ``results["models"]`` as a markdown table, in MODELS order, then others."""
    rows = list(results["models"].values())
    order = {m: i for i, m in enumerate(MODELS)}
    rows.sort(key=lambda r: (order.get(r["model"], len(order)), r["model"], r["batch"]))
    head = (
        "| model | bs | options | kernels | contractions | mma form | mma proposed | on tensor cores "
        "| PTX mma.sync | wgmma | ldmatrix | cp.async | check | max rel err / limit per output "
        "| emulate | note |"
    )
    lines = [head, "|" + "---|" * 16]
    for r in rows:
        plan, ptx = r.get("plan") or {}, r.get("ptx") or {}
        fam = ptx.get("families", {})
        errors = "<br>".join(
            f"{o['name']}: {o['metric']:.2e} / {o['limit']:.0e}{'' if o['passed'] else ' FAIL'}"
            for o in r.get("outputs", [])
        )
        note = r.get("note", "")
        if r.get("error"):
            note = "; ".join(filter(None, [note, r["error"].splitlines()[0]]))
        if plan and not plan.get("same_kernels_as_emulated", True):
            note = "; ".join(filter(None, [note, "emulated kernels differ from the runtime's"]))
        cells = [
            r["model"],
            str(r["batch"]),
            _options_text(r.get("options", {})),
            str(plan.get("groups", "-")),
            str(plan.get("contractions", "-")),
            str(plan.get("mma_form", "-")),
            str(plan.get("mma_proposed", "-")),
            str(plan.get("mma_groups", "-")),
            str(fam.get("mma.sync", "-")),
            str(fam.get("wgmma", "-")),
            str(fam.get("ldmatrix", "-")),
            str(fam.get("cp.async", "-")),
            r["status"],
            errors or "-",
            _fmt_seconds(r.get("seconds", {}).get("check")),
            note.replace("|", "/"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_results(workdir: Path, results: Mapping[str, Any]) -> None:
    _write_atomic(workdir / RESULTS_JSON, json.dumps(results, indent=2) + "\n")
    _write_atomic(workdir / RESULTS_MD, markdown_table(results))


def machine() -> dict[str, Any]:
    """The machine the emulator ran on (its times depend on it)."""
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = {"python": platform.python_version()}
    for package in ("numpy", "onnx", "onnxruntime", "torch"):
        try:
            versions[package] = __import__(package).__version__
        except Exception:
            versions[package] = "unavailable"
    return {"cpu": cpu, "cores": os.cpu_count(), "system": platform.platform(), "versions": versions}


def _commit() -> str:
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT, timeout=30
    )
    if done.returncode != 0:
        return "unknown"
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    return done.stdout.strip() + ("+changes" if dirty else "")


# -- command line --------------------------------------------------------------------------------


def _model_value(text: str, what: str) -> tuple[str, str]:
    name, sep, rest = text.partition(":")
    if not sep or not name or not rest:
        raise argparse.ArgumentTypeError(f"expected MODEL:{what}, got {text!r}")
    return name, rest


def _option(text: str) -> tuple[str, tuple[str, Any]]:
    from welder.export import parse_option

    name, rest = _model_value(text, "KEY=VALUE")
    return name, parse_option(rest)


def _skip(text: str) -> tuple[str, str]:
    return _model_value(text, "REASON")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="check_models.py",
        description="Export, tune for the H100 without a GPU, count tensor-core instructions in "
        "the PTX and check on the CPU emulator every fp16 benchmark model.",
    )
    p.add_argument("workdir", type=Path, help="folder for the models, logs, results.json and results.md")
    p.add_argument(
        "--models", nargs="+", default=list(MODELS), metavar="NAME", help=f"default: {' '.join(MODELS)}"
    )
    p.add_argument("--bs", type=int, default=1, help="batch size (default: 1)")
    p.add_argument(
        "--option",
        action="append",
        default=[],
        type=_option,
        metavar="MODEL:KEY=VALUE",
        help="export option of one model, e.g. nerf_large:points=4096 (repeatable; shown in the table)",
    )
    p.add_argument(
        "--skip-check",
        action="append",
        default=[],
        type=_skip,
        metavar="MODEL:REASON",
        help="export, tune and count MODEL but do not emulate it; the table gives REASON",
    )
    p.add_argument("--check-timeout", type=float, help="stop an emulated check after this many seconds")
    p.add_argument("--redo", action="store_true", help="run models whose result is already recorded")
    p.add_argument("--arch", default=ARCH, help=f"cost model of the plan (default: {ARCH})")
    p.add_argument("--cuda-arch", default=CUDA_ARCH, help=f"PTX target, sm_N (default: {CUDA_ARCH})")
    return p


def _refresh_plan(row: dict[str, Any], prefix: Path, arch: str) -> None:
    """Fills the plan counts of a row recorded before they were all counted (cheap: no
    planning, no emulation), when the model's folder is still there."""
    plan = row.get("plan")
    if not plan or "mma_proposed" in plan or not (prefix / "tuned.json").is_file():
        return
    facts = group_facts(prefix, arch)
    facts.same_kernels_as_emulated = plan.get("same_kernels_as_emulated")
    row["plan"] = asdict(facts)
    note = tensor_core_note(facts)
    old = row.get("note", "")
    skipped = old[old.index("emulated check not run") :] if "emulated check not run" in old else ""
    row["note"] = "; ".join(filter(None, [note, skipped]))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except WelderError as e:
        print(f"check_models.py: error: {e}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    from welder.export import MODELS as REGISTRY

    unknown = [
        m
        for m in [*args.models, *(n for n, _ in args.option), *(n for n, _ in args.skip_check)]
        if m not in REGISTRY
    ]
    if unknown:
        raise CheckModelsError(f"unknown model {unknown[0]!r}; choose among {', '.join(REGISTRY)}")
    if args.bs < 1:
        raise CheckModelsError(f"--bs must be at least 1, got {args.bs}")
    options: dict[str, dict[str, Any]] = {m: {} for m in args.models}
    for name, (key, value) in args.option:
        options.setdefault(name, {})[key] = value
    skips = dict(args.skip_check)
    nvcc = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if Path(p).is_file()), None)
    if nvcc is None:
        print("nvcc not found: the PTX is not counted", file=sys.stderr)
    args.workdir.mkdir(parents=True, exist_ok=True)
    results = load_results(args.workdir / RESULTS_JSON)
    results["machine"] = machine()
    settings = RunSettings(
        args.workdir.resolve(), args.bs, args.arch, args.cuda_arch, nvcc, args.check_timeout, _commit()
    )
    for name in args.models:
        key = result_key(name, args.bs, options[name])
        old = results["models"].get(key)
        if old is not None and not args.redo:
            print(f"{name}: recorded ({old['status']}), skipped")
            _refresh_plan(old, settings.workdir / model_folder(name, options[name]), args.arch)
            continue
        print(f"{name}: running", flush=True)
        result = check_model(name, options[name], skips.get(name), settings)
        results["models"][key] = asdict(result)
        write_results(args.workdir, results)
        check = _fmt_seconds(result.seconds.get("check"))
        print(f"{name}: {result.status} (emulated check {check}) {result.error or result.note}", flush=True)
    write_results(args.workdir, results)
    print(markdown_table(results), end="")
    print(f"wrote {args.workdir / RESULTS_JSON} and {args.workdir / RESULTS_MD}")
    statuses = [results["models"][result_key(m, args.bs, options[m])]["status"] for m in args.models]
    return 0 if all(s in ("PASS", "NOT RUN") for s in statuses) else 1


if __name__ == "__main__":
    sys.exit(main())
