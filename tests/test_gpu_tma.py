"""welder_tma.cuh on a Hopper GPU: the kernels of tests/kernels/tma_units.cu, tma_ring.cu and
tma_store_units.cu, compiled by nvcc for sm_90a and launched through pycuda with tensor-map
arguments encoded by the driver (welder.device.gpu), must meet the same numpy expectations
(tests/tma_reference.py) as on the CPU emulator (test_emulator_tma.py) -- which is what shows that
the emulator lands boxes, swizzles and zero-fills, and stores boxes back clipped to the tensor, the
way the copy engine does.  Skipped without pycuda and a GPU of compute
capability 9.0 (``scripts/gpu_suite.sh`` runs them).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from kernel_fixtures import HOPPER, cuda_context
from test_gpu import run_native
from test_wgmma import CLUSTER_CASES, PERSISTENT_CASES, PRODUCER_CASES, _best_per_tile, _persistent
from test_wgmma import _configs as _wgmma_configs
from tma_reference import (
    BOX_CASES,
    CLUSTER_EPILOGUE_CASES,
    EPILOGUE_CASES,
    RING,
    RING_SMEM_BYTES,
    RING_THREADS,
    STORE_BOX_CASES,
    STORE_UNITS,
    UNITS,
    BoxCase,
    EpilogueCase,
    assert_gemm_close,
    ring_case,
    store_box_case,
    wgmma_case,
)
from wgmma_reference import unpack_d

from welder.check import error_metric, threshold_for
from welder.codegen import generate_kernel
from welder.codegen.tensor_map import TensorMapArg, TensorMapError
from welder.device.gpu import (
    DeviceBuffer,
    GpuModule,
    compile_cubin,
    compute_capability,
    encode_tensor_map,
    sm_arch,
)

pytestmark = HOPPER


@pytest.fixture(scope="module")
def module():
    """The unit kernels (loads and stores) and the ring, compiled for sm_90a, in a context of this
    process."""
    with cuda_context():
        arch = sm_arch(compute_capability(), arch_specific=True)
        yield GpuModule(compile_cubin([UNITS.read_text(), RING.read_text(), STORE_UNITS.read_text()], arch))


@pytest.fixture()
def rng() -> np.random.Generator:
    return np.random.default_rng(20250701)


def launch(module: GpuModule, name: str, grid, block, smem: int, args: Sequence) -> None:
    """Runs a kernel on numpy arrays (copied in, and back out in place), numpy scalars and tensor
    maps (encoded by the driver over the device copy of the array they name)."""
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


@pytest.mark.parametrize("case", BOX_CASES, ids=lambda c: c.name)
def test_tma_boxes_land_swizzled_with_zero_filled_edges(module, rng, case: BoxCase):
    data, spec = case.tensor(rng)
    out = np.full(case.box_bytes, 0xEE, np.uint8)
    launch(module, "tma_box", 1, 128, case.smem_bytes, case.args(data, spec, out))
    np.testing.assert_array_equal(out, case.expected(data, spec))


def test_a_wgmma_reads_tma_operands_without_a_proxy_fence(module, rng):
    head, expected = wgmma_case(rng)
    out = np.full((128, 4), np.nan, np.float32)
    launch(module, "tma_wgmma", 1, 128, 4096, [*head, out])
    np.testing.assert_allclose(unpack_d(out), expected, rtol=1e-5, atol=1e-5)


def test_a_generated_kernel_shape_copies_through_boxes(module, rng):
    x = rng.standard_normal((20, 44)).astype(np.float32)
    y = np.full_like(x, np.nan)
    spec = TensorMapArg(0, 4, (44, 20), (176,), (32, 8), 0)
    launch(module, "tma_tile_copy", (2, 3), 64, 2048, [x, y, spec])
    np.testing.assert_array_equal(y, x)


@pytest.mark.parametrize("case", STORE_BOX_CASES, ids=lambda c: c.name)
def test_tma_stores_write_their_swizzled_box_clipped_to_the_tensor(module, rng, case: BoxCase):
    args, tensor, expected = store_box_case(case, rng)
    launch(module, "tma_store_box", 1, 128, case.smem_bytes, args)
    np.testing.assert_array_equal(tensor, expected)


@pytest.mark.parametrize(
    ("kernel", "case"),
    [("tma_store_epilogue", c) for c in EPILOGUE_CASES]
    + [("tma_store_epilogue_cluster", c) for c in CLUSTER_EPILOGUE_CASES],
    ids=str,
)
def test_the_staged_epilogue_matches_numpy(module, rng, kernel: str, case: EpilogueCase):
    args, c, expected = case.arrays(rng)
    launch(module, kernel, case.grid, 32 * case.warps, case.smem_bytes, args)
    np.testing.assert_array_equal(c, expected)


@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(128, 64, 64), (128, 64, 512), (200, 100, 520), (64, 200, 1040), (1000, 520, 776), (777, 1032, 1000)],
)
def test_the_producer_consumer_ring_matches_numpy(module, rng, m, n, k):
    grid, args, c, a, b = ring_case(m, n, k, rng)
    launch(module, "tma_ring_gemm", grid, RING_THREADS, RING_SMEM_BYTES, args)
    assert_gemm_close(c, a, b)


def test_the_driver_refuses_what_the_rules_refuse(module):
    # The Python rules stand in front of the driver; the driver itself agrees on a map they pass.
    buffer = DeviceBuffer(1 << 16)
    try:
        assert len(encode_tensor_map(TensorMapArg(0, 2, (64, 100), (128,), (64, 32), 128), buffer.ptr)) == 128
        with pytest.raises(TensorMapError, match="swizzle span"):
            encode_tensor_map(TensorMapArg(0, 2, (64, 100), (128,), (64, 32), 64), buffer.ptr)
    finally:
        buffer.free()


# -- generated kernels: the wgmma kind's producer variant --------------------------------------


def _run_generated(graph, group, feeds, chosen) -> None:
    """Each config's generated kernel on the GPU, twice, against the interpreter."""
    kernels = [generate_kernel(graph, group, cfg, f"tma_case_{j}") for j, cfg in enumerate(chosen)]
    generated = GpuModule(compile_cubin([k.source for k in kernels], sm_arch((9, 0), arch_specific=True)))
    reference = graph.run(feeds)
    for cfg, kernel in zip(chosen, kernels):
        for _ in range(2):
            for name, value in run_native(graph, [kernel], generated, feeds).items():
                err = error_metric(value, reference[name])
                assert np.isfinite(err) and err <= threshold_for("float16"), f"{cfg.stages[0]}: {err:.3e}"


@pytest.mark.parametrize("label", PRODUCER_CASES)
def test_producer_variant_matches_the_interpreter_on_the_gpu(module, label: str) -> None:
    """The producer variant's generated kernels (a TMA producer warpgroup, full/empty
    mbarriers) for the emulated cases of tests/test_wgmma.py, on the GPU, twice each (the
    ``module`` fixture's context is current)."""
    graph, group, feeds, configs = _wgmma_configs(label)
    _run_generated(graph, group, feeds, _best_per_tile(configs, producer=True)[:3])


@pytest.mark.parametrize("label", list(PERSISTENT_CASES))
def test_persistent_blocks_match_the_interpreter_on_the_gpu(module, label: str) -> None:
    """Persistent producer kernels (two and three blocks walking every tile, the ring carried
    across tiles) for the emulated cases of tests/test_wgmma.py, on the GPU."""
    graph, group, feeds, configs = _wgmma_configs(PERSISTENT_CASES[label]())
    chosen = [c for c in _best_per_tile(configs, producer=True) if c.num_blocks > 3][:2]
    assert chosen
    _run_generated(graph, group, feeds, [_persistent(c, b) for c, b in zip(chosen, (2, 3))])


@pytest.mark.parametrize("label", list(CLUSTER_CASES))
def test_clusters_match_the_interpreter_on_the_gpu(module, label: str) -> None:
    """Clustered producer kernels (two blocks sharing A or B through TMA multicast and each
    other's empty barriers), launch per tile and persistent, for the emulated cases of
    tests/test_wgmma.py, on the GPU."""
    graph, group, feeds, configs = _wgmma_configs(CLUSTER_CASES[label]())
    chosen = []
    for name in ("a", "b"):
        paired = _best_per_tile(configs, producer=True, multicast=name)[:1]
        chosen += paired + [_persistent(c, 2) for c in paired if c.num_blocks > 2]
    assert chosen
    _run_generated(graph, group, feeds, chosen)
