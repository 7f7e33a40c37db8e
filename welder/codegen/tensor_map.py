"""Tensor-map kernel arguments: what a Hopper TMA load reads through (``welder_tma.cuh``).

A kernel takes a tensor map as a ``const __grid_constant__ CUtensorMap`` parameter: 128 bytes,
64-byte aligned in the parameter buffer, that describe a tiled view of one of its global buffers.
The map's contents depend on that buffer's address, so the launcher -- not the kernel's author --
encodes it, once per buffer it is launched on: :class:`TensorMapArg` is the plain description
that travels with a launch (naming the pointer argument it covers), and the device layers encode
it -- the GPU through the driver's ``cuTensorMapEncodeTiled`` (:mod:`welder.device.gpu`), the CPU
emulator through its own encode (:mod:`welder.runtime.emu.emulator`).

:func:`tensor_map_problem` checks a description against the driver's documented rules (the same
ones ``welder_tensor_map.cuh`` states for C++), so that a bad map is refused with a sentence
saying why, before the driver's bare ``CUDA_ERROR_INVALID_VALUE``.
"""

from __future__ import annotations

from dataclasses import dataclass

from welder.errors import WelderError

#: Bytes of a CUtensorMap, and its alignment in a kernel's parameter buffer.
TENSOR_MAP_BYTES = 128
TENSOR_MAP_ALIGN = 64
SWIZZLES = (0, 32, 64, 128)


class TensorMapError(WelderError):
    """A tensor map could not be encoded: its description breaks a rule of the copy engine, it
    names an argument that is not a buffer, or the encoder refused it."""


@dataclass(frozen=True)
class TensorMapArg:
    """A tiled tensor map over the buffer passed as argument ``pointer`` of the same launch.

    ``dims`` and ``box`` are in elements, innermost first; ``strides`` holds the byte strides of
    dims 1.. (one fewer than ``dims``); ``elem_bytes`` is 2 (fp16) or 4 (fp32); ``swizzle`` is the
    shared-memory swizzle span in bytes (0, 32, 64 or 128)."""

    pointer: int
    elem_bytes: int
    dims: tuple[int, ...]
    strides: tuple[int, ...]
    box: tuple[int, ...]
    swizzle: int = 0
    offset: int = 0  # bytes from the buffer's start to the map's origin (a multiple of 16)

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def box_bytes(self) -> int:
        """Bytes one load of the box writes into shared memory (and completes on its mbarrier)."""
        total = self.elem_bytes
        for b in self.box:
            total *= b
        return total

    @property
    def extent(self) -> int:
        """Bytes from the map's origin to one past the last element it covers (the buffer must
        hold ``offset + extent`` bytes)."""
        return sum((d - 1) * s for d, s in zip(self.dims, (self.elem_bytes, *self.strides))) + self.elem_bytes


def tensor_map_problem(spec: TensorMapArg, base: int) -> str | None:
    """Why ``spec`` cannot be encoded over the global address ``base``, or None if it can."""
    if spec.elem_bytes not in (2, 4):
        return f"the element size must be 2 or 4 bytes, not {spec.elem_bytes}"
    if not 1 <= spec.rank <= 5:
        return f"the rank must be 1 to 5, not {spec.rank}"
    if len(spec.box) != spec.rank or len(spec.strides) != spec.rank - 1:
        return (
            f"a rank-{spec.rank} map needs {spec.rank} box dimensions and {spec.rank - 1} strides, "
            f"got {len(spec.box)} and {len(spec.strides)}"
        )
    if base == 0:
        return "the global address is null"
    if base % 16:
        return f"the global address 0x{base:x} must be 16-byte aligned"
    if any(not 1 <= d <= 2**32 for d in spec.dims):
        return f"every dimension must be 1 to 2^32, got {list(spec.dims)}"
    if any(s % 16 or not 0 <= s < 2**40 for s in spec.strides):
        return f"every stride must be a multiple of 16 bytes below 2^40, got {list(spec.strides)}"
    if any(not 1 <= b <= 256 for b in spec.box):
        return f"every box dimension must be 1 to 256, got {list(spec.box)}"
    inner = spec.box[0] * spec.elem_bytes
    if inner % 16:
        return f"the box's innermost extent ({inner} bytes) must be a multiple of 16 bytes"
    if spec.swizzle not in SWIZZLES:
        return f"the swizzle must be 0, 32, 64 or 128 bytes, not {spec.swizzle}"
    if spec.swizzle and inner > spec.swizzle:
        return f"the box's innermost extent ({inner} bytes) exceeds the {spec.swizzle}-byte swizzle span"
    return None


def check_tensor_map(spec: TensorMapArg, base: int, what: str = "tensor map") -> None:
    """Raises :class:`TensorMapError` naming ``what`` when ``spec`` cannot be encoded at ``base``."""
    problem = tensor_map_problem(spec, base)
    if problem is not None:
        raise TensorMapError(f"{what}: {problem}")


@dataclass(frozen=True)
class EncodedTensorMap:
    """The 128 bytes of an encoded map, bound to one buffer: what a launch's parameter buffer holds."""

    data: bytes

    def __post_init__(self) -> None:
        if len(self.data) != TENSOR_MAP_BYTES:
            raise TensorMapError(f"an encoded tensor map has {TENSOR_MAP_BYTES} bytes, not {len(self.data)}")
