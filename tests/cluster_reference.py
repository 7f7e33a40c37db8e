"""Cases and numpy expectations of tests/kernels/cluster_*.cu (codegen_templates/welder_cluster.cuh):
boxes loaded in parts by the blocks of a cluster with TMA multicast (the bytes each block must end up
with, from tma_reference's model of the copy engine), the value exchange across a cluster barrier,
and the two-block ring whose blocks share A's slices.

Shared by the emulator tests (test_emulator_cluster.py) and the GPU tests (test_gpu_cluster.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tma_reference import BOX_BASE, BOX_SMEM_EXTRA, KERNEL_DIR, BoxCase, box_image

from welder.codegen.tensor_map import TensorMapArg

UNITS, BUGS, RING = (KERNEL_DIR / f"cluster_{n}.cu" for n in ("units", "bugs", "ring"))
#: cluster size -> kernel (size 1: declared without cluster dims)
BOX_KERNELS = {1: "cluster_box_1", 2: "cluster_box_2", 4: "cluster_box_4"}
EXCHANGE_KERNELS = {1: "cluster_exchange_1", 2: "cluster_exchange_2", 4: "cluster_exchange_4"}
UNIT_KERNELS = [*BOX_KERNELS.values(), *EXCHANGE_KERNELS.values()]
BUG_KERNELS = ["cluster_misuse"]
RING_KERNELS = ["cluster_ring_gemm"]

#: cluster_ring.cu: block tile, cluster size, threads, dynamic shared memory (a static_assert there)
RING_TILE = (128, 64, 64)
RING_CLUSTER = 2
RING_THREADS = 384
RING_SMEM_BYTES = 99392
#: cluster_bugs.cu: threads per block, dynamic shared memory, the tensor its map covers (rows,
#: columns of fp16), box rows
BUG_THREADS = 128
BUG_SMEM_BYTES = 5120
BUG_SHAPE = (16, 64)
BUG_BOX_ROWS = 8


@dataclass(frozen=True)
class ClusterBoxCase:
    """One cluster_box_<cluster> launch of `clusters` clusters.  `part` is the box each block
    loads (2D: its innermost extent and `rows` rows); block rank r of cluster c loads it at
    (part.coords[0], part.coords[1] + (c * cluster + r) * rows) into part r of its tile, which
    every block of the cluster receives whole."""

    part: BoxCase
    cluster: int
    clusters: int

    @property
    def name(self) -> str:
        return f"x{self.cluster}-{self.part.name}"

    @property
    def rows(self) -> int:
        return self.part.box[1]

    @property
    def grid(self) -> int:
        return self.cluster * self.clusters

    @property
    def tile_bytes(self) -> int:
        return self.cluster * self.part.box_bytes

    @property
    def smem_bytes(self) -> int:
        return BOX_SMEM_EXTRA + self.tile_bytes

    def tensor(self, rng: np.random.Generator) -> tuple[np.ndarray, TensorMapArg]:
        return self.part.tensor(rng)

    def args(self, data: np.ndarray, spec: TensorMapArg, out: np.ndarray) -> list:
        c0, c1 = self.part.coords
        scalars = (self.part.box_bytes, self.rows, c0, c1)
        return [spec, data.view(np.uint8).reshape(-1), out, *(np.int32(v) for v in scalars)]

    def part_coords(self, block: int, rank: int) -> tuple[int, int]:
        c0, c1 = self.part.coords
        return c0, c1 + (block // self.cluster * self.cluster + rank) * self.rows

    def expected(self, data: np.ndarray, spec: TensorMapArg) -> np.ndarray:
        """out (grid x tile_bytes): each block's tile, every part of its cluster at its place."""
        part_bytes = self.part.box_bytes
        return np.stack(
            [
                np.concatenate(
                    [
                        box_image(data, spec, self.part_coords(block, r), BOX_BASE + r * part_bytes)
                        for r in range(self.cluster)
                    ]
                )
                for block in range(self.grid)
            ]
        )


BOX_CASES = [
    # two blocks, 128B swizzle (parts of 1024 bytes keep the pattern's alignment), rows above
    # and below the tensor
    ClusterBoxCase(BoxCase("2d-128B", 2, (20, 64), 64, (64, 8), 128, (0, -4)), 2, 2),
    ClusterBoxCase(BoxCase("2d-32B", 2, (40, 40), 48, (16, 8), 32, (16, 1)), 2, 3),
    # four blocks, unswizzled fp32 parts of 128 bytes, ragged at the bottom
    ClusterBoxCase(BoxCase("2d-none-fp32", 4, (30, 20), 20, (8, 4), 0, (8, 3)), 4, 2),
    # no cluster dims: a cluster of one, multicasting to itself
    ClusterBoxCase(BoxCase("2d-64B", 2, (20, 40), 40, (32, 8), 64, (8, 5)), 1, 3),
]


def exchange_case(cluster: int, clusters: int, threads: int, rng: np.random.Generator):
    """cluster_exchange_<cluster>'s grid and arguments (outputs full of NaN or 0xFFFFFFFF), and
    the expected out (2 x the input of the next block of the cluster) and ranks."""
    grid = cluster * clusters
    values = rng.standard_normal((grid, threads)).astype(np.float32)
    scratch = np.full_like(values, np.nan)
    out = np.full_like(values, np.nan)
    ranks = np.full(grid, 0xFFFFFFFF, np.uint32)
    block = np.arange(grid)
    rank = block % cluster
    peer = block - rank + (rank + 1) % cluster
    return grid, [values, scratch, out, ranks], 2 * values[peer], rank.astype(np.uint32)


def ring_case(m: int, n: int, k: int, rng: np.random.Generator):
    """cluster_ring_gemm's grid and arguments (C filled with NaN) and A, B^T as float64: A's map
    has boxes of half a block tile's rows (each block of a cluster loads one half)."""
    a = rng.standard_normal((m, k)).astype(np.float16)
    b = rng.standard_normal((n, k)).astype(np.float16)
    bm, bn, bk = RING_TILE
    map_a = TensorMapArg(2, 2, (k, m), (2 * k,), (bk, bm // RING_CLUSTER), 128)
    map_b = TensorMapArg(3, 2, (k, n), (2 * k,), (bk, bn), 128)
    c = np.full((m, n), np.nan, np.float32)
    grid = (RING_CLUSTER * -(-n // (RING_CLUSTER * bn)), -(-m // bm), 1)
    args = [map_a, map_b, a, b, c, np.int32(m), np.int32(n), np.int32(k)]
    return grid, args, c, a.astype(np.float64), b.astype(np.float64).T


def bug_args(rng: np.random.Generator, mode: int, grid: int = 2) -> tuple[list, np.ndarray, np.ndarray]:
    """cluster_misuse's arguments for `mode`, its source and its output (grid x src, NaN)."""
    src = rng.standard_normal(BUG_SHAPE).astype(np.float16)
    rows, cols = BUG_SHAPE
    spec = TensorMapArg(1, 2, (cols, rows), (2 * cols,), (cols, BUG_BOX_ROWS), 0)
    out = np.full((grid, *BUG_SHAPE), np.nan, np.float16)
    return [spec, src, out, np.int32(mode)], src, out
