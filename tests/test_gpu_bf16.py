"""Generated bf16 kernels on a real GPU: the tensor-core stages of tests/test_bf16.py (the
``mma`` kind on any GPU of compute capability 8.0 or later, ``wgmma`` on 9.0 through sm_90a)
and a bf16 transformer layer's whole plan, compiled by nvcc, launched through pycuda and
compared with the interpreter -- what shows that the bf16 epilogues, conversions and
instructions are the hardware's, as test_gpu_mma.py / test_gpu_wgmma.py do for the
instructions themselves.  Skipped without pycuda and a GPU (``scripts/gpu_suite.sh`` runs
them)."""

from __future__ import annotations

import pytest
import test_bf16
from kernel_fixtures import cuda_context, hopper
from test_bf16 import MMA_CASES, MODELS, WGMMA_CASES, _bf16_case, _context
from test_gpu import run_native

from welder.arch import match_gpu_name
from welder.check import error_metric, random_inputs, threshold_for
from welder.codegen import generate_kernel, generate_model
from welder.device.gpu import (
    GpuModule,
    compile_cubin,
    compute_capability,
    device_name,
    gpu_available,
    sm_arch,
)
from welder.frontend.onnx import import_onnx
from welder.schedule.kinds import mma, wgmma
from welder.schedule.plan import plan_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not gpu_available() or compute_capability() < (8, 0),
        reason="needs pycuda and a GPU with bf16 mma (8.0+)",
    ),
]


@pytest.fixture(scope="module")
def context():
    with cuda_context() as ctx:
        yield ctx


def _check(graph, kernels, arch_specific: bool, feeds: dict) -> list[str]:
    module = GpuModule(
        compile_cubin([k.source for k in kernels], sm_arch(compute_capability(), arch_specific=arch_specific))
    )
    ours = run_native(graph, kernels, module, feeds)
    reference = graph.run(feeds)
    failures = []
    for name, value in ours.items():
        assert value.dtype == reference[name].dtype
        err = error_metric(value, reference[name])
        if err > threshold_for(graph.tensor(name).dtype):
            failures.append(f"{kernels[0].name}: {name} error {err:.3e}")
    return failures


@pytest.mark.parametrize("label", MMA_CASES)
def test_mma_bf16_stages_match_the_interpreter(context, label: str) -> None:
    graph, group, feeds = _bf16_case(label)
    configs = mma.KIND.propose(group, _context(graph))
    failures = []
    for j, cfg in enumerate(configs[:3]):
        kernel = generate_kernel(graph, group, cfg, f"bf16_mma_{j}")
        failures += _check(graph, [kernel], False, feeds)
    assert failures == []


@pytest.mark.skipif(not hopper(), reason="wgmma needs compute capability 9.0")
@pytest.mark.parametrize("label", WGMMA_CASES)
def test_wgmma_bf16_stages_match_the_interpreter(context, label: str) -> None:
    graph, group, feeds = _bf16_case(label)
    configs = wgmma.KIND.propose(group, _context(graph))
    failures = []
    for j, cfg in enumerate(configs[:3]):
        kernel = generate_kernel(graph, group, cfg, f"bf16_wgmma_{j}")
        failures += _check(graph, [kernel], True, feeds)
    assert failures == []


@pytest.mark.parametrize("label", list(MODELS))
def test_bf16_transformer_plan_matches_the_interpreter(context, label: str) -> None:
    graph = import_onnx(test_bf16.to_bfloat16(MODELS[label]()))
    plan = plan_model(graph, match_gpu_name(device_name()), topk=1)
    kernels = generate_model(graph, [(g.group, g.configs[0]) for g in plan.groups])
    feeds = random_inputs(graph, seed=0)
    assert _check(graph, kernels, any(k.arch_specific for k in kernels), feeds) == []
