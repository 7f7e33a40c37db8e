"""welder_wgmma.cuh on a Hopper GPU: the kernels of tests/kernels/wgmma_units.cu and wgmma_gemm.cu,
compiled by nvcc for sm_90a, must meet the same numpy expectations (tests/wgmma_reference.py) as on
the CPU emulator (test_emulator_wgmma.py) -- which is what shows that the emulator's shared-memory
layouts, descriptors and accumulator fragment are the hardware's.  Skipped without pycuda and a GPU
of compute capability 9.0 (``scripts/gpu_suite.sh`` runs them).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import pytest
from kernel_fixtures import HOPPER, cuda_context
from wgmma_reference import (
    GEMM,
    GEMM_SMEM_BYTES,
    GEMM_THREADS,
    SWIZZLES,
    UNITS,
    assert_gemm_close,
    assert_unit_close,
    gemm_grid,
    gemm_inputs,
    unit_case,
)

from welder.device.gpu import (
    DeviceBuffer,
    GpuModule,
    compile_cubin,
    compute_capability,
    sm_arch,
)

pytestmark = HOPPER
MAJORS = list(itertools.product((0, 1), (0, 1)))


@pytest.fixture(scope="module")
def module():
    """The unit kernels and the GEMM, compiled for sm_90a, in a context of this process."""
    with cuda_context():
        arch = sm_arch(compute_capability(), arch_specific=True)
        yield GpuModule(compile_cubin([UNITS.read_text(), GEMM.read_text()], arch))


@pytest.fixture()
def rng() -> np.random.Generator:
    return np.random.default_rng(20250612)


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


def run_unit(module: GpuModule, case) -> np.ndarray:
    out = np.full((128, case.n // 2), np.nan, np.float32)
    args = [case.image, np.int32(case.image.size), case.params, case.c, out, np.int32(case.trans)]
    launch(module, case.kernel, 1, 128, case.smem_bytes, args)
    return out


@pytest.mark.parametrize("n", [8, 64, 256])
@pytest.mark.parametrize(("trans_a", "trans_b"), MAJORS)
@pytest.mark.parametrize("swizzle", SWIZZLES)
def test_wgmma_reads_the_canonical_layouts(module, rng, n, trans_a, trans_b, swizzle):
    swizzle_b = SWIZZLES[(SWIZZLES.index(swizzle) + 1) % len(SWIZZLES)]
    case = unit_case(n, trans_a, trans_b, swizzle, swizzle_b, rng)
    assert_unit_close(case, run_unit(module, case), rel=1e-5)


@pytest.mark.parametrize(("trans_a", "trans_b"), MAJORS)
@pytest.mark.parametrize("swizzle", SWIZZLES)
def test_chains_of_k16_steps_advance_the_descriptor(module, rng, trans_a, trans_b, swizzle):
    case = unit_case(64, trans_a, trans_b, swizzle, swizzle, rng, steps=5)
    assert_unit_close(case, run_unit(module, case), rel=1e-5)


@pytest.mark.parametrize("accumulate", [0, 1])
def test_scale_d_zero_ignores_the_accumulators(module, rng, accumulate):
    case = unit_case(64, 0, 1, 128, 128, rng, accumulate=accumulate)
    assert_unit_close(case, run_unit(module, case), rel=1e-5)


@pytest.mark.parametrize(("n", "dtype"), [(24, "f16"), (64, "bf16")])
def test_other_shapes_and_bf16(module, rng, n, dtype):
    for trans_a, trans_b in MAJORS:
        case = unit_case(n, trans_a, trans_b, 64, 32, rng, steps=3, dtype=dtype)
        assert_unit_close(case, run_unit(module, case), rel=1e-5)


@pytest.mark.parametrize(
    ("kernel", "m", "n", "k"),
    [
        ("wgmma_gemm_kn", 128, 128, 64),
        ("wgmma_gemm_nk", 128, 128, 64),
        ("wgmma_gemm_kn", 64, 256, 512),
        ("wgmma_gemm_nk", 64, 256, 512),
        ("wgmma_gemm_kn", 136, 200, 136),
        ("wgmma_gemm_kn_narrow", 200, 136, 100),
        ("wgmma_gemm_nk_narrow", 200, 136, 100),
        ("wgmma_gemm_kn", 1000, 520, 776),
        ("wgmma_gemm_nk", 777, 1032, 1000),
    ],
)
def test_wgmma_gemm_matches_numpy(module, rng, kernel, m, n, k):
    a, b, av, bv = gemm_inputs(kernel, m, n, k, rng)
    c = np.full((m, n), np.nan, np.float16)
    scalars = [np.int32(v) for v in (m, n, k)]
    launch(module, kernel, gemm_grid(m, n), GEMM_THREADS, GEMM_SMEM_BYTES, [a, b, c, *scalars])
    assert_gemm_close(c, av, bv)


@pytest.mark.parametrize("swizzle", SWIZZLES)
def test_swapped_lbo_and_sbo_give_wrong_results(module, rng, swizzle):
    # The roles older PTX ISA text gives LBO and SBO (K and MN core-matrix strides in every
    # layout) differ from the table's for MN-major swizzled operands: the hardware must reject
    # the swapped ones.  Extra shared memory keeps the wrong addresses inside the launch.
    case = unit_case(256, 1, 1, swizzle, swizzle, rng)
    case.params[[1, 2, 4, 5]] = case.params[[2, 1, 5, 4]]
    out = np.full((128, case.n // 2), np.nan, np.float32)
    args = [case.image, np.int32(case.image.size), case.params, case.c, out, np.int32(case.trans)]
    launch(module, case.kernel, 1, 128, case.smem_bytes + 131072, args)
    with pytest.raises(AssertionError):
        assert_unit_close(case, out, rel=1e-5)
