"""Rendering one fused group and its config into a CUDA kernel.

Python makes every decision here -- names, origins, thread coordinates, where each load
reads from -- and hands the templates plain values: numbers and one-line C expressions.
The templates hold all control flow, barriers and memory movement:
``codegen_templates/group_kernel.cu.j2`` the kernel (parameters, shared-memory views,
block coordinates, each stage's tile origins, a barrier between stages), and one template
per kernel kind for its stages (``codegen_templates/stages/<kind>.cu.j2``).

This module does what is the same for every kind: the parameters, the tile regions of
every stage (one propagation from the root tile), the shared-memory view of each tile a
later stage reads, and loads from global memory or from those views.  What a stage does
with them is its kind's: :data:`STAGE_EMITTERS` maps each kind to the emitter that turns
its config into the context its template reads.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from welder.graph import Graph
from welder.ir.expr import Expr, Load
from welder.ir.interpret import np_dtype
from welder.schedule.config import GroupConfig, StageConfig
from welder.schedule.group import Group
from welder.tile.propagate import propagate_group

from . import attention, ffma, mma, simt, wgmma
from .common import (
    STORAGE_TYPES,
    Kernel,
    KernelParam,
    StageCtx,
    TensorMapParam,
    environment,
    flat_index,
    read_value,
    render_prelude,
    sanitize_comment,
)
from .cprint import CPrinter
from .tensor_map import TensorMapArg

#: How codegen renders a stage of each kernel kind: ``emit(builder, k, config)`` returns the
#: stage's context for its template.  A kind computed outside the kernel (``library``) has
#: no entry: its group is a call the runtime makes.
StageEmitter = Callable[["KernelBuilder", int, StageConfig], StageCtx]
STAGE_EMITTERS: dict[str, StageEmitter] = {
    "simt": simt.emit_stage,
    "mma": mma.emit_stage,
    "mma_tf32": mma.emit_stage,  # the same stage with fp32 operands (MmaFormat TF32)
    "mma_tf32x3": mma.emit_stage,  # the same again, three TF32 products a piece (MmaFormat TF32X3)
    "ffma": ffma.emit_stage,  # the mma stage's tiles with exact fp32 FMAs
    "wgmma": wgmma.emit_stage,
    "attention": attention.emit_stage,
    "attention_ffma": attention.emit_stage,  # the same kernel with exact fp32 FMAs
}


#: The kinds whose stages can store an output at strides other than its own (a part of a
#: concatenation laid out in its memory); the others are never offered any.
STRIDED_STORES = frozenset({"simt", "mma", "mma_tf32", "mma_tf32x3", "ffma", "wgmma"})


class UnsupportedStage(ValueError):
    """A config holds a stage of a kind codegen cannot render into a kernel."""


class KernelBuilder:
    """One group under one config, on its way to a :class:`Kernel`; stage emitters read it."""

    def __init__(
        self,
        graph: Graph,
        group: Group,
        config: GroupConfig,
        name: str,
        layouts: Mapping[str, tuple[int, ...]] | None = None,
    ) -> None:
        for st in config.stages:
            if st.kind not in STAGE_EMITTERS:
                raise UnsupportedStage(f"{st.node}: codegen renders no {st.kind!r} stage into a kernel")
        self.graph = graph
        self.group = group
        self.cfg = config
        self.name = name
        self.shape_of = lambda t: graph.tensor(t).shape
        self.params: dict[str, KernelParam] = {}
        for t in group.inputs:
            self._param(t, False)
        for t in group.outputs:
            self._param(t, True)
            writer = self._writer(t)
            if layouts and t in layouts and writer is not None and writer.kind in STRIDED_STORES:
                self.params[t].storage = tuple(layouts[t])
        stages = [group.computes[s] for s in group.stages]
        self.regions = propagate_group(stages, group.root, config.block_tile, self.shape_of)
        self.stage_index = {s: k for k, s in enumerate(group.stages)}
        self.views: list[dict] = []
        self.tensor_maps: list[TensorMapParam] = []
        self.tile_views: dict[str, str] = {}
        self.tiles: dict[str, tuple[int, ...]] = {}
        # per-thread arrays that outlive a stage: vectors one stage loads and later ones read
        self.registers: list[dict] = []
        self.held: list[Any] = []  # what those arrays hold, as the kind that fills them records it
        for k, st in enumerate(config.stages):
            offset = getattr(st, "smem_offset", None)
            if offset is not None:
                view = f"tile{k}"
                tile = st.tile  # type: ignore[attr-defined]
                self.add_view(view, self.graph.tensor(st.node).dtype, offset, math.prod(tile))
                self.tile_views[st.node] = view
                self.tiles[st.node] = tuple(tile)

    def _writer(self, tensor: str) -> StageConfig | None:
        """The stage config that stores ``tensor``: its own stage, or the stage it is an
        epilogue of."""
        for st in self.cfg.stages:
            if st.node == tensor or tensor in getattr(st, "epilogue", ()):
                return st
        return None

    def decline_layout(self, tensor: str) -> None:
        """Writes output ``tensor`` at its own strides after all: a stage whose stores cannot
        take the strides it was offered says so before rendering them."""
        self.params[tensor].storage = None

    def _param(self, tensor: str, is_output: bool) -> None:
        info = self.graph.tensor(tensor)
        self.params[tensor] = KernelParam(f"p{len(self.params)}", tensor, info.dtype, info.shape, is_output)

    def add_view(self, name: str, dtype: str, offset: int, count: int, ctype: str | None = None) -> None:
        """A typed array ``name`` of ``count`` elements at ``offset`` in the shared pool (of
        ``dtype``'s storage type, or of the C type ``ctype``)."""
        ctype = ctype or STORAGE_TYPES[dtype]
        self.views.append({"name": name, "ctype": ctype, "offset": offset, "count": count})

    def add_registers(self, name: str, ctype: str, count: int) -> None:
        """A per-thread array ``name`` of ``count`` values of C type ``ctype``, declared
        before the first stage so that every stage can read it."""
        self.registers.append({"name": name, "ctype": ctype, "count": count})

    def add_tensor_map(
        self,
        tensor: str,
        offset: int,
        dims: tuple[int, ...],
        strides: tuple[int, ...],
        box: tuple[int, ...],
        swizzle: int,
    ) -> str:
        """A tensor-map parameter over kernel input ``tensor``, from element ``offset`` of it
        (the other fields as :class:`~welder.codegen.tensor_map.TensorMapArg`'s); returns its
        C name."""
        param = self.params[tensor]
        position = list(self.params).index(tensor)
        item = np_dtype(param.dtype).itemsize
        spec = TensorMapArg(position, item, dims, strides, box, swizzle, offset=offset * item)
        name = f"{param.name}_map{len(self.tensor_maps)}"
        self.tensor_maps.append(TensorMapParam(name, tensor, spec))
        return name

    def origin_name(self, k: int, d: int) -> str:
        """The C name of dimension ``d`` of stage ``k``'s tile origin in this block."""
        return f"o{k}_{d}"

    def render(self) -> Kernel:
        stage_ctxs = [self.stage(self.stage_index[st.node], st) for st in self.cfg.stages]
        for s in stage_ctxs[:-1]:
            s.barrier_after = True
        coords = []
        for axis in reversed(self.cfg.block_order):
            coords.append({"name": f"b{axis}", "extent": self.cfg.grid[axis]})
        splits = self.splits
        resident = self.resident
        grid = min(resident, self.cfg.num_blocks) if resident else self.cfg.num_blocks * splits
        ctx = {
            "name": self.name,
            "root_comment": sanitize_comment(self.group.root),
            "grid": grid,
            "tiles": self.cfg.num_blocks,
            "splits": splits,
            "persistent": bool(resident),
            "cluster": max(getattr(st, "cluster", 1) for st in self.cfg.stages),
            "threads": self.cfg.threads,
            "smem_bytes": self.cfg.smem_bytes,
            "params": [*self.params.values(), *self.tensor_maps],
            "views": self.views,
            "registers": self.registers,
            "block_coords": coords,
            "origins": [o for s in stage_ctxs for o in s.origins],  # every stage's, in order
        }
        body = environment().get_template("group_kernel.cu.j2").render(k=ctx, stages=stage_ctxs)
        return Kernel(
            self.name,
            render_prelude([h for s in stage_ctxs for h in s.headers]) + body,
            list(self.params.values()),
            grid,
            self.cfg.threads,
            self.cfg.smem_bytes,
            self.group.root,
            arch_specific=any(s.arch_specific for s in stage_ctxs),
            tensor_maps=[t.map for t in self.tensor_maps],
        )

    @property
    def splits(self) -> int:
        """Blocks per root tile: more than one where a stage splits its reduction among
        blocks (split-K); the kernel then launches ``splits`` blocks per tile, tile-major
        within each split, and the block's split is ``split`` in the kernel."""
        return max(st.blocks_per_tile for st in self.cfg.stages)

    @property
    def resident(self) -> int:
        """Blocks of a persistent kernel, each walking root tiles ``blockIdx.x``, ``+
        gridDim.x``, ... (0: one block per tile); a stage's kind decides (its ``persistent``)
        and provides a ``setup`` macro for what runs once per block."""
        return max(getattr(st, "persistent", 0) for st in self.cfg.stages)

    def stage(self, k: int, st: StageConfig) -> StageCtx:
        return STAGE_EMITTERS[st.kind](self, k, st)

    # -- expressions ---------------------------------------------------------------------------

    def index_c(self, e: Expr) -> str:
        """An index expression of block coordinates (``b<d>``, step indices ``k<d>``) as C."""
        return CPrinter(self.global_load, nonneg={f"b{d}" for d in range(8)} | {f"k{d}" for d in range(8)})(e)

    def tile_load(self, ld: Load, p: CPrinter) -> str | None:
        """``ld`` as a read of the shared-memory tile an earlier stage of the group wrote,
        or None when ``ld`` reads no such tile."""
        if ld.tensor not in self.tile_views:
            return None
        src = self.stage_index[ld.tensor]
        view = self.tile_views[ld.tensor]
        idx = [f"({p(i)} - {self.origin_name(src, d)})" for d, i in enumerate(ld.indices)]
        return read_value(f"{view}[{flat_index(idx, self.tiles[ld.tensor])}]", ld.dtype)

    def global_load(self, ld: Load, p: CPrinter) -> str:
        """``ld`` as a read of its kernel parameter in global memory."""
        param = self.params[ld.tensor]
        idx = [p(i) for i in ld.indices]
        return read_value(f"{param.name}[{flat_index(idx, param.addressed)}]", ld.dtype)


def generate_kernel(
    graph: Graph,
    group: Group,
    config: GroupConfig,
    name: str,
    layouts: Mapping[str, tuple[int, ...]] | None = None,
) -> Kernel:
    """CUDA source for one group under one config (a generated kernel: ``config.kernel``).

    ``layouts`` offers outputs a storage shape (``KernelParam.storage``): the kernel writes
    such an output at those strides where its writing stage's kind can, and its param
    says which it took."""
    return KernelBuilder(graph, group, config, name, layouts).render()
