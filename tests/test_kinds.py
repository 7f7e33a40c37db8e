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
