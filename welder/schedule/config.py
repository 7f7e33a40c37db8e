"""The plain data a schedule consists of: what the policy decides and codegen obeys.

Everything here serialises to JSON (``tuned.json``) and back, so a tuned model can be
rebuilt without searching again.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any


@dataclass
class StagedInput:
    """A global tensor copied into shared memory one reduction step at a time."""

    tensor: str
    extents: tuple[int, ...]  # region per step
    offset: int  # byte offset in the group's shared pool
    vector: int  # elements per load instruction


@dataclass
class StageConfig:
    """How one tile-owning node of a group computes its tile.

    Threads are laid out over the tile's axes (``thread_shape``, innermost axis fastest);
    thread ``t`` handles elements ``t_d + j_d * thread_shape[d]`` for ``j_d <
    reg_tile[d]``.  Threads beyond ``prod(thread_shape)`` split the reduction
    (``reduce_threads`` per output, combined with shuffles).
    """

    node: str
    tile: tuple[int, ...]  # extents of the region this block computes
    thread_shape: tuple[int, ...]
    reg_tile: tuple[int, ...]
    reduce_threads: int = 1
    rstep: tuple[int, ...] = ()
    staged: list[StagedInput] = field(default_factory=list)
    smem_offset: int | None = None  # where its tile lives when consumed inside the group
    reduce_offset: int | None = None  # scratch for combining warps of a cross-warp reduction
    write_global: bool = False


@dataclass
class Estimate:
    """The cost model's view of one config."""

    blocks: int
    blocks_per_sm: int
    waves: int
    read_bytes: int  # global memory, whole kernel, rounded to transactions, re-reads included
    write_bytes: int
    compulsory_bytes: int  # every tensor the kernel touches, once: what must cross DRAM
    flops: int
    smem_bytes: int
    regs_per_thread: int
    latency_us: float


@dataclass(frozen=True)
class GemmSpec:
    """A group that one strided batched matrix product of a vendor library computes:
    ``C[b, m, n] = sum_k A[b, m, k] * B[b, k, n]`` for ``b < batch``, in row-major terms.

    Element ``(b, m, k)`` of A is at ``offset_a + b * stride_a + m * lda + k`` in tensor ``a``
    (``k * lda + m`` when ``trans_a``: A is stored as K x M); element ``(b, k, n)`` of B at
    ``offset_b + b * stride_b + k * ldb + n`` (``n * ldb + k`` when ``trans_b``); C is the
    group's output, ``b * stride_c + m * ldc + n``.  Units are elements; a batch stride of 0
    broadcasts that operand over the batch.  A, B and C share ``dtype``; products accumulate
    in ``compute_dtype``.

    A batch that no single stride spans (windows x heads) takes ``outer`` such calls, call
    ``o`` with every address moved by ``o * outer_a``, ``o * outer_b``, ``o * outer_c``.
    """

    a: str
    b: str
    c: str
    batch: int
    m: int
    n: int
    k: int
    trans_a: bool
    trans_b: bool
    lda: int
    ldb: int
    ldc: int
    stride_a: int
    stride_b: int
    stride_c: int
    offset_a: int
    offset_b: int
    dtype: str
    compute_dtype: str = "float32"
    library: str = "cublas"
    outer: int = 1
    outer_a: int = 0
    outer_b: int = 0
    outer_c: int = 0


@dataclass
class GroupConfig:
    root: str
    block_tile: tuple[int, ...]
    grid: tuple[int, ...]  # blocks per root axis
    block_order: tuple[int, ...]  # root axes, slowest-varying first, for blockIdx.x
    threads: int
    stages: list[StageConfig]
    smem_bytes: int
    estimate: Estimate
    gemm: GemmSpec | None = None  # set: the group is a library call, the tiling fields are unused

    @property
    def num_blocks(self) -> int:
        n = 1
        for g in self.grid:
            n *= g
        return n

    def stage(self, node: str) -> StageConfig:
        return next(s for s in self.stages if s.node == node)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def renamed(self, names: dict[str, str]) -> GroupConfig:
        """Copy with node and tensor names mapped through ``names`` (others kept)."""

        def n(x: str) -> str:
            return names.get(x, x)

        stages = [
            replace(st, node=n(st.node), staged=[replace(sd, tensor=n(sd.tensor)) for sd in st.staged])
            for st in self.stages
        ]
        gemm = self.gemm and replace(self.gemm, a=n(self.gemm.a), b=n(self.gemm.b), c=n(self.gemm.c))
        return replace(self, root=n(self.root), stages=stages, gemm=gemm)

    @staticmethod
    def from_json(d: dict[str, Any]) -> GroupConfig:
        stages = []
        for s in d["stages"]:
            staged = [StagedInput(**{**x, "extents": tuple(x["extents"])}) for x in s["staged"]]
            stages.append(StageConfig(**{**_tuples(s, StageConfig), "staged": staged}))
        gemm = GemmSpec(**d["gemm"]) if d.get("gemm") else None
        return GroupConfig(
            **{
                **_tuples(d, GroupConfig),
                "stages": stages,
                "estimate": Estimate(**d["estimate"]),
                "gemm": gemm,
            }
        )


def _tuples(d: dict[str, Any], cls: type) -> dict[str, Any]:
    """JSON lists back to the tuples the dataclass declares."""
    out = dict(d)
    for f in fields(cls):
        if f.name in out and isinstance(out[f.name], list) and "tuple" in str(f.type):
            out[f.name] = tuple(out[f.name])
    return out
