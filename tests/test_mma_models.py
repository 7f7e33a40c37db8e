"""Half-precision models end to end without a GPU: the plan puts their products on tensor
cores, the runtime's PTX holds the tensor-core instructions, and the emulated kernels match
onnxruntime (``welder check --backend emulate``)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import onnx
import pytest
from models import bert_encoder_layer, vit_block
from onnx_util import to_half

from welder.arch import get_arch
from welder.codegen import generate_model, model_source
from welder.frontend.onnx import import_onnx
from welder.resources import TEMPLATE_DIR
from welder.runtime.emu import available
from welder.schedule.plan import plan_model
from welder.session import check_model

#: Sizes where the cost model puts at least one product on tensor cores (smaller ones stay
#: fused into SIMT groups, which it rightly estimates faster).
MODELS = {
    "bert layer": lambda: bert_encoder_layer(seq=64, hidden=256, heads=4, ffn=512)[0],
    "vit block": lambda: vit_block(image=64, patch=8, dim=256, heads=4, mlp=1024)[0],
}


def _half(label: str, tmp_path: Path) -> Path:
    path = tmp_path / f"{label.replace(' ', '_')}.onnx"
    onnx.save(to_half(MODELS[label]()), str(path))
    return path


@pytest.mark.skipif(not available(), reason="the CPU emulator needs Linux and g++")
@pytest.mark.parametrize("label", list(MODELS))
def test_half_model_on_tensor_cores_matches_onnxruntime(label: str, tmp_path: Path) -> None:
    path = _half(label, tmp_path)
    graph = import_onnx(path)
    plan = plan_model(graph, get_arch("H100"), topk=1)
    kinds = [st.kind for g in plan.groups for st in g.configs[0].stages]
    assert {"mma", "wgmma", "attention"} & set(kinds), f"{label}: no product on tensor cores ({kinds})"
    report = check_model(path, backend="emulate")
    assert report.passed, report


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("label", list(MODELS))
def test_half_model_compiles_to_tensor_core_instructions(label: str, tmp_path: Path) -> None:
    graph = import_onnx(_half(label, tmp_path))
    plan = plan_model(graph, get_arch("H100"), topk=1)
    kernels = generate_model(graph, [(g.group, g.configs[0]) for g in plan.groups])
    source = tmp_path / "model.cu"
    source.write_text(model_source(kernels))
    ptx = tmp_path / "model.ptx"
    arch = "sm_90a" if any(k.arch_specific for k in kernels) else "sm_90"  # wgmma kernels
    subprocess.run(
        ["nvcc", "-std=c++17", f"-arch={arch}", "-I", str(TEMPLATE_DIR), "-ptx", str(source), "-o", str(ptx)],
        check=True,
        capture_output=True,
    )
    text = ptx.read_text()
    mma_sync = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in text and "ldmatrix.sync.aligned" in text
    assert mma_sync or "wgmma.mma_async.sync.aligned" in text
    assert "cp.async.cg.shared.global" in text
