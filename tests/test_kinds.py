"""The kernel-kind seam: the registry, each kind's rule, and configs in JSON -- including
configs written before stages had kinds (tuned.json files and tuning caches on disk)."""

from __future__ import annotations

import copy
import math
from dataclasses import replace

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
from welder.schedule.kinds.simt import SimtConfig, schedule_group, stream_twin

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
    SIMT policy's, unchanged, and their twins: a softmax's reduction reads its row once, so
    its configs have streaming twins; a matmul's have none."""
    shape_of, dtype_of = (lambda t: bert.tensor(t).shape), (lambda t: bert.tensor(t).dtype)
    softmax = next(n for n in bert.nodes if "Softmax" in n and n.endswith(":sum"))
    for name, streams in ((softmax, True), (list(bert.nodes)[-1], False)):
        group = make_group(bert, [name])
        options = Options(topk=4)
        direct = schedule_group(group, shape_of, dtype_of, ARCH, options)
        assert direct and all(isinstance(st, SimtConfig) for c in direct for st in c.stages)
        twins = [t for c in direct if (t := stream_twin(group, c, shape_of, dtype_of, ARCH)) is not None]
        assert bool(twins) == streams
        proposed = propose(group, context(bert, options))
        assert CostModel(bert, ARCH, options).configs(group) == proposed
        plain = [c for c in proposed if c.stages[0].family == "simt"]
        assert plain and plain == direct[: len(plain)]
        streamed = [c for c in proposed if c.stages[0].family == "simt_stream"]
        assert bool(streamed) == streams and all(c in twins for c in streamed)
        assert len(plain) + len(streamed) == len(proposed)


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


def _variants(base: GroupConfig, specs: list[tuple[tuple[int, ...], int, float]]) -> list[GroupConfig]:
    """``base`` with each (block tile, threads, estimated latency) of ``specs``."""
    from dataclasses import replace

    return [
        replace(base, block_tile=tile, threads=threads, estimate=replace(base.estimate, latency_us=us))
        for tile, threads, us in specs
    ]


def test_alike_configs_give_way_to_the_next_shapes(bert: Graph) -> None:
    """Brute force over estimate-ordered lists of configs of three likenesses: the result is
    a stable sort in which a config past the ALIKE_FIRST-th of its likeness counts as
    ALIKE_DEFERRAL slower, and is placed after the configs that then tie with it."""
    import itertools
    from dataclasses import replace

    from welder.schedule.kinds.base import ALIKE_DEFERRAL, ALIKE_FIRST, alike, defer_alike

    base = CostModel(bert, ARCH).configs(make_group(bert, [next(iter(bert.nodes))]))[0]
    # The same volume split two ways is alike; another volume or block size is not.
    shapes = [((1, 32, 64), 256), ((2, 16, 64), 256), ((1, 16, 64), 256), ((1, 32, 64), 128)]
    estimates = [10.0, 10.0, 10.0, 10.5, 10.0 * (1 + ALIKE_DEFERRAL), 11.5, 30.0]
    assert alike(replace(base, block_tile=shapes[0][0])) == alike(replace(base, block_tile=shapes[1][0]))
    for picks in itertools.product(range(len(shapes)), repeat=len(estimates)):
        ranked = _variants(base, [(*shapes[s], e) for s, e in zip(picks, estimates)])
        seen: dict[tuple, int] = {}
        keys = []
        for i, c in enumerate(ranked):
            seen[alike(c)] = seen.get(alike(c), 0) + 1
            later = seen[alike(c)] > ALIKE_FIRST
            keys.append(
                (c.estimate.latency_us * (1 + ALIKE_DEFERRAL) if later else c.estimate.latency_us, later, i)
            )
        expected = [ranked[i] for *_, i in sorted(keys)]
        assert [id(c) for c in defer_alike(ranked)] == [id(c) for c in expected]


def test_a_layer_norm_topk_covers_several_row_counts() -> None:
    """Conformer's layer norm at batch 64 (512 x 64 rows of 512 halves) on the H200: the
    six splits of 32 rows over the two row axes tie in estimate, and before
    :func:`~welder.schedule.kinds.base.defer_alike` they filled the topk of 20, while 16
    rows a block (4 blocks an SM against 2) measured 23% faster.  The topk holds several
    row counts, at most two splits of each likeness, and 16 rows a block rank before 32
    (with each thread's serial reduction points counted, fewer rows a block rank first:
    8 and 4, whose threads split a row further)."""
    import numpy as np
    from onnx import helper
    from onnx_util import make_model

    from welder.schedule.kinds import Options, ScheduleContext, propose
    from welder.schedule.kinds.base import ALIKE_FIRST, alike

    scale = np.ones(512, np.float16)
    node = helper.make_node("LayerNormalization", ["x", "s", "b"], ["y"], axis=-1, epsilon=1e-5)
    model = make_model(
        [node], {"x": np.zeros((512, 64, 512), np.float16)}, ["y"], {"s": scale, "b": scale}, opset=17
    )
    graph = import_onnx(model)
    group = make_group(graph, list(graph.nodes))
    shape, dtype = (lambda t: graph.tensor(t).shape), (lambda t: graph.tensor(t).dtype)
    ctx = ScheduleContext(shape, dtype, get_arch("H200"), Options(topk=20))
    chosen = propose(group, ctx)
    assert len(chosen) == 20
    assert len({c.block_tile[0] * c.block_tile[1] for c in chosen}) >= 2
    likenesses = [alike(c) for c in chosen]
    assert max(likenesses.count(k) for k in likenesses) <= ALIKE_FIRST
    best: dict[int, float] = {}
    for c in propose(group, replace(ctx, options=Options(topk=1000))):
        rows = c.block_tile[0] * c.block_tile[1]
        best[rows] = min(best.get(rows, math.inf), c.estimate.latency_us)
    assert best[16] < best[32]


def test_ties_are_spread_over_shapes(bert: Graph) -> None:
    """Brute force over a ranked list with runs of tied estimates: the result is the same
    configs; estimates still never decrease across runs; within a run, every shape comes
    once before any comes twice, and configs of one shape keep their order."""
    import itertools

    from welder.schedule.kinds.base import TIE_TOLERANCE, spread_ties

    graph = bert
    base = CostModel(graph, ARCH).configs(make_group(graph, [next(iter(graph.nodes))]))[0]
    shapes = [((1, 128, 128), 256), ((1, 128, 64), 128), ((2, 64, 64), 256)]
    estimates = [10.0, 10.0, 10.0 * (1 + TIE_TOLERANCE / 2), 10.0, 12.0, 12.0, 30.0]
    for picks in itertools.product(range(len(shapes)), repeat=len(estimates)):
        ranked = _variants(base, [(*shapes[s], e) for s, e in zip(picks, sorted(estimates))])
        out = spread_ties(ranked)
        assert sorted(map(id, out)) == sorted(map(id, ranked))
        runs = [ranked[:4], ranked[4:6], ranked[6:]]  # 10, 10, 10.05, 10 | 12, 12 | 30
        assert [len(r) for r in runs] == [4, 2, 1]
        position = 0
        for run in runs:
            part = out[position : position + len(run)]
            assert {id(c) for c in part} == {id(c) for c in run}
            keys = [(c.block_tile, c.threads) for c in part]
            distinct = len(set(keys))
            assert len(set(keys[:distinct])) == distinct  # each shape once first
            for key in set(keys):
                assert [c for c in part if (c.block_tile, c.threads) == key] == [
                    c for c in run if (c.block_tile, c.threads) == key
                ]
            position += len(run)


def test_a_familys_reserved_places_go_to_different_shapes_on_ties() -> None:
    """An exact fp32 product (BERT's FFN at batch 64: ffma configs of several block shapes
    tie on their estimate): each family's reserved places hold every shape that ties with
    its best before a second config of any one shape."""
    import numpy as np
    from onnx import helper
    from onnx_util import make_model

    from welder.schedule.kinds import Options, ScheduleContext, propose

    x, w = np.zeros((8192, 768), np.float32), np.zeros((768, 3072), np.float32)
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["y"])], {"x": x}, ["y"], {"w": w})
    graph = import_onnx(model)
    group = make_group(graph, list(graph.nodes))
    shape, dtype = (lambda t: graph.tensor(t).shape), (lambda t: graph.tensor(t).dtype)

    def ctx(topk: int) -> ScheduleContext:
        return ScheduleContext(shape, dtype, ARCH, Options(topk=topk))

    everything = propose(group, ctx(10_000))
    chosen = propose(group, ctx(20))
    families = {c.stages[0].family for c in chosen}
    keep = 20 // max(4, len({c.stages[0].family for c in everything}))
    for family in families:
        members = [c for c in everything if c.stages[0].family == family]
        members.sort(key=lambda c: c.estimate.latency_us)
        best = members[0].estimate.latency_us
        tied = {(c.block_tile, c.threads) for c in members if c.estimate.latency_us <= best * 1.01}
        got = {(c.block_tile, c.threads) for c in chosen if c.stages[0].family == family}
        assert len(got) >= min(len(tied), keep), family
    ffma = {(c.block_tile, c.threads) for c in chosen if c.stages[0].family == "ffma"}
    assert len(ffma) >= 2
