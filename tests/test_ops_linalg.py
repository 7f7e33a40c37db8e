"""MatMul and Gemm (welder/frontend/ops/linalg.py) against onnxruntime.

MatMul follows numpy.matmul: 1-D operands gain and lose a dimension, batch dimensions
broadcast.  Gemm combines transposes, the alpha/beta scales and an optional C that
broadcasts to the [M, N] result.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import mutually_broadcastable_shapes
from onnx_util import assert_matches_ort, single_op

from welder.errors import ModelError
from welder.frontend.onnx import import_onnx
from welder.runtime.emu import available
from welder.session import check_model


def rand(shape, dtype=np.float32, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if np.issubdtype(dtype, np.integer):
        return np.asarray(rng.integers(-4, 5, size=shape), dtype=dtype)
    return np.asarray(rng.standard_normal(shape), dtype=dtype)


def dtype_id(dtype) -> str:
    return np.dtype(dtype).name


# -- MatMul -----------------------------------------------------------------------------

MATMUL_SHAPES = [
    ((4,), (4, 3)),  # 1-D x 2-D
    ((3, 4), (4,)),  # 2-D x 1-D
    ((5,), (5,)),  # 1-D x 1-D: a scalar
    ((3, 4), (4, 5)),
    ((1, 4), (4, 1)),
    ((2, 3, 4), (2, 4, 5)),  # batched
    ((2, 3, 4), (4, 5)),  # batched x shared matrix
    ((3, 4), (2, 4, 5)),
    ((2, 1, 3, 4), (5, 4, 6)),  # broadcast batch dims, rank mismatch
    ((1, 3, 4), (2, 4, 5)),  # size-1 batch dim on the left
    ((2, 3, 4), (1, 4, 5)),  # ... and on the right
    ((4,), (2, 3, 4, 5)),  # 1-D x batched
    ((2, 3, 4, 5), (5,)),  # batched x 1-D
    ((3, 1), (1, 4)),  # K = 1
    ((2, 0, 3), (3, 4)),  # empty batch
]


@pytest.mark.parametrize("shapes", MATMUL_SHAPES, ids=str)
def test_matmul_shapes(shapes):
    a, b = rand(shapes[0], seed=1), rand(shapes[1], seed=2)
    assert_matches_ort(single_op("MatMul", {"a": a, "b": b}), {"a": a, "b": b})


@pytest.mark.parametrize("shapes", [((3, 0), (0, 4)), ((2, 3, 0), (0,)), ((0,), (2, 0, 5))], ids=str)
def test_matmul_empty_reduction(shapes):
    """K = 0 gives zeros.  Compared with numpy: onnxruntime leaves some of these outputs
    uninitialised."""
    a, b = rand(shapes[0], seed=1), rand(shapes[1], seed=2)
    got = import_onnx(single_op("MatMul", {"a": a, "b": b})).run({"a": a, "b": b})["out0"]
    expected = np.matmul(a, b)
    assert got.dtype == expected.dtype
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("dtype", [np.float16, np.float64, np.int32, np.int64], ids=dtype_id)
@pytest.mark.parametrize("shapes", [((3, 8), (8, 5)), ((2, 3, 8), (8,))], ids=str)
def test_matmul_dtypes(dtype, shapes):
    """fp16 products accumulate in fp32, so K=64 stays within the fp16 threshold."""
    a, b = rand(shapes[0], dtype, seed=3), rand(shapes[1], dtype, seed=4)
    assert_matches_ort(single_op("MatMul", {"a": a, "b": b}), {"a": a, "b": b})


def test_matmul_fp16_long_reduction():
    a, b = rand((4, 512), np.float16, seed=5), rand((512, 6), np.float16, seed=6)
    assert_matches_ort(single_op("MatMul", {"a": a, "b": b}), {"a": a, "b": b})


def test_matmul_weight_initializer():
    a = rand((2, 3, 16), seed=7)
    w = rand((16, 8), seed=8)
    assert_matches_ort(single_op("MatMul", {"a": a}, initializers={"w": w}), {"a": a})


@settings(max_examples=25, deadline=None)
@given(
    batch=mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=3, min_side=1, max_side=3),
    mkn=st.tuples(st.integers(1, 5), st.integers(1, 5), st.integers(1, 5)),
    vectors=st.tuples(st.booleans(), st.booleans()),
    seed=st.integers(0, 2**16),
)
def test_matmul_random(batch, mkn, vectors, seed):
    """Random broadcast batches; either operand may instead be a 1-D vector."""
    m, k, n = mkn
    a_shape = (k,) if vectors[0] else (*batch.input_shapes[0], m, k)
    b_shape = (k,) if vectors[1] else (*batch.input_shapes[1], k, n)
    a, b = rand(a_shape, seed=seed), rand(b_shape, seed=seed + 1)
    assert_matches_ort(single_op("MatMul", {"a": a, "b": b}), {"a": a, "b": b})


@pytest.mark.parametrize(
    "shapes", [((3, 4), (5, 6)), ((4,), (3,)), ((2, 3, 4), (3, 4, 5)), ((), (3, 4))], ids=str
)
def test_matmul_rejects_mismatched_shapes(shapes):
    """Bad shapes are a ModelError naming the node, not a crash deep in the IR.  (The
    model is not checked by ONNX shape inference first: its outputs are untyped.)"""
    a, b = rand(shapes[0]), rand(shapes[1])
    with pytest.raises(ModelError):
        import_onnx(single_op("MatMul", {"a": a, "b": b}))


# -- Gemm -------------------------------------------------------------------------------

M, K, N = 3, 5, 4


def gemm_operands(trans_a: int, trans_b: int, dtype=np.float32, seed: int = 10):
    a = rand((K, M) if trans_a else (M, K), dtype, seed)
    b = rand((N, K) if trans_b else (K, N), dtype, seed + 1)
    return a, b


@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("trans_a", [0, 1])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.5, 1.0), (1.0, 2.0), (-1.5, 0.25), (0.0, 1.0)], ids=str)
@pytest.mark.parametrize("with_c", [False, True])
def test_gemm_attributes(trans_a, trans_b, scales, with_c):
    alpha, beta = scales
    a, b = gemm_operands(trans_a, trans_b)
    feeds = {"a": a, "b": b}
    if with_c:
        feeds["c"] = rand((M, N), seed=12)
    attrs = {"transA": trans_a, "transB": trans_b, "alpha": alpha, "beta": beta}
    assert_matches_ort(single_op("Gemm", feeds, attrs), feeds)


@pytest.mark.parametrize("c_shape", [(M, N), (1, N), (N,), (M, 1), (1, 1), (1,), ()], ids=str)
@pytest.mark.parametrize("beta", [1.0, 0.5])
@pytest.mark.parametrize("as_initializer", [False, True])
def test_gemm_c_broadcast(c_shape, beta, as_initializer):
    a, b = gemm_operands(0, 1)
    c = rand(c_shape, seed=13)
    attrs = {"transB": 1, "beta": beta}
    if as_initializer:
        model = single_op("Gemm", {"a": a, "b": b}, attrs, initializers={"c": c})
        assert_matches_ort(model, {"a": a, "b": b})
    else:
        feeds = {"a": a, "b": b, "c": c}
        assert_matches_ort(single_op("Gemm", feeds, attrs), feeds)


@pytest.mark.parametrize("with_c", [False, True])
def test_gemm_empty_reduction(with_c):
    """K = 0: the product is zero and only beta * C remains.  Compared with numpy, since
    onnxruntime returns C unscaled in this case."""
    a, b = np.zeros((0, M), np.float32), rand((0, N), seed=20)
    feeds = {"a": a, "b": b}
    expected = np.zeros((M, N), np.float32)
    if with_c:
        feeds["c"] = rand((N,), seed=21)
        expected = expected + np.float32(0.5) * feeds["c"]
    graph = import_onnx(single_op("Gemm", feeds, {"transA": 1, "alpha": 2.0, "beta": 0.5}))
    got = graph.run(feeds)["out0"]
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("dtype", [np.float16, np.float64], ids=dtype_id)
@pytest.mark.parametrize("trans_a", [0, 1])
def test_gemm_dtypes(dtype, trans_a):
    a, b = gemm_operands(trans_a, 1, dtype, seed=14)
    c = rand((N,), dtype, seed=16)
    feeds = {"a": a, "b": b, "c": c}
    attrs = {"transA": trans_a, "transB": 1, "alpha": 0.5, "beta": 2.0}
    assert_matches_ort(single_op("Gemm", feeds, attrs), feeds)


def test_gemm_linear_layer():
    """The exporter's Linear: x @ W^T + b with W and b as initializers."""
    x = rand((8, 32), seed=17)
    model = single_op(
        "Gemm",
        {"x": x},
        {"transB": 1},
        initializers={"w": rand((16, 32), seed=18), "b": rand((16,), seed=19)},
    )
    assert_matches_ort(model, {"x": x})


@pytest.mark.parametrize("shapes", [((3, 4), (5, 6)), ((2, 3, 4), (4, 5)), ((4,), (4, 5))], ids=str)
def test_gemm_rejects_bad_operands(shapes):
    a, b = rand(shapes[0]), rand(shapes[1])
    with pytest.raises(ModelError):
        import_onnx(single_op("Gemm", {"a": a, "b": b}))


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=dtype_id)
def test_a_shared_weight_matrix_makes_one_flat_product(dtype):
    """``[2, 3, 50, 64] @ [64, 48]``: one product over the 300 rows of every batch (a kind
    can then tile M across batches), reshaped back; a batched right operand is not
    flattened.  The emulated plan matches onnxruntime."""
    a, b = rand((2, 3, 50, 64), dtype, seed=3), rand((64, 48), dtype, seed=4)
    model = single_op("MatMul", {"a": a, "b": b})
    graph = import_onnx(model)
    products = [n.compute for n in graph.nodes.values() if n.compute.reduce_axes]
    assert [p.shape for p in products] == [(300, 48)]
    assert graph.tensor(graph.outputs[0]).shape == (2, 3, 50, 48)
    batched = import_onnx(single_op("MatMul", {"a": a, "b": rand((3, 64, 48), dtype)}))
    assert [n.compute.shape for n in batched.nodes.values() if n.compute.reduce_axes] == [(2, 3, 50, 48)]
    assert_matches_ort(model, {"a": a, "b": b})


@pytest.mark.skipif(not available(), reason="the CPU emulator needs Linux and g++")
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=dtype_id)
def test_the_flat_product_runs_planned_and_matches(dtype, tmp_path):
    """The flat product and the reshape after it, planned and emulated, against onnxruntime."""
    a, b = rand((2, 3, 50, 64), dtype, seed=3), rand((64, 48), dtype, seed=4)
    path = tmp_path / "matmul.onnx"
    path.write_bytes(single_op("MatMul", {"a": a, "b": b}).SerializeToString())
    assert check_model(path, backend="emulate").passed
