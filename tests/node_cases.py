"""The ONNX backend node-test models, loaded once per test process.

onnx builds them in memory (a few seconds per thousand), so the tile and code-generation
tests share one copy instead of each generating their own.
"""

from __future__ import annotations

import functools
import warnings

from welder.frontend.onnx import import_onnx
from welder.graph import Graph


@functools.cache
def node_cases() -> tuple:
    from onnx.backend.test.loader import load_model_tests

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tuple(c for c in load_model_tests(kind="node") if c.model is not None)


@functools.cache
def importable() -> tuple[tuple[object, Graph], ...]:
    """(case, imported graph) for every node test welder imports, with at least one node."""
    out = []
    for case in node_cases():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                graph = import_onnx(case.model)
        except Exception:
            continue
        if graph.nodes:
            out.append((case, graph))
    return tuple(out)
