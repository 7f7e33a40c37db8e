"""The kernel-kind seam: the registry, each kind's rule, and configs in JSON -- including
configs written before stages had kinds (tuned.json files and tuning caches on disk)."""

from __future__ import annotations

import copy

import pytest
from models import bert_encoder_layer

from welder.arch import get_arch
from welder.codegen import STAGE_EMITTERS, UnsupportedStage, generate_kernel
from welder.frontend.onnx import import_onnx
from welder.graph import Graph
from welder.schedule.config import GroupConfig
from welder.schedule.engine import CostModel
from welder.schedule.group import make_group
from welder.schedule.kinds import (
    KINDS,
    Options,
    ScheduleContext,
    UnknownKind,
    config_from_json,
    propose,
    stage_from_json,
)
from welder.schedule.kinds.library import LibraryConfig, find_gemm_groups, library_call
from welder.schedule.kinds.simt import SimtConfig, schedule_group

ARCH = get_arch("H100")


@pytest.fixture(scope="module")
def bert() -> Graph:
    return import_onnx(bert_encoder_layer()[0])


def context(graph: Graph, options: Options = Options()) -> ScheduleContext:
    return ScheduleContext(lambda t: graph.tensor(t).shape, lambda t: graph.tensor(t).dtype, ARCH, options)


def test_registry_names_match_config_kinds() -> None:
    for name, kind in KINDS.items():
        assert kind.name == name and kind.config_type.kind == name
    assert {"simt", "library"} <= set(KINDS)
    # Every kind rendered inside a kernel has an emitter; library groups are calls.
    assert set(STAGE_EMITTERS) == {n for n, k in KINDS.items() if k.config_type.in_kernel}


def test_simt_rule_is_the_policy(bert: Graph) -> None:
    """The cost model asks the registered kinds; with SIMT alone its candidates are the
    SIMT policy's, unchanged."""
    softmax = next(n for n in bert.nodes if "Softmax" in n)
    for name in (softmax, list(bert.nodes)[-1]):
        group = make_group(bert, [name])
        options = Options(topk=4)
        direct = schedule_group(
            group, lambda t: bert.tensor(t).shape, lambda t: bert.tensor(t).dtype, ARCH, options
        )
        assert direct and all(isinstance(st, SimtConfig) for c in direct for st in c.stages)
        assert CostModel(bert, ARCH, options).configs(group) == direct
        assert propose(group, context(bert, options)) == direct


def test_library_rule_applies_only_to_products(bert: Graph) -> None:
    """The library kind answers None for a group that is no product and, for a product's
    group, the same GEMM its pre-fusion claim found."""
    ctx = context(bert)
    lg = find_gemm_groups(bert, ARCH)[0]
    [cfg] = KINDS["library"].propose(lg.group, ctx) or [None]
    assert cfg is not None and library_call(cfg) is not None and library_call(cfg).gemm == lg.gemm
    assert not cfg.kernel
    softmax = next(n for n in bert.nodes if "Softmax" in n)
    assert KINDS["library"].propose(make_group(bert, [softmax]), ctx) is None
    # Listing both kinds merges their candidates.
    both = propose(lg.group, context(bert, Options(topk=3, kinds=("simt", "library"))))
    assert len(both) == 3 and sum(library_call(c) is not None for c in both) == 1


def _pre_kind_json(cfg: GroupConfig) -> dict:
    """``cfg`` as welder wrote it before stages had kinds: stages without ``kind``, and a
    library call as ``gemm`` beside an empty stage list."""
    d = copy.deepcopy(cfg.to_json())
    call = library_call(cfg)
    if call is not None:
        d["stages"], d["gemm"] = [], d["stages"][0]["gemm"]
        return d
    for st in d["stages"]:
        del st["kind"]
    d["gemm"] = None
    return d


def test_configs_written_before_kinds_still_read(bert: Graph) -> None:
    plain = make_group(bert, [n for n in bert.nodes if "Softmax" in n][:1])
    simt_cfg = CostModel(bert, ARCH, Options(topk=1)).configs(plain)[0]
    library_cfg = find_gemm_groups(bert, ARCH)[2].config
    for cfg in (simt_cfg, library_cfg):
        assert config_from_json(cfg.to_json()) == cfg
        assert config_from_json(_pre_kind_json(cfg)) == cfg
    assert isinstance(config_from_json(_pre_kind_json(library_cfg)).stages[0], LibraryConfig)


def test_unknown_kind_is_named() -> None:
    with pytest.raises(UnknownKind, match="'tensor_core_v9'"):
        stage_from_json({"kind": "tensor_core_v9", "node": "x"})


def test_codegen_refuses_a_library_stage(bert: Graph) -> None:
    lg = find_gemm_groups(bert, ARCH)[0]
    with pytest.raises(UnsupportedStage, match="no 'library' stage"):
        generate_kernel(bert, lg.group, lg.config, "k")


def test_every_family_of_candidates_gets_measured() -> None:
    """Where one family's estimates are all worse than another's (SIMT against tensor cores
    on a large fp16 product; unsplit against split-K), ``propose`` still keeps the best of
    each (six families on an H100: an equal share of ``topk`` apiece), in estimate order;
    ``topk`` 1 is the best estimate."""
    import numpy as np
    from onnx import helper
    from onnx_util import make_model

    from welder.schedule.kinds import Options, ScheduleContext, propose
    from welder.schedule.kinds.base import top_by_family

    x, w = np.zeros((128, 3072), np.float16), np.zeros((3072, 768), np.float16)
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["y"])], {"x": x}, ["y"], {"w": w})
    graph = import_onnx(model)
    group = make_group(graph, list(graph.nodes))

    def ctx(topk: int) -> ScheduleContext:
        shape, dtype = (lambda t: graph.tensor(t).shape), (lambda t: graph.tensor(t).dtype)
        return ScheduleContext(shape, dtype, get_arch("H100"), Options(topk=topk))

    everything = propose(group, ctx(10_000))
    by_estimate = sorted(everything, key=lambda c: c.estimate.latency_us)
    families = {c.stages[0].family for c in everything}
    assert families == {"wgmma", "wgmma/split-k", "wgmma/tma", "wgmma/tma+", "mma", "mma/split-k", "simt"}
    for topk in (6, 12, 18):
        chosen = propose(group, ctx(topk))
        assert len(chosen) == topk
        assert [c.estimate.latency_us for c in chosen] == sorted(c.estimate.latency_us for c in chosen)
        for family in families:
            best = [c for c in by_estimate if c.stages[0].family == family][: topk // len(families)]
            assert all(any(b is c or b.estimate == c.estimate for c in chosen) for b in best), family
        # the places left are the best estimates of whatever family
        assert by_estimate[0].estimate.latency_us == chosen[0].estimate.latency_us
    assert propose(group, ctx(1))[0].estimate.latency_us == by_estimate[0].estimate.latency_us
    assert top_by_family([], 4) == []
