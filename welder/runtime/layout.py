"""Where the standalone runtime lives under a PREFIX folder.

``welder tune`` writes ``PREFIX/nnfusion_rt/cuda_codegen/`` (the layout NNFusion and Welder
use, so their scripts find things where they expect them); the build goes to its ``build/``.
Every part of the runtime -- emit, build, load -- resolves paths here and nowhere else.
"""

from __future__ import annotations

import os
from pathlib import Path

from welder.errors import WelderError

RUNTIME_SUBDIR = Path("nnfusion_rt") / "cuda_codegen"
BUILD_SUBDIR = "build"
LIBRARY_NAME = "libnnfusion_naive_rt.so"
MAIN_TEST_NAME = "main_test"
CONSTANT_SUBDIR = "Constant"
SOURCE_NAME = "nnfusion_rt.cu"


def runtime_dir(prefix: str | os.PathLike[str]) -> Path:
    """``PREFIX/nnfusion_rt/cuda_codegen``; a path that already is such a folder is kept."""
    path = Path(prefix)
    if (path / SOURCE_NAME).is_file() and not (path / RUNTIME_SUBDIR / SOURCE_NAME).is_file():
        return path
    return path / RUNTIME_SUBDIR


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
