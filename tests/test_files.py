"""welder.files: a JSON file is replaced whole or left as it was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from welder import files


def test_a_write_replaces_the_file_and_leaves_nothing_beside_it(tmp_path: Path) -> None:
    path = tmp_path / "tuned.json"
    files.write_json({"a": 1}, path)
    files.write_json({"b": [1, 2]}, path)
    assert json.loads(path.read_text()) == {"b": [1, 2]}
    assert [p.name for p in tmp_path.iterdir()] == ["tuned.json"]


def test_a_write_that_fails_part_way_leaves_the_old_file_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The failure comes after part of the new text is written, as a killed or full-disk
    write would leave it: a reader still finds the old document, and no partial file."""
    path = tmp_path / "tuned.json"
    files.write_json({"old": list(range(100))}, path)

    def dump_half(doc: object, f, **kwargs) -> None:  # type: ignore[no-untyped-def]
        f.write(json.dumps(doc)[:10])
        raise OSError("No space left on device")

    monkeypatch.setattr(files.json, "dump", dump_half)
    with pytest.raises(OSError, match="No space"):
        files.write_json({"new": 1}, path)
    assert json.loads(path.read_text()) == {"old": list(range(100))}
    assert [p.name for p in tmp_path.iterdir()] == ["tuned.json"]


def test_tuned_json_is_written_this_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tuner's writer goes through it (a plain open-and-dump truncates the old file
    first): two committed tuned.json copies had been caught half-written."""
    from welder.schedule import plan

    path = tmp_path / "tuned.json"
    plan.write_json({"groups": []}, str(path))

    def fail(doc: object, f, **kwargs) -> None:  # type: ignore[no-untyped-def]
        f.write("{")
        raise OSError("killed")

    monkeypatch.setattr(json, "dump", fail)
    with pytest.raises(OSError):
        plan.write_json({"groups": [1]}, str(path))
    assert json.loads(path.read_text()) == {"groups": []}


def test_an_npz_written_through_a_replaced_path_lands_whole(tmp_path: Path) -> None:
    """np.savez adds ``.npz`` to a name without it, so the partial path keeps the target's
    suffix: what lands is the array written, and nothing is left beside it."""
    import numpy as np

    path = tmp_path / "inputs.npz"
    with files.replaced(path) as partial:
        np.savez(partial, x=np.arange(5))
    with np.load(path) as stored:
        assert stored["x"].tolist() == [0, 1, 2, 3, 4]
    assert [p.name for p in tmp_path.iterdir()] == ["inputs.npz"]
