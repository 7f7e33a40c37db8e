"""The cost model's proposals kept on disk (welder.schedule.proposals): a plan made again reads
every group from the store and equals a plan made without one; what the key holds, what a
damaged entry or an unwritable folder does, and that the digest covers the code that
proposes."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest
from models import conformer_conv_module, vit_block

from welder.arch import get_arch
from welder.frontend.onnx import import_onnx
from welder.graph import Graph
from welder.resources import PACKAGE_DIR
from welder.schedule.engine import CostModel, fuse, group_signature
from welder.schedule.group import make_group
from welder.schedule.kinds import Options
from welder.schedule.plan import Plan, plan_model
from welder.schedule.proposals import (
    PROPOSING_PACKAGES,
    ProposalStore,
    code_digest,
    default_folder,
    sources_digest,
)
from welder.tune.cache import TuningCache

ARCH = get_arch("H100")


def _plan_json(plan: Plan) -> list:
    return [(sorted(p.group.members), [c.to_json() for c in p.configs]) for p in plan.groups]


@pytest.mark.parametrize("builder", [vit_block, conformer_conv_module], ids=["vit", "conformer"])
def test_a_plan_made_again_reads_every_group_and_equals_one_made_without_a_store(
    builder, tmp_path: Path
) -> None:
    graph = import_onnx(builder()[0])
    store = ProposalStore(tmp_path)
    first = CostModel(graph, ARCH, store=store, workers=1)
    fuse(graph, first)
    assert first.calls > 0 and first.stored == 0
    assert len(list(tmp_path.glob("*.json"))) == first.calls
    again = CostModel(graph, ARCH, store=store, workers=1)
    fuse(graph, again)
    assert again.calls == 0 and again.stored == first.calls
    alone = plan_model(graph, ARCH, store=None)
    assert _plan_json(plan_model(graph, ARCH, store=store)) == _plan_json(alone)


def test_the_key_holds_the_group_the_arch_and_the_options(tmp_path: Path) -> None:
    store = ProposalStore(tmp_path)
    graph = import_onnx(vit_block()[0])
    signatures = {group_signature(graph, make_group(graph, [n])) for n in graph.nodes}
    keys = {store.key(s, ARCH, Options()) for s in signatures}
    assert len(keys) == len(signatures)
    s = next(iter(signatures))
    variants = {
        store.key(s, ARCH, Options()),
        store.key(s, get_arch("A100"), Options()),
        store.key(s, ARCH, Options(topk=2)),
        store.key(s, ARCH, Options(kinds=("simt",))),
    }
    assert len(variants) == 4


def test_a_damaged_entry_is_proposed_again_and_replaced(tmp_path: Path) -> None:
    graph = import_onnx(vit_block()[0])
    store = ProposalStore(tmp_path)
    group = make_group(graph, [next(iter(graph.nodes))])
    reference = CostModel(graph, ARCH).configs(group)
    CostModel(graph, ARCH, store=store).configs(group)
    [entry] = tmp_path.glob("*.json")
    for damaged in ("{", json.dumps({"configs": [{"root": 1}]}), json.dumps([])):
        entry.write_text(damaged)
        cost = CostModel(graph, ARCH, store=store)
        assert cost.configs(group) == reference
        assert (cost.calls, cost.stored) == (1, 0)
        replaced = CostModel(graph, ARCH, store=store)
        assert replaced.configs(group) == reference
        assert (replaced.calls, replaced.stored) == (0, 1)


def test_an_unwritable_folder_keeps_nothing_and_plans_as_without_it(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    graph = import_onnx(vit_block()[0])
    store = ProposalStore(blocker / "proposals")
    plan = plan_model(graph, ARCH, store=store)
    assert _plan_json(plan) == _plan_json(plan_model(graph, ARCH, store=None))
    assert blocker.read_text() == "not a folder"


def test_the_default_folder_follows_welder_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WELDER_CACHE_DIR", str(tmp_path / "a"))
    graph: Graph = import_onnx(vit_block()[0])
    plan_model(graph, ARCH)
    assert default_folder() == tmp_path / "a" / "proposals"
    assert any((tmp_path / "a" / "proposals").glob("*.json"))
    monkeypatch.setenv("WELDER_CACHE_DIR", str(tmp_path / "b"))
    assert ProposalStore().folder == tmp_path / "b" / "proposals"


def test_a_tuning_cache_keeps_its_proposals_beside_it(tmp_path: Path) -> None:
    assert TuningCache(tmp_path).proposals().folder == tmp_path / "proposals"
    assert TuningCache(tmp_path / "t.db").proposals().folder == tmp_path / "proposals"


def _imports(path: Path) -> set[str]:
    """The welder modules ``path`` imports, anywhere in it (functions too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("welder"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("welder"))
    return found


def _module_file(name: str) -> Path | None:
    """The source of module ``name`` (a name that is an attribute, not a module: None)."""
    rel = Path(*name.split(".")[1:])
    for candidate in (PACKAGE_DIR / rel.with_suffix(".py"), PACKAGE_DIR / rel / "__init__.py"):
        if rel.parts and candidate.is_file():
            return candidate
    return None


def test_the_digest_covers_every_module_the_schedule_stage_imports() -> None:
    """Every welder module the schedule stage imports, directly or through others, is one
    whose source the digest hashes."""
    todo = sorted((PACKAGE_DIR / "schedule").rglob("*.py"))
    seen: set[Path] = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        todo.extend(f for name in _imports(path) if (f := _module_file(name)) is not None)
    reached = {p.relative_to(PACKAGE_DIR) for p in seen}
    assert {p.parts[0] for p in reached if len(p.parts) > 1} >= {"schedule", "tile", "ir"}
    assert all(len(p.parts) == 1 or p.parts[0] in PROPOSING_PACKAGES for p in reached), sorted(reached)


def test_the_digest_changes_with_a_proposing_source_only(tmp_path: Path) -> None:
    package = tmp_path / "welder"
    for part in ("arch.py", "graph.py", "tile", "codegen"):
        source = PACKAGE_DIR / part
        if source.is_dir():
            shutil.copytree(source, package / part, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            package.mkdir(exist_ok=True)
            shutil.copy(source, package / part)
    before = sources_digest(package)
    assert sources_digest(package) == before
    codegen = next((package / "codegen").glob("*.py"))
    codegen.write_text(codegen.read_text() + "\n# edited\n")
    assert sources_digest(package) == before
    for edited in (package / "arch.py", next((package / "tile").glob("*.py"))):
        edited.write_text(edited.read_text() + "\n# edited\n")
        assert sources_digest(package) != before
        before = sources_digest(package)
    assert code_digest() == sources_digest(PACKAGE_DIR)
