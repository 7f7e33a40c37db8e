"""The emulator runs welder_mma.cuh -- mma.sync, ldmatrix, cp.async -- with the register layouts of
the PTX ISA, and a complete tensor-core GEMM (tests/kernels/mma_gemm.cu) on ragged and split-K
shapes; misuse is reported.  Expectations come from tests/mma_reference.py (numpy, written from
the ISA's fragment tables); the same kernels compile with nvcc for sm_80 and sm_90, and
test_gpu_mma.py runs them on a GPU against the same expectations.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from kernel_fixtures import EMULATOR, emulated
from kernel_fixtures import line_of as kernel_line
from mma_reference import (
    BUGS,
    GEMM,
    GEMM_KERNELS,
    GEMM_SMEM_BYTES,
    GEMM_THREADS,
    LDMATRIX_MODES,
    UNIT_KERNELS,
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

from welder.runtime import emu
from welder.runtime.emu import EmulationError

pytestmark = EMULATOR

BUG_KERNELS = [
    "cp_async_peek",
    "cp_async_exit_pending",
    "cp_async_no_wait",
    "cp_async_wait_no_barrier",
    "cp_async_refill_race",
    "cp_async_misuse",
    "mma_misuse",
]
# One translation unit, so one g++ run: the three fixture files (their includes are guarded).
SOURCE = "\n".join(p.read_text() for p in (UNITS, BUGS, GEMM))


def line_of(text: str) -> int:
    return kernel_line(SOURCE, text)


@pytest.fixture(scope="module")
def module() -> emu.EmulatedModule:
    return emulated(SOURCE, UNIT_KERNELS + BUG_KERNELS + GEMM_KERNELS)


@pytest.fixture()
def rng() -> np.random.Generator:
    return np.random.default_rng(20250611)


def launch_error(module: emu.EmulatedModule, *launch_args, **options) -> str:
    with pytest.raises(EmulationError) as caught:
        module.launch(*launch_args, **options)
    return str(caught.value)


# ------------------------------------------------------------------------------------- mma.sync


@pytest.mark.parametrize("kind", ["f16", "bf16", "tf32"])
def test_mma_registers_follow_the_isa_layout(module, rng, kind):
    # 4 warps in 2 blocks, each its own problem.  Products of the operands are exact and the
    # emulator rounds each k-step's sum once, so D matches float64 to float32 rounding.
    case = mma_case(kind, 4, rng)
    d = np.full((128, 4), np.nan, np.float32)
    module.launch("mma_fragments", 2, 64, 0, [case.a, case.b, case.c, d, case.kind_code])
    np.testing.assert_allclose(mma_result(case, d), case.expected, rtol=1e-6, atol=1e-6)


def test_tf32_operands_ignore_the_low_mantissa_bits(module, rng):
    # Raw fp32 operands: the reference truncates them to tf32, as the tensor core reads them.
    case = mma_case("tf32", 1, rng, tf32_rounded=False)
    d = np.full((32, 4), np.nan, np.float32)
    module.launch("mma_fragments", 1, 32, 0, [case.a, case.b, case.c, d, case.kind_code])
    np.testing.assert_allclose(mma_result(case, d), case.expected, rtol=1e-6, atol=1e-6)


def test_float_to_tf32_rounds_to_nearest_ties_away(module, rng):
    x = rng.standard_normal(1000).astype(np.float32)
    bits = x.view(np.uint32)
    bits[:100] = (bits[:100] & np.uint32(0xFFFFE000)) | np.uint32(0x1000)  # exact ties
    y = np.zeros(1000, np.uint32)
    module.launch("to_tf32", 4, 256, 0, [x, y, x.size])
    np.testing.assert_array_equal(y.view(np.float32), tf32_round(x))


# ------------------------------------------------------------------------------------- ldmatrix


@pytest.mark.parametrize(("matrices", "trans"), sorted(LDMATRIX_MODES))
def test_ldmatrix_registers_follow_the_isa_layout(module, rng, matrices, trans):
    count = 64 * 16
    tile = rng.permutation(count).astype(np.uint16)  # every element distinct
    # Lanes past 8 * matrices pass addresses far outside the view: ldmatrix ignores them.
    offsets = ldmatrix_offsets(count, matrices, 2, rng, unused=1 << 20)
    out = np.full((64, 4), 0xDEADBEEF, np.uint32)
    module.launch(
        "ldmatrix_fragments", 1, 64, 2 * count, [tile, count, offsets, out, LDMATRIX_MODES[matrices, trans]]
    )
    np.testing.assert_array_equal(out, ldmatrix_expected(tile, offsets, matrices, trans))


def test_ldmatrix_needs_every_lane(module):
    tile, out = np.zeros(256, np.uint16), np.zeros(32, np.float32)
    message = launch_error(module, "mma_misuse", 1, 32, 512, [tile, out, 0])
    site = line_of("welder_ldmatrix_x4(a, s + row * 16")
    assert (
        f"ldmatrix.sync.aligned.m8n8.x4.shared.b16 at kernel.cu:{site} (warp 0, mask 0xffffffff) cannot "
        "complete: lanes 0-30 arrived; lane 31 have exited" in message
    ), message


def test_ldmatrix_row_addresses_must_be_16_byte_aligned(module):
    tile, out = np.zeros(256, np.uint16), np.zeros(32, np.float32)
    message = launch_error(module, "mma_misuse", 1, 32, 512, [tile, out, 1])
    site = line_of("welder_ldmatrix_x4(a, s + row * 16")
    assert message.endswith(
        f"thread 0 (0,0,0): ldmatrix.sync.aligned.m8n8.x4.shared.b16 at kernel.cu:{site}: the row address, "
        "shared view 's' index 4 (byte 8), is not 16-byte aligned"
    ), message


def test_ldmatrix_rows_must_lie_in_the_view(module):
    tile, out = np.zeros(256, np.uint16), np.zeros(32, np.float32)
    message = launch_error(module, "mma_misuse", 1, 32, 512, [tile, out, 2])
    assert message.endswith(
        "thread 8 (8,0,0): a 16-byte access at index 256 of shared view 's' is out of bounds (count 256, "
        "2-byte elements)"
    ), message


def test_mma_needs_every_lane(module):
    tile, out = np.zeros(256, np.uint16), np.zeros(48, np.float32)
    message = launch_error(module, "mma_misuse", 1, 32, 512, [tile, out, 3])
    site = line_of("welder_mma_m16n8k16_f16f32(acc, a, b, acc);\n  out[threadIdx.x]")
    assert f"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 at kernel.cu:{site} (warp 0" in message, (
        message
    )
    assert "lane 31 have exited" in message
    message = launch_error(module, "mma_misuse", 1, 48, 512, [tile, out, 4])
    assert f"at kernel.cu:{site} needs a full warp, but warp 1 has only 16 threads" in message, message


# ------------------------------------------------------------------------------------- cp.async


def test_cp_async_zero_fills_past_src_bytes(module, rng):
    threads = 64
    src = rng.integers(1, 256, 32 * threads).astype(np.uint8)  # no zero bytes: zero-fill shows
    sizes = zero_fill_sizes(threads, rng)
    out = np.full(28 * threads, 0xAB, np.uint8)
    module.launch("cp_async_zero_fill", 1, threads, 32 * threads, [src, sizes, out])
    np.testing.assert_array_equal(out, zero_fill_expected(src, sizes))


def test_cp_async_pipeline_stages_complete_in_order(module, rng):
    threads = 64
    src = rng.standard_normal(3 * threads * 4).astype(np.float32)
    out = np.full(3 * threads * 4, np.nan, np.float32)
    module.launch("cp_async_stages", 1, threads, 3 * threads * 16, [src, out])
    neighbour = (np.arange(threads) + 1) % threads
    expected = src.reshape(3, threads, 4)[:, neighbour]
    np.testing.assert_array_equal(out.reshape(3, threads, 4), expected)


def test_cp_async_lands_when_a_wait_covers_its_group(module, rng):
    # Race checks off, so the slots can be read while copies are in flight: after wait_group 2, 1
    # and 0 exactly the first 1, 2, 3 committed groups have landed; the uncommitted fourth copy
    # lands only with wait_all (which commits first).  Unlanded slots read as fresh shared memory.
    threads = 32
    src = rng.standard_normal(4 * threads * 4).astype(np.float32)
    out = np.zeros(4 * 4 * threads * 4, np.float32)
    module.launch("cp_async_peek", 1, threads, 4 * threads * 16, [src, out], check_races=False)
    landed = out.reshape(4, 4, threads, 4)
    stale = np.full((threads, 4), 0xFFFFFFFF, np.uint32).view(np.float32)
    for step in range(4):
        for slot in range(4):
            expected = src.reshape(4, threads, 4)[slot] if slot <= step else stale
            np.testing.assert_array_equal(landed[step, slot].view(np.uint32), expected.view(np.uint32))


IN_FLIGHT = "read of cp.async destination before cp.async.wait_group"


def test_reading_a_copy_in_flight_is_reported(module, rng):
    src, out = rng.standard_normal(4 * 32 * 4).astype(np.float32), np.zeros(4 * 4 * 32 * 4, np.float32)
    message = launch_error(module, "cp_async_peek", 1, 32, 4 * 32 * 16, [src, out])
    site = line_of("welder_cp_async<16>(slot + (s * n + t) * 4")
    assert message.endswith(
        f"thread 0 (0,0,0): {IN_FLIGHT}: shared view 'slot' index 128 is written by the "
        f"cp.async.cg.shared.global 16 at kernel.cu:{site} that thread 0 (0,0,0) issued and has not "
        "waited for"
    ), message


def test_a_barrier_does_not_complete_copies(module, rng):
    src, out = rng.standard_normal(256).astype(np.float32), np.zeros(64, np.float32)
    message = launch_error(module, "cp_async_no_wait", 1, 64, 64 * 16, [src, out])
    site = line_of(
        "welder_cp_async<16>(buf + 4 * t, src + 4 * t);\n  welder_cp_async_commit();\n  __syncthreads"
    )
    assert message.endswith(
        f"thread 0 (0,0,0): {IN_FLIGHT}: shared view 'buf' index 4 is written by the "
        f"cp.async.cg.shared.global 16 at kernel.cu:{site} that thread 1 (1,0,0) issued and has not "
        "waited for"
    ), message


def test_another_threads_copy_needs_a_barrier_after_the_wait(module, rng):
    src, out = rng.standard_normal(256).astype(np.float32), np.zeros(64, np.float32)
    message = launch_error(module, "cp_async_wait_no_barrier", 1, 64, 64 * 16, [src, out])
    assert re.search(
        r"thread 1 \(1,0,0\): data race on shared view 'buf' index 4: thread 1 \(1,0,0\) writes it, but "
        r"thread 0 \(0,0,0\) read it with no barrier in between \(since the block started\)$",
        message,
    ), message


def test_refilling_a_stage_still_being_read_is_a_race(module, rng):
    src, out = rng.standard_normal(512).astype(np.float32), np.zeros(128, np.float32)
    message = launch_error(module, "cp_async_refill_race", 1, 64, 64 * 16, [src, out])
    assert (
        "data race on shared view 'buf' index 4: thread 1 (1,0,0) writes it, but thread 0 (0,0,0) read it"
        in message
    )


def test_an_exiting_thread_completes_its_copies(module, rng):
    src, out = rng.standard_normal(4).astype(np.float32), np.zeros(4, np.float32)
    # Unchecked, thread 1 (emulated after thread 0 exited) sees the data ...
    module.launch("cp_async_exit_pending", 1, 32, 16, [src, out], check_races=False)
    np.testing.assert_array_equal(out, src)
    # ... but reading it is a race: nothing orders the copy before the read.
    message = launch_error(module, "cp_async_exit_pending", 1, 32, 16, [src, out])
    assert (
        "data race on shared view 'buf' index 0: thread 1 (1,0,0) reads it, but thread 0 (0,0,0) wrote it"
        in message
    )


CP16 = r"cp\.async\.cg\.shared\.global 16 at kernel\.cu:\d+"
CP8 = r"cp\.async\.ca\.shared\.global 8 at kernel\.cu:\d+"


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        (0, rf"thread 0 \(0,0,0\): {CP16}: the global source address 0x[0-9a-f]+ is not 16-byte aligned$"),
        (
            1,
            rf"thread 0 \(0,0,0\): {CP8}: the destination, shared view 'buf' index 1 \(byte 4\), is not "
            r"8-byte aligned$",
        ),
        (2, rf"thread 0 \(0,0,0\): {CP16}: src_bytes 20 exceeds the copy size of 16 bytes$"),
        (
            3,
            rf"thread 1 \(1,0,0\): {CP16}: the destination, shared view 'buf' index 0, is also the "
            rf"destination of the {CP16} that thread 0 \(0,0,0\) issued and has not waited for$",
        ),
        (4, r"thread 0 \(0,0,0\): .*byte 512 of argument 0 \(const float32\*, 512 bytes\), past its end"),
    ],
)
def test_cp_async_misuse_is_reported(module, rng, mode, expected):
    src, out = rng.standard_normal(128).astype(np.float32), np.zeros(32, np.float32)
    message = launch_error(module, "cp_async_misuse", 1, 32, (4 * 32 + 4) * 4, [src, src.size, out, mode])
    assert re.search(expected, message), message


# ------------------------------------------------------------------------------------- the GEMM


GEMM_CASES = [
    ("mma_gemm_f16", 64, 64, 32, 1),  # one tile
    ("mma_gemm_f16", 100, 72, 40, 1),  # ragged M, N and K
    ("mma_gemm_f16", 130, 200, 96, 1),  # several blocks, ragged
    ("mma_gemm_f16", 37, 24, 8, 1),  # K shorter than the k tile
    ("mma_gemm_f16", 96, 80, 256, 3),  # split-K
    ("mma_gemm_f16", 70, 136, 200, 4),  # split-K with a ragged last split
    ("mma_gemm_bf16", 100, 72, 40, 1),
    ("mma_gemm_bf16", 64, 128, 96, 2),
    ("mma_gemm_f16_narrow", 50, 34, 50, 1),  # 4-byte copies: K and N only even
    ("mma_gemm_f16_narrow", 66, 10, 130, 2),
]


@pytest.mark.parametrize(("kernel", "m", "n", "k", "splits"), GEMM_CASES)
def test_tensor_core_gemm_matches_numpy(module, rng, kernel, m, n, k, splits):
    a, b, av, bv = gemm_inputs(kernel, m, n, k, rng)
    grid, per_split = gemm_launch(m, n, k, splits)
    c = np.zeros((m, n), np.float32) if splits > 1 else np.full((m, n), np.nan, np.float32)
    module.launch(kernel, grid, GEMM_THREADS, GEMM_SMEM_BYTES, [a, b, c, m, n, k, per_split])
    assert_gemm_close(c, av, bv, rel=1e-5)


def test_gemm_rejects_operands_that_break_copy_alignment(module, rng):
    # K = 36 is not a multiple of 8: rows of A start off 16-byte alignment.
    a, b, _, _ = gemm_inputs("mma_gemm_f16", 16, 16, 36, rng)
    c = np.zeros((16, 16), np.float32)
    message = launch_error(
        module, "mma_gemm_f16", (1, 1, 1), GEMM_THREADS, GEMM_SMEM_BYTES, [a, b, c, 16, 16, 36, 64]
    )
    assert "is not 16-byte aligned" in message, message


# ------------------------------------------------------------------------------------- nvcc


@pytest.fixture(scope="module")
def nvcc() -> str:
    path = shutil.which("nvcc")
    if path is None:
        pytest.skip("nvcc is not on PATH")
    return path


def test_kernels_compile_with_nvcc_to_tensor_core_instructions(nvcc, tmp_path: Path):
    source = tmp_path / "mma_kernels.cu"
    source.write_text(SOURCE)
    common = [nvcc, "-std=c++17", "-Werror", "all-warnings", "-I", str(emu.PRELUDE_DIR), str(source)]
    commands = {
        arch: [*common, f"-arch={arch}", "-cubin", "-o", str(tmp_path / f"{arch}.cubin")]
        for arch in ("sm_80", "sm_90")
    }
    commands["ptx"] = [*common, "-arch=sm_80", "-ptx", "-o", str(tmp_path / "kernels.ptx")]
    with ThreadPoolExecutor(len(commands)) as pool:
        results = dict(
            zip(
                commands,
                pool.map(lambda c: subprocess.run(c, capture_output=True, text=True), commands.values()),
            )
        )
    for what, result in results.items():
        assert result.returncode == 0 and not result.stderr.strip(), f"{what}:\n{result.stderr}"
    ptx = (tmp_path / "kernels.ptx").read_text()
    for instruction in [
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32",
        "cvt.rna.tf32.f32",
        *(f"ldmatrix.sync.aligned.m8n8.x{n}{t}.shared.b16" for n in (1, 2, 4) for t in ("", ".trans")),
        "cp.async.cg.shared.global",
        "cp.async.ca.shared.global",
        "cp.async.commit_group",
        "cp.async.wait_group 1",
        "cp.async.wait_all",
    ]:
        assert instruction in ptx, instruction
    # The GEMM's own entry point uses the pipeline and tensor-core instructions it is about.
    gemm = ptx[ptx.index(".entry mma_gemm_f16(") :]
    gemm = gemm[: gemm.index("\n}\n")]
    for instruction in [
        "mma.sync.aligned.m16n8k16",
        "ldmatrix.sync.aligned.m8n8.x4.trans",
        "cp.async.cg",
        "cp.async.wait_group 1",
    ]:
        assert instruction in gemm, instruction
