"""The tuner's correctness check follows the precision each group output is computed in,
and the fusion check says when it could not split a slow group.

The case is a ConvNeXt block in fp16 (7x7 depthwise conv, LayerNorm over channels,
pointwise MLP with GELU, layer scale, residual).  LayerNorm's statistics are fp32 tensors
computed from the fp16 convolution, so a group that ends in them has an fp32 output whose
value carries fp16 rounding.  A GPU rounds fp16 results differently from the reference
interpreter (another accumulation order, fused multiply-adds); ``OtherRoundingDevice``
stands for one by moving two in three fp16 values it computes by one unit in the last
place, up or down.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from onnx import helper
from onnx_util import make_model
from test_tuner import ARCH, ScriptedDevice, evaluate_outputs, stages_of

from welder.check import (
    THRESHOLDS,
    cone_float_dtypes,
    error_metric,
    output_threshold,
    output_thresholds,
    threshold_for,
)
from welder.frontend.onnx import import_onnx
from welder.graph import Graph
from welder.ir.expr import Load
from welder.schedule.engine import CostModel, fuse
from welder.schedule.plan import format_summary, tuned_json
from welder.session import check_model
from welder.tune.measure import group_inputs
from welder.tune.reference import select_rows, whole_outputs
from welder.tune.tuner import tune_model


def convnext_block(channels: int = 16, size: int = 8, seed: int = 0) -> Graph:
    """One ConvNeXt block in fp16, batch 1, as the torch exporter writes it (NHWC between
    the two Transposes, GELU through Erf)."""
    rng = np.random.default_rng(seed)

    def h(*shape: int, std: float = 1.0) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float16)

    c = channels
    n = helper.make_node
    nodes = [
        n("Conv", ["x", "dw_w", "dw_b"], ["dw"], group=c, kernel_shape=[7, 7], pads=[3, 3, 3, 3]),
        n("Transpose", ["dw"], ["nhwc"], perm=[0, 2, 3, 1]),
        n("LayerNormalization", ["nhwc", "ln_s", "ln_b"], ["ln"], axis=-1, epsilon=1e-6),
        n("MatMul", ["ln", "w1"], ["fc1"]),
        n("Add", ["fc1", "b1"], ["fc1b"]),
        n("Div", ["fc1b", "sqrt2"], ["gd"]),
        n("Erf", ["gd"], ["ge"]),
        n("Add", ["ge", "one"], ["ga"]),
        n("Mul", ["fc1b", "ga"], ["gm"]),
        n("Mul", ["gm", "half"], ["gelu"]),
        n("MatMul", ["gelu", "w2"], ["fc2"]),
        n("Add", ["fc2", "b2"], ["fc2b"]),
        n("Mul", ["fc2b", "gamma"], ["scaled"]),
        n("Transpose", ["scaled"], ["nchw"], perm=[0, 3, 1, 2]),
        n("Add", ["x", "nchw"], ["y"]),
    ]
    weights = {
        "dw_w": h(c, 1, 7, 7, std=1 / 7),
        "dw_b": h(c, std=0.1),
        "ln_s": h(c, std=0.2) + np.float16(1),
        "ln_b": h(c, std=0.1),
        "w1": h(c, 4 * c, std=c**-0.5),
        "b1": h(4 * c, std=0.1),
        "sqrt2": np.array(2**0.5, np.float16),
        "one": np.array(1, np.float16),
        "half": np.array(0.5, np.float16),
        "w2": h(4 * c, c, std=(4 * c) ** -0.5),
        "b2": h(c, std=0.1),
        "gamma": h(c, std=0.5),
    }
    return import_onnx(make_model(nodes, {"x": h(1, c, size, size)}, ["y"], weights))


def other_rounding(graph: Graph, known: dict[str, np.ndarray], names: list[str]) -> list[np.ndarray]:
    """Outputs ``names`` from the tensors in ``known``, every fp16 value computed on the way
    by arithmetic one ulp up on every third element and one down on the next (copies, and
    fp32 or wider values, are exact)."""

    def nudge(compute, v: np.ndarray) -> np.ndarray:
        if v.dtype != np.float16 or isinstance(compute.body, Load):  # copies are exact
            return v
        v = v.copy()
        flat = v.reshape(-1)
        flat[::3] = np.nextafter(flat[::3], np.float16(np.inf))
        flat[1::3] = np.nextafter(flat[1::3], np.float16(-np.inf))
        return v

    return evaluate_outputs(graph, known, names, nudge)


class OtherRoundingDevice(ScriptedDevice):
    """A fake GPU whose kernels compute through :func:`other_rounding`."""

    def run(self, program, kernel, inputs, rows=None) -> list[np.ndarray]:
        outs = super().run(program, kernel, inputs, rows)  # keeps the fake's bookkeeping and failures
        if self.what(kernel) != "ok":
            return outs
        names = [p.tensor for p in kernel.params if not p.is_output]
        rounded = other_rounding(
            self.graph, dict(zip(names, inputs)), [p.tensor for p in kernel.params if p.is_output]
        )
        return [select_rows(o, rows) for o in rounded]


def deep_is_slow(kernel) -> float:
    """Kernels of more than three stages measure far over their prediction."""
    return 1000.0 if stages_of(kernel) > 3 else 1.0


@pytest.fixture(scope="module")
def block() -> Graph:
    return convnext_block()


def _fp32_outputs(graph: Graph, outputs) -> list[str]:
    return [o for o in outputs if graph.tensor(o).dtype == "float32"]


# -- thresholds -----------------------------------------------------------------------------


def _mixed_graph() -> Graph:
    """``a = float(x16)``, ``b = relu(a)``, ``c = relu(w32)``, ``k = argmax(x16)``."""
    nodes = [
        helper.make_node("Cast", ["x"], ["a"], to=1),
        helper.make_node("Relu", ["a"], ["b"]),
        helper.make_node("Relu", ["w"], ["c"]),
        helper.make_node("ArgMax", ["x"], ["k"], axis=1),
    ]
    feeds = {"x": np.ones((2, 3), np.float16), "w": np.ones((2, 3), np.float32)}
    return import_onnx(make_model(nodes, feeds, ["b", "c", "k"]))


def test_threshold_follows_the_lowest_precision_of_the_cone():
    g = _mixed_graph()
    fp16, fp32 = THRESHOLDS["fp16"], THRESHOLDS["fp32"]
    assert output_thresholds(g, ["b", "c", "k"]) == {"b": fp16, "c": fp32, "k": 0.0}
    assert cone_float_dtypes(g, "b") == {"float16", "float32"}
    # A group that starts at the fp32 tensor a: kernel and reference read the same a.
    assert output_threshold(g, "b", members=["b"]) == fp32
    assert output_threshold(g, "b", members=["a", "b"]) == fp16
    # The arithmetic's own limit still applies where it is looser.
    assert output_threshold(g, "c", precision="tf32") == THRESHOLDS["tf32"]


def test_check_model_holds_an_fp32_output_of_fp16_values_to_the_fp16_limit(tmp_path):
    nodes = [
        helper.make_node("Cast", ["x"], ["a"], to=1),
        helper.make_node("Relu", ["a"], ["b"]),
        helper.make_node("Relu", ["w"], ["c"]),
    ]
    feeds = {"x": np.ones((2, 3), np.float16), "w": np.ones((2, 3), np.float32)}
    path = tmp_path / "m.onnx"
    path.write_bytes(make_model(nodes, feeds, ["b", "c"]).SerializeToString())
    report = check_model(path)
    limits = {o.name: o.threshold for o in report.outputs}
    assert limits == {"b": THRESHOLDS["fp16"], "c": THRESHOLDS["fp32"]}
    assert report.passed


def test_convnext_statistics_are_fp32_outputs_of_fp16_values(block):
    ln_stats = [t for t in block.nodes if t.startswith("ln:") and block.tensor(t).dtype == "float32"]
    assert ln_stats, "LayerNorm's statistics are expected in fp32"
    for t in ln_stats:
        assert output_threshold(block, t, members=list(block.nodes)) == THRESHOLDS["fp16"]


# -- the fusion check -------------------------------------------------------------------------


def test_convnext_split_is_accepted_under_the_dtype_following_threshold(block, caplog):
    """The deep fused group measures far over its prediction; its shallower parts, some
    ending in LayerNorm's fp32 statistics, are checked against the fp16 limit and replace
    it.  Under the old limit (the output dtype's alone) the same values would have failed."""
    deep = max(fuse(block, CostModel(block, ARCH)).groups, key=lambda g: len(g.stages))
    assert len(deep.stages) > 3
    device = OtherRoundingDevice(block, latency=deep_is_slow)
    with caplog.at_level(logging.WARNING, logger="welder.tune"):
        plan = tune_model(block, ARCH, 2, None, device)
    assert not any("dropped (wrong)" in r.getMessage() for r in caplog.records)
    assert plan.split_failures == []
    assert any("split into" in line for line in plan.log)
    assert all(len(g.group.stages) <= 3 for g in plan.groups)
    assert sorted(m for g in plan.groups for m in g.group.members) == sorted(block.nodes)

    fp32_checked = 0
    for g in plan.groups:
        group = g.group
        for o in _fp32_outputs(block, group.outputs):
            feeds = group_inputs(block, group)
            ours = other_rounding(block, dict(feeds), [o])[0]
            ref = whole_outputs(block, group, feeds)[o]
            err = error_metric(ours, ref)
            assert threshold_for("float32") < err <= output_threshold(block, o, group.members)
            fp32_checked += 1
    assert fp32_checked >= 1, "the split was expected to cut at an fp32 statistic"


def test_a_split_whose_parts_all_fail_is_reported(block, caplog):
    """Every candidate of every shallower group is wrong (as the old fp32 limit judged the
    halved parts of the ConvNeXt group, each ending in LayerNorm's fp32 statistics; the
    other way to split it must fail too): the slow group stays, loudly, in the log, the
    plan, tuned.json and the summary."""
    device = OtherRoundingDevice(
        block, latency=deep_is_slow, behaviour=lambda k: "wrong" if stages_of(k) <= 3 else "ok"
    )
    with caplog.at_level(logging.WARNING, logger="welder.tune"):
        plan = tune_model(block, ARCH, 2, None, device)
    assert len(plan.groups) == 1 and len(plan.groups[0].group.stages) > 3
    (failure,) = plan.split_failures
    assert failure.root == plan.groups[0].group.root
    assert set(failure.members) == set(block.nodes)
    assert {"Conv", "LayerNormalization", "MatMul"} <= set(failure.ops)
    assert "has no valid candidate" in failure.reason and "wrong" in failure.reason
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"could not split group {failure.root}" in w and "Conv" in w for w in warnings)
    doc = tuned_json(plan, block)
    assert doc["split_failures"][0]["root"] == failure.root
    assert doc["split_failures"][0]["measured_latency_us"] == 1000.0
    assert f"warning: fusion check could not split group {failure.root}" in format_summary(plan, block)
