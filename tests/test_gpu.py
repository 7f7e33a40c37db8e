"""Generated kernels on a real GPU: compiled by nvcc, launched through pycuda, compared with
the interpreter and with the CPU emulator on the same inputs; timing; fault and hang
containment; the tuner end to end.  Skipped without pycuda and a GPU (run them with
``scripts/gpu_suite.sh`` on the device machine)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from onnx import helper
from onnx_util import make_model
from test_fast_math import (
    FORMATS,
    FUNCTIONS,
    assert_difference_rounded_once,
    assert_quotient_rounded_once,
    assert_rounded_once,
    difference_model,
    quotient_model,
    unary_model,
)

from welder.arch import match_gpu_name
from welder.check import error_metric, threshold_for
from welder.codegen import Kernel, KernelParam, generate_kernel
from welder.device.gpu import (
    DeviceBuffer,
    GpuDevice,
    GpuModule,
    KernelTimeout,
    LaunchError,
    compile_cubin,
    compute_capability,
    device_name,
    gpu_available,
    sm_arch,
    time_kernel,
)
from welder.frontend.onnx import import_onnx
from welder.graph import Graph
from welder.ir.interpret import np_dtype
from welder.schedule.group import make_group
from welder.schedule.plan import plan_model
from welder.tune.cache import TuningCache
from welder.tune.tuner import tune_group, tune_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not gpu_available(), reason="needs pycuda and an NVIDIA GPU"),
]

RNG = np.random.default_rng(23)


def _w(*shape: int, dtype=np.float32) -> np.ndarray:
    return RNG.standard_normal(shape).astype(dtype)


@pytest.fixture(scope="module")
def context():
    """A CUDA context of this process for the in-process tests."""
    import pycuda.driver as drv

    drv.init()
    ctx = drv.Device(0).make_context()
    yield ctx
    ctx.pop()
    ctx.detach()


@pytest.fixture(scope="module")
def arch():
    return match_gpu_name(device_name())


@pytest.fixture(scope="module")
def sm() -> str:
    return sm_arch(compute_capability())


def run_native(graph: Graph, kernels: list[Kernel], module, feeds: dict) -> dict[str, np.ndarray]:
    """Launch a model's kernels in order on the GPU (outputs start as NaN bytes)."""
    import pycuda.driver as drv

    env = {**graph.constants, **feeds}
    bufs: dict[str, DeviceBuffer] = {}
    try:
        for k in kernels:
            args = []
            for p in k.params:
                if p.is_output:
                    bufs[p.tensor] = DeviceBuffer(int(np.prod(p.shape)) * np_dtype(p.dtype).itemsize)
                    bufs[p.tensor].fill_bytes(0xFF)
                elif p.tensor not in bufs:
                    bufs[p.tensor] = DeviceBuffer.from_array(np.asarray(env[p.tensor], np_dtype(p.dtype)))
                args.append(bufs[p.tensor])
            args += k.tensor_maps  # encoded over the buffers they name
            module.launch(k.name, k.grid, k.threads, k.smem_bytes, args)
        drv.Context.synchronize()
        return {
            o: bufs[o].to_array(graph.tensor(o).shape, np_dtype(graph.tensor(o).dtype)) for o in graph.outputs
        }
    finally:
        for b in bufs.values():
            b.free()


def _kernels(graph: Graph, label: str, choice: int = 0, topk: int = 2, arch=None) -> list[Kernel]:
    from welder.arch import get_arch

    plan = plan_model(graph, arch or get_arch("H100"), topk=topk)
    return [
        generate_kernel(graph, p.group, p.configs[min(choice, len(p.configs) - 1)], f"{label}_{i}")
        for i, p in enumerate(plan.groups)
    ]


class ModuleSet:
    """Kernels spread over several modules (native or emulated), launched by name."""

    def __init__(self, modules: dict[str, object]) -> None:
        self.by_kernel = modules

    def launch(self, name: str, grid: int, block: int, smem: int, args: list) -> None:
        self.by_kernel[name].launch(name, grid, block, smem, args)


def _chunks(kernels: list[Kernel], jobs: int) -> list[list[Kernel]]:
    size = -(-len(kernels) // jobs)
    return [kernels[i : i + size] for i in range(0, len(kernels), size)]


def compile_everywhere(kernels: list[Kernel], sm: str) -> tuple[ModuleSet, ModuleSet]:
    """(native, emulated) modules of ``kernels``: nvcc and g++ calls of a few dozen kernels
    each, all side by side on the machine's cores.  The cubins are loaded afterwards, in
    this thread, which holds the CUDA context."""
    from concurrent.futures import ThreadPoolExecutor

    from welder.codegen import TEMPLATE_DIR, model_source
    from welder.runtime.emu import compile_kernels

    def emulate(chunk: list[Kernel]):
        names = [k.name for k in chunk]
        return compile_kernels(model_source(chunk), names, extra_flags=[f"-I{TEMPLATE_DIR}"])

    workers = max(2, os.cpu_count() or 2)
    chunks = _chunks(kernels, 2 * workers)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        cubins = [pool.submit(compile_cubin, [k.source for k in c], sm) for c in chunks]
        # The first build also compiles the emulator's runtime once; the others then share it.
        first = emulate(chunks[0])
        emulated = [first, *pool.map(emulate, chunks[1:])]
        native = [GpuModule(f.result()) for f in cubins]
    return (
        ModuleSet({k.name: m for c, m in zip(chunks, native) for k in c}),
        ModuleSet({k.name: m for c, m in zip(chunks, emulated) for k in c}),
    )


def test_device_is_described(sm):
    assert device_name()
    assert compute_capability() >= (7, 0)
    assert sm.startswith("sm_")


def test_generated_kernels_match_the_interpreter_and_the_emulator(context, sm):
    """The kernels of tests/test_codegen.py, natively: every node-test model under two
    configs, the fused chains under four distinct configs and tiles that do not divide
    them, reductions stepped with a short last step (fp32 and fp16, every vector width),
    reductions split across warps, fp16 kernels and a matmul's top 12 configs.  Every
    output is compared with the interpreter and with the emulator on the same inputs."""
    import test_codegen
    from test_codegen import run_emulated

    from welder.runtime.emu import available

    assert available(), "the emulator needs g++ on this machine"
    cases = [c for b in test_codegen.all_batches() for c in b.cases]
    native, emulated = compile_everywhere([k for c in cases for k in c.kernels], sm)
    failures = []
    for case in cases:
        try:
            ours = run_native(case.graph, case.kernels, native, case.feeds)
        except Exception as e:  # a fault ends the context: no later case could run
            raise AssertionError(f"{case.kernels[0].name} ({case.label}) failed natively: {e}") from e
        reference = case.graph.run(case.feeds)
        emulator = run_emulated(case, emulated)
        for o in case.graph.outputs:
            limit = threshold_for(case.graph.tensor(o).dtype)
            for what, other in (("interpreter", reference[o]), ("emulator", emulator[o])):
                err = error_metric(ours[o], other)
                if err > limit:
                    failures.append(f"{case.kernels[0].name} ({case.label}) {o}: native vs {what} {err:.2e}")
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:40])
    assert len(cases) > 900


def _fast_math_output(model, feeds, name, sm):
    """Output ``y`` of ``model`` run natively on the GPU, one config a group."""
    graph = import_onnx(model)
    kernels = _kernels(graph, name, topk=1)
    return run_native(graph, kernels, GpuModule(compile_cubin([k.source for k in kernels], sm)), feeds)["y"]


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("op", list(FUNCTIONS))
def test_16_bit_math_is_within_an_ulp_of_the_exact_value_for_every_input(context, sm, op, fmt):
    """tests/test_fast_math.py's check with the hardware's ex2.approx and rcp.approx."""
    dtype = FORMATS[fmt]
    model, feeds = unary_model(op, dtype)
    got = _fast_math_output(model, feeds, f"fast_{op}_{fmt}", sm)
    assert_rounded_once(op, dtype, got, feeds["x"])


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_the_exp_of_a_difference_is_within_an_ulp_for_every_input(context, sm, fmt):
    """tests/test_fast_math.py's check of welder_exp16_sub with the hardware's ex2.approx."""
    dtype = FORMATS[fmt]
    model, feeds = difference_model(dtype)
    got = _fast_math_output(model, feeds, f"fast_exp_sub_{fmt}", sm)
    assert_difference_rounded_once(dtype, got, feeds["x"])


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_quotient_is_within_an_ulp_for_every_input(context, sm, fmt):
    """tests/test_fast_math.py's check of x / d with the hardware's rcp.approx (fp16's
    welder_div16) and IEEE division (bf16)."""
    dtype = FORMATS[fmt]
    model, feeds = quotient_model(dtype)
    got = _fast_math_output(model, feeds, f"fast_div_{fmt}", sm)
    assert_quotient_rounded_once(dtype, got, feeds["x"])


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_max_and_min_keep_a_nan(context, sm, dtype):
    """welder_max and welder_min (one max.NaN / min.NaN on sm_80 and later): a NaN in a pair
    or anywhere in a row comes out NaN, as numpy's maximum and minimum give it; every other
    value is numpy's exactly, elementwise, in row reductions and in a softmax's maximum."""
    x, y = _w(64, 256, dtype=dtype), _w(64, 256, dtype=dtype)
    x[::3, 5] = np.nan
    y[1::4, 200] = np.nan
    nodes = [
        helper.make_node("Max", ["x", "y"], ["mx"]),
        helper.make_node("Min", ["x", "y"], ["mn"]),
        helper.make_node("ReduceMax", ["x"], ["rmax"], axes=[1], keepdims=0),
        helper.make_node("ReduceMin", ["y"], ["rmin"], axes=[1], keepdims=0),
        helper.make_node("Softmax", ["y"], ["sm"], axis=1),
    ]
    graph = import_onnx(make_model(nodes, {"x": x, "y": y}, ["mx", "mn", "rmax", "rmin", "sm"], opset=13))
    kernels = _kernels(graph, f"nan_minmax_{np.dtype(dtype).name}", topk=1)
    feeds = {"x": x, "y": y}
    got = run_native(graph, kernels, GpuModule(compile_cubin([k.source for k in kernels], sm)), feeds)
    np.testing.assert_array_equal(got["mx"], np.maximum(x, y))
    np.testing.assert_array_equal(got["mn"], np.minimum(x, y))
    np.testing.assert_array_equal(got["rmax"], x.max(axis=1))
    np.testing.assert_array_equal(got["rmin"], y.min(axis=1))
    assert np.array_equal(np.isnan(got["sm"]).any(axis=1), np.isnan(y).any(axis=1))
    clean = ~np.isnan(y).any(axis=1)
    expected = graph.run(feeds)["sm"]
    assert error_metric(got["sm"][clean], expected[clean]) <= threshold_for(graph.tensor("sm").dtype)


def test_attention_with_split_keys_matches_the_interpreter(context, sm):
    """tests/test_attention.py's configs whose warps split the keys (2 and 4 a ring slot,
    combined through shared memory at the end), natively, over 300 keys with a mask."""
    import test_attention
    from test_mma import _context

    from welder.schedule.kinds import attention

    graph = import_onnx(
        test_attention.attention_model(test_attention.CASES["bert: mask, 300 tokens (online softmax)"])
    )
    group = make_group(graph, list(graph.nodes))
    configs = [
        c for c in attention.KIND.propose(group, _context(graph, topk=64)) if c.stages[0].key_splits > 1
    ]
    assert {c.stages[0].key_splits for c in configs} == set(attention.SPLITS)
    _assert_attention_matches(graph, group, configs, sm, "split_attention")


def _assert_attention_matches(graph, group, configs, sm: str, name: str) -> None:
    """Every config of tests/test_attention.py's ``group``, natively, within fp16's threshold
    of the interpreter on that file's inputs."""
    import test_attention

    kernels = [generate_kernel(graph, group, c, f"{name}_{i}") for i, c in enumerate(configs)]
    module = GpuModule(compile_cubin([k.source for k in kernels], sm))
    feeds = test_attention._feeds(graph)
    reference = graph.run(feeds)["y"]
    for cfg, kernel in zip(configs, kernels):
        got = run_native(graph, [kernel], module, feeds)["y"]
        assert error_metric(got, reference) <= threshold_for("float16"), cfg.stages[0]


def test_persistent_attention_matches_the_interpreter(context, sm):
    """tests/test_attention.py's persistent configs (two blocks walking every tile, each
    copying the next tile's operands while it multiplies this one's), natively, where the
    copies really run beside the products: a slot rewritten too early shows here."""
    import test_attention
    from test_mma import _context

    from welder.schedule.kinds import attention

    for label in test_attention.ONE_PASS:
        graph = import_onnx(test_attention.attention_model(test_attention.CASES[label]))
        group = make_group(graph, list(graph.nodes))
        configs = attention.persistent_configs(group, _context(graph, topk=8), resident=2)
        assert configs, label
        _assert_attention_matches(graph, group, configs, sm, "persistent_attention")


def test_a_deep_product_of_positive_terms_does_not_drift_on_the_tensor_cores(context, sm):
    """tests/test_tf32x3.py's deep product of positive terms, 256 x 256, natively in the
    four largest block and warp tiles that sum the whole of K: the hardware's adder, which
    the emulator only models, must not bias the sum (a kernel that added each mma into the
    accumulators failed BERT b64 fp32's test_acc on the H200, 1.6e-4)."""
    from test_tf32x3 import DEEP_LIMIT, deep_positive_product

    graph, group, configs, feeds, exact = deep_positive_product(configs=4, m=256, n=256)
    kernels = [generate_kernel(graph, group, cfg, f"deep_tf32x3_{k}") for k, cfg in enumerate(configs)]
    module = GpuModule(compile_cubin([k.source for k in kernels], sm))
    for k in kernels:
        got = run_native(graph, [k], module, feeds)["y"]
        assert np.max(np.abs(got - exact) / exact) <= DEEP_LIMIT, k.name


def test_time_kernel_median_is_positive_and_scales_with_work(context, sm):
    small = import_onnx(make_model([helper.make_node("Relu", ["x"], ["y"])], {"x": _w(1 << 18)}, ["y"]))
    big = import_onnx(make_model([helper.make_node("Relu", ["x"], ["y"])], {"x": _w(1 << 24)}, ["y"]))
    [ks] = _kernels(small, "relu_small")
    [kb] = _kernels(big, "relu_big")
    module = GpuModule(compile_cubin([ks.source, kb.source], sm))
    times = {}
    for k, n in ((ks, 1 << 18), (kb, 1 << 24)):
        x = DeviceBuffer.from_array(_w(n))
        y = DeviceBuffer(4 * n)
        try:
            first = time_kernel(module, k.name, k.grid, k.threads, k.smem_bytes, [x, y], budget_s=0.3)
            second = time_kernel(module, k.name, k.grid, k.threads, k.smem_bytes, [x, y], budget_s=0.3)
        finally:
            x.free()
            y.free()
        assert first > 0 and second > 0
        assert abs(first - second) <= 0.3 * max(first, second), (first, second)
        times[n] = first
    # 64x the bytes: far slower, though not necessarily 64x (the small one is latency-bound).
    assert times[1 << 24] > 4 * times[1 << 18], times


_HANDWRITTEN = {
    "smem_big": r"""
extern "C" __global__ void smem_big(const float* x, float* y, int n) {
  extern __shared__ float buf[];
  for (int i = threadIdx.x; i < n; i += blockDim.x) buf[i] = 2.0f * x[i];
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += blockDim.x) y[i] = buf[n - 1 - i];
}
""",
    "add_one": r"""
extern "C" __global__ void add_one(const float* x, float* y) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < 1024) y[i] = x[i] + 1.0f;
}
""",
    "fault": r"""
extern "C" __global__ void fault(const float* x, float* y) {
  float* bad = reinterpret_cast<float*>(0x10);
  bad[threadIdx.x] = x[threadIdx.x];
  y[threadIdx.x] = 0.0f;
}
""",
    "hang": r"""
extern "C" __global__ void hang(const float* x, float* y) {
  volatile const float* v = x;
  while (v[0] == v[0] || v[0] != v[0]) { }
  y[0] = 1.0f;
}
""",
}


def test_dynamic_shared_memory_above_48_kib(context, sm):
    module = GpuModule(compile_cubin(_HANDWRITTEN["smem_big"], sm))
    n = 16384  # 64 KiB of floats
    x = _w(n)
    xb, yb = DeviceBuffer.from_array(x), DeviceBuffer(4 * n)
    try:
        module.launch("smem_big", 1, 256, 4 * n, [xb, yb, np.int32(n)])
        import pycuda.driver as drv

        drv.Context.synchronize()
        np.testing.assert_array_equal(yb.to_array((n,), np.float32), (2 * x)[::-1])
    finally:
        xb.free()
        yb.free()


def _matmul_graph() -> Graph:
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])]
    return import_onnx(make_model(nodes, {"x": _w(256, 512)}, ["y"], {"w": _w(512, 384)}))


def test_tune_group_measures_checks_and_caches(tmp_path, arch):
    graph = _matmul_graph()
    group = make_group(graph, list(graph.nodes))
    cache = TuningCache(tmp_path)
    with GpuDevice(budget_s=0.2) as device:
        first = tune_group(graph, group, arch, 6, cache, device)
        assert first is not None and not first.from_cache
        assert 0 < first.latency_us < 10_000 and first.candidates >= 2
        assert first.latency_us == min(first.timings_us.values()) or first.dropped
        again = tune_group(graph, group, arch, 6, cache, device)
    assert again.from_cache and again.latency_us == first.latency_us and again.config == first.config


def test_tuned_model_runs_correctly(context, arch, sm):
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("LayerNormalization", ["h", "s", "b"], ["n"], axis=-1),
        helper.make_node("Gelu", ["n"], ["g"]),
        helper.make_node("Softmax", ["g"], ["y"], axis=-1),
    ]
    inits = {"w": _w(96, 128), "s": _w(128), "b": _w(128)}
    graph = import_onnx(make_model(nodes, {"x": _w(64, 96)}, ["y"], inits, opset=20))
    with GpuDevice(budget_s=0.2) as device:
        plan = tune_model(graph, arch, 4, None, device)
        fused = tune_model(graph, arch, 2, None, device, measure_fusion=True)
    for p in (plan, fused):
        assert p.groups and all(g.latency_us > 0 for g in p.groups)
        kernels = [
            generate_kernel(graph, g.group, g.configs[0], f"tuned{id(p)}_{i}") for i, g in enumerate(p.groups)
        ]
        module = GpuModule(compile_cubin([k.source for k in kernels], sm))
        feeds = {"x": _w(64, 96)}
        ours, ref = run_native(graph, kernels, module, feeds), graph.run(feeds)
        assert error_metric(ours["y"], ref["y"]) <= threshold_for("float32")


def _handwritten_kernel(name: str) -> Kernel:
    params = [
        KernelParam("x", "x", "float32", (1024,), False),
        KernelParam("y", "y", "float32", (1024,), True),
    ]
    return Kernel(name, _HANDWRITTEN[name], params, 4, 256, 0, "y")


def test_faulting_and_hanging_kernels_are_contained():
    """Only a worker process survives these; an in-process fault would end this test
    process's use of the GPU (see test_in_process_fault_is_final)."""
    x = [_w(1024)]
    good, fault, hang = (_handwritten_kernel(n) for n in ("add_one", "fault", "hang"))
    with GpuDevice(timeout_s=10, budget_s=0.1) as device:
        program = device.compile([good, fault, hang])
        np.testing.assert_allclose(device.run(program, good, x)[0], x[0] + 1)
        with pytest.raises(LaunchError) as info:
            device.run(program, fault, x)
        assert info.value.fatal
        np.testing.assert_allclose(device.run(program, good, x)[0], x[0] + 1)  # a fresh worker
        start = time.perf_counter()
        with pytest.raises(KernelTimeout):
            device.time(program, hang, x)
        assert time.perf_counter() - start < 60
        np.testing.assert_allclose(device.run(program, good, x)[0], x[0] + 1)
        assert device.time(program, good, x) > 0


def test_only_the_asked_rows_come_back():
    """``run(rows=...)``: those ranges of each output's first axis, one after another, as
    the tuner compares a large group on its sampled rows."""
    from welder.tune.reference import select_rows

    params = [KernelParam(t, t, "float32", (32, 32), t == "y") for t in ("x", "y")]
    good = Kernel("add_one", _HANDWRITTEN["add_one"], params, 4, 256, 0, "y")
    x = [_w(32, 32)]
    rows = ((0, 3), (17, 18), (29, 32))
    with GpuDevice(timeout_s=10, budget_s=0.1) as device:
        program = device.compile([good])
        (whole,) = device.run(program, good, x)
        (some,) = device.run(program, good, x, rows)
    np.testing.assert_allclose(whole, x[0] + 1)
    assert some.shape == (7, 32)
    np.testing.assert_array_equal(some, select_rows(whole, rows))


def test_a_groups_candidates_are_timed_on_one_set_of_rotated_copies(sm):
    """The executor makes the outputs and the rotated copies at a data key's first timing
    and reuses them for the next kernels timed on it (a group's candidates), and frees them
    with the data; other output specs make new ones."""
    from welder.device.gpu import GpuExecutor, launch_spec, output_specs

    good = _handwritten_kernel("add_one")
    executor = GpuExecutor(0)
    try:
        executor.load("m", compile_cubin([good.source], sm))
        executor.upload("d", [_w(1024)])
        first = executor.time("m", launch_spec(good), "d", output_specs(good), 0.05)
        copies = executor._timing["d"][2]
        second = executor.time("m", launch_spec(good), "d", output_specs(good), 0.05)
        assert first > 0 and second > 0
        assert executor._timing["d"][2] is copies and len(copies) == 31  # 8 KB: the cap of 32 sets
        wider = [((2048,), "float32")]
        assert executor.time("m", launch_spec(good), "d", wider, 0.05) > 0
        assert executor._timing["d"][0] == tuple(wider) and executor._timing["d"][2] is not copies
        executor.release("d")
        assert "d" not in executor._timing
    finally:
        executor.close()


def test_in_process_fault_is_final():
    """In a process of its own: the fault ends that process's use of the GPU for good."""
    import subprocess
    import sys

    code = (
        "import sys; sys.path.insert(0, 'tests')\n"
        "import numpy as np, pytest\n"
        "from test_gpu import _handwritten_kernel\n"
        "from welder.device.gpu import GpuDevice, GpuError, LaunchError\n"
        "x = [np.ones(1024, np.float32)]\n"
        "good, fault = _handwritten_kernel('add_one'), _handwritten_kernel('fault')\n"
        "with GpuDevice(isolate=False, timeout_s=10, budget_s=0.1) as d:\n"
        "    p = d.compile([good, fault])\n"
        "    assert (d.run(p, good, x)[0] == 2).all()\n"
        "    with pytest.raises(LaunchError):\n"
        "        d.run(p, fault, x)\n"
        "    with pytest.raises(GpuError, match='lost'):\n"
        "        d.run(p, good, x)\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.stdout.strip().endswith("ok"), result.stdout + result.stderr


def test_hostile_ids_are_clamped_inside_every_tensor(context, sm):
    """Gather, GatherElements and GatherND fed huge and negative indices, run natively: the
    kernels clamp into each dimension (docs/ir.md, "Data-dependent indices"), so the launch
    completes without a fault and gives the gather of the clamped indices.  Run it under
    compute-sanitizer to see that no access leaves its tensor."""
    hostile = np.array([2**31 + 5, 2**62, -(2**62), -(2**31) - 7, 50257, -50257, 10**12, -1], np.int64)
    table, x, grid = _w(1000, 64), _w(8, 300), _w(50, 7)
    feeds = {
        "ids": hostile.reshape(1, 8),
        "ge": np.resize(hostile, (8, 300)),
        "nd": np.resize(hostile, (8, 2)),
    }
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["rows"], axis=0),
        helper.make_node("Relu", ["rows"], ["act"]),
        helper.make_node("GatherElements", ["x", "ge"], ["picked"], axis=1),
        helper.make_node("GatherND", ["grid", "nd"], ["cells"]),
    ]
    model = make_model(nodes, feeds, ["act", "picked", "cells"], {"table": table, "x": x, "grid": grid})
    graph = import_onnx(model)
    kernels = _kernels(graph, "hostile_ids")
    assert any("welder_index(" in k.source for k in kernels)
    ours = run_native(graph, kernels, GpuModule(compile_cubin([k.source for k in kernels], sm)), feeds)

    def clamp(v: np.ndarray, n) -> np.ndarray:
        return np.clip(np.where(v < 0, v + n, v), 0, np.asarray(n) - 1)

    nd = clamp(feeds["nd"], np.array([50, 7]))
    expected = {
        "act": np.maximum(table[clamp(feeds["ids"], 1000)], 0),
        "picked": np.take_along_axis(x, clamp(feeds["ge"], 300), axis=1),
        "cells": grid[nd[:, 0], nd[:, 1]],
    }
    for name, value in expected.items():
        np.testing.assert_array_equal(ours[name], value)
