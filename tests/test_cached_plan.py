"""scripts/cached_plan.py: a tune's plan rebuilt from its tuning cache, with no GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import onnx
from onnx import helper
from onnx_util import make_model
from test_mma import _h
from test_tuner import ARCH, ScriptedDevice

from welder.codegen import generate_model
from welder.pipeline import planned_import
from welder.runtime.layout import kernel_sources, runtime_dir
from welder.tune.cache import DB_NAME, TuningCache
from welder.tune.tuner import tune_model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import cached_plan  # noqa: E402

GPU = "NVIDIA H100 80GB HBM3"


def _model(path: Path) -> None:
    """A product, its bias and a softmax: more than one group."""
    x = _h(64, 96)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["p"]),
        helper.make_node("Add", ["p", "b"], ["z"]),
        helper.make_node("Softmax", ["z"], ["y"], axis=-1),
    ]
    onnx.save(make_model(nodes, {"x": x}, ["y"], {"w": _h(96, 80), "b": _h(80)}, opset=17), path)


def test_the_plan_rebuilt_from_the_cache_is_the_tunes(tmp_path: Path, capsys) -> None:
    """After a tune, the script lists the tune's kernels and emits their runtime from the
    cache alone, leaving the cache as it was; a setting the tune did not use (another topk)
    names the group the cache lacks (exit 1), and a missing cache is an error (exit 2)."""
    path = tmp_path / "model.onnx"
    _model(path)
    graph = planned_import(str(path), ARCH)
    db = tmp_path / "cache"
    db.mkdir()
    plan = tune_model(graph, ARCH, 2, TuningCache(db), ScriptedDevice(graph, name=GPU))
    kernels = generate_model(graph, [(g.group, g.configs[0]) for g in plan.groups])
    before = (db / DB_NAME).read_bytes()
    out = tmp_path / "runtime"
    argv = [str(path), "--cache", str(db), "--gpu", GPU, "--arch", ARCH.name, "--topk", "2"]

    assert cached_plan.main([*argv, "-o", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    listed = [line.split()[0] for line in printed[1:] if line.startswith("welder_")]
    assert listed == [k.name[:48] for k in kernels]
    families = [line.split()[1] for line in printed[1 : 1 + len(kernels)]]
    assert families == [g.configs[0].family for g in plan.groups]
    assert (out / "model.onnx").is_file()
    emitted = [path.read_text() for path in kernel_sources(runtime_dir(out))]
    assert len(emitted) == len(kernels)
    assert all(k.source in text for k, text in zip(kernels, emitted)), "the tune's configs, kernel for kernel"
    assert (db / DB_NAME).read_bytes() == before

    assert cached_plan.main([*argv[:-1], "3"]) == 1
    assert "not in the cache for NVIDIA H100 80GB HBM3 (fake nvcc 1.0): group " in capsys.readouterr().err
    assert (db / DB_NAME).read_bytes() == before
    assert cached_plan.main([str(path), "--cache", str(tmp_path / "none.db"), "--gpu", GPU]) == 2
    assert "is not a tuning cache" in capsys.readouterr().err
