"""A model's graph without its weights' values, small enough to bring back from a GPU machine.

    python scripts/model_skeleton.py MODEL.onnx OUT.onnx.gz

Every floating-point initializer of more than ``KEEP`` elements keeps its name, type and
shape but has its values replaced by a short repeating pattern, and the model is written
gzipped: BERT-base's 440 MB become a few megabytes at most, while the graph welder imports
from it -- its nodes, tensors, shapes, its integer and small constants (Reshape's shapes, a
product's scale, Gather's indices) -- is the one the tune planned.  ``scripts/ranking.py
--rerank --model OUT.onnx.gz`` rebuilds the tune's groups from it; its outputs mean
nothing.  ``scripts/paper_pending.sh`` packs one a case beside the tuned.json files.
"""

from __future__ import annotations

import argparse
import gzip
import sys
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import numpy_helper

#: Initializers up to this many elements keep their values (shapes, axes, scales).
KEEP = 1024


def skeleton(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every floating-point initializer of more than ``KEEP`` elements
    refilled (in place) with :func:`filler`'s values."""
    for i, tensor in enumerate(model.graph.initializer):
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))
        if dtype.kind == "f" and int(np.prod(tensor.dims, dtype=np.int64)) > KEEP:
            values = filler(tuple(tensor.dims), dtype, i)
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(values, tensor.name))
    return model


def filler(shape: tuple[int, ...], dtype: np.dtype, index: int) -> np.ndarray:
    """Values in [0.25, 1.25) repeating every 251 elements, but for the first, which is
    ``index + 2``: they compress to almost nothing, and no value is one the importer
    simplifies by (a weight of zeros or ones, or of one value throughout, is folded away),
    nor are two initializers equal (equal weights make equal products, which it merges).
    Integer tensors keep their values: indices shape what a Gather becomes."""
    n = int(np.prod(shape, dtype=np.int64))
    values = (np.arange(n) % 251) / 251 + 0.25
    values[0] = index + 2
    return values.astype(dtype).reshape(shape)


def write(source: Path, out: Path) -> None:
    out.write_bytes(gzip.compress(skeleton(onnx.load(str(source))).SerializeToString(), mtime=0))


def load(path: Path) -> onnx.ModelProto:
    """A model file, gzipped (``.gz``: a skeleton) or not."""
    data = path.read_bytes()
    return onnx.load_from_string(gzip.decompress(data) if path.suffix == ".gz" else data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", type=Path, help="the ONNX model")
    parser.add_argument("out", type=Path, help="where to write its skeleton (gzipped)")
    args = parser.parse_args(argv)
    try:
        write(args.model, args.out)
    except (OSError, ValueError, DecodeError) as e:
        print(f"model_skeleton: {args.model}: {e or type(e).__name__}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
