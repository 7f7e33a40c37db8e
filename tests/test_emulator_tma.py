"""The emulator runs welder_tma.cuh -- mbarriers, TMA tile loads and stores through tensor maps,
setmaxnreg -- as the copy engine does: boxes of rank 1-5 land in shared memory in each swizzle mode
with ragged edges zero-filled (compared with tests/tma_reference.py's numpy model of the PTX ISA's
swizzle), stores write such boxes back clipped to the tensor, a wgmma reads TMA-written operands
without a proxy fence, a warp-specialised producer/consumer ring with full/empty mbarriers feeds
wgmma over many k-slices (tests/kernels/tma_ring.cu, against numpy's matmul), and a persistent
epilogue stages each warp's strip in swizzled panels for TMA stores (tests/kernels/tma_store_*.cu).
Misuse is reported, each case naming the mbarrier, load or store at fault.  The same
kernels compile with nvcc for sm_90a and test_gpu_tma.py runs them on a Hopper GPU; so do the
cluster kernels of welder_cluster.cuh (tests/kernels/cluster_*.cu, emulated in
test_emulator_cluster.py).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from cluster_reference import BUGS as CLUSTER_BUGS
from cluster_reference import RING as CLUSTER_RING
from cluster_reference import UNITS as CLUSTER_UNITS
from kernel_fixtures import EMULATOR, emulated
from kernel_fixtures import line_of as kernel_line
from tma_reference import (
    BOX_CASES,
    BUG_KERNELS,
    BUGS,
    CLUSTER_EPILOGUE_CASES,
    EPILOGUE_CASES,
    RING,
    RING_KERNELS,
    RING_SMEM_BYTES,
    RING_THREADS,
    STORE_BOX_CASES,
    STORE_BUG_KERNELS,
    STORE_BUGS,
    STORE_UNIT_KERNELS,
    STORE_UNITS,
    UNIT_KERNELS,
    UNITS,
    BoxCase,
    EpilogueCase,
    assert_gemm_close,
    box_elements,
    gather_box,
    ring_case,
    scatter_box,
    store_box_case,
    swizzle_chunks,
    wgmma_case,
)
from wgmma_reference import swizzled, unpack_d

from welder.codegen.tensor_map import TensorMapArg, TensorMapError, tensor_map_problem
from welder.runtime import emu
from welder.runtime.emu import EmulationError

pytestmark = EMULATOR

SOURCE = "\n".join(p.read_text() for p in (UNITS, BUGS, RING, STORE_UNITS, STORE_BUGS))


def line_of(text: str) -> int:
    return kernel_line(SOURCE, text)


@pytest.fixture(scope="module")
def module() -> emu.EmulatedModule:
    return emulated(
        SOURCE, [*UNIT_KERNELS, *BUG_KERNELS, *RING_KERNELS, *STORE_UNIT_KERNELS, *STORE_BUG_KERNELS]
    )


@pytest.fixture()
def rng() -> np.random.Generator:
    return np.random.default_rng(20250701)


# ------------------------------------------------------------------------------------- the model


@pytest.mark.parametrize("swizzle", [32, 64, 128])
def test_the_swizzle_model_is_the_address_swizzle_wgmma_reads(swizzle):
    # Two descriptions of one pattern: the ISA's span/line wording here, wgmma_reference's
    # address-bit form there.  Also a permutation within each span-aligned segment.
    for start in (0, 128, 384, 1024):
        chunks = swizzle_chunks(start, 2048, swizzle)
        moved = [swizzled(start + 16 * int(c), swizzle) - start for c in range(chunks.size)]
        np.testing.assert_array_equal(16 * chunks, moved)
        assert sorted(chunks.tolist()) == list(range(chunks.size))


# ------------------------------------------------------------------------------------- boxes


@pytest.mark.parametrize("case", BOX_CASES, ids=lambda c: c.name)
def test_tma_boxes_land_swizzled_with_zero_filled_edges(module, rng, case: BoxCase):
    data, spec = case.tensor(rng)
    out = np.full(case.box_bytes, 0xEE, np.uint8)
    module.launch("tma_box", 1, 128, case.smem_bytes, case.args(data, spec, out))
    expected = case.expected(data, spec)
    np.testing.assert_array_equal(out, expected)
    # The test's power: a box over an edge brings zeros, and a swizzled layout is not the linear one.
    if any(c < 0 or c + b > d for c, b, d in zip(case.coords, case.box, spec.dims)):
        assert (gather_box(data, spec, case.coords) == 0).any()
    if case.swizzle:
        assert not np.array_equal(expected, case.expected(data, replace(spec, swizzle=0)))


def test_a_swizzled_box_narrower_than_its_span_is_not_modelled(module, rng):
    case = BOX_CASES[0]  # rows of 48 bytes
    data, spec = case.tensor(rng)
    out = np.zeros(case.box_bytes, np.uint8)
    with pytest.raises(
        EmulationError, match="the box's innermost extent is 48 bytes, less than the 64B swizzle span"
    ):
        module.launch("tma_box", 1, 128, case.smem_bytes, case.args(data, replace(spec, swizzle=64), out))


def test_an_innermost_coordinate_off_16_bytes_is_reported(module, rng):
    # The H100 faults (illegal instruction) on a box starting 6 bytes into a row; -16 bytes is fine.
    case = replace(BOX_CASES[0], coords=(-8, 30))
    data, spec = case.tensor(rng)
    out = np.zeros(case.box_bytes, np.uint8)
    module.launch("tma_box", 1, 128, case.smem_bytes, case.args(data, spec, out))
    np.testing.assert_array_equal(out, case.expected(data, spec))
    case = replace(case, coords=(3, 30))
    expected = "the innermost coordinate 3 starts the box at byte 6 of a row, not a multiple of 16 bytes"
    with pytest.raises(EmulationError, match=expected):
        module.launch("tma_box", 1, 128, case.smem_bytes, case.args(data, spec, out))


def test_a_wgmma_reads_tma_operands_without_a_proxy_fence(module, rng):
    head, expected = wgmma_case(rng)
    out = np.full((128, 4), np.nan, np.float32)
    module.launch("tma_wgmma", 1, 128, 4096, [*head, out])
    np.testing.assert_allclose(unpack_d(out), expected, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------- the ring

RING_CASES = [
    (128, 64, 64),  # one slice
    (128, 64, 512),  # eight slices through four slots: every slot refilled
    (200, 100, 520),  # ragged M, N and K: nine slices, the last one short
    (64, 200, 1040),  # seventeen slices, half-empty row blocks
]


@pytest.mark.parametrize(("m", "n", "k"), RING_CASES)
def test_the_producer_consumer_ring_matches_numpy(module, rng, m, n, k):
    grid, args, c, a, b = ring_case(m, n, k, rng)
    module.launch("tma_ring_gemm", grid, RING_THREADS, RING_SMEM_BYTES, args)
    assert_gemm_close(c, a, b)


# ------------------------------------------------------------------------------------- misuse


def misuse(module, rng, mode: int) -> str:
    a = rng.standard_normal((64, 16)).astype(np.float16)
    b = rng.standard_normal((8, 16)).astype(np.float16)
    spec = TensorMapArg(1, 2, (16, 64), (32,), (16, 64), 32)
    out = np.zeros((128, 4), np.float32)
    args = [spec, a, b, out, np.int32(mode)]
    with pytest.raises(EmulationError) as caught:
        module.launch("tma_misuse", 1, 128, 8192, args)
    return str(caught.value)


LOAD = "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
WGMMA = "wgmma.mma_async.sync.aligned.m64nNk16.f32.f16.f16"
BAR = "mbarrier 'bar' index 0 (byte 0)"


def test_the_misuse_kernel_is_right_when_nothing_is_planted(module, rng):
    a = rng.standard_normal((64, 16)).astype(np.float16)
    b = rng.standard_normal((8, 16)).astype(np.float16)
    out = np.zeros((128, 4), np.float32)
    module.launch(
        "tma_misuse", 1, 128, 8192, [TensorMapArg(1, 2, (16, 64), (32,), (16, 64), 32), a, b, out, -1]
    )
    np.testing.assert_allclose(
        unpack_d(out), a.astype(np.float64) @ b.astype(np.float64).T, rtol=1e-6, atol=1e-6
    )


def test_reading_a_tma_destination_before_the_wait_is_reported(module, rng):
    message = misuse(module, rng, 0)
    load = line_of("welder_tma_load_2d(tile_a, &map, bar, 0, 0);\n    if (mode == 2)")
    assert message.endswith(
        "thread 0 (0,0,0): read of a TMA destination before the wait on its mbarrier: shared view "
        "'tile_a' index 3 "
        f"is written by the {LOAD} at kernel.cu:{load} that thread 0 (0,0,0) issued, completing on "
        f"{BAR}, and no "
        "thread has waited on that mbarrier since"
    ), message


def test_a_wgmma_over_a_pending_tma_destination_is_reported(module, rng):
    message = misuse(module, rng, 1)
    site = line_of("welder_wgmma_m64k16_f16f32<8, 0, 0>(d, desc_a, desc_b, 0);")
    assert re.search(
        rf"thread 0 \(0,0,0\): {re.escape(WGMMA)} at kernel\.cu:{site} reads shared address 0x800 "
        rf"\(byte 1024 of "
        rf"the dynamic buffer\), the destination of the {re.escape(LOAD)} at kernel\.cu:\d+ that "
        rf"thread 0 \(0,0,0\) "
        rf"issued, completing on {re.escape(BAR)}, on which no thread has waited yet",
        message,
    ), message


def test_an_arrival_beyond_the_expected_count_is_reported(module, rng):
    message = misuse(module, rng, 2)
    site = line_of("if (mode == 2) welder_mbarrier_arrive(bar);")
    assert message.endswith(
        f"thread 0 (0,0,0): mbarrier.arrive.shared::cta.b64 at kernel.cu:{site}: arrival beyond the "
        f"expected count "
        f"on {BAR}: its phase 0 already has all 1 arrivals and waits only for 2048 transaction bytes"
    ), message


def test_a_deadlock_on_an_mbarrier_names_it(module, rng):
    message = misuse(module, rng, 3)
    site = line_of("if (mode != 1) welder_mbarrier_wait(bar, 0);")
    assert message.endswith(
        "deadlock: every thread is blocked and no mbarrier phase they wait for can complete: "
        "threads 0-127 wait "
        f"at mbarrier.try_wait.parity.shared::cta.b64 (kernel.cu:{site}) on {BAR} for the phase of parity 0 "
        "(phase 0 in progress: 1 of 2 arrivals and 0 transaction bytes pending)"
    ), message


def test_a_negative_transaction_count_is_reported(module, rng):
    message = misuse(module, rng, 4)
    assert re.search(
        rf"the 2048 bytes of the {re.escape(LOAD)} at kernel\.cu:\d+ \(thread 0 \(0,0,0\)\) take "
        rf"the transaction "
        rf"count of {re.escape(BAR)} below zero \(-1024\)",
        message,
    ), message


def test_a_load_needs_the_init_fence(module, rng):
    message = misuse(module, rng, 5)
    assert (
        f"whose init (thread 0 (0,0,0) at kernel.cu:{line_of('welder_mbarrier_init(bar, mode == 3')})"
        in message
    )
    assert "no fence.mbarrier_init (welder_mbarrier_init_fence)" in message


def test_exiting_with_a_load_in_flight_is_reported(module, rng):
    message = misuse(module, rng, 6)
    assert "every thread exited with the " + LOAD in message, message
    assert "(no thread waited on that mbarrier after the load was issued)" in message


def test_using_an_mbarrier_before_its_init_is_visible_is_reported(module, rng):
    message = misuse(module, rng, 7)
    assert (
        f"thread 1 (1,0,0): mbarrier.arrive.shared::cta.b64 at "
        f"kernel.cu:{line_of('if (mode == 7')}: {BAR} was " in (message)
    ), message
    assert "with no __syncthreads since" in message


def test_plain_accesses_of_an_mbarrier_are_reported(module, rng):
    message = misuse(module, rng, 8)
    assert message.endswith(
        f"thread 2 (2,0,0): write of an mbarrier object: shared view 'bar_bytes' index 0 is part of {BAR} "
        f"(initialised at kernel.cu:{line_of('welder_mbarrier_init(bar, mode == 3')}); only the "
        f"welder_mbarrier_* "
        "calls may use those bytes"
    ), message


def test_a_misaligned_destination_is_reported(module, rng):
    message = misuse(module, rng, 9)
    assert (
        "the destination, shared view 'tile_a' index 0 (shared address 0x840), is not 128-byte aligned"
        in message
    )


def test_setmaxnreg_needs_the_whole_warpgroup(module, rng):
    message = misuse(module, rng, 10)
    site = line_of("welder_setmaxnreg_dec<40>();")
    assert (
        f"setmaxnreg.dec.sync.aligned.u32 at kernel.cu:{site} (warpgroup 0, threads 0-127) cannot "
        f"complete: every "
        "thread of the warpgroup must reach it; threads 0-63 arrived; threads 64-127 wait at __syncthreads"
    ) in message, message


def test_plain_stores_still_need_the_proxy_fence_beside_tma(module, rng):
    # A came by TMA (no fence needed), B by st.shared without fence.proxy.async: B is reported.
    message = misuse(module, rng, 11)
    assert re.search(
        r"reads shared address 0x1800 \(byte 5120 of the dynamic buffer\), which thread \d+ "
        r"\(\d+,0,0\) wrote "
        r"through the generic proxy without a fence\.proxy\.async",
        message,
    ), message


def test_a_load_into_operands_of_a_wgmma_in_flight_is_reported(module, rng):
    message = misuse(module, rng, 12)
    assert "shared memory read by an in-flight wgmma written before wgmma.wait_group: " + LOAD in message, (
        message
    )


# ------------------------------------------------------------------------------------- stores


@pytest.mark.parametrize("case", STORE_BOX_CASES, ids=lambda c: c.name)
def test_tma_stores_write_their_swizzled_box_clipped_to_the_tensor(module, rng, case: BoxCase):
    args, tensor, expected = store_box_case(case, rng)
    before, image = tensor.copy(), args[2]
    module.launch("tma_store_box", 1, 128, case.smem_bytes, args)
    np.testing.assert_array_equal(tensor, expected)
    # The test's power: the store changes the tensor; a box over an edge has elements to drop
    # (written anyway, they would land in the NaN padding, in other rows or outside the array);
    # and a store that read the swizzled image linearly would write other values.
    assert not np.array_equal(expected, before)
    spec = args[0]
    if any(c < 0 or c + b > d for c, b, d in zip(case.coords, case.box, spec.dims)):
        assert not box_elements(spec, case.coords)[0].all()
    if case.swizzle:
        assert not np.array_equal(expected, scatter_box(before, spec, case.coords, image))


def test_a_store_box_starting_before_the_tensor_is_reported(module, rng):
    # Loads may start before the tensor; on an H100 such a store is an illegal instruction.
    case = STORE_BOX_CASES[2]
    args, tensor, _ = store_box_case(case, rng)
    before = tensor.copy()
    args[7] = np.int32(-5)  # the outer coordinate of 2d-64B as its load case has it
    expected = r"coordinate -5 \(dimension 1, innermost first\) starts the box before the tensor"
    with pytest.raises(EmulationError, match=expected):
        module.launch("tma_store_box", 1, 128, case.smem_bytes, args)
    np.testing.assert_array_equal(tensor, before)


def test_a_store_writes_rows_in_whole_16_byte_units(module, rng):
    # 50 fp32 columns end 8 bytes into a 16-byte unit: the store writes columns 50 and 51 too
    # (into the row padding, as the H100 does), which an exact clip would leave NaN.
    case = next(c for c in STORE_BOX_CASES if c.name == "2d-128B-fp32")
    args, tensor, expected = store_box_case(case, rng)
    module.launch("tma_store_box", 1, 128, case.smem_bytes, args)
    np.testing.assert_array_equal(tensor, expected)
    rows = tensor.view(np.float32).reshape(case.shape[0], case.pitch)
    written = rows[case.coords[1] : case.shape[0], 50:52]
    assert np.isfinite(written).all() and written.size


def test_a_store_unit_past_the_end_of_its_buffer_is_reported(module, rng):
    # A tensor of 10 fp16 ends 4 bytes into its second unit: the store would write past the array.
    case = BoxCase("1d-short", 2, (10,), 10, (16,), 0, (0,))
    data, spec = case.tensor(rng)
    image = np.zeros(case.box_bytes, np.uint8)
    args = case.args(data.view(np.uint8).reshape(-1), spec, image)
    with pytest.raises(EmulationError, match="beyond the end of argument 1"):
        module.launch("tma_store_box", 1, 128, case.smem_bytes, args)


@pytest.mark.parametrize("threads", [1, 40])
def test_a_store_works_from_blocks_of_any_size(module, rng, threads):
    case = BOX_CASES[3]  # 2d-128B, ragged at the bottom
    args, tensor, expected = store_box_case(case, rng)
    module.launch("tma_store_box", 1, threads, case.smem_bytes, args)
    np.testing.assert_array_equal(tensor, expected)


def run_epilogue(module, rng, kernel: str, case: EpilogueCase, **options) -> None:
    args, c, expected = case.arrays(rng)
    module.launch(kernel, case.grid, 32 * case.warps, case.smem_bytes, args, **options)
    # NaN padding compares equal to itself: a clipped element written anyway would show.
    np.testing.assert_array_equal(c, expected)


@pytest.mark.parametrize("case", EPILOGUE_CASES, ids=str)
def test_the_staged_epilogue_matches_numpy(module, rng, case: EpilogueCase):
    run_epilogue(module, rng, "tma_store_epilogue", case)


@pytest.mark.parametrize("case", CLUSTER_EPILOGUE_CASES, ids=str)
def test_the_staged_epilogue_runs_in_clusters(module, rng, case: EpilogueCase):
    run_epilogue(module, rng, "tma_store_epilogue_cluster", case)


def test_the_staged_epilogue_runs_without_race_checks(module, rng):
    run_epilogue(module, rng, "tma_store_epilogue", EPILOGUE_CASES[1], check_races=False)


def store_misuse(module, rng, mode: int, readonly: bool = False) -> str:
    x = rng.standard_normal((32, 64)).astype(np.float32)
    c = np.zeros((32, 64), np.float16)
    c.flags.writeable = not readonly
    spec = TensorMapArg(1, 2, (64, 32), (128,), (64, 16), 128)
    with pytest.raises(EmulationError) as caught:
        module.launch("tma_store_misuse", 1, 32, 4096, [x, c, spec, np.int32(mode)])
    return str(caught.value)


STORE = "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group"
STORE_MAP = (
    "through the tensor map (rank 2, 2-byte elements, dims [64, 32], strides [2, 128] bytes, "
    "box [64, 16], swizzle 128B)"
)
STORE_SITE = "welder_tma_store_2d(&map, panel, c0, 16 * round);"


def test_the_store_misuse_kernel_is_right_when_nothing_is_planted(module, rng):
    x = rng.standard_normal((32, 64)).astype(np.float32)
    c = np.zeros((32, 64), np.float16)
    spec = TensorMapArg(1, 2, (64, 32), (128,), (64, 16), 128)
    module.launch("tma_store_misuse", 1, 32, 4096, [x, c, spec, np.int32(-1)])
    np.testing.assert_array_equal(c, (2 * x + 1).astype(np.float16))


def test_a_store_of_unfenced_writes_names_the_writer(module, rng):
    message = store_misuse(module, rng, 0)
    assert message.endswith(
        f"thread 0 (0,0,0): {STORE} at kernel.cu:{line_of(STORE_SITE)} {STORE_MAP} reads shared view "
        "'panel' index 1 (byte 4), which thread 1 (1,0,0) wrote through the generic proxy with no "
        "fence.proxy.async (welder_fence_proxy_async) of that thread after the write, so the copy "
        "engine may not see it"
    ), message


def test_a_store_needs_a_syncwarp_after_the_other_lanes_fences(module, rng):
    message = store_misuse(module, rng, 1)
    assert message.endswith(
        f"thread 0 (0,0,0): {STORE} at kernel.cu:{line_of(STORE_SITE)} {STORE_MAP} reads shared view "
        "'panel' index 1 (byte 4), which thread 1 (1,0,0) wrote and then fenced (fence.proxy.async), "
        "but no __syncwarp naming both threads or __syncthreads lies between that fence and the "
        "store (since the block started)"
    ), message


@pytest.mark.parametrize(
    ("mode", "open_group"),
    [(2, ""), (11, ""), (12, " (its bulk group is still open: no cp.async.bulk.commit_group since)")],
    ids=["no wait", "a wait leaving the group", "never committed"],
)
def test_overwriting_a_store_source_before_the_wait_is_reported(module, rng, mode, open_group):
    message = store_misuse(module, rng, mode)
    assert message.endswith(
        "thread 0 (0,0,0): shared memory read by a bulk store in flight written before "
        "cp.async.bulk.wait_group.read: a write of shared view 'panel' index 0 (byte 0), which the "
        f"{STORE} at kernel.cu:{line_of(STORE_SITE)} that thread 0 (0,0,0) issued reads, and no "
        "cp.async.bulk.wait_group.read (welder_tma_store_wait_read) of that thread has covered it "
        f"yet{open_group}"
    ), message


def test_exiting_before_a_store_read_its_source_is_reported(module, rng):
    message = store_misuse(module, rng, 3)
    assert message.endswith(
        f"thread 0 (0,0,0): exits with a bulk tensor store whose shared source it has not waited for "
        f"(the {STORE} at kernel.cu:{line_of(STORE_SITE)}, from shared view 'panel' index 0): a "
        "cp.async.bulk.wait_group.read 0 (welder_tma_store_wait_read<0>) must cover every bulk group "
        "first, as the block's shared memory may be reused once its threads exit"
    ), message


def test_a_store_never_committed_is_never_waited_for(module, rng):
    message = store_misuse(module, rng, 7)
    assert message.endswith(
        f"thread 0 (0,0,0): exits with a bulk tensor store whose shared source it has not waited for "
        f"(the {STORE} at kernel.cu:{line_of(STORE_SITE)}, from shared view 'panel' index 0, never "
        "committed): a cp.async.bulk.wait_group.read 0 (welder_tma_store_wait_read<0>) must cover every "
        "bulk group first, as the block's shared memory may be reused once its threads exit"
    ), message


def test_a_misaligned_store_source_is_reported(module, rng):
    message = store_misuse(module, rng, 4)
    assert message.endswith(
        f"thread 0 (0,0,0): {STORE} at kernel.cu:{line_of(STORE_SITE)}: the source, shared view 'panel' "
        "index 0 (shared address 0x480), is not 1024-byte aligned (the 128B swizzle's pattern spans "
        "1024 bytes)"
    ), message


def test_a_store_whose_innermost_coordinate_is_off_16_bytes_is_reported(module, rng):
    message = store_misuse(module, rng, 5)
    assert message.endswith(
        f"thread 0 (0,0,0): {STORE} at kernel.cu:{line_of(STORE_SITE)}: the innermost coordinate 4 "
        "starts the box at byte 8 of a row, not a multiple of 16 bytes (as for a load, which on an "
        "H100 is an illegal instruction)"
    ), message


def test_a_store_through_a_map_of_a_read_only_argument_is_reported(module, rng):
    message = store_misuse(module, rng, -1, readonly=True)
    assert message.endswith(
        f"thread 0 (0,0,0): {STORE} at kernel.cu:{line_of(STORE_SITE)} {STORE_MAP}: the tensor map "
        "points into argument 1 (float16*), a read-only buffer: the store would change it"
    ), message


def test_rewriting_a_store_source_needs_a_syncwarp_after_the_wait(module, rng):
    message = store_misuse(module, rng, 6)
    assert message.endswith(
        "thread 1 (1,0,0): data race on shared view 'panel' index 1: thread 1 (1,0,0) writes it, but "
        "thread 0 (0,0,0) read it with no barrier in between (since the block started)"
    ), message


def test_a_store_of_unwritten_elements_is_reported(module, rng):
    message = store_misuse(module, rng, 8)
    assert message.endswith(
        f"{STORE_MAP} reads shared view 'panel' index 256 (byte 1024), which no thread of this block "
        "has written, for the box's element [0, 8], inside the tensor at [0, 8] (innermost first)"
    ), message


def test_a_store_from_a_pending_cp_async_destination_is_reported(module, rng):
    message = store_misuse(module, rng, 9)
    assert message.endswith(
        f"{STORE_MAP}: the source, shared view 'panel' index 0 (byte 0), is the destination of the "
        f"cp.async.cg.shared.global 16 at kernel.cu:{line_of('welder_cp_async<16>(panel, x);')} that "
        "thread 0 (0,0,0) issued and has not waited for"
    ), message


def test_a_tma_load_into_a_store_source_in_flight_is_reported(module, rng):
    message = store_misuse(module, rng, 10)
    assert (
        "shared memory read by a bulk store in flight written before cp.async.bulk.wait_group.read: "
        f"{LOAD} at kernel.cu:{line_of('welder_tma_load_2d(panel, &map, bar, 0, 16);')} into shared "
        f"view 'panel' index 0 (byte 0), which the {STORE} at kernel.cu:{line_of(STORE_SITE)} that "
        "thread 0 (0,0,0) issued reads"
    ) in message, message


# ------------------------------------------------------------------------------------- encoding

BASE = 0x10000
GOOD = [
    TensorMapArg(0, 2, (64, 100), (128,), (64, 32), 128),
    TensorMapArg(0, 4, (7,), (), (4,), 0),
    TensorMapArg(0, 2, (16, 3, 3, 3, 3), (32, 96, 288, 864), (16, 1, 2, 3, 1), 32),
    TensorMapArg(0, 4, (2**32, 2), (2**40 - 16,), (256, 256), 0),
]
BAD = [
    (TensorMapArg(0, 8, (64,), (), (16,), 0), BASE, "element size must be 2 or 4"),
    (TensorMapArg(0, 2, (2,) * 6, (32,) * 5, (8,) * 6, 0), BASE, "rank must be 1 to 5"),
    (TensorMapArg(0, 2, (64, 4), (128,), (64, 4), 0), BASE + 8, "16-byte aligned"),
    (TensorMapArg(0, 2, (64, 4), (128,), (64, 4), 0), 0, "null"),
    (TensorMapArg(0, 2, (0, 4), (128,), (8, 4), 0), BASE, "dimension"),
    (TensorMapArg(0, 2, (2**32 + 1, 4), (128,), (8, 4), 0), BASE, "dimension"),
    (TensorMapArg(0, 2, (64, 4), (136,), (64, 4), 0), BASE, "stride"),
    (TensorMapArg(0, 2, (64, 4), (2**40,), (64, 4), 0), BASE, "stride"),
    (TensorMapArg(0, 2, (64, 4), (128,), (64, 0), 0), BASE, "box dimension"),
    (TensorMapArg(0, 2, (512, 4), (1024,), (264, 4), 0), BASE, "box dimension"),
    (TensorMapArg(0, 2, (64, 4), (128,), (12, 4), 0), BASE, "multiple of 16"),
    (TensorMapArg(0, 2, (64, 4), (128,), (64, 4), 16), BASE, "swizzle must be"),
    (TensorMapArg(0, 2, (64, 4), (128,), (64, 4), 64), BASE, "swizzle span"),
    (TensorMapArg(0, 4, (64, 4), (256,), (16, 4), 32), BASE, "swizzle span"),
]


@pytest.mark.parametrize("spec", GOOD)
def test_the_encode_accepts_what_the_driver_accepts(module, spec):
    assert tensor_map_problem(spec, BASE) is None
    assert len(module.encode_tensor_map(spec, BASE)) == 128


@pytest.mark.parametrize(("spec", "base", "reason"), BAD)
def test_the_encode_refuses_bad_arguments_like_the_driver(module, spec, base, reason):
    # The emulator's C++ encode and the Python check (used before the GPU driver) agree.
    with pytest.raises(TensorMapError) as caught:
        module.encode_tensor_map(spec, base)
    assert reason in str(caught.value), str(caught.value)
    problem = tensor_map_problem(spec, base)
    assert problem is not None and reason in problem, problem


def test_a_map_past_its_array_or_over_a_non_array_is_refused(module, rng):
    case = BOX_CASES[0]
    data, spec = case.tensor(rng)
    out = np.zeros(case.box_bytes, np.uint8)
    too_big = replace(spec, dims=(spec.dims[0], spec.dims[1] + 1))
    with pytest.raises(
        EmulationError, match=r"argument 0 \(tensormap\): the map covers \d+ bytes but argument 1"
    ):
        module.launch("tma_box", 1, 128, case.smem_bytes, case.args(data, too_big, out))
    on_output = replace(spec, pointer=3)
    with pytest.raises(EmulationError, match="its pointer argument 3 is not an array argument"):
        module.launch("tma_box", 1, 128, case.smem_bytes, case.args(data, on_output, out))
    bad = replace(spec, swizzle=32)  # rows of 48 bytes exceed the span
    with pytest.raises(EmulationError, match="swizzle span"):
        module.launch("tma_box", 1, 128, case.smem_bytes, case.args(data, bad, out))


# ------------------------------------------------------------------------------------- nvcc


@pytest.fixture(scope="module")
def nvcc() -> str:
    path = shutil.which("nvcc")
    if path is None:
        pytest.skip("nvcc is not on PATH")
    return path


#: Every multicast rank and both cluster calls, beside the cluster kernels (which multicast 2D only).
MULTICAST_RANKS = """
#include "welder_prelude.cuh"
#include "welder_mma.cuh"
#include "welder_wgmma.cuh"
#include "welder_tma.cuh"
extern "C" __global__ void __cluster_dims__(2, 1, 1)
    multicast_ranks(const __grid_constant__ CUtensorMap map, int c) {
  WELDER_SMEM_BEGIN;
  WELDER_SHARED(uint64_t, bar, 0, 1);
  WELDER_SHARED(unsigned char, tile, 1024, 1024);
  welder_tma_load_1d_multicast(tile, &map, bar, 0x3, c);
  welder_tma_load_2d_multicast(tile, &map, bar, 0x3, c, c);
  welder_tma_load_3d_multicast(tile, &map, bar, 0x3, c, c, c);
  welder_tma_load_4d_multicast(tile, &map, bar, 0x3, c, c, c, c);
  welder_tma_load_5d_multicast(tile, &map, bar, 0x3, c, c, c, c, c);
}
WELDER_CLUSTER_DIMS(multicast_ranks, 2)
"""


def test_kernels_compile_with_nvcc_to_tma(nvcc, tmp_path: Path):
    source = tmp_path / "tma_kernels.cu"
    source.write_text(SOURCE)
    common = [nvcc, "-std=c++17", "-Werror", "all-warnings", "-I", str(emu.PRELUDE_DIR), str(source)]
    ring = tmp_path / "tma_ring.cu"
    ring.write_text(RING.read_text())
    cluster = tmp_path / "cluster_kernels.cu"
    cluster.write_text("\n".join(p.read_text() for p in (CLUSTER_UNITS, CLUSTER_BUGS, CLUSTER_RING)))
    ranks = tmp_path / "multicast_ranks.cu"
    ranks.write_text(MULTICAST_RANKS)
    commands = {
        "cubin": [*common, "-arch=sm_90a", "-cubin", "-o", str(tmp_path / "k.cubin")],
        "ptx": [*common, "-arch=sm_90a", "-ptx", "-o", str(tmp_path / "k.ptx")],
        "ring": [*common[:-1], str(ring), "-arch=sm_90a", "-cubin", "-o", str(tmp_path / "ring.cubin")],
        "cluster": [*common[:-1], str(cluster), "-arch=sm_90a", "-cubin", "-o", str(tmp_path / "c.cubin")],
        "cluster-ptx": [*common[:-1], str(cluster), "-arch=sm_90a", "-ptx", "-o", str(tmp_path / "c.ptx")],
        "ranks": [*common[:-1], str(ranks), "-arch=sm_90a", "-ptx", "-o", str(tmp_path / "r.ptx")],
    }
    with ThreadPoolExecutor(len(commands)) as pool:
        runs = pool.map(lambda c: subprocess.run(c, capture_output=True, text=True), commands.values())
        results = dict(zip(commands, runs))
    for what, result in results.items():
        # ptxas notes that the misuse kernel's setmaxnreg is ignored (info C7508), nothing else.
        noise = [ln for ln in result.stderr.splitlines() if ln.strip() and not ln.startswith("ptxas info")]
        assert result.returncode == 0 and not noise, f"{what}:\n{result.stderr}"
    # In the ring setmaxnreg takes effect: its launch bounds fix the register count at entry.
    assert "setmaxnreg" not in results["ring"].stderr, results["ring"].stderr
    ptx = (tmp_path / "k.ptx").read_text()
    for n in range(1, 6):
        assert f"cp.async.bulk.tensor.{n}d.shared::cluster.global.tile.mbarrier::complete_tx::bytes" in ptx, n
        assert f"cp.async.bulk.tensor.{n}d.global.shared::cta.bulk_group [" in ptx, n
    for instruction in [
        "cp.async.bulk.commit_group;",
        "cp.async.bulk.wait_group.read 0;",
        "cp.async.bulk.wait_group.read 1;",
        "cp.async.bulk.wait_group 0;",
        "fence.proxy.async.shared::cta;",
        "mbarrier.init.shared::cta.b64",
        "fence.mbarrier_init.release.cluster",
        "mbarrier.arrive.shared::cta.b64",
        "mbarrier.arrive.expect_tx.shared::cta.b64",
        "mbarrier.try_wait.parity.shared::cta.b64",
        "prefetch.tensormap",
        "setmaxnreg.inc.sync.aligned.u32 232",
        "setmaxnreg.dec.sync.aligned.u32 40",
    ]:
        assert instruction in ptx, instruction
    # The cluster kernels: their cluster dims (__cluster_dims__) and each instruction of
    # welder_cluster.cuh; the multicast load in every rank.
    assert "setmaxnreg" not in results["cluster"].stderr, results["cluster"].stderr
    cluster_ptx = (tmp_path / "c.ptx").read_text()
    for instruction in [
        ".reqnctapercluster 2, 1, 1",
        ".reqnctapercluster 4, 1, 1",
        "%cluster_ctarank",
        "barrier.cluster.arrive.release.aligned",
        "barrier.cluster.wait.acquire.aligned",
        "mapa.shared::cluster.u32",
        "mbarrier.arrive.release.cluster.shared::cluster.b64 _,",
    ]:
        assert instruction in cluster_ptx, instruction
    ranks_ptx = (tmp_path / "r.ptx").read_text()
    for n in range(1, 6):
        multicast = (
            f"cp.async.bulk.tensor.{n}d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
            ".multicast::cluster"
        )
        assert multicast in ranks_ptx, n


def test_the_host_encode_compiles_for_the_runtime(nvcc, tmp_path: Path):
    # welder_encode_tensor_map in host code: found through the runtime, nothing links -lcuda.
    source = tmp_path / "host.cu"
    source.write_text(
        '#include "welder_prelude.cuh"\n#include "welder_mma.cuh"\n#include "welder_wgmma.cuh"\n'
        '#include "welder_tma.cuh"\n#include <cstdio>\n'
        "int main() {\n"
        "  void* base = nullptr;\n"
        "  if (cudaMalloc(&base, 1 << 16) != cudaSuccess) base = reinterpret_cast<void*>(0x10000);\n"
        "  alignas(64) CUtensorMap map;\n"
        "  unsigned long long dims[2] = {64, 64}, strides[1] = {128};\n"
        "  unsigned box[2] = {64, 8};\n"
        "  const int good = welder_encode_tensor_map(&map, 2, 2, base, dims, strides, box, 128);\n"
        "  const int wide = welder_encode_tensor_map(&map, 2, 2, base, dims, strides, box, 64);\n"
        "  const int null = welder_encode_tensor_map(&map, 2, 2, nullptr, dims, strides, box, 128);\n"
        '  std::printf("%d %d %d\\n", good, wide, null);\n}\n'
    )
    result = subprocess.run(
        [
            nvcc,
            "-std=c++17",
            "-gencode=arch=compute_90a,code=sm_90a",
            "-I",
            str(emu.PRELUDE_DIR),
            str(source),
            "-o",
            str(tmp_path / "host"),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    libraries = subprocess.run(["ldd", str(tmp_path / "host")], capture_output=True, text=True).stdout
    assert "libcuda.so" not in libraries, libraries
    # With a GPU the driver encodes (0); without one it cannot be found (11).  The rules refuse
    # the box wider than the 64B swizzle (10) and the null address (1) either way.
    run = subprocess.run([str(tmp_path / "host")], capture_output=True, text=True, timeout=60)
    good, wide, null = run.stdout.split()
    assert (wide, null) == ("10", "1")
    assert good in ("0", "11"), run.stdout
