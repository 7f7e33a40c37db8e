"""Einsum lowering: interpreter vs onnxruntime, plus the shape of the computes it builds."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx_util import assert_matches_ort, single_op

from welder.errors import ModelError, UnsupportedError
from welder.frontend.onnx import import_onnx

# (equation, operand shapes)
CASES = [
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
    ("bhid,bhjd->bhij", [(2, 3, 5, 8), (2, 3, 6, 8)]),
    ("bhij,bhjd->bhid", [(2, 3, 5, 6), (2, 3, 6, 8)]),
    ("ij,jk->ik", [(3, 4), (4, 5)]),
    ("bid,jd->bij", [(2, 3, 4), (5, 4)]),
    ("...ij,...jk->...ik", [(2, 3, 4, 5), (2, 3, 5, 6)]),
    ("...ij,...jk->...ik", [(4, 5), (5, 6)]),
    ("...ij,...jk->...ik", [(2, 1, 4, 5), (1, 3, 5, 6)]),
    ("bij->bji", [(2, 3, 4)]),
    ("ii->i", [(4, 4)]),
    ("ii", [(4, 4)]),
    ("ij->", [(3, 4)]),
    ("ij,jk", [(3, 4), (4, 5)]),
    ("ba", [(3, 4)]),
    ("i,j->ij", [(3,), (4,)]),
    ("i,i,i->i", [(5,), (5,), (5,)]),
    ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 5)]),
    ("bij,bjk,bkl->bil", [(2, 3, 4), (2, 4, 2), (2, 2, 3)]),
    ("iij->ji", [(3, 3, 4)]),
    ("i...->...", [(2, 3, 4)]),
    (" bij , bjk -> bik ", [(2, 3, 4), (2, 4, 5)]),
    ("ij,jk->ik", [(3, 1), (4, 5)]),
    ("ij,ij->ij", [(3, 4), (3, 4)]),
    ("nchw,oc->nohw", [(2, 3, 4, 5), (6, 3)]),
    ("->", [()]),
    (",i->i", [(), (3,)]),
]


def _inputs(shapes, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    if np.issubdtype(dtype, np.integer):
        return {f"x{k}": rng.integers(-5, 5, s).astype(dtype) for k, s in enumerate(shapes)}
    return {f"x{k}": rng.standard_normal(s).astype(dtype) for k, s in enumerate(shapes)}


def _model(equation, inputs, opset=13):
    return single_op("Einsum", inputs, {"equation": equation}, opset=opset)


def _only_compute(model):
    nodes = list(import_onnx(model))
    assert len(nodes) == 1
    return nodes[0].compute


@pytest.mark.parametrize(("equation", "shapes"), CASES, ids=[c[0].strip() or "scalar" for c in CASES])
def test_matches_onnxruntime(equation, shapes):
    inputs = _inputs(shapes)
    assert_matches_ort(_model(equation, inputs), inputs)


@pytest.mark.parametrize("dtype", [np.float16, np.float64, np.int32, np.int64])
@pytest.mark.parametrize("opset", [12, 21])
def test_dtypes_and_opsets(dtype, opset):
    inputs = _inputs([(2, 3, 4), (2, 4, 5)], dtype)
    assert_matches_ort(_model("bij,bjk->bik", inputs, opset), inputs)


@settings(max_examples=15, deadline=None)
@given(
    st.data(),
    st.integers(1, 3),
)
def test_random_contractions(data, n_operands):
    """Random equations over a small alphabet: each operand draws distinct labels, the
    output keeps a random subset of the labels used."""
    alphabet = "abcde"
    size = {c: data.draw(st.integers(1, 4), label=f"size {c}") for c in alphabet}
    terms = [
        "".join(data.draw(st.permutations(alphabet), label="order")[: data.draw(st.integers(0, 3))])
        for _ in range(n_operands)
    ]
    used = sorted(set("".join(terms)))
    output = "".join(data.draw(st.permutations(used), label="out")[: data.draw(st.integers(0, len(used)))])
    equation = ",".join(terms) + "->" + output
    inputs = _inputs([tuple(size[c] for c in t) for t in terms])
    assert_matches_ort(_model(equation, inputs), inputs)


@pytest.mark.parametrize(
    ("equation", "shapes"),
    [
        ("...ij,...jk->...ik", [(2, 3, 4, 5), (3, 5, 6)]),
        ("...ij,...jk->...ik", [(2, 3, 4, 5), (1, 5, 6)]),
        ("...i,i->...", [(2, 3, 4), (4,)]),
    ],
)
def test_ellipses_of_different_ranks_broadcast(equation, shapes):
    """ONNX shape inference (and so onnxruntime) rejects ellipses of different ranks, which
    numpy broadcasts from the right; compare with numpy."""
    inputs = _inputs(shapes)
    got = import_onnx(_model(equation, inputs)).run(inputs)["out0"]
    expected = np.einsum(equation, *inputs.values())
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_attention_scores_are_one_sum_of_products():
    inputs = _inputs([(2, 3, 5, 8), (2, 3, 6, 8)])
    c = _only_compute(_model("bhid,bhjd->bhij", inputs))
    assert c.reduce_op == "sum"
    assert [a.extent for a in c.reduce_axes] == [8]
    assert c.shape == (2, 3, 5, 6)


def test_transpose_is_injective():
    inputs = _inputs([(2, 3, 4)])
    c = _only_compute(_model("bij->bji", inputs))
    assert c.is_injective
    assert c.shape == (2, 4, 3)


def test_summed_label_of_size_one_needs_no_reduction():
    inputs = _inputs([(3, 1), (1, 5)])
    assert _only_compute(_model("ij,jk->ik", inputs)).is_injective
    assert_matches_ort(_model("ij,jk->ik", inputs), inputs)


@pytest.mark.parametrize(
    ("equation", "shapes", "message"),
    [
        ("ij,jk->ik", [(3, 4), (5, 6)], "label 'j' has incompatible sizes"),
        ("ij->ik", [(3, 4)], "'k' appears in no input"),
        ("ij->ii", [(3, 3)], "appears more than once"),
        ("ijk->ij", [(3, 4)], "rank 2"),
        ("ij,jk->ik", [(3, 4)], "node has 1 input"),
        ("i2->i", [(3, 4)], "labels are letters"),
        ("ij->j->i", [(3, 4)], "'->'"),
        ("ij...->i.j", [(3, 4)], "'...'"),
        ("...ij->ij", [(2, 3, 4)], "do not"),
        ("...i,...i->...i", [(2, 3), (4, 3)], "ellipsis dimension has incompatible sizes"),
    ],
)
def test_bad_equations_name_the_node(equation, shapes, message):
    inputs = _inputs(shapes)
    with pytest.raises(ModelError, match=message) as err:
        import_onnx(_model(equation, inputs))
    assert "Einsum node 'einsum_0'" in str(err.value)


def test_bool_inputs_are_refused():
    inputs = {"x0": np.ones((2, 2), np.bool_)}
    with pytest.raises(UnsupportedError, match=r"einsum_0.*bool"):
        import_onnx(_model("ij->ji", inputs))
