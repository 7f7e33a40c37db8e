"""How many processes welder starts: the affinity mask, capped by $WELDER_JOBS."""

from __future__ import annotations

import os

import onnx
import pytest
from onnx import TensorProto, helper

from welder.arch import get_arch
from welder.cli import main
from welder.errors import WelderError
from welder.frontend.onnx import import_onnx
from welder.hostcpu import JOBS_VARIABLE, usable_cores
from welder.schedule.engine import CostModel


def affinity() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def relu_model() -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_without_the_variable_every_core_of_the_affinity_mask(monkeypatch):
    monkeypatch.delenv(JOBS_VARIABLE, raising=False)
    assert usable_cores() == affinity()
    monkeypatch.setenv(JOBS_VARIABLE, "")
    assert usable_cores() == affinity()


@pytest.mark.parametrize("jobs", [1, 2, 3, 1000])
def test_the_variable_caps_the_cores_and_the_planning_workers(monkeypatch, jobs):
    monkeypatch.setenv(JOBS_VARIABLE, str(jobs))
    assert usable_cores() == min(jobs, affinity())
    graph = import_onnx(relu_model())
    assert CostModel(graph, get_arch("H100")).workers == min(jobs, affinity())


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_a_bad_value_is_an_error_naming_the_variable(monkeypatch, tmp_path, capsys, value):
    monkeypatch.setenv(JOBS_VARIABLE, value)
    with pytest.raises(WelderError, match=rf"\${JOBS_VARIABLE} must be a whole number.*{value!r}"):
        usable_cores()
    path = tmp_path / "relu.onnx"
    onnx.save(relu_model(), path)
    assert main(["check", str(path), "--backend", "emulate"]) == 2
    err = capsys.readouterr().err
    assert f"welder check: error: ${JOBS_VARIABLE} must be a whole number" in err
    assert "Traceback" not in err
