"""Staging buffers that start before their region so that vector loads start aligned.

A depthwise 3x3 convolution with padding reads each block's rows from one element before
its tile: no vector of 16 bytes starts there, and the staging loop fell back to single
elements.  The buffer now starts at the aligned element before (``StagedInput.shift``) and
rounds its width up; the kernels index it from that origin.  Every config the SIMT policy
proposes for depthwise convolutions in fp16 and fp32 is run on the CPU emulator and
compared with the interpreter, and the proposals must include shifted buffers loaded in
vectors -- else the test would not exercise them.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper
from onnx_util import make_model
from test_mma import _context, emulate_configs, needs_emulator

from welder.check import error_metric, threshold_for
from welder.codegen import generate_kernel
from welder.frontend.onnx import import_onnx
from welder.schedule.group import make_group
from welder.schedule.kinds import simt


def _depthwise(dtype: type, channels: int = 8, size: int = 32, stride: int = 1) -> tuple:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, channels, size, size)).astype(dtype)
    w = (rng.standard_normal((channels, 1, 3, 3)) / 3).astype(dtype)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], group=channels, strides=[stride] * 2),
        helper.make_node("Sigmoid", ["c"], ["s"]),
        helper.make_node("Mul", ["c", "s"], ["y"]),
    ]
    return make_model(nodes, {"x": x}, ["y"], {"w": w}, opset=13), {"x": x}


@needs_emulator
@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["fp16", "fp32"])
def test_shifted_staging_matches_the_interpreter(dtype: type) -> None:
    model, feeds = _depthwise(dtype)
    graph = import_onnx(model)
    group = make_group(graph, list(graph.nodes))
    configs = simt.KIND.propose(group, _context(graph, topk=8))
    shifted = [c for c in configs if any(sd.shift for st in c.stages for sd in getattr(st, "staged", ()))]
    assert shifted, "no proposal stages a shifted buffer"
    kernels = [generate_kernel(graph, group, c, f"k{j}") for j, c in enumerate(shifted)]
    assert all("welder_vload" in k.source for k in kernels)  # the staging loads are vectors
    reference = graph.run(feeds)["y"]
    limit = threshold_for(np.dtype(dtype).name)
    for cfg, outputs in zip(shifted, emulate_configs(graph, group, shifted, feeds)):
        err = error_metric(outputs[0]["y"], reference)
        assert err <= limit, (cfg.block_tile, err)


def test_superset_only_where_the_offset_alone_spoils_alignment() -> None:
    """Rows of 32 halves read from one before the tile: 8 halves earlier, 40 wide.  A row
    length no vector divides, or a buffer that would grow by more than half, keeps the
    region as it is."""
    graph = import_onnx(_depthwise(np.float16)[0])
    group = make_group(graph, list(graph.nodes))
    configs = simt.KIND.propose(group, _context(graph, topk=8))
    for cfg in configs:
        for st in cfg.stages:
            for sd in getattr(st, "staged", ()):
                if sd.shift:
                    assert sd.extents[-1] % 8 == 0 and 0 < sd.shift < 8
    odd = import_onnx(_depthwise(np.float16, size=30)[0])
    group = make_group(odd, list(odd.nodes))
    for cfg in simt.KIND.propose(group, _context(odd, topk=8)):
        assert not any(sd.shift for st in cfg.stages for sd in getattr(st, "staged", ()))
