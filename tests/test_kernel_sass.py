"""scripts/kernel_sass.py: a tuned group's kernel regenerated, compiled, and its SASS counted."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper
from onnx_util import make_model

from welder.cli import main as welder_main

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import kernel_sass  # noqa: E402

SASS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;                     /* 0x00000a00ff017b82 */
        /*0010*/                   S2R R0, SR_TID.X ;                         /* 0x0000000000007919 */
        /*0020*/              @!P0 IMAD.MOV.U32 R3, RZ, RZ, R0 ;              /* 0x000000ffff038224 */
        /*0030*/               @P1 LDG.E.U16 R4, desc[UR4][R2.64] ;           /* 0x0000000402047981 */
        /*0040*/                   IMAD.WIDE R2, R0, 0x2, R2 ;                /* 0x0000000200027825 */
        /*0050*/                   HMMA.16816.F32 R8, R12, R16, R8 ;          /* 0x000000100c08723c */
        /*0060*/             @!UP0 BRA 0x10 ;                                 /* 0x0000000000008947 */
        /*0070*/                   EXIT ;                                     /* 0x000000000000794d */
"""


def test_opcodes_are_counted_by_class_predicates_included() -> None:
    counts = kernel_sass.opcode_counts(SASS)
    # Brute force: the first word after the address that is not a predicate, up to its dot.
    expected: dict[str, int] = {}
    for line in SASS.strip().splitlines():
        words = line.split("*/", 1)[1].split()
        word = words[1] if words[0].startswith("@") else words[0]
        op = word.split(".")[0]
        expected[op] = expected.get(op, 0) + 1
    assert counts == expected
    assert counts["IMAD"] == 2 and counts["LDG"] == 1 and counts["BRA"] == 1


PTX = """
.visible .entry other(
)
{
	ret;
}
.visible .entry k(
	.param .u64 k_param_0
)
{
	.reg .b32 	%r<4>;
	mov.u32 	%r1, 0;
$L__BB0_1:
	ld.shared.v2.f32 	{%f1, %f2}, [%r1];
	add.s32 	%r1, %r1, 1;
	setp.lt.s32 	%p1, %r1, 8;
	@%p1 bra 	$L__BB0_1;
	@%p1 bra 	$L__BB0_2;
	mov.u32 	%r2, 1;
$L__BB0_2:
	ret;
}
"""


def test_instructions_between_a_label_and_a_branch_back_to_it_are_a_loop() -> None:
    """Counted by hand: 8 instructions in ``k`` (declarations are not), of which the load,
    the add, the compare and the back branch lie in the loop; the forward branch and what
    follows it do not."""
    assert kernel_sass.straight_line_fraction(PTX, "k") == 4 / 8
    assert kernel_sass.straight_line_fraction(PTX, "other") == 1.0


def test_ptxas_reports_are_read() -> None:
    log = (
        "ptxas info    : Used 136 registers, used 1 barriers\n"
        "    24 bytes stack frame, 8 bytes spill stores, 16 bytes spill loads\n"
    )
    assert kernel_sass.ptxas_facts(log) == (136, 24, 8, 16)
    with pytest.raises(ValueError, match="no ptxas report"):
        kernel_sass.ptxas_facts("nothing here")


def _tuned(tmp_path: Path) -> Path:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 96)).astype(np.float16)
    w = rng.standard_normal((96, 128)).astype(np.float16)
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["y"])], {"x": x}, ["y"], {"w": w})
    out = tmp_path / "mm"
    out.mkdir()
    onnx.save(model, str(out / "model.onnx"))
    assert welder_main(["tune", str(out), "--arch", "H100", "--cost-model", "--no-build"]) == 0
    return out


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_a_tuned_group_is_compiled_and_counted(tmp_path: Path, capsys) -> None:
    prefix = _tuned(tmp_path)
    out = tmp_path / "sass.json"
    assert kernel_sass.main([str(prefix), "--json", str(out)]) == 0
    [result] = json.loads(out.read_text())
    tuned = json.loads((prefix / "tuned.json").read_text())
    assert result["group"] == tuned["groups"][0]["root"]
    assert 0 < result["registers"] <= 255
    assert result["spill_store_bytes"] == 0
    assert result["blocks"] == tuned["groups"][0]["kernel"]["grid"]
    if shutil.which("cuobjdump"):
        assert result["opcodes"].get("EXIT", 0) >= 1
        assert sum(result["opcodes"].values()) <= result["instructions"]
    else:
        assert result["opcodes"] == {}
        assert "no opcode classes" in capsys.readouterr().out
    assert result["instructions"] > 0 and 0.0 < result["straight_line"] <= 1.0


def test_group_tools_rebuild_groups_of_the_graph_the_tuner_planned(tmp_path: Path, capsys) -> None:
    """The tuner plans the graph with an operand's constant scale moved past the product (a
    member named ``...:unscaled`` that the imported graph lacks): kernel_sass and mma_why rebuild
    the tuned groups from that graph, not the imported one."""
    import mma_why

    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 96)).astype(np.float16)
    w = rng.standard_normal((96, 128)).astype(np.float16)
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"]), helper.make_node("MatMul", ["xs", "w"], ["y"])]
    model = make_model(nodes, {"x": x}, ["y"], {"w": w, "s": np.array(0.125, np.float16)})
    prefix = tmp_path / "scaled"
    prefix.mkdir()
    onnx.save(model, str(prefix / "model.onnx"))
    assert welder_main(["tune", str(prefix), "--arch", "H100", "--cost-model", "--no-build"]) == 0
    tuned = json.loads((prefix / "tuned.json").read_text())
    assert any(m.endswith(":unscaled") for g in tuned["groups"] for m in g["members"])
    capsys.readouterr()
    assert mma_why.main([str(prefix), "--all"]) == 0
    assert "1 groups with an accepted contraction" in capsys.readouterr().out
    if shutil.which("nvcc") is not None:
        assert kernel_sass.main([str(prefix)]) == 0


def test_what_cannot_be_studied_is_said(tmp_path: Path, capsys) -> None:
    assert kernel_sass.main([str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err
    prefix = _tuned(tmp_path)
    assert kernel_sass.main([str(prefix), "--group", "no such root"]) == 2
    assert "no generated group" in capsys.readouterr().err
