"""scripts/latest_rows.py: each config's latest row across tables, and the means over them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from latest_rows import latest_rows, main


def _table(path: Path, date: str, commit: str, rows: list[tuple[str, int, str, float, float, str]]) -> Path:
    doc = {
        "meta": {"date": date, "welder": f"0.1.0 @ {commit}; welder tune PREFIX"},
        "rows": [
            {
                "config": {"model": m, "batch": b, "dtype": d},
                "cells": {"welder": {"ms": w, "accuracy": acc}, "compile": {"ms": c}},
            }
            for m, b, d, w, c, acc in rows
        ],
    }
    path.write_text(json.dumps(doc))
    return path


def test_the_latest_row_of_each_config_stands_and_the_means_match_numpy(tmp_path: Path, capsys) -> None:
    old = _table(
        tmp_path / "old.json",
        "2026-11-25 10:00 UTC",
        "aaaaaaa",
        [
            ("bert", 1, "fp16", 1.0, 0.5, "PASS"),
            ("bert", 64, "fp16", 2.0, 3.0, "PASS"),
            ("nerf", 1, "fp32", 1, 2, "PASS"),
        ],
    )
    new = _table(
        tmp_path / "new.json",
        "2026-11-26 10:00 UTC",
        "bbbbbbb",
        [("bert", 1, "fp16", 0.5, 0.6, "PASS"), ("bert", 64, "fp32", 4.0, 2.0, "FAIL")],
    )
    found = latest_rows([new, old])
    assert latest_rows([old, new]) == found  # the order of the files does not matter, the dates do
    assert sorted(found) == ["bert_b1_fp16", "bert_b64_fp16", "bert_b64_fp32"]  # nerf: not a table model
    assert found["bert_b1_fp16"].commit == "bbbbbbb" and found["bert_b1_fp16"].row.cells["welder"].ms == 0.5
    assert main([str(old), str(new)]) == 0
    out = capsys.readouterr().out
    expected = np.exp(np.mean(np.log([0.6 / 0.5, 3.0 / 2.0])))
    assert f"fp16: **{expected:.2f}x** over 2 rows" in out
    assert "fp32" not in out.split("\n\n")[-1]  # the failing row is listed, not averaged
    assert "| bert | 64 | fp32 | 4.000 | 2.000 | 0.50x | FAIL |" in out
    assert main([str(tmp_path / "missing.json")]) == 2
