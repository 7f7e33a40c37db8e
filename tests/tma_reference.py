"""numpy models of Hopper's tensor copies (codegen_templates/welder_tma.cuh): which global bytes a
tile-mode box reads (out-of-bounds elements as zeros) or writes (out-of-bounds elements dropped) and
where the copy engine puts them in shared memory, or takes them from, for each swizzle mode --
written from the PTX ISA's description of the tensor-map swizzle modes, not from the emulator --
plus the cases and expectations of tests/kernels/tma_*.cu.

Shared by the emulator tests (test_emulator_tma.py) and the GPU tests (test_gpu_tma.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from welder.codegen.tensor_map import TensorMapArg

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
UNITS, BUGS, RING = (KERNEL_DIR / f"tma_{n}.cu" for n in ("units", "bugs", "ring"))
STORE_UNITS, STORE_BUGS = (KERNEL_DIR / f"tma_store_{n}.cu" for n in ("units", "bugs"))
UNIT_KERNELS = ["tma_box", "tma_wgmma", "tma_tile_copy"]
BUG_KERNELS = ["tma_misuse"]
RING_KERNELS = ["tma_ring_gemm"]
STORE_UNIT_KERNELS = ["tma_store_box", "tma_store_epilogue", "tma_store_epilogue_cluster"]
STORE_BUG_KERNELS = ["tma_store_misuse"]

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


def box_elements(
    spec: TensorMapArg, coords: tuple[int, ...], store: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """For each element e of the box at `coords`, row-major with the innermost fastest: whether
    its coordinates coords + e all lie inside [0, dim), and then the byte offset of its bytes
    (of the `elem_bytes` rows returned) from the tensor's base.  A `store` writes the innermost
    axis in whole 16-byte units (measured on an H100): there, dim[0] counts up to the end of the
    unit holding the tensor's last element."""
    strides = (spec.elem_bytes, *spec.strides)
    index = np.indices(spec.box[::-1]).reshape(spec.rank, -1)[::-1]  # innermost first
    inside = np.ones(index.shape[1], bool)
    offset = np.zeros(index.shape[1], np.int64)
    for d in range(spec.rank):
        c = coords[d] + index[d]
        extent = spec.dims[d]
        if store and d == 0:
            extent = -(-extent * spec.elem_bytes // 16) * 16 // spec.elem_bytes
        inside &= (c >= 0) & (c < extent)
        offset += np.where(inside, c, 0) * strides[d]
    return inside, offset[inside][:, None] + np.arange(spec.elem_bytes)


def gather_box(source: np.ndarray, spec: TensorMapArg, coords: tuple[int, ...]) -> np.ndarray:
    """The box's bytes in row-major order (innermost fastest) as the copy engine reads them from
    `source` (the tensor's bytes from its base): element e of the box at coordinates coords + e,
    zeros where any coordinate lies outside [0, dim)."""
    flat = np.ascontiguousarray(source).view(np.uint8).reshape(-1)
    inside, rows = box_elements(spec, coords)
    out = np.zeros((inside.size, spec.elem_bytes), np.uint8)
    out[inside] = flat[rows]
    return out.reshape(-1)


def scatter_box(
    tensor: np.ndarray, spec: TensorMapArg, coords: tuple[int, ...], values: np.ndarray
) -> np.ndarray:
    """The bytes of `tensor` (from its base) after a store of the box at `coords` whose elements,
    row-major with the innermost fastest, are the bytes `values`: an element inside the tensor
    (rows rounded up to 16 bytes) replaces the one at its coordinates, the others are dropped,
    every other byte stays."""
    assert min(coords) >= 0, "a store box starting before the tensor is an illegal instruction"
    out = np.ascontiguousarray(tensor).view(np.uint8).reshape(-1).copy()
    inside, rows = box_elements(spec, coords, store=True)
    out[rows] = values.reshape(-1, spec.elem_bytes)[inside]
    return out


def swizzle_image(data: np.ndarray, swizzle: int, start: int) -> np.ndarray:
    """Where a box's bytes `data` (row-major) lie in shared memory from shared address `start`:
    where a load lands them, and where a store takes them from."""
    chunks = data.reshape(-1, 16)
    image = np.zeros_like(chunks)
    image[swizzle_chunks(start, data.size, swizzle)] = chunks
    return image.reshape(-1)


def box_image(source: np.ndarray, spec: TensorMapArg, coords: tuple[int, ...], start: int) -> np.ndarray:
    """The shared-memory bytes a load of the box at `coords` writes at shared address `start`."""
    return swizzle_image(gather_box(source, spec, coords), spec.swizzle, start)


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


def _past_the_far_edge(case: BoxCase) -> BoxCase:
    """`case` with each negative outer coordinate moved so that half the box lies past the far edge
    instead: an H100 faults on a store box that starts before the tensor."""
    assert case.coords[0] >= 0, "the innermost coordinate must stay a multiple of 16 bytes"
    dims = case.shape[::-1]
    coords = tuple(c if c >= 0 else dims[d] - case.box[d] // 2 for d, c in enumerate(case.coords))
    return replace(case, coords=coords)


#: the boxes stored back: BOX_CASES, with no coordinate below zero
STORE_BOX_CASES = [_past_the_far_edge(c) for c in BOX_CASES]


def store_box_case(case: BoxCase, rng: np.random.Generator) -> tuple[list, np.ndarray, np.ndarray]:
    """tma_store_box's arguments for `case`: a tensor of random data with NaN row padding, and a box
    of fresh random elements laid out in shared memory as a load of the box would land them; then
    the tensor's bytes (which the launch writes) and what they must be afterwards."""
    data, spec = case.tensor(rng)
    values = rng.standard_normal(int(np.prod(case.box))).astype(data.dtype).view(np.uint8)
    image = swizzle_image(values, spec.swizzle, BOX_BASE + case.dst_offset)
    tensor = data.view(np.uint8).reshape(-1)
    expected = scatter_box(tensor, spec, case.coords, values)
    return case.args(tensor, spec, image), tensor, expected


# -------------------------------------------------------------------------------- the epilogue

#: tma_store_units.cu: bytes of one warp's staging area (two 16 x 64 fp16 panels)
STAGE_BYTES = 4096


@dataclass(frozen=True)
class EpilogueCase:
    """One tma_store_epilogue launch: C (m x n fp16, rows `pitch` elements apart) = 2 x + 1 in
    tiles of 16 * warps rows and 128 columns, walked by `grid` blocks."""

    m: int
    n: int
    warps: int
    grid: int

    @property
    def pitch(self) -> int:
        """A row pitch of whole 16-byte units with at least 8 columns of padding, which the
        clipped stores must leave alone past the 16-byte unit of column n - 1."""
        return (self.n + 15) // 8 * 8

    @property
    def tiles(self) -> int:
        return -(-self.m // (16 * self.warps)) * -(-self.n // 128)

    @property
    def smem_bytes(self) -> int:
        return 1024 + self.warps * 2 * STAGE_BYTES

    def arrays(self, rng: np.random.Generator) -> tuple[list, np.ndarray, np.ndarray]:
        """The arguments (C filled with NaN), C, and C as it must be afterwards."""
        x = rng.standard_normal((self.m, self.n)).astype(np.float32)
        c = np.full((self.m, self.pitch), np.nan, np.float16)
        spec = TensorMapArg(1, 2, (self.n, self.m), (2 * self.pitch,), (64, 16), 128)
        expected = c.copy()
        expected[:, : self.n] = (2 * x + 1).astype(np.float16)
        # The stores write rows in whole 16-byte units: the kernel's -7 for columns past n lands
        # in the padding up to the next multiple of 8 columns.
        expected[:, self.n : -(-self.n // 8) * 8] = -7.0
        return [x, c, spec, np.int32(self.m), np.int32(self.n)], c, expected


EPILOGUE_CASES = [
    EpilogueCase(64, 128, 4, 1),  # one tile
    EpilogueCase(200, 300, 4, 2),  # twelve ragged tiles: each staging area reused three times
    EpilogueCase(130, 72, 5, 3),  # five warps (no whole warpgroups); a block without a tile
    EpilogueCase(300, 520, 8, 3),  # eight warps, five rounds per block
]
#: tma_store_epilogue_cluster's cases: grids of whole clusters of two
CLUSTER_EPILOGUE_CASES = [EpilogueCase(200, 300, 4, 2), EpilogueCase(130, 264, 6, 4)]


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
