"""Implicit-GEMM convolutions on a real GPU: the cases of tests/test_mma_conv.py (3x3, strided,
ResNet's 7x7 stem, patch embedding, dilation, wide groups, a fused bias + ReLU + residual),
each under its tensor-core kind's best configs (``mma``, and ``wgmma`` on a 9.0 GPU),
compiled by nvcc for this GPU, launched through pycuda and compared with onnxruntime.
Skipped without pycuda and a GPU (``scripts/gpu_suite.sh`` runs them)."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_fixtures import ANY_GPU, cuda_context
from test_gpu import run_native
from test_mma_conv import IMPLICIT, KINDS, _implicit, _onnxruntime

from welder.arch import match_gpu_name
from welder.check import error_metric, threshold_for
from welder.codegen import generate_kernel
from welder.device.gpu import (
    GpuModule,
    compile_cubin,
    compute_capability,
    device_name,
    sm_arch,
)
from welder.frontend.onnx import import_onnx
from welder.schedule.group import make_group
from welder.schedule.kinds import Options, ScheduleContext

pytestmark = ANY_GPU


@pytest.fixture(scope="module")
def context():
    """A CUDA context of this process."""
    with cuda_context() as ctx:
        yield ctx


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("label", list(IMPLICIT))
def test_implicit_gemm_conv_matches_onnxruntime_on_the_gpu(context, label: str, kind: str) -> None:
    rule = KINDS[kind]
    capability = compute_capability()
    if not rule.runs_on(capability):
        pytest.skip(f"no {kind} instructions on compute capability {capability}")
    model, feeds = _implicit(label)
    graph = import_onnx(model)
    group = make_group(graph, list(graph.nodes))
    ctx = ScheduleContext(
        lambda t: graph.tensor(t).shape,
        lambda t: graph.tensor(t).dtype,
        match_gpu_name(device_name()),
        Options(topk=50),
    )
    configs = rule.propose(group, ctx)
    assert configs, f"{label}: the {kind} rule proposed nothing"
    chosen = list({cfg.stages[0].block: cfg for cfg in reversed(configs)}.values())[-3:]
    kernels = [generate_kernel(graph, group, cfg, f"conv_{j}") for j, cfg in enumerate(chosen)]
    arch = sm_arch(capability, arch_specific=any(k.arch_specific for k in kernels))
    module = GpuModule(compile_cubin([k.source for k in kernels], arch))
    reference = _onnxruntime(model, feeds)
    for cfg, kernel in zip(chosen, kernels):
        for _ in range(2):  # a second launch finds the state the first left
            out = run_native(graph, [kernel], module, feeds)["y"]
            err = error_metric(out, reference)
            assert np.isfinite(err) and err <= threshold_for("float16"), f"{cfg.stages[0]}: error {err:.3e}"
