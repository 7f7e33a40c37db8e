"""scripts/model_skeleton.py: a model's graph with its large weights refilled, gzipped."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from models import bert_encoder_layer, mobilenetv2_block
from onnx import numpy_helper

from welder.frontend.onnx import import_onnx
from welder.pipeline import planned_graph

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import model_skeleton  # noqa: E402


@pytest.mark.parametrize(("make", "keep"), [(bert_encoder_layer, 1024), (mobilenetv2_block, 16)])
def test_the_skeleton_imports_as_the_graph_the_model_plans(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make, keep: int
) -> None:
    """The nodes and every tensor's shape and type are the model's, and so is the graph
    welder plans from it; the large weights are refilled, the small constants kept; the file
    is a fraction of the model's.  (The test block's weights are small: with a lower bound
    its batch norms, folded into the convolutions on import, are refilled too.)"""
    monkeypatch.setattr(model_skeleton, "KEEP", keep)
    model = make()[0]
    source, out = tmp_path / "model.onnx", tmp_path / "model.onnx.gz"
    onnx.save(model, source)
    assert model_skeleton.main([str(source), str(out)]) == 0
    skeleton = model_skeleton.load(out)
    assert [(n.op_type, list(n.input), list(n.output)) for n in skeleton.graph.node] == [
        (n.op_type, list(n.input), list(n.output)) for n in model.graph.node
    ]
    refilled = 0
    for i, (before, after) in enumerate(zip(model.graph.initializer, skeleton.graph.initializer)):
        a, b = numpy_helper.to_array(before), numpy_helper.to_array(after)
        assert (after.name, b.shape, b.dtype) == (before.name, a.shape, a.dtype)
        if a.size > model_skeleton.KEEP and a.dtype.kind == "f":
            refilled += 1
            assert np.array_equal(b, model_skeleton.filler(a.shape, a.dtype, i))
        else:
            assert np.array_equal(a, b)
    assert refilled
    assert out.stat().st_size < source.stat().st_size / 5, (out.stat().st_size, source.stat().st_size)
    want, got = planned_graph(import_onnx(source)), planned_graph(import_onnx(skeleton))
    assert list(got.nodes) == list(want.nodes)
    names = {t for n in want.nodes.values() for t in (*n.inputs, n.name)}
    assert all(got.tensor(t).shape == want.tensor(t).shape for t in names)
    assert all(got.tensor(t).dtype == want.tensor(t).dtype for t in names)


def test_a_file_that_is_no_model_is_an_error_naming_it(tmp_path: Path, capsys) -> None:
    bad, out = tmp_path / "bad.onnx", tmp_path / "out.onnx.gz"
    bad.write_text("not a model")
    assert model_skeleton.main([str(bad), str(out)]) == 2
    assert "bad.onnx" in capsys.readouterr().err and not out.exists()
    assert model_skeleton.main([str(tmp_path / "missing.onnx"), str(out)]) == 2
