"""The model plan in the tuning cache: a second tune of the same model skips the fusion
search and its checks, and ends with the same groups as the first (which ran them)."""

from __future__ import annotations

import pytest
from test_tuner import ARCH, ScriptedDevice, bert, layernorm_gelu, stages_of

from welder.schedule.engine import graph_signature
from welder.tune import tuner as tuner_module
from welder.tune.cache import TuningCache
from welder.tune.plan_cache import CachedPlan
from welder.tune.tuner import tune_model


def slow_deep(kernel) -> float:
    """Deep groups measure far over their estimates, so the fusion checks split some."""
    return 100.0 * stages_of(kernel) ** 2


def members(plan) -> list[tuple[str, ...]]:
    return [tuple(g.group.members) for g in plan.groups]


def no_search(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the fusion search ran")

    monkeypatch.setattr(tuner_module, "fuse", refuse)


def test_a_second_tune_takes_the_plan_from_the_cache(tmp_path, monkeypatch):
    """Same groups in the same order, the same split failures and log, no compile and no
    search: the first tune (which split fusions after measuring them) is the reference."""
    graph = bert(2)
    cache = TuningCache(tmp_path)
    first = tune_model(graph, ARCH, 4, cache, ScriptedDevice(graph, latency=slow_deep))
    assert any("split into" in line for line in first.log)  # the checks had work to remember
    device = ScriptedDevice(graph, latency=slow_deep)
    no_search(monkeypatch)
    second = tune_model(graph, ARCH, 4, cache, device)
    assert members(second) == members(first)
    assert [g.measured_us for g in second.groups] == [g.measured_us for g in first.groups]
    assert second.split_failures == first.split_failures
    assert device.compiles == []
    assert second.log[: len(first.log)] == first.log
    assert second.log[-1].startswith("fusion from the tuning cache")


@pytest.mark.parametrize(
    "change",
    [{"topk": 3}, {"nofusion": True}, {"kinds": ("simt",)}],
    ids=["topk", "nofusion", "kinds"],
)
def test_a_plan_is_not_taken_for_other_settings(tmp_path, change):
    graph = layernorm_gelu()
    cache = TuningCache(tmp_path)
    tune_model(graph, ARCH, 2, cache, ScriptedDevice(graph))
    settings = {"topk": 2, **change}
    topk = settings.pop("topk")
    plan = tune_model(graph, ARCH, topk, cache, ScriptedDevice(graph), **settings)
    assert not any(line.startswith("fusion from the tuning cache") for line in plan.log)


def test_a_plan_from_another_fusion_search_is_not_taken(tmp_path, monkeypatch):
    """A changed fusion search or --nofusion partition (FUSION_VERSION) forms its groups
    again instead of taking those the older one stored."""
    from welder.tune import plan_cache

    graph = layernorm_gelu()
    cache = TuningCache(tmp_path)
    for nofusion in (False, True):
        tune_model(graph, ARCH, 2, cache, ScriptedDevice(graph), nofusion=nofusion)
        again = tune_model(graph, ARCH, 2, cache, ScriptedDevice(graph), nofusion=nofusion)
        assert again.log[-1].startswith("fusion from the tuning cache")
    monkeypatch.setattr(plan_cache, "FUSION_VERSION", plan_cache.FUSION_VERSION + 1)
    for nofusion in (False, True):
        plan = tune_model(graph, ARCH, 2, cache, ScriptedDevice(graph), nofusion=nofusion)
        assert not any(line.startswith("fusion from the tuning cache") for line in plan.log)


def test_a_plan_is_not_taken_for_another_graph_or_gpu(tmp_path):
    graph, other = bert(1), bert(2)
    assert graph_signature(graph) != graph_signature(other)
    assert graph_signature(graph) == graph_signature(bert.__wrapped__(1))  # imported again
    cache = TuningCache(tmp_path)
    tune_model(graph, ARCH, 2, cache, ScriptedDevice(graph))
    for g, device in ((other, ScriptedDevice(other)), (graph, ScriptedDevice(graph, name="Other GPU"))):
        plan = tune_model(g, ARCH, 2, cache, device)
        assert not any(line.startswith("fusion from the tuning cache") for line in plan.log)


def test_a_tune_cut_short_by_its_budget_stores_no_plan(tmp_path):
    graph = bert(2)
    cache = TuningCache(tmp_path)
    tune_model(graph, ARCH, 4, cache, ScriptedDevice(graph, latency=slow_deep), budget_s=1e-9)
    full = tune_model(graph, ARCH, 4, cache, ScriptedDevice(graph, latency=slow_deep))
    assert not any(line.startswith("fusion from the tuning cache") for line in full.log)
    assert any("split into" in line for line in full.log)


def test_a_stored_plan_that_no_longer_forms_is_searched_again(tmp_path):
    graph = layernorm_gelu()
    cache = TuningCache(tmp_path)
    first = tune_model(graph, ARCH, 2, cache, ScriptedDevice(graph))
    with cache.connect() as conn:
        [(key,)] = conn.execute("SELECT key FROM plans").fetchall()
    broken = CachedPlan((("no such node",),), (), ())
    cache.put_plan(key, ARCH.name, "Fake GPU", broken.to_json())
    again = tune_model(graph, ARCH, 2, cache, ScriptedDevice(graph))
    assert members(again) == members(first)
    assert not any(line.startswith("fusion from the tuning cache") for line in again.log)


def test_clearing_the_cache_clears_its_plans(tmp_path):
    graph = layernorm_gelu()
    cache = TuningCache(tmp_path)
    tune_model(graph, ARCH, 2, cache, ScriptedDevice(graph))
    cache.clear(gpu="Fake GPU")
    plan = tune_model(graph, ARCH, 2, cache, ScriptedDevice(graph))
    assert not any(line.startswith("fusion from the tuning cache") for line in plan.log)


def test_a_plan_and_its_split_failures_survive_the_database(tmp_path):
    """What put_plan stores, get_plan gives back: members in order, log lines, split
    failures (a failure with and one without a measurement) and the unfused baselines,
    equal field by field."""
    from welder.schedule.plan import SplitFailure

    failures = (
        SplitFailure("y", ("h", "n", "y"), ("MatMul", "LayerNormalization", "Gelu"), 12.5, 3.25, "why"),
        SplitFailure("z", ("z",), ("Add",), None, 1.0, "no valid candidate"),
    )
    unfused = ((7.5, 4096, False), (2.0, 64, True))
    plan = CachedPlan((("h", "n"), ("y",)), ("line one", "line two"), failures, unfused)
    cache = TuningCache(tmp_path)
    cache.put_plan("key", ARCH.name, "Fake GPU", plan.to_json())
    assert CachedPlan.from_json(cache.get_plan("key")) == plan
    assert cache.get_plan("other key") is None
    # A record stored before the unfused baseline was kept reads with none (worked out again).
    older = {k: v for k, v in plan.to_json().items() if k != "unfused"}
    assert CachedPlan.from_json(older).unfused == () and CachedPlan.from_json(older).groups == plan.groups
