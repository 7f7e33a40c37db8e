"""How far TF32 arithmetic alone takes a model's outputs from fp32: every MatMul and Gemm
operand rounded to TF32's 11 significant bits, the rest in fp32, both run by onnxruntime.

    python scripts/tf32_error.py MODEL.onnx [--seed S]

Prints welder's metric (``max(|a - b| / max(|b|, 1))``, welder.check) of each output.  This is
the error any TF32 implementation -- cuBLAS under torch's TF32 switch as much as welder's
``mma_tf32`` kind -- starts from, so it is what the TF32 threshold (welder.check.THRESHOLDS)
must leave room for.  The rounding is Veltkamp's split in plain fp32 ops, ``c = x * (2^13 +
1); hi = c - (c - x)``, which keeps the 11 leading bits of ``x`` rounded to nearest; graph
optimisations are off so that onnxruntime evaluates it as written.  The inputs are welder's
check inputs, as test_acc draws them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

#: 2^13 + 1: the split keeps 24 - 13 = 11 significant bits, TF32's (1 implicit + 10 stored).
SPLITTER = 8193.0


def with_tf32_products(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with both operands of every MatMul and Gemm rounded to TF32 first."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    graph.initializer.append(numpy_helper.from_array(np.array(SPLITTER, np.float32), "tf32_splitter"))
    nodes, rounded = [], {}
    for node in graph.node:
        if node.op_type in ("MatMul", "Gemm"):
            for j in range(2):
                x = node.input[j]
                if x not in rounded:  # a tensor feeding several products is rounded once
                    c, d, hi = (f"{x}/tf32_{s}" for s in ("c", "d", "hi"))
                    nodes += [
                        helper.make_node("Mul", [x, "tf32_splitter"], [c]),
                        helper.make_node("Sub", [c, x], [d]),
                        helper.make_node("Sub", [c, d], [hi]),
                    ]
                    rounded[x] = hi
                node.input[j] = rounded[x]
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    return out


def tf32_errors(model: onnx.ModelProto, seed: int = 0) -> dict[str, float]:
    """Each output's metric between the model with TF32 products and as given, on welder's
    check inputs (welder.check.random_inputs)."""
    import onnxruntime as ort

    from welder.check import error_metric, random_inputs
    from welder.frontend.onnx import import_onnx

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    exact = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    rounded = ort.InferenceSession(
        with_tf32_products(model).SerializeToString(), opts, providers=["CPUExecutionProvider"]
    )
    feeds = random_inputs(import_onnx(model), seed)
    names = [o.name for o in exact.get_outputs()]
    return {
        n: error_metric(a, b) for n, a, b in zip(names, rounded.run(names, feeds), exact.run(names, feeds))
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="an fp32 ONNX model")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not Path(args.model).is_file():
        print(f"tf32_error: no such file: {args.model}", file=sys.stderr)
        return 2
    for name, err in tf32_errors(onnx.load(args.model), args.seed).items():
        print(f"{name}: {err:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
