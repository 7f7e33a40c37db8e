"""Where the standalone runtime lives under a PREFIX folder.

``welder tune`` writes ``PREFIX/nnfusion_rt/cuda_codegen/`` (the layout NNFusion and Welder
use, so their scripts find things where they expect them); the build goes to its ``build/``.
Every part of the runtime -- emit, build, load -- resolves paths here and nowhere else.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from welder.errors import WelderError

RUNTIME_SUBDIR = Path("nnfusion_rt") / "cuda_codegen"
BUILD_SUBDIR = "build"
LIBRARY_NAME = "libnnfusion_naive_rt.so"
MAIN_TEST_NAME = "main_test"
CONSTANT_SUBDIR = "Constant"
SOURCE_NAME = "nnfusion_rt.cu"
#: The files that define the kernels, ``kernels_0.cu``, ``kernels_1.cu``, ... (nnfusion_rt.cu
#: declares and launches them): several translation units, which the build compiles in parallel.
KERNEL_SOURCE_PREFIX = "kernels_"


def runtime_dir(prefix: str | os.PathLike[str]) -> Path:
    """``PREFIX/nnfusion_rt/cuda_codegen``; a path that already is such a folder is kept."""
    path = Path(prefix)
    if (path / SOURCE_NAME).is_file() and not (path / RUNTIME_SUBDIR / SOURCE_NAME).is_file():
        return path
    return path / RUNTIME_SUBDIR


def kernel_source_name(index: int) -> str:
    """The name of kernel file number ``index`` (``kernels_3.cu``)."""
    return f"{KERNEL_SOURCE_PREFIX}{index}.cu"


def kernel_sources(folder: str | os.PathLike[str]) -> list[Path]:
    """The kernel files of the emitted runtime in ``folder``, in the order of their numbers
    (that is, in the order the kernels run)."""
    numbered = [
        (int(match.group(1)), path)
        for path in Path(folder).glob(f"{KERNEL_SOURCE_PREFIX}*.cu")
        if (match := re.fullmatch(rf"{KERNEL_SOURCE_PREFIX}(\d+)\.cu", path.name))
    ]
    return [path for _, path in sorted(numbered)]


def runtime_sources(folder: str | os.PathLike[str]) -> list[Path]:
    """Every CUDA source of the emitted runtime in ``folder``: nnfusion_rt.cu, then the kernel
    files.  What reads or compiles "the runtime's code" takes all of them, since the kernels
    live in the kernel files and the host code in nnfusion_rt.cu."""
    return [Path(folder) / SOURCE_NAME, *kernel_sources(folder)]


def existing_runtime_dir(prefix: str | os.PathLike[str]) -> Path:
    """The emitted runtime folder of ``prefix``; a WelderError if nothing was emitted there."""
    path = runtime_dir(prefix)
    if not (path / SOURCE_NAME).is_file() or not (path / "CMakeLists.txt").is_file():
        raise WelderError(
            f"no generated runtime in {prefix} (expected {path / SOURCE_NAME}); run `welder tune` first"
        )
    return path


def library_path(prefix: str | os.PathLike[str]) -> Path:
    """The built shared library of ``prefix``'s runtime."""
    return runtime_dir(prefix) / BUILD_SUBDIR / LIBRARY_NAME


def main_test_path(prefix: str | os.PathLike[str]) -> Path:
    """The built latency executable of ``prefix``'s runtime."""
    return runtime_dir(prefix) / BUILD_SUBDIR / MAIN_TEST_NAME
