"""welder_cluster.cuh on a Hopper GPU: the kernels of tests/kernels/cluster_units.cu and
cluster_ring.cu, compiled by nvcc for sm_90a with their __cluster_dims__ (which cuLaunchKernel
honours) and launched through the existing launchers, must meet the same numpy expectations
(tests/cluster_reference.py) as on the CPU emulator (test_emulator_cluster.py) -- which is what
shows that the emulator runs clusters, multicast and remote arrivals the way the GPU does.  Skipped
without pycuda and a GPU of compute capability 9.0 (``scripts/gpu_suite.sh`` runs them).
"""

from __future__ import annotations

import numpy as np
import pytest
from cluster_reference import (
    BOX_CASES,
    BOX_KERNELS,
    EXCHANGE_KERNELS,
    RING,
    RING_SMEM_BYTES,
    RING_THREADS,
    UNITS,
    ClusterBoxCase,
    exchange_case,
    ring_case,
)
from kernel_fixtures import HOPPER, cuda_context
from test_gpu_tma import launch
from tma_reference import assert_gemm_close

from welder.device.gpu import GpuModule, compile_cubin, compute_capability, sm_arch

pytestmark = HOPPER


@pytest.fixture(scope="module")
def module():
    """The unit kernels and the ring, compiled for sm_90a, in a context of this process."""
    with cuda_context():
        arch = sm_arch(compute_capability(), arch_specific=True)
        yield GpuModule(compile_cubin([UNITS.read_text(), RING.read_text()], arch))


@pytest.fixture()
def rng() -> np.random.Generator:
    return np.random.default_rng(20250801)


@pytest.mark.parametrize("case", BOX_CASES, ids=lambda c: c.name)
def test_every_block_of_a_cluster_receives_the_parts_its_peers_multicast(module, rng, case: ClusterBoxCase):
    data, spec = case.tensor(rng)
    out = np.full((case.grid, case.tile_bytes), 0xEE, np.uint8)
    launch(module, BOX_KERNELS[case.cluster], case.grid, 128, case.smem_bytes, case.args(data, spec, out))
    np.testing.assert_array_equal(out, case.expected(data, spec))


@pytest.mark.parametrize("cluster", sorted(EXCHANGE_KERNELS))
def test_a_cluster_barrier_orders_a_value_exchange_between_blocks(module, rng, cluster: int):
    grid, args, expected, ranks = exchange_case(cluster, 3, 64, rng)
    launch(module, EXCHANGE_KERNELS[cluster], grid, 64, 0, args)
    np.testing.assert_array_equal(args[3], ranks)
    np.testing.assert_array_equal(args[2], expected)


@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(128, 128, 64), (128, 128, 512), (200, 100, 520), (64, 300, 1040), (1000, 520, 776), (777, 1032, 1000)],
)
def test_the_two_block_ring_sharing_a_matches_numpy(module, rng, m, n, k):
    grid, args, c, a, b = ring_case(m, n, k, rng)
    launch(module, "cluster_ring_gemm", grid, RING_THREADS, RING_SMEM_BYTES, args)
    assert_gemm_close(c, a, b)
