"""The package's layers import one way: every module of welder may import modules of its own
layer and of earlier ones, never of a later one -- scheduling makes decisions without
knowing how they are rendered, tuned or run.  Inside ``welder.schedule``, the kernel kinds
are independent of each other and of the search that uses them.

Imports are read from the source with ``ast`` (function-level imports included, imports
only for type checkers excluded), so a violation is caught whether or not it would form a
cycle at run time."""

from __future__ import annotations

import ast
from collections.abc import Collection
from pathlib import Path

import pytest

import welder

ROOT = Path(welder.__file__).resolve().parent

#: Layers, earliest first; a module belongs to the layer of its longest listed prefix.
LAYERS: list[tuple[str, ...]] = [
    (
        "welder.errors",
        "welder.files",
        "welder.resources",
        "welder.lock",
        "welder.hostcpu",
        "welder.arch",
        "welder.ir",
        "welder.graph",
        "welder.check",
    ),
    ("welder.frontend",),
    ("welder.tile",),
    ("welder.schedule",),
    ("welder.codegen",),
    ("welder.device",),
    ("welder.tune",),
    ("welder.runtime",),
    (
        "welder.pipeline",
        "welder.session",
        "welder.export",
        "welder.onnx_backend",
        "welder.demo",
        "welder.cli",
        "welder",
    ),
]

#: Inside ``welder.schedule``: plain data and groups, then the kinds, then the fusion search,
#: then whole-model plans.
SCHEDULE_LAYERS: list[tuple[str, ...]] = [
    ("welder.schedule.config", "welder.schedule.group"),
    ("welder.schedule.kinds.base",),
    ("welder.schedule.kinds",),
    ("welder.schedule.engine",),
    ("welder.schedule.plan",),
]


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package at ``root`` by dotted name."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _type_checking_only(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def imports_of(name: str, path: Path, known: Collection[str] = ()) -> set[str]:
    """The welder modules ``name`` imports (``from pkg import mod`` counts as ``pkg.mod``
    where that is one of the ``known`` modules)."""
    tree = ast.parse(path.read_text(), str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if _type_checking_only(node, parents):
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known)
    return {m for m in found if m == "welder" or m.startswith("welder.")}


def rank(module: str, layers: list[tuple[str, ...]]) -> int | None:
    """The index of the layer ``module`` belongs to (its longest matching prefix)."""
    best: tuple[int, int] | None = None
    for k, prefixes in enumerate(layers):
        for prefix in prefixes:
            inside = module == prefix or module.startswith(prefix + ".")
            if inside and (best is None or len(prefix) > best[0]):
                best = (len(prefix), k)
    return None if best is None else best[1]


def upward(layers: list[tuple[str, ...]], within: str = "", root: Path = ROOT) -> list[str]:
    """Every import from a module to a module of a later layer."""
    bad = []
    known = modules(root)
    for name, path in known.items():
        if not name.startswith(within):
            continue
        mine = rank(name, layers)
        for target in sorted(imports_of(name, path, known)):
            theirs = rank(target, layers)
            if mine is not None and theirs is not None and theirs > mine:
                bad.append(f"{name} imports {target}")
    return bad


def test_every_module_has_a_layer() -> None:
    assert [m for m in modules() if rank(m, LAYERS) is None] == []


def test_no_module_imports_a_later_layer() -> None:
    assert upward(LAYERS) == []


def test_schedule_imports_in_order() -> None:
    assert upward(SCHEDULE_LAYERS, "welder.schedule") == []


#: Kinds built as a subclass of another kind's rule (the same search with other data).
EXTENDS = {
    "welder.schedule.kinds.wgmma": {"welder.schedule.kinds.mma"},
    # attention_ffma takes its fp32 format from the ffma kind
    "welder.schedule.kinds.attention": {"welder.schedule.kinds.mma", "welder.schedule.kinds.ffma"},
    "welder.schedule.kinds.ffma": {"welder.schedule.kinds.mma"},
    "welder.schedule.kinds.tf32x3": {"welder.schedule.kinds.mma"},
}


def test_kinds_are_independent() -> None:
    """A kind's module may use the shared base and the SIMT kind (whose stages follow a
    tensor-core stage inside a group), and the kind it extends (EXTENDS), never another."""
    kinds = [m for m in modules() if m.startswith("welder.schedule.kinds.") and not m.endswith(".base")]
    assert len(kinds) >= 2
    shared = {"welder.schedule.kinds.base", "welder.schedule.kinds", "welder.schedule.kinds.simt"}
    known = modules()
    for name in kinds:
        others = {m for m in imports_of(name, known[name], known) if m.startswith("welder.schedule.kinds")}
        assert others <= shared | {name} | EXTENDS.get(name, set()), name


@pytest.mark.parametrize(
    "source, expected",
    [
        ("from welder.tune.tuner import tune_model\n", "welder.schedule.x imports welder.tune.tuner"),
        ("def f():\n    import welder.runtime.spec\n", "welder.schedule.x imports welder.runtime.spec"),
        ("from ..codegen import kernel\n", "welder.schedule.x imports welder.codegen"),
    ],
)
def test_an_upward_import_is_found(tmp_path: Path, source: str, expected: str) -> None:
    """The check itself: a schedule module importing a later layer, at the top, inside a
    function, or relatively, is reported."""
    fake = tmp_path / "welder" / "schedule" / "x.py"
    fake.parent.mkdir(parents=True)
    fake.write_text(source)
    (tmp_path / "welder" / "codegen").mkdir()
    (tmp_path / "welder" / "codegen" / "kernel.py").write_text("")
    assert expected in upward(LAYERS, root=tmp_path / "welder")


def test_type_checking_imports_are_not_counted(tmp_path: Path) -> None:
    fake = tmp_path / "welder" / "schedule" / "x.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("if TYPE_CHECKING:\n    from welder.tune import tuner\n")
    assert imports_of("welder.schedule.x", fake) == set()
