"""numpy models of Hopper's wgmma (codegen_templates/welder_wgmma.cuh): where an operand's elements
lie in shared memory for each canonical layout of the PTX ISA ("Asynchronous Warpgroup Level Matrix
Shared Memory Layout"), the descriptor fields, and the accumulator fragment of wgmma .m64nNk16 --
written from the ISA and CUTLASS's description of the canonical layouts, not from the emulator --
plus the inputs and expected outputs of tests/kernels/wgmma_*.cu.

Shared by the emulator tests (test_emulator_wgmma.py) and the GPU tests (test_gpu_wgmma.py): the
same shared-memory images and expectations must hold on both, which is what shows that the
emulator reads shared memory the way the tensor cores do.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from mma_reference import bf16_bits, bf16_value

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
UNITS, BUGS, GEMM = (KERNEL_DIR / f"wgmma_{n}.cu" for n in ("units", "bugs", "gemm"))

#: unit kernels of wgmma_units.cu: (N, dtype) -> name
UNIT_KERNELS = {
    (8, "f16"): "wgmma_unit_n8_f16",
    (64, "f16"): "wgmma_unit_n64_f16",
    (256, "f16"): "wgmma_unit_n256_f16",
    (24, "f16"): "wgmma_unit_n24_f16",
    (64, "bf16"): "wgmma_unit_n64_bf16",
}
BUG_KERNELS = ["wgmma_misuse", "wgmma_early_read"]
#: kernels of wgmma_gemm.cu: (B stored as [K][N] or [N][K], copy bytes)
GEMM_KERNELS = {
    "wgmma_gemm_kn": ("kn", 16),
    "wgmma_gemm_nk": ("nk", 16),
    "wgmma_gemm_kn_narrow": ("kn", 8),
    "wgmma_gemm_nk_narrow": ("nk", 8),
}
GEMM_TILE = (128, 128, 64)
GEMM_THREADS = 256
GEMM_STAGES = 4
#: four stages of a 128x64 A tile and a 64x128 B tile in fp16, and 1024 bytes to align them
GEMM_SMEM_BYTES = GEMM_STAGES * (128 * 64 + 64 * 128) * 2 + 1024
SWIZZLES = (0, 32, 64, 128)
MAX_STEPS = 8

# -------------------------------------------------------------------------------- layouts
# 16-bit elements; mn indexes M for A and N for B; k in 0..15 within one k16 step.  Offsets are from
# the descriptor's start address; the swizzle acts on the absolute address afterwards.  Core
# matrices are 8 rows of 16 bytes.  With a swizzle of W bytes, a "row" is W bytes and 8 rows form
# the swizzle atom (8W bytes), which must sit at an address that is a multiple of 8W.


def element_offset(mn_major: bool, swizzle: int, lbo: int, sbo: int, mn: int, k: int) -> int:
    """Byte offset of element (mn, k) before the swizzle.

    K-major (rows of the operand run along K):
      no swizzle: 8x8 core matrices, each 8 mn-rows of 16 bytes (8 k); the two core matrices
                  along K are LBO apart, those along MN are SBO apart.
      swizzle W:  each mn-row is W bytes of K (the k16 step reads 32 of them); 8 rows make an atom;
                  atoms along MN are SBO apart; LBO is not used.
    MN-major (rows run along MN):
      no swizzle: core matrices of 8 k-rows of 16 bytes (8 mn); along MN SBO apart, along K LBO.
      swizzle W:  each k-row is W bytes of MN (W/2 elements); 8 k-rows make an atom; the two atoms
                  along K are SBO apart, atoms along MN LBO apart.
    """
    if swizzle == 0:
        if mn_major:
            return (k % 8) * 16 + (k // 8) * lbo + (mn % 8) * 2 + (mn // 8) * sbo
        return (mn % 8) * 16 + (mn // 8) * sbo + (k % 8) * 2 + (k // 8) * lbo
    if mn_major:
        per_row = swizzle // 2
        return (k % 8) * swizzle + (k // 8) * sbo + (mn % per_row) * 2 + (mn // per_row) * lbo
    return (mn % 8) * swizzle + (mn // 8) * sbo + k * 2


def swizzled(address: int, swizzle: int) -> int:
    """The swizzle of the PTX ISA on an absolute shared address: bits 4-6 (128B), 4-5 (64B) or 4
    (32B) XOR bits 7-9, 7-8 or 7: the 16-byte unit within a row moves by the row within the atom."""
    mask = {0: 0, 32: 1, 64: 3, 128: 7}[swizzle]
    return address ^ (((address >> 7) & mask) << 4)


def descriptor(address: int, swizzle: int, lbo: int, sbo: int) -> int:
    """The wgmma matrix descriptor: start address, LBO and SBO in 16-byte units at bits 0, 16 and
    32 (14 bits each), base offset 0, layout type at bits 62-63 (1: 128B, 2: 64B, 3: 32B)."""
    layout = {0: 0, 128: 1, 64: 2, 32: 3}[swizzle]
    return ((address & 0x3FFFF) >> 4) | (lbo >> 4) << 16 | (sbo >> 4) << 32 | layout << 62


@dataclass(frozen=True)
class Placement:
    """How one operand's k16 steps lie in the tile: descriptor fields and each step's offset."""

    mn_major: bool
    swizzle: int
    lbo: int
    sbo: int
    steps: tuple[int, ...]  # byte offset of step s from the tile's start
    size: int  # bytes the operand spans from its first step's offset


def placement(extent: int, mn_major: bool, swizzle: int, steps: int, at: int) -> Placement:
    """A compact placement of an (extent x 16*steps) operand starting at byte `at` (aligned to the
    swizzle atom), with LBO and SBO different from each other where both are used."""
    w = swizzle
    if swizzle == 0:
        groups = -(-extent // 8)
        if mn_major:
            sbo, lbo = 128, groups * 128  # core matrices along MN adjacent, the K pair after them
        else:
            lbo, sbo = 128, 256  # the K pair adjacent, then the next 8 rows
        step = 2 * groups * 128
        return Placement(mn_major, 0, lbo, sbo, tuple(at + s * step for s in range(steps)), steps * step)
    if mn_major:
        per_row = w // 2
        atoms = -(-extent // per_row)
        sbo, lbo = 8 * w, 16 * w  # a step's two k-atoms adjacent; MN atoms after them
        step = atoms * 16 * w
        return Placement(True, w, lbo, sbo, tuple(at + s * step for s in range(steps)), steps * step)
    # K-major: a row of W bytes holds W/32 k16 steps; the step advances the start address by 32
    # bytes inside the atom, and moves to the next column of atoms when the row is used up.
    per_row = w // 32
    rows = -(-extent // 8) * 8
    column = rows * w
    offsets = tuple(at + (s // per_row) * column + (s % per_row) * 32 for s in range(steps))
    return Placement(False, w, 16, 8 * w, offsets, -(-steps // per_row) * column)


def place(image: np.ndarray, used: np.ndarray, p: Placement, bits: np.ndarray) -> None:
    """Writes the operand `bits` (extent x 16*steps, uint16) into the byte image as `p` says,
    checking that no byte is written twice."""
    extent = bits.shape[0]
    for s, start in enumerate(p.steps):
        for mn in range(extent):
            for k in range(16):
                at = swizzled(start + element_offset(p.mn_major, p.swizzle, p.lbo, p.sbo, mn, k), p.swizzle)
                assert not used[at : at + 2].any(), f"byte {at} placed twice"
                used[at : at + 2] = True
                image[at : at + 2] = np.frombuffer(np.uint16(bits[mn, 16 * s + k]).tobytes(), np.uint8)


def d_position(m: int, i: int) -> tuple[int, int]:
    """(row, col) of D held by accumulator i of warpgroup thread m (PTX ISA, wgmma .m64nNk16 D):
    warp w = m / 32 owns rows 16w..16w+15; d[4j + 0..1] = D[16w + g][8j + 2t ..], d[4j + 2..3] =
    D[16w + g + 8][8j + 2t ..] with g = lane / 4, t = lane % 4."""
    w, lane = divmod(m, 32)
    g, t = divmod(lane, 4)
    j, r = divmod(i, 4)
    return 16 * w + g + 8 * (r // 2), 8 * j + 2 * t + r % 2


def pack_d(d: np.ndarray) -> np.ndarray:
    """A 64xN matrix as 128 threads x N/2 accumulators."""
    n = d.shape[1]
    out = np.empty((128, n // 2), d.dtype)
    for m in range(128):
        for i in range(n // 2):
            out[m, i] = d[d_position(m, i)]
    return out


def unpack_d(regs: np.ndarray) -> np.ndarray:
    """128 threads x N/2 accumulators back to the 64xN matrix."""
    n = regs.shape[1] * 2
    out = np.full((64, n), np.nan, regs.dtype)
    for m in range(128):
        for i in range(n // 2):
            out[d_position(m, i)] = regs[m, i]
    return out


# -------------------------------------------------------------------------------- unit cases


@dataclass
class UnitCase:
    """Inputs of a wgmma_unit_* launch and the exact D."""

    kernel: str
    n: int
    image: np.ndarray  # uint8, the tile's bytes
    params: np.ndarray  # int32, see wgmma_units.cu
    c: np.ndarray  # 128 x N/2 float32 accumulators in
    trans: int
    expected: np.ndarray  # 64 x N float64
    scale: np.ndarray  # 64 x N: sum of |products| (+ |C|), for tolerances

    @property
    def smem_bytes(self) -> int:
        return self.image.size + 1024


def operand_values(
    shape: tuple[int, int], dtype: str, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """(bits as uint16, values as float64) of a random f16 or bf16 operand."""
    if dtype == "f16":
        x = rng.standard_normal(shape).astype(np.float16)
        return x.view(np.uint16), x.astype(np.float64)
    bits = bf16_bits(rng.standard_normal(shape) * 4)
    return bits, bf16_value(bits).astype(np.float64)


def unit_case(
    n: int,
    trans_a: int,
    trans_b: int,
    swizzle_a: int,
    swizzle_b: int,
    rng: np.random.Generator,
    *,
    steps: int = 2,
    accumulate: int = 1,
    dtype: str = "f16",
) -> UnitCase:
    """A and B (64 x 16*steps, 16*steps x N) placed in one image; bytes no element occupies read
    as NaN (0xFFFF), so a wrong address shows."""
    assert 1 <= steps <= MAX_STEPS
    a_bits, a = operand_values((64, 16 * steps), dtype, rng)
    b_bits, b = operand_values((16 * steps, n), dtype, rng)
    pa = placement(64, bool(trans_a), swizzle_a, steps, 0)
    pb = placement(n, bool(trans_b), swizzle_b, steps, -(-pa.size // 1024) * 1024)
    size = -(-(pb.steps[0] + pb.size) // 1024) * 1024
    image, used = np.full(size, 0xFF, np.uint8), np.zeros(size, bool)
    place(image, used, pa, a_bits)
    place(image, used, pb, np.ascontiguousarray(b_bits.T))  # B indexed (n, k)
    c = rng.standard_normal((64, n))
    product, scale = a @ b, np.abs(a) @ np.abs(b)
    if accumulate:
        expected, scale = c + product, scale + np.abs(c)
        c_in = pack_d(c.astype(np.float32))
    else:  # scale-d = 0: D's old value is ignored, even NaN
        expected = product
        c_in = np.full((128, n // 2), np.nan, np.float32)
    params = np.zeros(8 + 2 * MAX_STEPS, np.int32)
    params[:8] = [pa.swizzle, pa.lbo, pa.sbo, pb.swizzle, pb.lbo, pb.sbo, steps, accumulate]
    params[8 : 8 + steps] = pa.steps
    params[8 + MAX_STEPS : 8 + MAX_STEPS + steps] = pb.steps
    return UnitCase(UNIT_KERNELS[n, dtype], n, image, params, c_in, 2 * trans_a + trans_b, expected, scale)


def assert_unit_close(case: UnitCase, out: np.ndarray, rel: float) -> None:
    """Every accumulator within `rel` of its scale (fp32 rounding of exact products per step)."""
    d = unpack_d(out.reshape(128, case.n // 2)).astype(np.float64)
    assert np.isfinite(d).all(), f"non-finite results at {np.argwhere(~np.isfinite(d))[:4].tolist()}"
    err = np.abs(d - case.expected)
    worst = np.unravel_index(np.argmax(err - rel * case.scale), err.shape)
    assert (err <= rel * case.scale + 1e-6).all(), f"D{worst} = {d[worst]}, expected {case.expected[worst]}"


# -------------------------------------------------------------------------------- misuse cases


def bug_operands(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The 4096-byte image of wgmma_bugs.cu (A K-major, no swizzle, LBO 128, SBO 256 at byte 0; B,
    N = 8, likewise at 2048), and A, B as float64."""
    a_bits, a = operand_values((64, 16), "f16", rng)
    b_bits, b = operand_values((16, 8), "f16", rng)
    image, used = np.zeros(4096, np.uint8), np.zeros(4096, bool)
    place(image, used, Placement(False, 0, 128, 256, (0,), 2048), a_bits)
    place(image, used, Placement(False, 0, 128, 256, (2048,), 256), np.ascontiguousarray(b_bits.T))
    return image, a, b


# -------------------------------------------------------------------------------- gemm


def gemm_inputs(kernel: str, m: int, n: int, k: int, rng: np.random.Generator):
    """(A [M][K], B as the kernel takes it, A and B [K][N] as float64) for a wgmma_gemm kernel."""
    a = rng.standard_normal((m, k)).astype(np.float16)
    b = rng.standard_normal((k, n)).astype(np.float16)
    stored = b if GEMM_KERNELS[kernel][0] == "kn" else np.ascontiguousarray(b.T)
    return a, stored, a.astype(np.float64), b.astype(np.float64)


def gemm_grid(m: int, n: int) -> tuple[int, int, int]:
    bm, bn, _ = GEMM_TILE
    return -(-n // bn), -(-m // bm), 1


def assert_gemm_close(c: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """fp16 C against A @ B: half an fp16 ulp of the exact value plus fp32 accumulation error."""
    reference, scale = a @ b, np.abs(a) @ np.abs(b)
    c = c.astype(np.float64)
    assert np.isfinite(c).all(), "unwritten or non-finite outputs"
    err = np.abs(c - reference)
    bound = np.abs(reference) * 2.0**-10 + 1e-5 * scale + 1e-6
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), f"C{worst} = {c[worst]}, expected {reference[worst]}"
