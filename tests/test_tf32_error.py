"""scripts/tf32_error.py: TF32 operand rounding in ONNX ops, against numpy's bit arithmetic."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import helper
from onnx_util import make_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from tf32_error import main, tf32_errors, with_tf32_products

from welder.check import THRESHOLDS


def _round_tf32(x: np.ndarray) -> np.ndarray:
    """x rounded to 11 significant bits, to nearest, by integer arithmetic on its bits."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + (1 << 12)) & ~np.uint64((1 << 13) - 1)).astype(np.uint32).view(np.float32)


def test_operands_are_rounded_to_eleven_bits() -> None:
    """x @ I with the rounding in front is x rounded: the product by one and the zeros add
    nothing, so onnxruntime's result is the split's value exactly."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((64, 16)) * 10.0 ** rng.integers(-6, 6, (64, 1))).astype(np.float32)
    eye = {"eye": np.eye(16, dtype=np.float32)}
    model = make_model([helper.make_node("MatMul", ["x", "eye"], ["y"])], {"x": x}, ["y"], eye)
    rounded = with_tf32_products(model).SerializeToString()
    session = ort.InferenceSession(rounded, providers=["CPUExecutionProvider"])
    (y,) = session.run(None, {"x": x})
    assert np.array_equal(y, _round_tf32(x))
    assert not np.array_equal(y, x)


def test_a_products_error_is_tf32s_and_within_its_limit(tmp_path: Path, capsys) -> None:
    rng = np.random.default_rng(4)
    x = rng.standard_normal((32, 256)).astype(np.float32)
    w = (rng.standard_normal((256, 64)) / 16).astype(np.float32)
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["y"])], {"x": x}, ["y"], {"w": w})
    (err,) = tf32_errors(model).values()
    assert 1e-5 < err < THRESHOLDS["tf32"]  # far from fp32's rounding, inside TF32's limit
    path = tmp_path / "mlp.onnx"
    path.write_bytes(model.SerializeToString())
    assert main([str(path)]) == 0 and "y: " in capsys.readouterr().out
    assert main([str(tmp_path / "missing.onnx")]) == 2
