"""numpy models of Hopper's tensor copies (codegen_templates/welder_tma.cuh): which global bytes a
tile-mode box reads (out-of-bounds elements as zeros) and where the copy engine puts them in shared
memory for each swizzle mode -- written from the PTX ISA's description of the tensor-map swizzle
modes, not from the emulator -- plus the cases and expectations of tests/kernels/tma_*.cu.

Shared by the emulator tests (test_emulator_tma.py) and the GPU tests (test_gpu_tma.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from welder.codegen.tensor_map import TensorMapArg

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
UNITS, BUGS, RING = (KERNEL_DIR / f"tma_{n}.cu" for n in ("units", "bugs", "ring"))
UNIT_KERNELS = ["tma_box", "tma_wgmma", "tma_tile_copy"]
BUG_KERNELS = ["tma_misuse"]
RING_KERNELS = ["tma_ring_gemm"]

#: tma_ring.cu: block tile, threads, dynamic shared memory (checked by a static_assert there)
RING_TILE = (128, 64, 64)
RING_THREADS = 384
RING_SMEM_BYTES = 99392
#: tma_box's shared memory besides the box: alignment slack and the mbarrier's 1024-byte line
BOX_SMEM_EXTRA = 2048
#: where tma_box's box starts, relative to a 1024-aligned shared address, before `dst_offset`
BOX_BASE = 1024


def swizzle_chunks(start: int, nbytes: int, swizzle: int) -> np.ndarray:
    """Where each 16-byte chunk of a box written at shared address `start` lands (as an offset
    from `start`, in chunks).  The PTX ISA's swizzle modes: shared memory is seen as lines of 128
    bytes; within each `swizzle`-byte span, the index of a 16-byte chunk (0 .. swizzle/16 - 1) is
    XORed with the index of its 128-byte line modulo swizzle/16, so the pattern repeats every
    8 lines (128B), 4 (64B) or 2 (32B)."""
    chunk = np.arange(nbytes // 16)
    address = start + 16 * chunk
    if swizzle == 0:
        return chunk
    per_span = swizzle // 16
    span_start = address // swizzle * swizzle
    in_span = address % swizzle // 16
    line = address // 128 % per_span
    return (span_start + 16 * (in_span ^ line) - start) // 16


def gather_box(source: np.ndarray, spec: TensorMapArg, coords: tuple[int, ...]) -> np.ndarray:
    """The box's bytes in row-major order (innermost fastest) as the copy engine reads them from
    `source` (the tensor's bytes from its base): element e of the box at coordinates coords + e,
    zeros where any coordinate lies outside [0, dim)."""
    flat = np.ascontiguousarray(source).view(np.uint8).reshape(-1)
    strides = (spec.elem_bytes, *spec.strides)
    index = np.indices(spec.box[::-1]).reshape(spec.rank, -1)[::-1]  # innermost first
    inside = np.ones(index.shape[1], bool)
    offset = np.zeros(index.shape[1], np.int64)
    for d in range(spec.rank):
        c = coords[d] + index[d]
        inside &= (c >= 0) & (c < spec.dims[d])
        offset += np.where(inside, c, 0) * strides[d]
    out = np.zeros((index.shape[1], spec.elem_bytes), np.uint8)
    rows = offset[inside][:, None] + np.arange(spec.elem_bytes)
    out[inside] = flat[rows]
    return out.reshape(-1)


def box_image(source: np.ndarray, spec: TensorMapArg, coords: tuple[int, ...], start: int) -> np.ndarray:
    """The shared-memory bytes a load of the box at `coords` writes at shared address `start`."""
    data = gather_box(source, spec, coords).reshape(-1, 16)
    image = np.zeros_like(data)
    image[swizzle_chunks(start, data.size, spec.swizzle)] = data
    return image.reshape(-1)


@dataclass(frozen=True)
class BoxCase:
    """One tma_box launch: a tensor (its shape outermost first, a row pitch in elements) and a box.
    The innermost coordinate times the element size must be a multiple of 16 bytes (negative
    ones too): otherwise the H100 faults with an illegal instruction."""

    name: str
    elem_bytes: int
    shape: tuple[int, ...]  # outermost first
    pitch: int  # elements between rows (>= shape[-1]); higher dims are dense over rows
    box: tuple[int, ...]  # innermost first
    swizzle: int
    coords: tuple[int, ...]  # innermost first
    dst_offset: int = 0

    def tensor(self, rng: np.random.Generator) -> tuple[np.ndarray, TensorMapArg]:
        """Random data (padded rows filled with NaN, which no load may read) and the map over it
        (the pointer argument of tma_box is 1)."""
        dtype = np.float16 if self.elem_bytes == 2 else np.float32
        padded = rng.standard_normal((*self.shape[:-1], self.pitch)).astype(dtype)
        padded[..., self.shape[-1] :] = np.nan
        dims = self.shape[::-1]
        strides, stride = [], self.pitch * self.elem_bytes
        for d in dims[1:]:
            strides.append(stride)
            stride *= d
        spec = TensorMapArg(1, self.elem_bytes, dims, tuple(strides), self.box, self.swizzle)
        return padded, spec

    @property
    def box_bytes(self) -> int:
        return int(np.prod(self.box)) * self.elem_bytes

    @property
    def smem_bytes(self) -> int:
        return BOX_SMEM_EXTRA + self.dst_offset + self.box_bytes

    def args(self, data: np.ndarray, spec: TensorMapArg, out: np.ndarray) -> list:
        coords = [*self.coords, *([0] * (5 - len(self.coords)))]
        scalars = [len(self.box), self.box_bytes, self.dst_offset, *coords]
        return [spec, data.view(np.uint8).reshape(-1), out, *(np.int32(v) for v in scalars)]

    def expected(self, data: np.ndarray, spec: TensorMapArg) -> np.ndarray:
        return box_image(data, spec, self.coords, BOX_BASE + self.dst_offset)


BOX_CASES = [
    # 2D, each swizzle with rows of one span, ragged at both ends and past the tensor
    BoxCase("2d-none", 2, (40, 72), 72, (24, 16), 0, (8, 30)),
    BoxCase("2d-32B", 2, (70, 40), 48, (16, 32), 32, (24, 50)),
    BoxCase("2d-64B", 2, (70, 40), 40, (32, 24), 64, (16, -5)),
    BoxCase("2d-128B", 2, (100, 64), 64, (64, 16), 128, (0, 90)),
    BoxCase("2d-128B-fp32", 4, (33, 50), 52, (32, 16), 128, (32, -3)),
    BoxCase("2d-none-fp32", 4, (20, 12), 12, (4, 8), 0, (8, 15)),
    # the pattern follows shared addresses: a box starting mid-pattern
    BoxCase("2d-32B-offset", 2, (40, 16), 16, (16, 24), 32, (0, 3), dst_offset=128),
    BoxCase("2d-64B-offset", 2, (40, 32), 32, (32, 20), 64, (0, 7), dst_offset=384),
    # 3D, padded strides, each swizzle
    BoxCase("3d-none", 2, (5, 20, 40), 48, (16, 8, 3), 0, (32, 15, 3)),
    BoxCase("3d-32B", 2, (6, 10, 16), 24, (16, 12, 2), 32, (0, -2, 5)),
    BoxCase("3d-64B", 4, (4, 9, 16), 16, (16, 8, 4), 64, (0, 4, 1)),
    BoxCase("3d-128B", 2, (3, 17, 64), 72, (64, 8, 2), 128, (0, 12, 2)),
    # 1, 4 and 5 dimensions
    BoxCase("1d", 4, (100,), 100, (32,), 0, (80,)),
    BoxCase("4d-64B", 2, (3, 4, 5, 32), 32, (32, 4, 2, 2), 64, (0, 2, 3, 2)),
    BoxCase("5d-none", 2, (2, 3, 2, 5, 16), 24, (8, 4, 2, 2, 2), 0, (8, 2, 1, 2, 1)),
]


# -------------------------------------------------------------------------------- tma_wgmma


def wgmma_case(rng: np.random.Generator) -> tuple[list, np.ndarray]:
    """tma_wgmma's arguments (before `out`) and the exact D = A B (64 x 8)."""
    a = rng.standard_normal((64, 16)).astype(np.float16)
    b = rng.standard_normal((8, 16)).astype(np.float16)  # [N][K]
    map_a = TensorMapArg(2, 2, (16, 64), (32,), (16, 64), 32)
    map_b = TensorMapArg(3, 2, (16, 8), (32,), (16, 8), 32)
    return [map_a, map_b, a, b], a.astype(np.float64) @ b.astype(np.float64).T


# -------------------------------------------------------------------------------- the ring


def ring_case(m: int, n: int, k: int, rng: np.random.Generator):
    """tma_ring_gemm's grid and arguments (C filled with NaN) and A, B^T as float64."""
    a = rng.standard_normal((m, k)).astype(np.float16)
    b = rng.standard_normal((n, k)).astype(np.float16)
    bm, bn, bk = RING_TILE
    map_a = TensorMapArg(2, 2, (k, m), (2 * k,), (bk, bm), 128)
    map_b = TensorMapArg(3, 2, (k, n), (2 * k,), (bk, bn), 128)
    c = np.full((m, n), np.nan, np.float32)
    grid = (-(-n // bn), -(-m // bm), 1)
    args = [map_a, map_b, a, b, c, np.int32(m), np.int32(n), np.int32(k)]
    return grid, args, c, a.astype(np.float64), b.astype(np.float64).T


def assert_gemm_close(c: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """fp32 C against A @ B: fp32 accumulation error of the exact products."""
    reference, scale = a @ b, np.abs(a) @ np.abs(b)
    assert np.isfinite(c).all(), "unwritten or non-finite outputs"
    err = np.abs(c.astype(np.float64) - reference)
    bound = 1e-5 * scale + 1e-6
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), f"C{worst} = {c[worst]}, expected {reference[worst]}"
