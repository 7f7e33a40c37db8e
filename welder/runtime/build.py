"""Building an emitted runtime with CMake: ``build/libnnfusion_naive_rt.so`` and ``build/main_test``.

For the GPU the sources compile with nvcc; with ``emulate=True`` the same sources compile
with the C++ compiler against welder's CPU emulator (``welder/runtime/emu``), which lets the
whole runtime -- memory plan, weight loading, launches, CUDA graphs, timing -- run in tests
on machines without a GPU.  A build folder is started afresh when it holds the other of the
two, or was copied from another place.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from welder.errors import WelderError
from welder.hostcpu import usable_cores
from welder.lock import prefix_lock
from welder.resources import EMU_DIR
from welder.runtime.emit import CudaArchError, normalize_cuda_arch
from welder.runtime.emu.emulator import runtime_build_objects, runtime_build_prelude
from welder.runtime.layout import BUILD_SUBDIR, LIBRARY_NAME, MAIN_TEST_NAME, existing_runtime_dir

#: How much of a failed build's output an error shows (the end: where compilers report).
_SHOWN_LINES = 60
_NVCC_FALLBACKS = ("/usr/local/cuda/bin/nvcc",)


class RuntimeBuildError(WelderError):
    """The runtime could not be built: a tool is missing, or configuring or compiling failed."""


def build_runtime(
    prefix: str | os.PathLike[str],
    cuda_arch: str | None = None,
    *,
    emulate: bool = False,
    jobs: int | None = None,
) -> Path:
    """Configures and builds the runtime emitted under ``prefix``; returns its build folder.

    ``cuda_arch`` overrides the architecture the runtime was emitted for (e.g. "90").
    ``jobs`` defaults to the number of CPU cores.  Raises :class:`RuntimeBuildError` with the
    compiler's messages when something fails, and before CMake runs when there is no
    architecture to build for or nvcc does not support it.  Holds ``prefix``'s lock (see
    :mod:`welder.lock`) while it builds.
    """
    source = existing_runtime_dir(prefix)
    with prefix_lock(prefix, "welder build"):
        return _build(source, cuda_arch, emulate, jobs)


def _build(source: Path, cuda_arch: str | None, emulate: bool, jobs: int | None) -> Path:
    build = source / BUILD_SUBDIR
    cmake = shutil.which("cmake")
    if cmake is None:
        raise RuntimeBuildError("cmake was not found on PATH; the runtime needs CMake 3.20 or newer")
    options = [f"-DWELDER_EMULATE={'ON' if emulate else 'OFF'}", "-DCMAKE_BUILD_TYPE=Release"]
    if emulate:
        if shutil.which("g++") is None and shutil.which("c++") is None:
            raise RuntimeBuildError("no C++ compiler (g++) was found on PATH to build the emulated runtime")
        options.append(f"-DWELDER_EMU_DIR={EMU_DIR}")
        compiler = shutil.which("g++")
        if compiler is not None:  # the objects are g++'s, so the build's compiler is too
            objects = ";".join(map(str, runtime_build_objects()))
            options += [f"-DCMAKE_CXX_COMPILER={compiler}", f"-DWELDER_EMU_OBJECTS={objects}"]
            prelude = runtime_build_prelude()
            if prelude is not None:
                options.append(f"-DWELDER_EMU_PCH={prelude}")
    else:
        nvcc = find_nvcc()
        options.append(f"-DCMAKE_CUDA_COMPILER={nvcc}")
        arch = normalize_cuda_arch(cuda_arch)
        if arch is not None:
            options.append(f"-DCMAKE_CUDA_ARCHITECTURES={arch}")
        target = arch or emitted_cuda_arch(source)
        if target is None and shutil.which("nvidia-smi") is None:
            raise RuntimeBuildError(
                "No GPU found to build for (nvidia-smi is not on PATH) and the runtime was generated "
                f"for none. Name the architecture: `welder build {source.parents[1]} --cuda-arch 90` "
                "(your GPU's compute capability)"
            )
        if target is not None:
            check_cuda_arch(target, nvcc)
    _reset_stale_build(build, emulate)
    _run([cmake, "-S", str(source), "-B", str(build), *options], "configuring the runtime (cmake)")
    cores = jobs or usable_cores()
    _run([cmake, "--build", str(build), "--parallel", str(cores)], "compiling the runtime")
    for name in (LIBRARY_NAME, MAIN_TEST_NAME):
        if not (build / name).is_file():
            raise RuntimeBuildError(f"the build finished but {build / name} is missing")
    return build


def find_nvcc() -> str:
    """nvcc from $CUDACXX, PATH or /usr/local/cuda; a RuntimeBuildError naming the fixes if none."""
    candidates = [os.environ.get("CUDACXX"), shutil.which("nvcc"), *_NVCC_FALLBACKS]
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise RuntimeBuildError(
        "nvcc was not found (looked at $CUDACXX, PATH and /usr/local/cuda/bin); install the CUDA toolkit "
        "or set CUDACXX to its nvcc"
    )


def emitted_cuda_arch(source: Path) -> str | None:
    """The architecture the runtime in ``source`` was generated for, if one was named."""
    cmake = source / "CMakeLists.txt"
    found = re.search(r"^\s*set\(CMAKE_CUDA_ARCHITECTURES ([0-9]+[af]?)\)", cmake.read_text(), re.M)
    return found.group(1) if found else None


@functools.cache
def nvcc_architectures(nvcc: str) -> tuple[str, ...] | None:
    """The compute capabilities ``nvcc --list-gpu-arch`` names (``("75", "80", ...)``), or
    None when this nvcc cannot tell (releases before CUDA 11)."""
    try:
        done = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.findall(r"\bcompute_(\d+)", done.stdout)
    if done.returncode != 0 or not found:
        return None
    return tuple(sorted(set(found), key=int))


def check_cuda_arch(arch: str, nvcc: str | None = None) -> None:
    """A :class:`CudaArchError` naming what nvcc supports when it cannot compile for
    ``arch`` ("90", "sm_70", ...): checked up front, as CMake buries nvcc's refusal in a
    failed compiler identification."""
    arch = normalize_cuda_arch(arch) or ""
    nvcc = nvcc or find_nvcc()
    supported = nvcc_architectures(nvcc)
    number = re.match(r"\d+", arch)
    if supported is None or number is None or number.group(0) in supported:
        return
    raise CudaArchError(
        f"{nvcc} cannot compile for CUDA architecture {arch} (sm_{arch}); it supports "
        f"{', '.join(supported)}. Pass one of those as --cuda-arch, or install a CUDA toolkit "
        f"that still supports sm_{arch}"
    )


def _reset_stale_build(build: Path, emulate: bool) -> None:
    """Removes a build folder CMake would refuse or misuse: one configured for the other mode
    (GPU vs emulator), or one copied or moved from elsewhere with its prefix."""
    cache = build / "CMakeCache.txt"
    if not cache.is_file():
        return
    text = cache.read_text(errors="replace")
    mode = re.search(r"^WELDER_EMULATE:BOOL=(\w+)$", text, re.MULTILINE)
    was_emulated = bool(mode) and mode.group(1).upper() in ("ON", "TRUE", "1", "YES")
    home = re.search(r"^CMAKE_CACHEFILE_DIR:INTERNAL=(.*)$", text, re.MULTILINE)
    moved = home is None or Path(home.group(1)).resolve() != build.resolve()
    if was_emulated != emulate or moved:
        shutil.rmtree(build)


def _run(command: Sequence[str], what: str) -> None:
    """Runs a build step; on failure raises with the end of its output."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, errors="replace", check=False)
    except OSError as e:
        raise RuntimeBuildError(f"{what}: cannot run {command[0]}: {e}") from None
    if done.returncode != 0:
        shown = "\n".join(_diagnostics((done.stdout + done.stderr).strip().splitlines()))
        raise RuntimeBuildError(f"{what} failed (exit code {done.returncode}):\n{shown}")


def _diagnostics(lines: list[str]) -> list[str]:
    """The part of a build log that explains a failure: from the first error on (make and
    cmake print their own noise around it), else the end."""
    first = next((k for k, line in enumerate(lines) if re.search(r"\berror\b", line, re.IGNORECASE)), None)
    if first is None:
        return lines[-_SHOWN_LINES:]
    return lines[max(0, first - 2) : first + _SHOWN_LINES]
