"""The ``mma_tf32x3`` kind: fp32 contractions on TF32 tensor cores to fp32's accuracy, each
product taken as three.

An fp32 operand ``x`` splits into ``hi``, ``x`` rounded to TF32 (to nearest: add half a TF32
unit to the bits, clear the low 13), and ``lo = x - hi``, exact in fp32, of which the tensor
core reads the leading 11 bits (it ignores the low 13 of a TF32 operand).  TF32 keeps 11
significant bits, so ``|lo| <= 2^-11 |x|`` and what the core drops of ``lo`` is under
``2^-21 |x|``.  Each piece's product is then ``a_lo b_hi + a_hi b_lo + a_hi b_hi``, three
``m16n8k8`` instructions into the same fp32 accumulators, the small terms first; what is
left out (``a_lo b_lo`` and the two truncations) is under about ``2^-20`` of ``|a b|``, a
few fp32 roundings, where one TF32 product (the ``mma_tf32`` kind) is off by up to
``2^-11``.  So its configs are held to the fp32 limit (:data:`welder.check.THRESHOLDS`), as
the ``ffma`` kind's are, and it is on by default: the tuner measures it beside the FMA
kernels and keeps whichever is faster, and a candidate whose results miss the fp32 limit on
the GPU (the tensor cores' adder rounds its sums its own way) is rejected like any other.

Cost: three times the tensor-core work of a TF32 product (``MmaFormat.products``), still
some two to three times the rate of FMAs on an H100 or H200 (494 TF32 TFLOP/s dense for
wgmma, about two thirds of it for ``mma.sync``, against 67 fp32).  The split is three
instructions an element (an add and a mask for ``hi``, a subtraction for ``lo``; sm_90's
``cvt.rna.tf32`` alone takes four): 96 a lane per K step of a 64 x 64 warp tile, beside its
96 ``mma.sync``.  The lo halves take as many registers as the fragments.  An infinite
operand element has a NaN lo, so the outputs it reaches are NaN where exact fp32 gives an
infinity: not finite either way, as the check requires.  Everything else -- the search, the
cp.async ring, the epilogue -- is the ``mma`` kind's (:class:`~.mma.MmaKind`); the template
is the mma template with its ``products`` set.  Like the ``ffma`` kind it takes a gathered
fp32 operand (a convolution's image, a padded window) in float pairs, which the plain TF32
kind leaves to 16-bit types: the ring holds the same rows whoever fills them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from welder.schedule.kinds.mma import (
    MMA_M,
    MMA_N,
    TF32,
    MmaConfig,
    MmaKind,
    registers,
)

#: fp32 operands as TF32 pairs: the TF32 instruction, three products a piece, no rounding at
#: the load (the split rounds).
TF32X3 = replace(TF32, kind="mma_tf32x3", precision="fp32", convert=None, products=3)


@dataclass
class Tf32x3Config(MmaConfig):
    """An :class:`~.mma.MmaConfig` of an fp32 contraction taken as three TF32 products."""

    kind: ClassVar[str] = "mma_tf32x3"


class Tf32x3Kind(MmaKind):
    """The mma rule with the split format, gathered fp32 operands as the ``ffma`` kind takes
    them, and registers for the operands' lo halves."""

    gather_32bit = True

    def registers(self, cfg: MmaConfig) -> int:
        wm, wn = cfg.block_m // cfg.warps[0], cfg.block_n // cfg.warps[1]
        return registers(cfg) + (wm // MMA_M) * 4 + (wn // MMA_N) * 2


KIND = Tf32x3Kind((TF32X3,), Tf32x3Config)
