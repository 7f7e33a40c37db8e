"""welder: a tile-graph scheduling compiler for ONNX inference.

The package reads as the pipeline: ``frontend`` (ONNX -> Graph of Computes), ``ir`` (the
tensor-expression IR and its reference interpreter), ``tile`` and ``schedule`` (tiling
and fusion decisions), ``codegen`` (CUDA from templates) and ``runtime`` (the standalone
library and its CPU emulation).  ``InferenceSession`` sits on top.
"""

from welder.errors import ModelError, ShapeError, UnsupportedError, WelderError
from welder.frontend.onnx import import_onnx
from welder.graph import Graph
from welder.session import InferenceSession

__version__ = "0.1.0"

__all__ = [
    "Graph",
    "InferenceSession",
    "ModelError",
    "ShapeError",
    "UnsupportedError",
    "WelderError",
    "import_onnx",
]
