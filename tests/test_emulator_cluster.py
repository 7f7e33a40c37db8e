"""The emulator runs welder_cluster.cuh -- clusters of blocks, the cluster barrier, arrivals on a
peer block's mbarrier, TMA loads with multicast -- as a Hopper GPU does: the blocks of a cluster
each load part of a box and every block ends up with the whole box (compared with tma_reference's
numpy model of the copy engine), a cluster barrier orders a value exchange between the blocks, and a
two-block producer/consumer ring whose blocks multicast halves of a shared operand and release
slots in both blocks matches numpy's matmul (tests/kernels/cluster_*.cu).  Misuse is reported,
each case naming the fault.  The same kernels compile with nvcc for sm_90a
(test_emulator_tma.py) and test_gpu_cluster.py runs them on a Hopper GPU.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from cluster_reference import (
    BOX_CASES,
    BOX_KERNELS,
    BUG_KERNELS,
    BUG_SMEM_BYTES,
    BUG_THREADS,
    BUGS,
    EXCHANGE_KERNELS,
    RING,
    RING_KERNELS,
    RING_SMEM_BYTES,
    RING_THREADS,
    UNIT_KERNELS,
    UNITS,
    ClusterBoxCase,
    bug_args,
    exchange_case,
    ring_case,
)
from kernel_fixtures import EMULATOR, emulated
from kernel_fixtures import line_of as kernel_line
from tma_reference import assert_gemm_close

from welder.runtime import emu
from welder.runtime.emu import EmulationError

pytestmark = EMULATOR

SOURCE = "\n".join(p.read_text() for p in (UNITS, BUGS, RING))


def line_of(text: str) -> int:
    return kernel_line(SOURCE, text)


@pytest.fixture(scope="module")
def module() -> emu.EmulatedModule:
    return emulated(SOURCE, [*UNIT_KERNELS, *BUG_KERNELS, *RING_KERNELS])


@pytest.fixture()
def rng() -> np.random.Generator:
    return np.random.default_rng(20250801)


# ------------------------------------------------------------------------------------- multicast


@pytest.mark.parametrize("case", BOX_CASES, ids=lambda c: c.name)
def test_every_block_of_a_cluster_receives_the_parts_its_peers_multicast(module, rng, case: ClusterBoxCase):
    data, spec = case.tensor(rng)
    out = np.full((case.grid, case.tile_bytes), 0xEE, np.uint8)
    module.launch(BOX_KERNELS[case.cluster], case.grid, 128, case.smem_bytes, case.args(data, spec, out))
    expected = case.expected(data, spec)
    np.testing.assert_array_equal(out, expected)
    # The test's power: the parts differ (a block holding only its own part, or its part in every
    # place, would fail) and so do the clusters.
    parts = expected.reshape(case.grid, case.cluster, -1)
    assert all(not np.array_equal(parts[0, 0], parts[0, r]) for r in range(1, case.cluster))
    assert not np.array_equal(expected[0], expected[-1])


@pytest.mark.parametrize("cluster", sorted(EXCHANGE_KERNELS))
def test_a_cluster_barrier_orders_a_value_exchange_between_blocks(module, rng, cluster: int):
    grid, args, expected, ranks = exchange_case(cluster, 3, 64, rng)
    module.launch(EXCHANGE_KERNELS[cluster], grid, 64, 0, args)
    np.testing.assert_array_equal(args[3], ranks)
    np.testing.assert_array_equal(args[2], expected)


# ------------------------------------------------------------------------------------- the ring

RING_CASES = [
    (128, 128, 64),  # one cluster, one slice
    (128, 128, 512),  # eight slices through four slots: every slot refilled in both blocks
    (200, 100, 520),  # ragged M, N and K: the second block of the cluster half outside N
    (64, 300, 1040),  # seventeen slices, three clusters, half-empty row blocks
]


@pytest.mark.parametrize(("m", "n", "k"), RING_CASES)
def test_the_two_block_ring_sharing_a_matches_numpy(module, rng, m, n, k):
    grid, args, c, a, b = ring_case(m, n, k, rng)
    module.launch("cluster_ring_gemm", grid, RING_THREADS, RING_SMEM_BYTES, args)
    assert_gemm_close(c, a, b)


# ------------------------------------------------------------------------------------- misuse

ARRIVE = "mbarrier.arrive.release.cluster.shared::cluster.b64"
MULTICAST = (
    "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
)
CLUSTER = "cluster of blocks (0,0,0)-(1,0,0)"
BAR = "mbarrier 'bar' index 0 (byte 0)"
LATE = "mbarrier 'late' index 0 (byte 8)"
EXITED = (
    "whose threads have all exited (a block must not exit while its peers may still use its shared "
    "memory: end the kernel with welder_cluster_sync)"
)
UNPUBLISHED = (
    "but that init is not visible to the cluster yet: a fence.mbarrier_init (welder_mbarrier_init_fence) "
    "of the initialising thread and then a welder_cluster_sync must come between the init and its use "
    "by another block"
)


def misuse(module, rng, mode: int) -> str:
    args, _, _ = bug_args(rng, mode)
    with pytest.raises(EmulationError) as caught:
        module.launch("cluster_misuse", 2, BUG_THREADS, BUG_SMEM_BYTES, args)
    return str(caught.value)


def test_the_misuse_kernel_is_right_when_nothing_is_planted(module, rng):
    args, src, out = bug_args(rng, -1, grid=4)
    module.launch("cluster_misuse", 4, BUG_THREADS, BUG_SMEM_BYTES, args)
    np.testing.assert_array_equal(out, np.stack([src] * 4))


def test_an_arrival_before_the_cluster_barrier_that_publishes_the_init_is_reported(module, rng):
    message = misuse(module, rng, 0)
    site = line_of("if (mode == 0 && rank == 1 && tid == 0) welder_mbarrier_arrive_cluster(bar, peer);")
    init = line_of("welder_mbarrier_init(bar, 1);\n    welder_mbarrier_init(late, 1);")
    assert message.endswith(
        f"block (1,0,0), thread 0 (0,0,0): {ARRIVE} at kernel.cu:{site}: {BAR} of block (0,0,0) "
        f"(cluster rank 0) was initialised by thread 0 (0,0,0) at kernel.cu:{init}, {UNPUBLISHED}"
    ), message


def test_an_arrival_after_a_barrier_without_the_init_fence_is_reported(module, rng):
    message = misuse(module, rng, 9)
    site = line_of("if (mode == 9 && rank == 0 && tid == 0) welder_mbarrier_arrive_cluster(late, peer);")
    init = line_of("welder_mbarrier_init(late, 1);")
    assert message.endswith(
        f"block (0,0,0), thread 0 (0,0,0): {ARRIVE} at kernel.cu:{site}: {LATE} of block (1,0,0) "
        f"(cluster rank 1) was initialised by thread 0 (0,0,0) at kernel.cu:{init}, {UNPUBLISHED}"
    ), message


def test_a_block_exiting_while_its_peer_still_arrives_on_it_is_reported(module, rng):
    message = misuse(module, rng, 1)
    site = line_of("welder_mbarrier_wait(late, 0);\n      welder_mbarrier_arrive_cluster(late, peer);") + 1
    assert message.endswith(
        f"block (1,0,0), thread 0 (0,0,0): {ARRIVE} at kernel.cu:{site}: arrives on shared view 'late' "
        f"index 0 of block (0,0,0) (cluster rank 0), {EXITED}"
    ), message


def test_more_multicast_bytes_than_expected_are_reported(module, rng):
    # Each block's phase completes on its own 1024 bytes; the peer's 1024 are left over.
    message = misuse(module, rng, 2)
    site = line_of("welder_tma_load_2d_multicast(tile + rank * 8 * 64")
    assert message.endswith(
        f"block (0,0,0): every thread exited with 1024 transaction bytes on {BAR} that no expect_tx "
        "announced (phase 1 in progress: 1 of 1 arrivals and 0 transaction bytes pending; the "
        f"{MULTICAST} at kernel.cu:{site} that thread 0 (0,0,0) of block (1,0,0) issued, completing on "
        f"{BAR}, still in flight): a phase expected fewer bytes (welder_mbarrier_arrive_expect_tx) than "
        "its TMA loads deliver"
    ), message


def test_a_divergent_cluster_barrier_is_reported(module, rng):
    message = misuse(module, rng, 3)
    first = line_of("    welder_cluster_sync();\n  } else {")
    assert message.endswith(
        f"{CLUSTER}: welder_cluster_sync at kernel.cu:{first + 2} cannot complete: every thread of every "
        "block of the cluster must reach the same cluster barrier; block (0,0,0) threads 0-127 arrived; "
        f"block (1,0,0) threads 0-127 wait at welder_cluster_sync (kernel.cu:{first})"
    ), message


def test_a_deadlock_of_the_cluster_names_each_blocks_threads(module, rng):
    message = misuse(module, rng, 10)
    site = line_of("if (mode == 10) welder_mbarrier_wait(late, 0);")
    waiting = (
        f"threads 0-127 wait at mbarrier.try_wait.parity.shared::cta.b64 (kernel.cu:{site}) on {LATE} for "
        "the phase of parity 0 (phase 0 in progress: 1 of 1 arrivals and 0 transaction bytes pending)"
    )
    assert message.endswith(
        f"{CLUSTER}: deadlock: every thread of the cluster is blocked and no mbarrier phase they wait for "
        f"can complete: block (0,0,0) {waiting}; block (1,0,0) {waiting}"
    ), message


def test_threads_exiting_before_a_cluster_barrier_are_reported(module, rng):
    message = misuse(module, rng, 5)
    assert message.endswith(
        "block (0,0,0) threads 0-127 arrived; block (1,0,0) threads 0-63 arrived; block (1,0,0) threads "
        "64-127 have exited"
    ), message


def test_a_multicast_into_a_block_that_has_not_initialised_the_mbarrier_is_reported(module, rng):
    message = misuse(module, rng, 4)
    site = line_of("welder_tma_load_2d_multicast(tile, &map, bar, 0x3, 0, 0);")
    assert message.endswith(
        f"block (0,0,0), thread 0 (0,0,0): {MULTICAST} at kernel.cu:{site}: shared view 'bar' index 0 "
        "(byte 0) of block (1,0,0) (cluster rank 1) is not an mbarrier: no welder_mbarrier_init of it in "
        "that block"
    ), message


def test_a_block_exiting_with_a_peers_multicast_in_flight_is_reported(module, rng):
    message = misuse(module, rng, 6)
    site = line_of("welder_tma_load_2d_multicast(spare, &map, late, 0x3, 0, 0);")
    assert message.endswith(
        f"block (0,0,0): every thread exited with the {MULTICAST} at kernel.cu:{site} that thread 0 (0,0,0) "
        f"of block (1,0,0) issued, completing on {LATE} still in flight (no thread waited on that "
        "mbarrier after the load was issued)"
    ), message


def test_a_multicast_into_a_peers_pending_destination_is_reported(module, rng):
    message = misuse(module, rng, 11)
    site = line_of("welder_tma_load_2d_multicast(spare, &map, late, 0x2, 0, 0);")
    assert message.endswith(
        f"block (0,0,0), thread 0 (0,0,0): {MULTICAST} at kernel.cu:{site}: the destination in block (1,0,0) "
        f"(cluster rank 1), shared view 'spare' (byte 3072), is also the destination of the {MULTICAST} at "
        f"kernel.cu:{site} that thread 0 (0,0,0) of block (0,0,0) issued, completing on {LATE}, on which no "
        "thread has waited yet"
    ), message


def test_ranks_outside_the_cluster_are_reported(module, rng):
    site = line_of("welder_mbarrier_arrive_cluster(bar, 2)")
    message = misuse(module, rng, 7)
    assert message.endswith(
        f"{ARRIVE} at kernel.cu:{site}: block rank 2 is not in the cluster of 2 blocks"
    ), message
    message = misuse(module, rng, 8)
    assert "the multicast mask 0x5 names ranks outside those of the cluster's 2 blocks" in message, message


# ------------------------------------------------------------------------------------- launches


def test_a_grid_that_is_not_whole_clusters_is_an_invalid_launch(module, rng):
    args, _, _ = bug_args(rng, -1, grid=3)
    with pytest.raises(EmulationError) as caught:
        module.launch("cluster_misuse", 3, BUG_THREADS, BUG_SMEM_BYTES, args)
    assert str(caught.value) == (
        "kernel 'cluster_misuse': grid (3,1,1) is not a whole number of clusters: the kernel declares "
        "cluster dims (2,1,1), so grid.x must be a multiple of 2 (the GPU refuses the launch: "
        "cudaErrorInvalidClusterSize)"
    )


DIMS_SOURCE = """
#include "welder_prelude.cuh"
#include "welder_mma.cuh"
#include "welder_wgmma.cuh"
#include "welder_tma.cuh"
extern "C" __global__ void wide(int* out) { out[blockIdx.x] = welder_cluster_ctarank(); }
WELDER_CLUSTER_DIMS(wide, 16)
extern "C" __global__ void square(int* out) { out[blockIdx.x] = welder_cluster_ctarank(); }
WELDER_CLUSTER_DIMS(square, 2, 2)
"""


def test_cluster_dims_the_emulator_does_not_model_are_refused():
    module = emulated(DIMS_SOURCE, ["wide", "square"])
    for kernel, reason in [
        ("wide", "the kernel declares cluster dims (16,1,1): a cluster has 1 to 8 blocks"),
        ("square", "the kernel declares cluster dims (2,2,1): the emulator supports clusters along x only"),
    ]:
        with pytest.raises(EmulationError, match=re.escape(reason)):
            module.launch(kernel, 32, 32, 0, [np.zeros(32, np.int32)])
