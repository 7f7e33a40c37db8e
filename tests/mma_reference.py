"""numpy models of the tensor-core instructions behind codegen_templates/welder_mma.cuh, written
from the PTX ISA's fragment tables ("Matrix Fragments for mma.m16n8k16 / m16n8k8", "ldmatrix"),
not from the emulator, plus the inputs and expected outputs of the kernels in tests/kernels/.

Shared by the emulator tests (test_emulator_mma.py) and the GPU tests (test_gpu_mma.py): the same
expectations must hold on both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
UNITS, BUGS, GEMM = (KERNEL_DIR / f"mma_{n}.cu" for n in ("units", "bugs", "gemm"))

#: kernels of mma_units.cu
UNIT_KERNELS = ["mma_fragments", "to_tf32", "ldmatrix_fragments", "cp_async_zero_fill", "cp_async_stages"]
#: kernels of mma_gemm.cu
GEMM_KERNELS = ["mma_gemm_f16", "mma_gemm_bf16", "mma_gemm_f16_narrow"]
#: mma_gemm.cu's block tile and dynamic shared memory
GEMM_TILE = (64, 64, 32)
GEMM_THREADS = 128
GEMM_SMEM_BYTES = 3 * (64 * 40 + 32 * 72) * 2
#: mode numbers of ldmatrix_fragments: (matrices, transposed)
LDMATRIX_MODES = {(1, False): 0, (2, False): 1, (4, False): 2, (1, True): 3, (2, True): 4, (4, True): 5}

# -------------------------------------------------------------------------------- fragments
# The ISA names g = laneid >> 2 ("groupID") and t = laneid % 4 ("threadID_in_group"), and numbers
# a lane's elements a0, a1, ... low to high: element 2j is the low half of register j for 16-bit
# types, element j is register j for tf32 and f32.


def _g_t(lane: int) -> tuple[int, int]:
    return lane >> 2, lane % 4


def a_position(kind: str, lane: int, i: int) -> tuple[int, int]:
    """(row, col) in A of element a_i of `lane`: m16n8k16 (f16, bf16) or m16n8k8 (tf32)."""
    g, t = _g_t(lane)
    if kind == "tf32":
        return (g if i in (0, 2) else g + 8), (t if i < 2 else t + 4)
    return (g if i in (0, 1, 4, 5) else g + 8), 2 * t + (i & 1) + (8 if i >= 4 else 0)


def b_position(kind: str, lane: int, i: int) -> tuple[int, int]:
    """(row, col) in B of element b_i of `lane`."""
    g, t = _g_t(lane)
    if kind == "tf32":
        return (t if i == 0 else t + 4), g
    return 2 * t + (i & 1) + (8 if i >= 2 else 0), g


def c_position(lane: int, i: int) -> tuple[int, int]:
    """(row, col) in C / D (16x8, f32) of element c_i of `lane`."""
    g, t = _g_t(lane)
    return (g if i < 2 else g + 8), 2 * t + (i & 1)


def k_of(kind: str) -> int:
    return 8 if kind == "tf32" else 16


def pack_a(kind: str, bits: np.ndarray) -> np.ndarray:
    """A's element bits (16 x k, uint16 for f16/bf16, uint32 for tf32) as 32 lanes x 4 registers."""
    return _pack(bits, 8 if kind != "tf32" else 4, lambda lane, i: a_position(kind, lane, i))


def pack_b(kind: str, bits: np.ndarray) -> np.ndarray:
    """B's element bits (k x 8) as 32 lanes x 2 registers."""
    return _pack(bits, 4 if kind != "tf32" else 2, lambda lane, i: b_position(kind, lane, i))


def _pack(bits: np.ndarray, elements: int, position: Callable[[int, int], tuple[int, int]]) -> np.ndarray:
    per_register = 2 if bits.dtype == np.uint16 else 1
    regs = np.zeros((32, elements // per_register), np.uint32)
    for lane in range(32):
        for i in range(elements):
            value = np.uint32(bits[position(lane, i)])
            regs[lane, i // per_register] |= value << np.uint32(16 * (i % per_register))
    return regs


def pack_c(c: np.ndarray) -> np.ndarray:
    """A 16x8 float32 matrix as 32 lanes x 4 accumulator registers."""
    return np.array([[c[c_position(lane, i)] for i in range(4)] for lane in range(32)], np.float32)


def unpack_c(regs: np.ndarray) -> np.ndarray:
    """32 lanes x 4 accumulator registers back to the 16x8 matrix."""
    out = np.full((16, 8), np.nan, np.float32)
    for lane in range(32):
        for i in range(4):
            out[c_position(lane, i)] = regs[lane, i]
    return out


# -------------------------------------------------------------------------------- number formats


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, rounded to nearest even (finite inputs)."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_value(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def tf32_round(x: np.ndarray) -> np.ndarray:
    """float32 rounded to 10 explicit mantissa bits, to nearest with ties away from zero (cvt.rna),
    computed on the value in float64 rather than on the bit pattern."""
    x = np.asarray(x, np.float64)
    mantissa, exponent = np.frexp(x)  # x = mantissa * 2**exponent, 0.5 <= |mantissa| < 1
    scaled = mantissa * 2.0**11  # 11 significant bits
    rounded = np.sign(scaled) * np.floor(np.abs(scaled) + 0.5)
    return np.ldexp(rounded, exponent - 11).astype(np.float32)


def tf32_truncate(x: np.ndarray) -> np.ndarray:
    """What the tensor core reads of an fp32 operand not rounded first: the top 19 bits."""
    return (np.asarray(x, np.float32).view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)


# -------------------------------------------------------------------------------- mma cases


@dataclass
class MmaCase:
    """Inputs of mma_fragments for `warps` independent warps, and the exact D of each."""

    kind: str
    a: np.ndarray  # warps*32 x 4 registers
    b: np.ndarray  # warps*32 x 2
    c: np.ndarray  # warps*32 x 4 float32
    expected: np.ndarray  # warps x 16 x 8, float64

    @property
    def kind_code(self) -> int:
        return {"f16": 0, "bf16": 1, "tf32": 2}[self.kind]


def mma_case(kind: str, warps: int, rng: np.random.Generator, *, tf32_rounded: bool = True) -> MmaCase:
    """Random operands; for tf32, either rounded to tf32 in numpy first (exact on any hardware) or
    raw fp32 values, whose low 13 bits the tensor core ignores."""
    k = k_of(kind)
    regs_a, regs_b, regs_c, expected = [], [], [], []
    for _ in range(warps):
        c = rng.standard_normal((16, 8)).astype(np.float32)
        if kind == "f16":
            a, b = (
                rng.standard_normal((16, k)).astype(np.float16),
                rng.standard_normal((k, 8)).astype(np.float16),
            )
            a_bits, b_bits, av, bv = a.view(np.uint16), b.view(np.uint16), a, b
        elif kind == "bf16":
            a_bits = bf16_bits(rng.standard_normal((16, k)) * 4)
            b_bits = bf16_bits(rng.standard_normal((k, 8)) * 4)
            av, bv = bf16_value(a_bits), bf16_value(b_bits)
        else:
            a = rng.standard_normal((16, k)).astype(np.float32)
            b = rng.standard_normal((k, 8)).astype(np.float32)
            if tf32_rounded:
                a, b = tf32_round(a), tf32_round(b)
            a_bits, b_bits = a.view(np.uint32), b.view(np.uint32)
            av, bv = tf32_truncate(a), tf32_truncate(b)
        regs_a.append(pack_a(kind, a_bits))
        regs_b.append(pack_b(kind, b_bits))
        regs_c.append(pack_c(c))
        expected.append(av.astype(np.float64) @ bv.astype(np.float64) + c)
    return MmaCase(
        kind, np.concatenate(regs_a), np.concatenate(regs_b), np.concatenate(regs_c), np.array(expected)
    )


def mma_result(case: MmaCase, d: np.ndarray) -> np.ndarray:
    """The D matrices (warps x 16 x 8) that the lanes' registers `d` (warps*32 x 4) hold."""
    return np.array([unpack_c(d[32 * w : 32 * (w + 1)]) for w in range(len(case.expected))])


# -------------------------------------------------------------------------------- ldmatrix


def ldmatrix_offsets(
    count: int, matrices: int, warps: int, rng: np.random.Generator, unused: int | None = None
) -> np.ndarray:
    """Per thread, the element offset of the row it addresses: distinct random 16-byte-aligned rows
    of a tile of `count` 16-bit elements.  Lanes whose address the variant ignores get `unused`
    (default: a valid row as well)."""
    offsets = []
    for _ in range(warps):
        rows = rng.choice(count // 8, size=32, replace=False) * 8
        if unused is not None:
            rows[8 * matrices :] = unused
        offsets.append(rows)
    return np.concatenate(offsets).astype(np.int32)


def ldmatrix_expected(tile: np.ndarray, offsets: np.ndarray, matrices: int, trans: bool) -> np.ndarray:
    """Registers (threads x 4) after ldmatrix: matrix i is the 8x8 block whose row j starts at the
    offset lane 8i+j gave; every lane receives it (transposed for .trans) in the layout of an mma
    accumulator: register i of lane l holds elements 2(l%4) and 2(l%4)+1 of row l/4."""
    out = np.zeros((len(offsets), 4), np.uint32)
    for w in range(len(offsets) // 32):
        lanes = offsets[32 * w : 32 * (w + 1)]
        for i in range(matrices):
            m = np.stack([tile[lanes[8 * i + j] : lanes[8 * i + j] + 8] for j in range(8)])
            if trans:
                m = m.T
            for lane in range(32):
                lo, hi = m[lane // 4, 2 * (lane % 4)], m[lane // 4, 2 * (lane % 4) + 1]
                out[32 * w + lane, i] = np.uint32(lo) | np.uint32(hi) << np.uint32(16)
    return out


# -------------------------------------------------------------------------------- cp.async


def zero_fill_sizes(threads: int, rng: np.random.Generator) -> np.ndarray:
    """src_bytes of the 16-, 8- and 4-byte copies of each thread of cp_async_zero_fill, every
    value of each range included."""
    sizes = np.stack(
        [rng.integers(0, 17, threads), rng.integers(0, 9, threads), rng.integers(0, 5, threads)], axis=1
    )
    sizes[:17, 0] = np.arange(17)[: min(17, threads)]
    sizes[:9, 1] = np.arange(9)[: min(9, threads)]
    sizes[:5, 2] = np.arange(5)[: min(5, threads)]
    return sizes.astype(np.int32)


def zero_fill_expected(src: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """out of cp_async_zero_fill: thread t holds the 28 bytes its neighbour copied."""
    threads = len(sizes)
    out = np.zeros((threads, 28), np.uint8)
    for t in range(threads):
        f = (t + 1) % threads
        for start, size in ((0, sizes[f, 0]), (16, sizes[f, 1]), (24, sizes[f, 2])):
            out[t, start : start + size] = src[32 * f + start : 32 * f + start + size]
    return out.reshape(-1)


# -------------------------------------------------------------------------------- gemm


def gemm_inputs(
    kernel: str, m: int, n: int, k: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(A, B as passed to the kernel, A and B as float64 values) for an mma_gemm kernel."""
    if kernel == "mma_gemm_bf16":
        a, b = bf16_bits(rng.standard_normal((m, k))), bf16_bits(rng.standard_normal((k, n)))
        return a, b, bf16_value(a).astype(np.float64), bf16_value(b).astype(np.float64)
    a, b = rng.standard_normal((m, k)).astype(np.float16), rng.standard_normal((k, n)).astype(np.float16)
    return a, b, a.astype(np.float64), b.astype(np.float64)


def gemm_launch(m: int, n: int, k: int, splits: int) -> tuple[tuple[int, int, int], int]:
    """(grid, k_per_split) of an mma_gemm launch: k_per_split rounded up to the 32-wide k tile."""
    bm, bn, bk = GEMM_TILE
    per_split = -(-k // splits)
    per_split = -(-per_split // bk) * bk
    return (-(-n // bn), -(-m // bm), splits), per_split


def assert_gemm_close(c: np.ndarray, a: np.ndarray, b: np.ndarray, rel: float) -> None:
    """|C - AB| within `rel` of sum |a||b| per element (fp32 accumulation of exact products)."""
    reference, scale = a @ b, np.abs(a) @ np.abs(b)
    assert np.isfinite(c).all(), "unwritten or non-finite outputs"
    err = np.abs(c - reference)
    worst = np.unravel_index(np.argmax(err - rel * scale), err.shape)
    assert (err <= rel * scale + 1e-6).all(), f"C{worst} = {c[worst]}, expected {reference[worst]}"
