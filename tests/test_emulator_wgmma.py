"""The emulator runs welder_wgmma.cuh -- wgmma.mma_async m64nNk16 from shared-memory descriptors,
wgmma.fence / commit / wait, fence.proxy.async -- with the shared-memory layouts and accumulator
fragment of the PTX ISA, and a complete pipelined wgmma GEMM (tests/kernels/wgmma_gemm.cu) on
ragged shapes; misuse is reported.  Expectations come from tests/wgmma_reference.py (numpy, which
also lays the operands out in shared memory); the same kernels compile with nvcc for sm_90a, and
test_gpu_wgmma.py runs them on a Hopper GPU against the same expectations.
"""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from kernel_fixtures import EMULATOR, emulated
from kernel_fixtures import line_of as kernel_line
from wgmma_reference import (
    BUG_KERNELS,
    BUGS,
    GEMM,
    GEMM_KERNELS,
    GEMM_SMEM_BYTES,
    GEMM_THREADS,
    SWIZZLES,
    UNIT_KERNELS,
    UNITS,
    assert_gemm_close,
    assert_unit_close,
    bug_operands,
    gemm_grid,
    gemm_inputs,
    pack_d,
    unit_case,
    unpack_d,
)

from welder.runtime import emu
from welder.runtime.emu import EmulationError

pytestmark = EMULATOR

SOURCE = "\n".join(p.read_text() for p in (UNITS, BUGS, GEMM))
ROOT = Path(__file__).resolve().parent.parent


def line_of(text: str) -> int:
    return kernel_line(SOURCE, text)


@pytest.fixture(scope="module")
def module() -> emu.EmulatedModule:
    return emulated(SOURCE, [*UNIT_KERNELS.values(), *BUG_KERNELS, *GEMM_KERNELS])


@pytest.fixture()
def rng() -> np.random.Generator:
    return np.random.default_rng(20250612)


def run_unit(module: emu.EmulatedModule, case) -> np.ndarray:
    out = np.full((128, case.n // 2), np.nan, np.float32)
    args = [case.image, case.image.size, case.params, case.c, out, case.trans]
    module.launch(case.kernel, 1, 128, case.smem_bytes, args)
    return out


def launch_error(module: emu.EmulatedModule, *launch_args, **options) -> str:
    with pytest.raises(EmulationError) as caught:
        module.launch(*launch_args, **options)
    return str(caught.value)


# ------------------------------------------------------------------------------------- layouts

MAJORS = list(itertools.product((0, 1), (0, 1)))  # (imm-trans-a, imm-trans-b): 1 = MN-major


@pytest.mark.parametrize("n", [8, 64, 256])
@pytest.mark.parametrize(("trans_a", "trans_b"), MAJORS)
@pytest.mark.parametrize("swizzle", SWIZZLES)
def test_wgmma_reads_the_canonical_layouts(module, rng, n, trans_a, trans_b, swizzle):
    # A and B use different swizzles (B's is the next one), so a mix-up between them shows; two
    # k16 steps, the second through an advanced descriptor, accumulating onto C.
    swizzle_b = SWIZZLES[(SWIZZLES.index(swizzle) + 1) % len(SWIZZLES)]
    case = unit_case(n, trans_a, trans_b, swizzle, swizzle_b, rng)
    assert_unit_close(case, run_unit(module, case), rel=1e-6)


@pytest.mark.parametrize(("trans_a", "trans_b"), MAJORS)
@pytest.mark.parametrize("swizzle", SWIZZLES)
def test_chains_of_k16_steps_advance_the_descriptor(module, rng, trans_a, trans_b, swizzle):
    # Five steps: K-major swizzled operands advance 32 bytes inside the atom row and then move on
    # to the next column of atoms; the others step by whole core matrices or atoms.
    case = unit_case(64, trans_a, trans_b, swizzle, swizzle, rng, steps=5)
    assert_unit_close(case, run_unit(module, case), rel=1e-6)


@pytest.mark.parametrize("accumulate", [0, 1])
def test_scale_d_zero_ignores_the_accumulators(module, rng, accumulate):
    # With scale-d = 0 the accumulators start as NaN and must not reach the result.
    case = unit_case(64, 0, 1, 128, 128, rng, accumulate=accumulate)
    out = run_unit(module, case)
    assert_unit_close(case, out, rel=1e-6)
    assert np.isnan(case.c).all() != bool(accumulate)


@pytest.mark.parametrize(("n", "dtype"), [(24, "f16"), (64, "bf16")])
def test_other_shapes_and_bf16(module, rng, n, dtype):
    for trans_a, trans_b in MAJORS:
        case = unit_case(n, trans_a, trans_b, 64, 32, rng, steps=3, dtype=dtype)
        assert_unit_close(case, run_unit(module, case), rel=1e-6)


def test_a_wrong_layout_is_caught(module, rng):
    # The test's own power: the same image read through a descriptor that claims the other
    # major-ness (or another swizzle) gives a different product.
    case = unit_case(64, 0, 0, 128, 128, rng)
    case.trans = 1  # A declared MN-major
    with pytest.raises(AssertionError):
        assert_unit_close(case, run_unit(module, case), rel=1e-6)
    case = unit_case(64, 0, 0, 128, 128, rng)
    case.params[0] = 64  # A's swizzle declared 64B
    with pytest.raises(AssertionError):
        assert_unit_close(case, run_unit(module, case), rel=1e-6)


def test_accumulator_fragment_round_trips():
    # pack_d and unpack_d are each other's inverse and cover every element once.
    d = np.arange(64 * 256, dtype=np.float64).reshape(64, 256)
    np.testing.assert_array_equal(unpack_d(pack_d(d)), d)


# ------------------------------------------------------------------------------------- misuse


def test_reading_accumulators_before_the_wait_sees_old_values(module, rng):
    image, a, b = bug_operands(rng)
    c = rng.standard_normal((64, 8))
    c_regs = pack_d(c.astype(np.float32))
    early, late = np.zeros((128, 4), np.float32), np.zeros((128, 4), np.float32)
    module.launch("wgmma_early_read", 1, 128, 4096, [image, c_regs, early, late])
    np.testing.assert_array_equal(early, c_regs)  # stale: the wgmma has not been waited for
    np.testing.assert_allclose(unpack_d(late), c + a @ b, rtol=1e-6, atol=1e-6)


def misuse(module, rng, mode: int, threads: int = 128) -> str:
    image, _, _ = bug_operands(rng)
    out = np.zeros((128, 4), np.float32)
    return launch_error(module, "wgmma_misuse", 1, threads, 4096, [image, out, mode])


WGMMA = "wgmma.mma_async.sync.aligned.m64nNk16.f32.f16.f16"


def test_every_thread_of_the_warpgroup_must_take_part(module, rng):
    message = misuse(module, rng, 0)
    site = line_of("if (mode != 7) welder_wgmma_fence();")
    assert (
        f"wgmma.fence.sync.aligned at kernel.cu:{site} (warpgroup 0, threads 0-127) cannot complete: every "
        "thread of the warpgroup must reach it; threads 0-95 arrived; threads 96-127 have exited" in message
    ), message


def test_the_block_must_be_whole_warpgroups(module, rng):
    message = misuse(module, rng, 1, threads=96)
    site = line_of("if (mode != 7) welder_wgmma_fence();")
    assert message.endswith(
        f"wgmma.fence.sync.aligned at kernel.cu:{site} needs whole warpgroups of 128 threads "
        "(warps 4i..4i+3), but the block has 96 threads"
    ), message


def test_overwriting_operands_before_the_wait_is_reported(module, rng):
    message = misuse(module, rng, 2)
    site = line_of("welder_wgmma_m64k16_f16f32<8, 0, 0>(d, desc_a")
    assert message.endswith(
        "thread 5 (5,0,0): shared memory read by an in-flight wgmma written before wgmma.wait_group: "
        f"a write of shared view 'tile' index 100 (byte 100), which the {WGMMA} at kernel.cu:{site} of "
        "warpgroup 0 reads, and no wgmma.wait_group of that warpgroup has covered it yet"
    ), message


def test_operands_outside_the_dynamic_buffer_are_reported(module, rng):
    message = misuse(module, rng, 3)
    site = line_of("welder_wgmma_m64k16_f16f32<8, 0, 0>(d, desc_a")
    assert re.search(
        rf"thread 0 \(0,0,0\): {re.escape(WGMMA)} at kernel\.cu:{site}: operand B element \(n 0, k 8\) "
        r"lies at shared address 0x1400, outside the 4096 bytes of dynamic shared memory given at launch "
        r"\(addresses 0x400-0x13ff; descriptor 0x[0-9a-f]{16}\)$",
        message,
    ), message


def test_operands_need_a_barrier_after_they_are_written(module, rng):
    message = misuse(module, rng, 4)
    site = line_of("welder_wgmma_m64k16_f16f32<8, 0, 0>(d, desc_a")
    assert message.endswith(
        f"thread 0 (0,0,0): {WGMMA} at kernel.cu:{site} reads shared address 0x400 (byte 0 of the dynamic "
        "buffer), which thread 0 (0,0,0) wrote with no __syncthreads between the write and the wgmma "
        "(since the block started)"
    ), message


def test_operands_need_a_proxy_fence_before_the_barrier(module, rng):
    message = misuse(module, rng, 5)
    site = line_of("welder_wgmma_m64k16_f16f32<8, 0, 0>(d, desc_a")
    assert message.endswith(
        f"thread 0 (0,0,0): {WGMMA} at kernel.cu:{site} reads shared address 0x400 (byte 0 of the dynamic "
        "buffer), which thread 0 (0,0,0) wrote through the generic proxy without a fence.proxy.async "
        "(welder_fence_proxy_async) between the write and a __syncthreads before the wgmma"
    ), message


def test_exiting_with_wgmma_in_flight_is_reported(module, rng):
    message = misuse(module, rng, 6)
    site = line_of("welder_wgmma_m64k16_f16f32<8, 0, 0>(d, desc_a")
    assert message.endswith(
        f"thread 0 (0,0,0): exits with wgmma operations of its warpgroup in flight (the {WGMMA} at "
        f"kernel.cu:{site}): a wgmma.wait_group 0 must cover every committed group before the threads exit"
    ), message


def test_wgmma_needs_a_wgmma_fence(module, rng):
    message = misuse(module, rng, 7)
    expected = "no wgmma.fence of warpgroup 0 since it started or since its last wgmma.wait_group"
    assert expected in message, message


# ------------------------------------------------------------------------------------- the GEMM

GEMM_CASES = [
    ("wgmma_gemm_kn", 128, 128, 64),  # one tile
    ("wgmma_gemm_nk", 128, 128, 64),
    ("wgmma_gemm_kn", 64, 256, 512),  # half a block row, eight k-tiles through the 4-stage ring
    ("wgmma_gemm_nk", 64, 256, 512),
    ("wgmma_gemm_kn", 136, 200, 136),  # ragged M, N and K with 16-byte copies
    ("wgmma_gemm_kn_narrow", 200, 136, 100),  # K = 100: 8-byte copies
    ("wgmma_gemm_nk_narrow", 200, 136, 100),
    ("wgmma_gemm_nk_narrow", 30, 20, 12),  # smaller than one tile everywhere
]


@pytest.mark.parametrize(("kernel", "m", "n", "k"), GEMM_CASES)
def test_wgmma_gemm_matches_numpy(module, rng, kernel, m, n, k):
    a, b, av, bv = gemm_inputs(kernel, m, n, k, rng)
    c = np.full((m, n), np.nan, np.float16)
    module.launch(kernel, gemm_grid(m, n), GEMM_THREADS, GEMM_SMEM_BYTES, [a, b, c, m, n, k])
    assert_gemm_close(c, av, bv)


# ------------------------------------------------------------------------------------- nvcc


def test_generated_asm_is_up_to_date():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_wgmma_asm.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


@pytest.fixture(scope="module")
def nvcc() -> str:
    path = shutil.which("nvcc")
    if path is None:
        pytest.skip("nvcc is not on PATH")
    return path


def test_kernels_compile_with_nvcc_to_wgmma(nvcc, tmp_path: Path):
    source = tmp_path / "wgmma_kernels.cu"
    source.write_text(SOURCE)
    common = [nvcc, "-std=c++17", "-Werror", "all-warnings", "-I", str(emu.PRELUDE_DIR), str(source)]
    commands = {
        "cubin": [*common, "-arch=sm_90a", "-cubin", "-o", str(tmp_path / "k.cubin")],
        "ptx": [*common, "-arch=sm_90a", "-ptx", "-o", str(tmp_path / "k.ptx")],
        "sm_90": [*common, "-arch=sm_90", "-cubin", "-o", str(tmp_path / "plain.cubin")],
    }
    with ThreadPoolExecutor(len(commands)) as pool:
        results = dict(
            zip(
                commands,
                pool.map(lambda c: subprocess.run(c, capture_output=True, text=True), commands.values()),
            )
        )
    for what in ("cubin", "ptx"):
        result = results[what]
        # ptxas reports where it had to add warpgroup waits/arrives (info C7517/C7519), nothing else.
        noise = [ln for ln in result.stderr.splitlines() if ln.strip() and not ln.startswith("ptxas info")]
        assert result.returncode == 0 and not noise, f"{what}:\n{result.stderr}"
    # The plain sm_90 target has no wgmma: the header says so.
    assert results["sm_90"].returncode != 0
    assert "welder_wgmma.cuh needs sm_90a" in results["sm_90"].stderr
    ptx = (tmp_path / "k.ptx").read_text()
    for n in (8, 24, 64, 128, 256):
        assert f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16" in ptx, n
    for instruction in [
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16",
        "wgmma.fence.sync.aligned",
        "wgmma.commit_group.sync.aligned",
        "wgmma.wait_group.sync.aligned 0",
        "fence.proxy.async.shared::cta",
    ]:
        assert instruction in ptx, instruction
    start = ptx.index(".entry wgmma_gemm_kn(")
    end = ptx.find(".entry", start + 1)
    gemm = ptx[start : end if end >= 0 else len(ptx)]
    for instruction in [
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16",
        "wgmma.wait_group.sync.aligned 1",
        "cp.async.cg.shared.global",
        "cp.async.wait_group 1",
        "fence.proxy.async.shared::cta",
    ]:
        assert instruction in gemm, instruction
    # ptxas needed no extra waits in the GEMM: its fences and waits already order the accumulators.
    assert "wgmma_gemm" not in results["cubin"].stderr


def test_sm_arch_names_the_architecture_specific_target():
    from welder.device.gpu import CompileError, sm_arch

    assert sm_arch((9, 0)) == "sm_90"
    assert sm_arch((9, 0), arch_specific=True) == "sm_90a"
    with pytest.raises(CompileError, match=r"8\.0 has no architecture-specific target"):
        sm_arch((8, 0), arch_specific=True)
