"""scripts/calibration.py: measured / predicted per kernel kind, against numpy's quantiles."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import calibration  # noqa: E402


def _tuned(path: Path, groups: list[tuple[str, float | None, float]], precision: str = "fp32") -> Path:
    doc = {
        "precision": precision,
        "groups": [
            {"measured_latency_us": m, "predicted_latency_us": p, "configs": [{"stages": [{"kind": k}]}]}
            for k, m, p in groups
        ],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    return path


def test_ratios_by_kind_and_precision_match_numpy(tmp_path: Path, capsys) -> None:
    rng = np.random.default_rng(3)
    simt = rng.uniform(0.5, 3.0, 37)
    mma = rng.uniform(1.0, 5.0, 11)
    a = _tuned(tmp_path / "bert_b64_fp32" / "tuned.json", [("simt", 10.0 * r, 10.0) for r in simt])
    unmeasured = [("mma", None, 4.0)]
    b = _tuned(tmp_path / "tuned_vit_b64_fp16.json", [("mma", 4.0 * r, 4.0) for r in mma] + unmeasured)
    stats = {(s.kind, s.precision): s for s in calibration.summarise(calibration.ratios([a, b]))}
    assert set(stats) == {("simt", "fp32"), ("mma", "fp16")}
    for key, values in ((("simt", "fp32"), simt), (("mma", "fp16"), mma)):
        s = stats[key]
        assert s.groups == len(values)  # the unmeasured group is skipped
        assert s.median == pytest.approx(np.percentile(values, 50))
        assert s.p10 == pytest.approx(np.percentile(values, 10))
        assert s.p90 == pytest.approx(np.percentile(values, 90))
    assert calibration.main([str(a), str(b), "--json", str(tmp_path / "c.json")]) == 0
    assert "| simt | fp32 | 37 |" in capsys.readouterr().out
    assert len(json.loads((tmp_path / "c.json").read_text())) == 2


def test_the_target_counts_both_ways() -> None:
    assert calibration.KindStats("simt", "fp32", 9, 1.2, 0.8, 1.9).on_target
    assert not calibration.KindStats("simt", "fp32", 9, 1.4, 0.9, 1.9).on_target  # median
    assert not calibration.KindStats("mma", "fp16", 9, 1.1, 0.9, 2.5).on_target  # worst decile
    assert not calibration.KindStats("mma", "fp16", 9, 0.7, 0.6, 0.9).on_target  # predicted 1.4x slow


def test_missing_or_unmeasured_files_are_usage_errors(tmp_path: Path, capsys) -> None:
    assert calibration.main([str(tmp_path / "nope.json")]) == 2
    assert "no such file" in capsys.readouterr().err
    empty = _tuned(tmp_path / "t.json", [("simt", None, 3.0)])
    assert calibration.main([str(empty)]) == 2
    assert "no measured group" in capsys.readouterr().err
