"""CPU execution of generated CUDA kernels, a test instrument for templates.

``compile_kernels(source, names)`` builds kernel text with g++ against a CUDA emulation layer
(threads as fibers, checked shared memory, warp collectives, half precision, wmma) and returns an
:class:`EmulatedModule` whose ``launch`` runs a kernel on numpy arrays.  See docs/emulator.md.
"""

from welder.runtime.emu.emulator import (
    DEFAULT_STACK_BYTES,
    PRELUDE,
    PRELUDE_DIR,
    EmulatedModule,
    EmulationError,
    available,
    compile_kernels,
)

__all__ = [
    "DEFAULT_STACK_BYTES",
    "PRELUDE",
    "PRELUDE_DIR",
    "EmulatedModule",
    "EmulationError",
    "available",
    "compile_kernels",
]
