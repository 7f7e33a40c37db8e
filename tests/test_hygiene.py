"""The suite writes only under temporary folders (tests/conftest.py): every place welder or
its dependencies keep caches and state resolves inside the run's private sandbox, never in
the user's home or the working directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import SANDBOX_VARIABLE
from hypothesis import configuration

from welder.runtime.emu import available, compile_kernels
from welder.runtime.emu.emulator import _cache_root
from welder.tune.cache import TuningCache, default_cache_path


def _sandbox() -> Path:
    return Path(os.environ[SANDBOX_VARIABLE]).resolve()


def _inside(path: Path) -> bool:
    return path.resolve().is_relative_to(_sandbox())


def _welder_cache(path: Path) -> bool:
    """Inside the sandbox, or inside the folder a developer chose to keep builds in."""
    kept = os.environ.get("WELDER_TEST_CACHE_DIR")
    return _inside(path) or (kept is not None and path.resolve().is_relative_to(Path(kept).resolve()))


def test_the_sandbox_is_a_private_temporary_folder() -> None:
    import tempfile

    sandbox = _sandbox()
    assert sandbox.is_relative_to(Path(tempfile.gettempdir()).resolve())
    assert not Path.cwd().resolve().is_relative_to(sandbox)
    assert sandbox.stat().st_mode & 0o077 == 0  # mkdtemp: nobody else may plant files in it


def test_home_and_caches_point_into_the_sandbox() -> None:
    assert _inside(Path.home())
    assert _inside(Path(os.path.expanduser("~")))
    assert _welder_cache(default_cache_path())
    assert _welder_cache(_cache_root(None))
    assert _inside(configuration.storage_directory("examples", intent_to_write=False).path)
    for name in ("XDG_CACHE_HOME", "ONNX_HOME"):
        assert _inside(Path(os.environ[name]))


def test_the_tuning_cache_opened_without_a_path_lands_in_the_sandbox() -> None:
    assert _welder_cache(TuningCache().path)


@pytest.mark.skipif(not available(), reason="the emulator needs Linux and g++")
def test_an_emulator_build_with_the_default_cache_lands_in_the_sandbox() -> None:
    source = '#include "welder_prelude.cuh"\n__global__ void twice(float* x) { x[threadIdx.x] *= 2.0f; }\n'
    module = compile_kernels(source, ["twice"])
    data = np.arange(4, dtype=np.float32)
    module.launch("twice", 1, 4, 0, [data])
    assert data.tolist() == [0.0, 2.0, 4.0, 6.0]
    root = _cache_root(None)
    assert _welder_cache(root) and any(root.glob("*.so"))


def test_child_processes_inherit_the_sandbox() -> None:
    """Tests run welder and the artifacts scripts as child processes; they see the same
    redirections."""
    code = "import pathlib; print(pathlib.Path.home())"
    home = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert _inside(Path(home.strip()))
