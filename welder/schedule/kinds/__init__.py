"""Kernel kinds: the ways a tile-owning stage can be computed, one module each.

===============  ===============================================  =========================================
kind             stage config, policy rule                        template
===============  ===============================================  =========================================
mma              :mod:`.mma` -- fp16 contractions on tensor cores  ``codegen_templates/stages/mma.cu.j2``
                 (the group's first stage; later stages SIMT)
mma_tf32         :mod:`.mma` -- the same for fp32 contractions,    the same template
                 as TF32 (listed only with ``--tf32``)
mma_tf32x3       :mod:`.tf32x3` -- fp32 contractions to fp32's    the same template, three products
                 accuracy, each operand a pair of TF32 values     a piece
ffma             :mod:`.ffma` -- exact fp32 contractions in the  ``codegen_templates/stages/ffma.cu.j2``
                 mma kind's tiles, FMAs on CUDA cores            (the mma template's ring and epilogue)
wgmma            :mod:`.wgmma` -- fp16 contractions on Hopper's    ``codegen_templates/stages/wgmma.cu.j2``
                 warpgroup instructions (the mma search, other
                 data; compute capability 9.0 only)
attention        :mod:`.attention` -- two fp16 products     ``codegen_templates/stages/attention.cu.j2``
                 joined by row reductions (a softmax),
                 the scores kept in registers
attention_ffma   :mod:`.attention` -- the same in exact fp32,     the same template
                 FMAs on CUDA cores
simt             :mod:`.simt` -- every group                      ``codegen_templates/stages/simt.cu.j2``
library          :mod:`.library` -- products as cuBLAS calls      ``codegen_templates/runtime/cublas.j2``
                 (claimed before fusion with ``--skip-dot``)      (a call the runtime makes, no kernel)
===============  ===============================================  =========================================

Adding a kind takes its own module here (a
:class:`~welder.schedule.config.StageConfig` subclass and a rule implementing
:class:`~.base.KernelKind`), its template under ``codegen_templates/stages/``, its stage
emitter in ``welder/codegen/``, and one line in :data:`KINDS` and in
``welder.codegen.kernel.STAGE_EMITTERS``.  The search asks the kinds named in
:attr:`~.base.Options.kinds` for candidates (:func:`propose`), so a new kind takes part once
it is listed there.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Mapping, Sequence
from typing import Any

from welder.errors import WelderError
from welder.schedule.calibration import calibrated, precision_of
from welder.schedule.config import Estimate, GroupConfig, StageConfig, tuples_of
from welder.schedule.group import Group
from welder.schedule.kinds import attention, ffma, library, mma, simt, tf32x3, wgmma
from welder.schedule.kinds.base import KernelKind, Options, ScheduleContext, top_by_family

#: Bumped whenever a kind starts proposing candidates it did not before (a new family, such
#: as the SIMT kind's sliding-window twins; new tile shapes).  It is part of the tuning
#: cache's key (``welder.tune.tuner.cache_key``): a cached winner was the best of what the
#: search offered then, so a search that offers more must tune again.
SEARCH_VERSION = 21  # 4: attention past 256 keys (online softmax); 5: shorter softmaxes in chunks too;
# 6: a family's tied estimates spread over block shapes (base.spread_ties); 7: SIMT streaming twins;
# 8: streaming twins whose reductions share one staged row (simt.share_rows); 9: configs alike to
# two before them give way to the next shapes (base.defer_alike).  Versions 7 and 8 reached row
# reductions alone and left other groups cached under the versions before them; version 9
# changes which of every kind's configs make the topk, which is only known by proposing for a
# group, so every group is keyed at 9 and tuned again once; 10: a reduction of few blocks is
# offered blocks past ``Options.max_threads`` (simt.few_blocks), and a SIMT estimate counts
# the reduction points a thread takes in turn (simt.serial_points), which reorders the topk;
# 11: reductions split over threads walk their rows in 16-byte vectors (simt.reduce_vector_twin);
# 12: attention of few row warps splits each ring slot's keys across warps (attention.SPLITS).
# 13: those configs launch one block a tile (12 launched one a split, each computing the whole tile),
# and a window twin lays out a group's first reduction stage, behind a producer stage too (simt.window_twin);
# 14: a reduction in vectors holds its row in registers for the stages after it (simt.held_twin);
# 15: fp32 contractions are offered as three TF32 products a piece (the mma_tf32x3 kind, on by default),
# and a reduction reads in vectors a member an earlier stage keeps as a tile of whole rows
# (simt.reduce_vector); 16: mma_tf32x3's products go through a k-step partial added with an FADD
# (a cached tf32x3 winner was measured, and checked, as the truncating chain).
# 17: persistent TMA-stored wgmma configs of two warpgroups get a twin whose warpgroups take turns
# (WgmmaConfig.pingpong, a family of its own).
# 18: the SIMT search steps past a size that leaves a ragged tile to the next that divides the axis
# (simt.next_sizes: a 56-wide depthwise convolution's rows reach 28 and 56, read in vectors), and
# the turn-taking twins take the deepest ring their twin's shared memory holds (wgmma._deepest_turns).
# 19: no turn-taking wgmma configs (version 17's, removed): cached winners of 17 and 18 may be one,
# and one hung MobileNetV2 b64 fp16's runtime on the GPU where it had timed well alone.
# 20: one-pass attention of many tiles gets persistent twins that copy the next tile's operands
# during this one's products (AttentionConfig.persistent, a family of its own).
# 21: none that leave an SM fewer than eight warps of them (attention.MIN_PERSISTENT_WARPS_PER_SM),
# whose places in the topk go to the next configs of every family.


KINDS: dict[str, KernelKind] = {
    simt.KIND.name: simt.KIND,
    library.KIND.name: library.KIND,
    attention.KIND.name: attention.KIND,
    attention.FFMA_KIND.name: attention.FFMA_KIND,
    wgmma.KIND.name: wgmma.KIND,
    mma.KIND.name: mma.KIND,
    mma.TF32_KIND.name: mma.TF32_KIND,
    tf32x3.KIND.name: tf32x3.KIND,
    ffma.KIND.name: ffma.KIND,
}


class UnknownKind(WelderError, ValueError):
    """A config names a kernel kind this welder does not have (written by a newer one)."""


def kind(name: str) -> KernelKind:
    if name not in KINDS:
        raise UnknownKind(f"unknown kernel kind {name!r}; this welder has {sorted(KINDS)}")
    return KINDS[name]


def propose(group: Group, ctx: ScheduleContext, kinds: Sequence[str] | None = None) -> list[GroupConfig]:
    """The ``topk`` best configs of ``group`` over the kinds in ``kinds`` (default:
    ``ctx.options.kinds``), in estimated latency, earlier kinds first on ties -- except that
    every family of candidates (a kind; split-K apart from the rest of its kind) keeps a
    share of the places for its best (:func:`~.base.top_by_family`).  Estimates compare worst
    across families
    (on the H100 the SIMT estimate of a 50 x 384 x 1152 fp16 product was 4.9 us and its
    kernel took 9 us, while the tensor-core kernel estimated at 5.8 us took 4.2 us), so the
    tuner measures each family that applies rather than trusting the ranking between them.
    Each kind's estimates are first scaled by its measured correction
    (:mod:`welder.schedule.calibration`)."""
    found = []
    precision = precision_of(ctx.dtype_of(group.root))
    for name in ctx.options.kinds if kinds is None else kinds:
        configs = kind(name).propose(group, ctx)
        if configs:
            found.append(calibrated(configs, name, precision))
    return top_by_family(list(heapq.merge(*found, key=lambda c: c.estimate.latency_us)), ctx.options.topk)


def config_from_json(d: Mapping[str, Any]) -> GroupConfig:
    """A group config from :meth:`GroupConfig.to_json`'s dict.  Configs written before stages
    had kinds read too: a stage without ``kind`` is SIMT, and a group with a ``gemm`` was
    one library call."""
    stages = [stage_from_json(s) for s in d["stages"]]
    if d.get("gemm"):
        stages = [library.LibraryConfig(d["root"], library.GemmSpec(**d["gemm"]))]
    known = {f.name for f in dataclasses.fields(GroupConfig)}
    plain = tuples_of({k: v for k, v in d.items() if k in known}, GroupConfig)
    return GroupConfig(**{**plain, "stages": stages, "estimate": Estimate(**d["estimate"])})


def stage_from_json(d: Mapping[str, Any]) -> StageConfig:
    """A stage config from its JSON (``StageConfig.to_json``); one without a kind is SIMT,
    as every stage was before kinds."""
    fields = dict(d)
    name = fields.pop("kind", simt.KIND.name)
    return kind(name).config_type.from_json(fields)


__all__ = [
    "KINDS",
    "KernelKind",
    "Options",
    "ScheduleContext",
    "UnknownKind",
    "config_from_json",
    "kind",
    "propose",
    "stage_from_json",
]
