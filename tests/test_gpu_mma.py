"""welder_mma.cuh on a real GPU: the kernels of tests/kernels/mma_units.cu and mma_gemm.cu,
compiled by nvcc for the device, must meet the same numpy expectations (tests/mma_reference.py)
as on the CPU emulator (test_emulator_mma.py) -- which is what shows that the emulator's register
layouts are the hardware's.  Skipped without pycuda and a GPU (``scripts/gpu_suite.sh`` runs them).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from kernel_fixtures import ANY_GPU, cuda_context
from mma_reference import (
    GEMM,
    GEMM_SMEM_BYTES,
    GEMM_THREADS,
    LDMATRIX_MODES,
    UNITS,
    assert_gemm_close,
    gemm_inputs,
    gemm_launch,
    ldmatrix_expected,
    ldmatrix_offsets,
    mma_case,
    mma_result,
    tf32_round,
    zero_fill_expected,
    zero_fill_sizes,
)

from welder.device.gpu import (
    DeviceBuffer,
    GpuModule,
    compile_cubin,
    compute_capability,
    sm_arch,
)

pytestmark = ANY_GPU


@pytest.fixture(scope="module")
def module():
    """The unit kernels and the GEMM, compiled for this GPU, in a context of this process."""
    with cuda_context():
        yield GpuModule(compile_cubin([UNITS.read_text(), GEMM.read_text()], sm_arch(compute_capability())))


@pytest.fixture()
def rng() -> np.random.Generator:
    return np.random.default_rng(20250611)


def launch(
    module: GpuModule, name: str, grid, block, smem: int, args: Sequence[np.ndarray | np.generic]
) -> None:
    """Runs a kernel on numpy arrays (copied in, and back out in place) and numpy scalars."""
    import pycuda.driver as drv

    buffers = [(DeviceBuffer.from_array(a), a) if isinstance(a, np.ndarray) else (None, a) for a in args]
    try:
        module.launch(name, grid, block, smem, [b if b is not None else a for b, a in buffers])
        drv.Context.synchronize()
        for b, a in buffers:
            if b is not None:
                a[...] = b.to_array(a.shape, a.dtype)
    finally:
        for b, _ in buffers:
            if b is not None:
                b.free()


@pytest.mark.parametrize("kind", ["f16", "bf16", "tf32"])
def test_mma_registers_follow_the_isa_layout(module, rng, kind):
    case = mma_case(kind, 4, rng)
    d = np.full((128, 4), np.nan, np.float32)
    launch(module, "mma_fragments", 2, 64, 0, [case.a, case.b, case.c, d, np.int32(case.kind_code)])
    np.testing.assert_allclose(mma_result(case, d), case.expected, rtol=1e-5, atol=1e-5)


def test_tf32_operands_ignore_the_low_mantissa_bits(module, rng):
    case = mma_case("tf32", 1, rng, tf32_rounded=False)
    d = np.full((32, 4), np.nan, np.float32)
    launch(module, "mma_fragments", 1, 32, 0, [case.a, case.b, case.c, d, np.int32(case.kind_code)])
    np.testing.assert_allclose(mma_result(case, d), case.expected, rtol=1e-5, atol=1e-5)


def test_float_to_tf32_rounds_to_nearest_ties_away(module, rng):
    x = rng.standard_normal(1000).astype(np.float32)
    bits = x.view(np.uint32)
    bits[:100] = (bits[:100] & np.uint32(0xFFFFE000)) | np.uint32(0x1000)
    y = np.zeros(1000, np.uint32)
    launch(module, "to_tf32", 4, 256, 0, [x, y, np.int32(x.size)])
    np.testing.assert_array_equal(y.view(np.float32), tf32_round(x))


@pytest.mark.parametrize(("matrices", "trans"), sorted(LDMATRIX_MODES))
def test_ldmatrix_registers_follow_the_isa_layout(module, rng, matrices, trans):
    count = 64 * 16
    tile = rng.permutation(count).astype(np.uint16)
    offsets = ldmatrix_offsets(count, matrices, 2, rng)
    out = np.full((64, 4), 0xDEADBEEF, np.uint32)
    mode = np.int32(LDMATRIX_MODES[matrices, trans])
    launch(module, "ldmatrix_fragments", 1, 64, 2 * count, [tile, np.int32(count), offsets, out, mode])
    np.testing.assert_array_equal(out, ldmatrix_expected(tile, offsets, matrices, trans))


def test_cp_async_zero_fills_past_src_bytes(module, rng):
    threads = 64
    src = rng.integers(1, 256, 32 * threads).astype(np.uint8)
    sizes = zero_fill_sizes(threads, rng)
    out = np.full(28 * threads, 0xAB, np.uint8)
    launch(module, "cp_async_zero_fill", 1, threads, 32 * threads, [src, sizes, out])
    np.testing.assert_array_equal(out, zero_fill_expected(src, sizes))


def test_cp_async_pipeline_stages_complete_in_order(module, rng):
    threads = 64
    src = rng.standard_normal(3 * threads * 4).astype(np.float32)
    out = np.full(3 * threads * 4, np.nan, np.float32)
    launch(module, "cp_async_stages", 1, threads, 3 * threads * 16, [src, out])
    neighbour = (np.arange(threads) + 1) % threads
    np.testing.assert_array_equal(out.reshape(3, threads, 4), src.reshape(3, threads, 4)[:, neighbour])


@pytest.mark.parametrize(
    ("kernel", "m", "n", "k", "splits"),
    [
        ("mma_gemm_f16", 64, 64, 32, 1),
        ("mma_gemm_f16", 100, 72, 40, 1),
        ("mma_gemm_f16", 1000, 520, 776, 1),
        ("mma_gemm_f16", 96, 80, 1024, 5),
        ("mma_gemm_bf16", 300, 200, 136, 1),
        ("mma_gemm_bf16", 64, 128, 96, 2),
        ("mma_gemm_f16_narrow", 50, 34, 50, 1),
        ("mma_gemm_f16_narrow", 66, 10, 130, 2),
    ],
)
def test_tensor_core_gemm_matches_numpy(module, rng, kernel, m, n, k, splits):
    a, b, av, bv = gemm_inputs(kernel, m, n, k, rng)
    grid, per_split = gemm_launch(m, n, k, splits)
    c = np.zeros((m, n), np.float32) if splits > 1 else np.full((m, n), np.nan, np.float32)
    scalars = [np.int32(v) for v in (m, n, k, per_split)]
    launch(module, kernel, grid, GEMM_THREADS, GEMM_SMEM_BYTES, [a, b, c, *scalars])
    assert_gemm_close(c, av, bv, rel=1e-4)
