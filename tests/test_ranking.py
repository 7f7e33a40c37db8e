"""scripts/ranking.py: the cost model's ranking of each group's configs against their times."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from test_tuner import ARCH, ScriptedDevice, layernorm_gelu

from welder.schedule.plan import tuned_json
from welder.tune.compile import candidate_index
from welder.tune.tuner import tune_model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import ranking  # noqa: E402


def _record(rank: int, estimate: float, measured: float | None, dropped: str | None = None) -> dict:
    config = {"stages": [{"kind": "simt"}], "estimate": {"latency_us": estimate}}
    return {"rank": rank, "measured_us": measured, "dropped": dropped, "config": config}


def _tuned(path: Path, timed: dict[str, list[dict]]) -> Path:
    path.write_bytes(gzip.compress(json.dumps({"groups": [], "timed": timed}).encode()))
    return path


def _brute_spearman(a: list[float], b: list[float]) -> float:
    """Mean ranks counted element by element, then numpy's Pearson correlation."""

    def ranks(v: list[float]) -> list[float]:
        return [sum(y < x for y in v) + (sum(y == x for y in v) - 1) / 2 for x in v]

    return float(np.corrcoef(ranks(a), ranks(b))[0, 1])


def test_spearman_matches_a_brute_force_count_with_ties() -> None:
    rng = np.random.default_rng(0)
    for n in (2, 3, 5, 9):
        for _ in range(20):
            a = [float(x) for x in rng.integers(0, 4, n)]
            b = [float(x) for x in rng.integers(0, 4, n)]
            if len(set(a)) < 2 or len(set(b)) < 2:
                assert ranking.spearman(a, b) == 0.0
                continue
            assert ranking.spearman(a, b) == pytest.approx(_brute_spearman(a, b))
    assert ranking.spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)


def test_regret_first_place_and_worst_decile_per_kind(tmp_path: Path) -> None:
    """Dropped configs and configs found wrong do not count; a group needs two kept."""
    timed = {
        "good": [_record(0, 1.0, 10.0), _record(1, 2.0, 12.0), _record(2, 3.0, 15.0)],
        "bad": [_record(0, 1.0, 30.0), _record(1, 2.0, 25.0, "wrong"), _record(2, 3.0, 20.0)],
        "half": [_record(0, 1.0, 8.0, "compile"), _record(1, 2.0, 9.0), _record(2, 3.0, None, "launch")],
    }
    found = ranking.groups([_tuned(tmp_path / "m_b1_fp16.json.gz", timed)])
    by = {g.signature: g for g in found}
    assert set(by) == {"good", "bad"}
    assert by["good"].regret == 1.0 and by["good"].fastest_rank == 0 and by["good"].rho == pytest.approx(1.0)
    assert by["bad"].regret == pytest.approx(1.5) and by["bad"].fastest_rank == 2
    assert by["bad"].ranks == (0, 2) and by["bad"].rho == pytest.approx(-1.0)
    [stats] = ranking.summarise(found)
    assert (stats.kind, stats.precision, stats.groups) == ("simt", "fp16", 2)
    regrets = [1.0, 1.5]
    assert stats.regret_median == pytest.approx(np.quantile(regrets, 0.5))
    assert stats.regret_p90 == pytest.approx(np.quantile(regrets, 0.9))
    assert stats.first_share == 0.5
    kept = [(10.0, 1.0), (12.0, 2.0), (15.0, 3.0), (30.0, 1.0), (20.0, 3.0)]
    ratios = np.array([t / e for t, e in kept])
    assert stats.ratio_median == pytest.approx(np.median(ratios))
    assert stats.ratio_log_sd == pytest.approx(np.std(np.log(ratios)))


def test_a_tuned_json_from_the_tuner_reads_back(tmp_path: Path) -> None:
    """The tuner's own timed table: every group's configs timed slowest-first-ranked (the
    last ranked the fastest), so each regret is the first time over the last."""
    graph = layernorm_gelu()
    device = ScriptedDevice(graph, latency=lambda k: 10.0 - candidate_index(k.name))
    plan = tune_model(graph, ARCH, 3, None, device)
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps(tuned_json(plan, graph)))
    found = ranking.groups([path])
    assert found and len(found) == len({g.signature for g in found})
    for g in found:
        n = len(g.times)
        assert g.times == tuple(10.0 - k for k in range(n))
        assert g.regret == pytest.approx(10.0 / (10.0 - (n - 1)))
        assert g.fastest_rank == n - 1
    assert ranking.main([str(path), "--worst", "2"]) == 0


def test_files_without_timed_configs_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert ranking.main([str(tmp_path / "missing.json")]) == 2
    assert "no such file" in capsys.readouterr().err
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"groups": []}))
    assert ranking.main([str(old)]) == 2
    assert "no group with two or more timed configs" in capsys.readouterr().err


def test_table_lists_each_kind_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    timed = {f"g{i}": [_record(0, 1.0, 1.0 + i), _record(1, 2.0, 1.5)] for i in range(3)}
    path = _tuned(tmp_path / "m_b64_fp32.json.gz", timed)
    out_json = tmp_path / "r.json"
    assert ranking.main([str(path), "--json", str(out_json)]) == 0
    table = capsys.readouterr().out
    assert sum(line.startswith("| simt | fp32 | 3 |") for line in table.splitlines()) == 1
    [entry] = json.loads(out_json.read_text())
    assert (entry["kind"], entry["precision"], entry["groups"]) == ("simt", "fp32", 3)
    assert entry["first_share"] == pytest.approx(1 / 3)  # g0: 1.0 us first, 1.5 after


def _tuned_doc(tmp_path: Path, latency) -> tuple[object, dict, Path]:
    graph = layernorm_gelu()
    plan = tune_model(graph, ARCH, 3, None, ScriptedDevice(graph, latency=latency))
    doc = tuned_json(plan, graph)
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps(doc))
    return graph, doc, path


def test_rerank_with_the_same_cost_model_keeps_every_rank(tmp_path: Path) -> None:
    graph, doc, path = _tuned_doc(tmp_path, lambda k: 1.0 + (7 * candidate_index(k.name)) % 5)
    found = ranking.groups([path])
    again = ranking.rerank(found, doc, graph)
    assert [g.signature for g in again] == [g.signature for g in found]
    for g in again:
        assert g.reranked == g.ranks and g.regret_now == pytest.approx(g.regret)
    stats = ranking.summarise(again)
    assert all(s.regret_median_now == pytest.approx(s.regret_median) for s in stats)
    assert all(s.ratio_median_now == pytest.approx(s.ratio_median) for s in stats)
    assert all(s.ratio_log_sd_now == pytest.approx(s.ratio_log_sd) for s in stats)


def test_rerank_reads_the_new_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An order that puts last what the tune ranked first finds the fastest config first
    where the tune's order had it last."""
    import candidates

    graph, doc, path = _tuned_doc(tmp_path, lambda k: 10.0 - candidate_index(k.name))
    order = candidates.tuner_order
    monkeypatch.setattr(candidates, "tuner_order", lambda *a: tuple(x[::-1] for x in order(*a)))
    found = ranking.rerank(ranking.groups([path]), doc, graph)
    assert found
    for g in found:
        total = g.reranked[0] + 1  # the first config timed is last today
        assert g.reranked == tuple(total - 1 - r for r in g.ranks)
        assert g.regret > 1.0 and g.regret_now == 1.0
    [stats] = [s for s in ranking.summarise(found) if s.kind == "simt"]
    assert stats.first_share == 0.0 and stats.first_share_now == 1.0


def test_rerank_needs_the_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, _, path = _tuned_doc(tmp_path, None)
    assert ranking.main([str(path), "--rerank"]) == 2
    assert "model.onnx" in capsys.readouterr().err
    assert ranking.main([str(path), str(path), "--rerank", "--model", "m.onnx"]) == 2
    assert "one tuned.json" in capsys.readouterr().err
