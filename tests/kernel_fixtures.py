"""What the tests of hand-written kernels (tests/kernels/) and of generated ones share: their
compilation for the CPU emulator, the line numbers the emulator's messages name, and the
markers and CUDA context of the tests that run them on a GPU."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import pytest

from welder.device.gpu import compute_capability, gpu_available
from welder.runtime import emu
from welder.runtime.emu import compile_kernels

#: Tests that compile kernels for the emulator.
EMULATOR = pytest.mark.skipif(not emu.available(), reason="kernel emulation needs Linux and g++")
#: The hand-written kernels compile cleanly: a warning there is a bug in the test's kernel.
WARNINGS_AS_ERRORS = ("-Wall", "-Wextra", "-Werror")


def line_of(source: str, text: str) -> int:
    """Line of the first occurrence of ``text`` in ``source``, as the emulator names it
    (``kernel.cu:N``)."""
    return source[: source.index(text)].count("\n") + 1


def emulated(source: str, names: Sequence[str]) -> emu.EmulatedModule:
    """``source`` (one translation unit) compiled for the emulator, warnings as errors, in the
    test session's cache (``$WELDER_CACHE_DIR``, a folder of the session's own): the module's
    key holds its flags, and the emulator's objects and precompiled prelude are built once
    for every module there, not once per file of tests."""
    return compile_kernels(source, list(names), extra_flags=WARNINGS_AS_ERRORS)


def hopper() -> bool:
    """Whether a GPU of compute capability 9.0 (sm_90a code) is here."""
    return gpu_available() and compute_capability() == (9, 0)


#: Tests that need any NVIDIA GPU, and those that need sm_90a.
ANY_GPU = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="needs pycuda and an NVIDIA GPU")]
HOPPER = [
    pytest.mark.gpu,
    pytest.mark.skipif(not hopper(), reason="needs pycuda and a GPU of compute capability 9.0 (sm_90a)"),
]


@contextmanager
def cuda_context() -> Iterator[object]:
    """A CUDA context of this process on device 0, current until the block ends."""
    import pycuda.driver as drv

    drv.init()
    ctx = drv.Device(0).make_context()
    try:
        yield ctx
    finally:
        ctx.pop()
        ctx.detach()
