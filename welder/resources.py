"""Where welder's files that are not Python live: the CUDA and runtime templates and the
emulator's C++ sources.

They ship inside the package as package data, so a source checkout, an editable install and
an installed wheel all find them the same way: through ``importlib.resources``, here and only
here.  Every consumer -- the Jinja loaders, nvcc's and g++'s include paths, the CMake build of
the emulated runtime -- takes its paths from this module, so none of them depends on where the
package happens to sit relative to a repository.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path


def _package_dir() -> Path:
    """The ``welder`` package folder on disk.  Compilers read the headers by path, so a
    package imported from a zip archive, which has no such folder, cannot be used."""
    root = files("welder")
    if not isinstance(root, Path):
        raise ImportError(
            f"welder is imported from {root}, not from a folder; install it as files on disk "
            "(pip install welder), since nvcc and g++ read its headers by path"
        )
    return root.resolve()


PACKAGE_DIR: Path = _package_dir()
#: Kernel templates (``*.cu.j2``) and the headers every kernel includes (``*.cuh``).
TEMPLATE_DIR: Path = PACKAGE_DIR / "codegen_templates"
#: The standalone runtime's templates: sources, ``main_test`` and ``CMakeLists.txt``.
RUNTIME_TEMPLATE_DIR: Path = TEMPLATE_DIR / "runtime"
#: The header generated kernels start with; it pulls in the emulator under WELDER_EMULATE.
PRELUDE: Path = TEMPLATE_DIR / "welder_prelude.cuh"
#: The CPU emulator's C++ headers and sources.
EMU_DIR: Path = PACKAGE_DIR / "runtime" / "emu"
