"""The tuning database: the best measured config of every group ever tuned, on disk.

Tuning a group costs seconds (nvcc plus GPU timing of every candidate), and models repeat
their groups (twelve identical BERT layers) and get tuned again and again, so results are
kept in an SQLite file -- by default ``~/.cache/welder/tuning.db``, or
``$WELDER_CACHE_DIR/tuning.db``.  An entry is keyed by what decides the answer:

* the group's structure (``engine.group_signature``: equal for identical layers),
* the arch whose cost model proposed the candidates (``Arch.name``),
* the GPU the candidates were timed on (the driver's name for it),
* the compiler that built them (``nvcc --version``'s release line).

Its value is the winning config in the group's canonical names (``engine.canonical_names``:
``in0..`` for inputs, ``m0..`` for members), so another group with the same structure can
rename it back to its own tensors; its measured latency; how many candidates were tried and
the ``topk`` asked for; and when it was written.  A *negative* entry records that no
candidate compiled, ran and computed the right result, so that is not retried either.

Several processes may tune at once: the file is in WAL mode (readers never block the
writer), every write is one ``BEGIN IMMEDIATE`` transaction that waits out other writers
(busy timeout), and SQLite's atomic commit means a process killed mid-tune leaves only
complete entries -- rerunning the tune resumes where it stopped.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from welder.errors import WelderError
from welder.schedule.proposals import FOLDER as PROPOSALS_FOLDER
from welder.schedule.proposals import ProposalStore

#: Bumped when the table layout changes; a file written by a newer layout is refused.
SCHEMA_VERSION = 1
DB_NAME = "tuning.db"
DEFAULT_TIMEOUT_S = 60.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tuned (
    signature  TEXT NOT NULL,
    arch       TEXT NOT NULL,
    gpu        TEXT NOT NULL,
    compiler   TEXT NOT NULL,
    config     TEXT,              -- GroupConfig JSON in canonical names; NULL: negative entry
    latency_us REAL,
    candidates INTEGER NOT NULL,  -- configs tried
    topk       INTEGER NOT NULL,  -- configs asked for
    created    REAL NOT NULL,     -- seconds since the epoch
    PRIMARY KEY (signature, arch, gpu, compiler)
)
"""
# A whole model's groups as the fusion search and its checks left them (welder.tune.plan_cache):
# a tune that finds its model here skips the search, and each group then finds its config above.
_PLANS = """
CREATE TABLE IF NOT EXISTS plans (
    key     TEXT PRIMARY KEY,  -- plan_cache.plan_key: the graph and every setting of the search
    arch    TEXT NOT NULL,
    gpu     TEXT NOT NULL,
    plan    TEXT NOT NULL,     -- plan_cache.CachedPlan JSON
    created REAL NOT NULL
)
"""


class CacheError(WelderError):
    """The tuning database cannot be used (unreadable, corrupt, or from a newer welder)."""


@dataclass(frozen=True)
class CacheKey:
    """What a tuning result depends on."""

    signature: str  # engine.group_signature
    arch: str  # Arch.name of the cost model that proposed the candidates
    gpu: str  # the GPU they were timed on, as the driver names it
    compiler: str  # the compiler's version line


@dataclass(frozen=True)
class CacheEntry:
    key: CacheKey
    config: dict[str, Any] | None  # GroupConfig.to_json() in canonical names; None if negative
    latency_us: float | None
    candidates: int
    topk: int
    created: float

    @property
    def negative(self) -> bool:
        """No candidate was valid: the group cannot be built with these configs."""
        return self.config is None

    def satisfies(self, topk: int) -> bool:
        """Whether this entry answers a tune that asks for ``topk`` candidates: it must have
        looked at least as far down the cost model's ranking."""
        return self.topk >= topk


@dataclass
class CacheStats:
    path: Path
    entries: int
    negative: int
    file_bytes: int
    by_target: dict[tuple[str, str], int] = field(default_factory=dict)  # (gpu, arch) -> entries

    def format(self) -> str:
        lines = [
            f"{self.path}: {self.entries} tuned groups ({self.negative} without a valid config), "
            f"{self.file_bytes / 1024:.0f} KiB"
        ]
        for (gpu, arch), n in sorted(self.by_target.items()):
            lines.append(f"  {gpu} / cost model {arch}: {n}")
        return "\n".join(lines)


def default_cache_path() -> Path:
    """``$WELDER_CACHE_DIR/tuning.db`` if that variable is set, else ``~/.cache/welder/tuning.db``."""
    root = os.environ.get("WELDER_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "welder") / DB_NAME


class TuningCache:
    """The persistent tuning database.

    ``path`` is the database file, or a directory to hold ``tuning.db``; by default
    :func:`default_cache_path`.  Every method opens its own short-lived connection, so one
    instance may be used from several threads, and several processes may share the file.
    """

    def __init__(
        self, path: str | os.PathLike[str] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> None:
        p = Path(path) if path is not None else default_cache_path()
        self.path = p / DB_NAME if p.is_dir() else p
        self.timeout_s = timeout_s
        self._ready = False

    # -- connection ---------------------------------------------------------------------------

    @contextmanager
    def connect(self) -> Iterator[sqlite3.Connection]:
        """A connection in WAL mode with the busy timeout set, closed on exit.  It runs in
        autocommit mode: callers open transactions explicitly (``BEGIN IMMEDIATE`` to write),
        so a write never holds a lock longer than its own statement group."""
        self._prepare()
        conn = self._open()
        try:
            yield conn
        finally:
            conn.close()

    def _open(self) -> sqlite3.Connection:
        try:
            conn = sqlite3.connect(str(self.path), timeout=self.timeout_s, isolation_level=None)
            conn.execute(f"PRAGMA busy_timeout = {int(self.timeout_s * 1000)}")
            conn.execute("PRAGMA synchronous = NORMAL")  # durable enough in WAL mode, and atomic
            return conn
        except sqlite3.Error as e:
            raise _cache_error(self.path, e) from None

    def _prepare(self) -> None:
        """Create the file and table on first use; refuse a file that is not ours."""
        if self._ready:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CacheError(f"cannot create the tuning cache folder {self.path.parent}: {e}") from None
        conn = self._open()
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("BEGIN IMMEDIATE")
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                conn.execute("ROLLBACK")
                raise CacheError(
                    f"the tuning cache {self.path} was written by a newer welder (schema {version}); "
                    "upgrade welder or point WELDER_CACHE_DIR elsewhere"
                )
            conn.execute(_SCHEMA)
            conn.execute(_PLANS)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            conn.execute("COMMIT")
        except sqlite3.Error as e:
            raise _cache_error(self.path, e) from None
        finally:
            conn.close()
        self._ready = True

    # -- queries --------------------------------------------------------------------------------

    def get(self, key: CacheKey) -> CacheEntry | None:
        """The stored result for ``key``, or None if this group was never tuned there."""
        with self.connect() as conn:
            row = conn.execute(
                "SELECT config, latency_us, candidates, topk, created FROM tuned "
                "WHERE signature = ? AND arch = ? AND gpu = ? AND compiler = ?",
                _key_values(key),
            ).fetchone()
        if row is None:
            return None
        config, latency, candidates, topk, created = row
        return CacheEntry(key, json.loads(config) if config else None, latency, candidates, topk, created)

    def put(
        self,
        key: CacheKey,
        config: dict[str, Any] | None,
        latency_us: float | None,
        candidates: int,
        topk: int,
    ) -> CacheEntry:
        """Record a tuning result (``config`` None: a negative entry) and return what the
        database holds for ``key`` afterwards.

        An existing entry is replaced only by a better-founded one: a result from a wider
        search (larger ``topk``), a valid config where there was none, or -- at the same
        ``topk`` -- a faster one.  A negative result never replaces a valid config; it replaces
        a negative one from a search as wide, dating the failure anew.  So when
        two processes tune the same group at once, the outcome does not depend on who
        commits last."""
        if (config is None) != (latency_us is None):
            raise ValueError("a cache entry has both a config and a latency, or neither")
        new = CacheEntry(key, config, latency_us, candidates, topk, time.time())
        with self.connect() as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                old = conn.execute(
                    "SELECT config IS NULL, latency_us, topk FROM tuned "
                    "WHERE signature = ? AND arch = ? AND gpu = ? AND compiler = ?",
                    _key_values(key),
                ).fetchone()
                if old is None or _better(new, bool(old[0]), old[1], old[2]):
                    conn.execute(
                        "INSERT OR REPLACE INTO tuned VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (
                            *_key_values(key),
                            json.dumps(config, sort_keys=True) if config is not None else None,
                            latency_us,
                            candidates,
                            topk,
                            new.created,
                        ),
                    )
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        stored = self.get(key)
        assert stored is not None
        return stored

    def get_plan(self, key: str) -> dict[str, Any] | None:
        """The model plan stored under ``key`` (``welder.tune.plan_cache``), or None."""
        with self.connect() as conn:
            row = conn.execute("SELECT plan FROM plans WHERE key = ?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])

    def put_plan(self, key: str, arch: str, gpu: str, plan: dict[str, Any]) -> None:
        """Store a model plan under ``key``, replacing an older one: the key holds every
        setting the plan depends on, so the newer plan differs only by what the group
        entries it was built on learned since."""
        with self.connect() as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.execute(
                    "INSERT OR REPLACE INTO plans VALUES (?, ?, ?, ?, ?)",
                    (key, arch, gpu, json.dumps(plan, sort_keys=True), time.time()),
                )
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise

    def entries(self) -> list[CacheEntry]:
        """Every entry, oldest first (for reports and tests)."""
        with self.connect() as conn:
            rows = conn.execute(
                "SELECT signature, arch, gpu, compiler, config, latency_us, candidates, topk, created "
                "FROM tuned ORDER BY created"
            ).fetchall()
        return [
            CacheEntry(CacheKey(*r[:4]), json.loads(r[4]) if r[4] else None, r[5], r[6], r[7], r[8])
            for r in rows
        ]

    def stats(self) -> CacheStats:
        with self.connect() as conn:
            total, negative = conn.execute(
                "SELECT COUNT(*), COALESCE(SUM(config IS NULL), 0) FROM tuned"
            ).fetchone()
            by_target = {
                (gpu, arch): n
                for gpu, arch, n in conn.execute("SELECT gpu, arch, COUNT(*) FROM tuned GROUP BY gpu, arch")
            }
        size = sum(p.stat().st_size for p in self._files() if p.exists())
        return CacheStats(self.path, total, negative, size, by_target)

    def clear(self, gpu: str | None = None, arch: str | None = None) -> int:
        """Delete entries (all, or those of one GPU and/or cost-model arch) and the model plans
        of the same; returns how many group entries went."""
        where, args = [], []
        if gpu is not None:
            where.append("gpu = ?")
            args.append(gpu)
        if arch is not None:
            where.append("arch = ?")
            args.append(arch)
        condition = " WHERE " + " AND ".join(where) if where else ""
        with self.connect() as conn:
            conn.execute("BEGIN IMMEDIATE")
            removed = conn.execute("DELETE FROM tuned" + condition, args).rowcount
            conn.execute("DELETE FROM plans" + condition, args)
            conn.execute("COMMIT")
        return removed

    def proposals(self) -> ProposalStore:
        """The cost model's proposals kept beside the database (``proposals/`` in its folder),
        so that emptying the folder makes a tune cold in both."""
        return ProposalStore(self.path.parent / PROPOSALS_FOLDER)

    def _files(self) -> list[Path]:
        return [self.path, Path(f"{self.path}-wal"), Path(f"{self.path}-shm")]


def _cache_error(path: Path, e: sqlite3.Error) -> CacheError:
    """Locked or unreachable files are reported as such; anything else means the file is
    not a database we can read."""
    if isinstance(e, sqlite3.OperationalError):
        return CacheError(f"cannot use the tuning cache {path}: {e}")
    return CacheError(f"the tuning cache {path} is unusable ({e}); delete it to start afresh")


def _key_values(key: CacheKey) -> tuple[str, str, str, str]:
    return key.signature, key.arch, key.gpu, key.compiler


def _better(new: CacheEntry, old_negative: bool, old_latency: float | None, old_topk: int) -> bool:
    if new.negative:
        return old_negative and new.topk >= old_topk  # at the same topk: a fresher date
    if old_negative or new.topk > old_topk:
        return True
    return new.topk == old_topk and old_latency is not None and new.latency_us < old_latency
