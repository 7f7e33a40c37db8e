"""Writing the standalone runtime: ``PREFIX/nnfusion_rt/cuda_codegen/``.

The folder is self-contained -- sources, the kernel prelude headers, the weights and a
CMakeLists.txt -- so it builds on a GPU machine that has CUDA and CMake but not welder.
Python decides everything (``spec.py``); the C++ and CMake text lives in
``welder/codegen_templates/runtime``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import jinja2
import numpy as np

from welder.codegen.cprint import c_string
from welder.codegen.kernel import Kernel
from welder.errors import WelderError
from welder.graph import Graph
from welder.resources import RUNTIME_TEMPLATE_DIR, TEMPLATE_DIR
from welder.runtime.layout import CONSTANT_SUBDIR, kernel_sources, runtime_dir
from welder.runtime.spec import RuntimeSpec, runtime_spec
from welder.schedule.config import GroupConfig
from welder.schedule.group import Group

#: The headers every kernel source includes, copied beside the sources.
PRELUDE_HEADERS = (
    "welder_prelude.cuh",
    "welder_math.cuh",
    "welder_mma.cuh",
    "welder_wgmma.cuh",
    "welder_wgmma_asm.cuh",
    "welder_tma.cuh",
    "welder_cluster.cuh",
    "welder_tensor_map.cuh",
)
#: Generated file -> its template (besides the kernel files, each from KERNEL_TEMPLATE).
RENDERED = {
    "nnfusion_rt.h": "nnfusion_rt.h.j2",
    "nnfusion_rt.cu": "nnfusion_rt.cu.j2",
    "main_test.cpp": "main_test.cpp.j2",
    "CMakeLists.txt": "CMakeLists.txt.j2",
}
#: The template of every kernel file (kernels_N.cu; spec.py decides which kernels each holds).
KERNEL_TEMPLATE = "kernels.cu.j2"


class CudaArchError(WelderError):
    """A CUDA architecture that is not a compute capability like "90" or "sm_80"."""


def normalize_cuda_arch(arch: str | None) -> str | None:
    """``"sm_90"``, ``"9.0"``, ``"compute_90a"`` or ``"90"`` -> ``"90"`` / ``"90a"``; None stays None."""
    if arch is None:
        return None
    text = str(arch).strip().lower().removeprefix("sm_").removeprefix("compute_").replace(".", "")
    if not re.fullmatch(r"[1-9][0-9]{1,2}[af]?", text):
        raise CudaArchError(f"CUDA architecture {arch!r} is not a compute capability like 90, sm_80 or 8.6")
    return text


@cache
def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(RUNTIME_TEMPLATE_DIR)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["c_string"] = c_string
    return env


def render(spec: RuntimeSpec) -> dict[str, str]:
    """Generated file name -> text, for every templated file of the runtime: the kernel
    files included."""
    env = _environment()
    texts = {name: env.get_template(template).render(spec=spec) for name, template in RENDERED.items()}
    kernels = env.get_template(KERNEL_TEMPLATE)
    texts.update({f.name: kernels.render(spec=spec, file=f) for f in spec.kernel_files})
    return texts


def emit_runtime(
    prefix: str | os.PathLike[str],
    graph: Graph,
    groups_with_configs: Sequence[tuple[Group, GroupConfig]],
    kernels: Sequence[Kernel],
    cuda_arch: str | None = None,
    *,
    cuda_libraries: Sequence[str] = (),
) -> Path:
    """Writes the runtime of ``graph`` -- run as ``groups_with_configs``, one kernel of
    ``kernels`` per group in the same order -- into ``PREFIX/nnfusion_rt/cuda_codegen`` and
    returns that folder.

    ``cuda_arch`` ("90", "sm_80", ...) is the architecture the CMake build compiles for; None
    means the GPU present at build time.  ``cuda_libraries`` names CUDA libraries the kernels
    call besides cudart (e.g. "cublas"), linked by the build.  Weights go to
    ``Constant/*.bin``; files of an earlier emit there are replaced, and its kernel files that
    this runtime has no counterpart for are removed.
    """
    arch = normalize_cuda_arch(cuda_arch)
    for lib in cuda_libraries:
        if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", lib):
            raise ValueError(f"{lib!r} is not a CUDA library target name (e.g. cublas)")
    spec = runtime_spec(graph, groups_with_configs, kernels, arch, cuda_libraries)
    out = runtime_dir(prefix)
    out.mkdir(parents=True, exist_ok=True)
    texts = render(spec)
    for name, text in texts.items():
        _write_text(out / name, text)
    for stale in kernel_sources(out):
        if stale.name not in texts:
            stale.unlink()
    for header in PRELUDE_HEADERS:
        _write_bytes(out / header, (TEMPLATE_DIR / header).read_bytes())
    _write_weights(out / CONSTANT_SUBDIR, graph, spec)
    return out


def _write_text(path: Path, text: str) -> None:
    """Writes ``path`` only if its content changes, so an unchanged runtime is not rebuilt."""
    _write_bytes(path, text.encode())


def _write_bytes(path: Path, data: bytes) -> None:
    """Writes ``path`` only if its content changes: every kernel file includes the prelude
    headers, so a header copied afresh (a new mtime) rebuilt every kernel of a tune from the
    cache -- 9 s of mobilevit_s's 16 at batch 64 on the H100 machine."""
    if not path.is_file() or path.read_bytes() != data:
        path.write_bytes(data)


def _write_weights(folder: Path, graph: Graph, spec: RuntimeSpec) -> None:
    """One raw little-endian file per constant; stale files of an earlier model removed."""
    folder.mkdir(exist_ok=True)
    wanted = {w.file for w in spec.weights}
    for stale in folder.glob("*.bin"):
        if stale.name not in wanted:
            stale.unlink()
    for w in spec.weights:
        value = np.asarray(graph.constants[w.tensor])
        data = np.ascontiguousarray(value, dtype=value.dtype.newbyteorder("<")).tobytes()
        if len(data) != w.nbytes:
            raise ValueError(f"constant {w.tensor!r}: {len(data)} bytes, the plan expects {w.nbytes}")
        path = folder / w.file
        if not path.is_file() or path.stat().st_size != len(data) or path.read_bytes() != data:
            path.write_bytes(data)
