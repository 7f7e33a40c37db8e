"""The cost model's proposals on disk: the configs proposed for a group, kept between runs.

Proposing a group's configs is the fusion search's whole cost (a tenth of a second a group,
hundreds of distinct groups a model), and the answer depends only on the group's structure
(``engine.group_signature``), the arch whose cost model ranks the candidates, the search
options and the code that proposes.  A second compile of a model, a tune whose every group
the tuning database answers, or another model with the same layers, would otherwise
propose every group again: a warm tune spent 6.6-11.7 s of its 9-14 s there (Table 4).

Entries live as one JSON file each under ``$WELDER_CACHE_DIR/proposals`` (by default
``~/.cache/welder/proposals``), or the folder a :class:`ProposalStore` is given; the tuner
keeps them beside its tuning database, so emptying that folder makes a tune cold again.
Each file is written beside its place and renamed over it (``welder.files``), so processes
proposing at once (a search's forked workers, concurrent tunes) never read half an entry;
an unreadable entry counts as absent.  The key hashes the sources of every package the
proposals depend on (:func:`code_digest`), so an edited or upgraded welder starts afresh
instead of reading configs its own policy would not propose.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from pathlib import Path

from welder.arch import Arch
from welder.files import write_json
from welder.resources import PACKAGE_DIR
from welder.schedule.config import GroupConfig
from welder.schedule.kinds import Options, config_from_json

#: Bumped when the file layout changes.
FORMAT_VERSION = 1
FOLDER = "proposals"
#: The packages whose sources decide a proposal (the schedule stage imports nothing else
#: of welder's but the top-level modules, which are hashed too).
PROPOSING_PACKAGES = ("schedule", "tile", "ir")


@functools.cache
def code_digest() -> str:
    """Hash of the sources the proposals come from (:func:`sources_digest` of the package)."""
    return sources_digest(PACKAGE_DIR)


def sources_digest(package: Path) -> str:
    """Hash of the top-level modules of ``package`` and every module of its
    :data:`PROPOSING_PACKAGES`, by path and content."""
    files = sorted(package.glob("*.py"))
    for sub in PROPOSING_PACKAGES:
        files += sorted((package / sub).rglob("*.py"))
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:24]


def default_folder() -> Path:
    """``$WELDER_CACHE_DIR/proposals`` if that variable is set, else ``~/.cache/welder/proposals``."""
    root = os.environ.get("WELDER_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "welder") / FOLDER


class ProposalStore:
    """Proposed configs in canonical names (``engine.canonical_names``), by group signature,
    arch and options, in ``folder`` (default: :func:`default_folder`, read at each use, so
    that :data:`DEFAULT_STORE` follows ``WELDER_CACHE_DIR``)."""

    def __init__(self, folder: str | os.PathLike[str] | None = None) -> None:
        self._folder = Path(folder) if folder is not None else None

    @property
    def folder(self) -> Path:
        return self._folder if self._folder is not None else default_folder()

    def key(self, signature: str, arch: Arch, options: Options) -> str:
        """Everything a proposal depends on, hashed: the reprs of the arch and the options
        hold every field, so an arch described differently under the same name is another
        key."""
        text = f"{FORMAT_VERSION}|{code_digest()}|{signature}|{arch!r}|{options!r}"
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def get(self, key: str) -> list[GroupConfig] | None:
        """The configs stored under ``key`` (an empty list: the group has none), or None."""
        try:
            entry = json.loads((self.folder / f"{key}.json").read_text())
            return [config_from_json(c) for c in entry["configs"]]
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def put(self, key: str, configs: list[GroupConfig]) -> None:
        """Store ``configs`` under ``key`` (:func:`welder.files.write_json`: a reader sees the
        old entry or the new one).  A folder that cannot be written leaves the store without
        the entry: the next run proposes again, as without a store."""
        with contextlib.suppress(OSError):
            self.folder.mkdir(parents=True, exist_ok=True)
            write_json({"configs": [c.to_json() for c in configs]}, self.folder / f"{key}.json")


#: The store of the default folder: what a plan and a tune keep their proposals in.
DEFAULT_STORE = ProposalStore()
