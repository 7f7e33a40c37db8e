"""The tuning database: keys, replacement rules, location, and its behaviour under several
writing processes and a writer killed mid-transaction."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from welder.errors import WelderError
from welder.tune.cache import (
    DB_NAME,
    SCHEMA_VERSION,
    CacheError,
    CacheKey,
    TuningCache,
    default_cache_path,
)

ROOT = Path(__file__).resolve().parents[1]
KEY = CacheKey("a61a9d046e9257f6f3e9a693", "H100", "NVIDIA H100 80GB HBM3", "release 13.0, V13.0.88")
CONFIG = {"root": "m0", "block_tile": [16, 8], "stages": []}


def _key(**changes: str) -> CacheKey:
    return CacheKey(**{**KEY.__dict__, **changes})


def test_round_trip_of_results_and_negative_entries(tmp_path):
    cache = TuningCache(tmp_path)
    assert cache.path == tmp_path / DB_NAME
    assert cache.get(KEY) is None
    stored = cache.put(KEY, CONFIG, 12.5, candidates=20, topk=20)
    assert stored.config == CONFIG and stored.latency_us == 12.5 and not stored.negative
    again = TuningCache(tmp_path).get(KEY)
    assert again == stored and again.candidates == 20 and again.created > 0
    negative = cache.put(_key(signature="other"), None, None, candidates=5, topk=5)
    assert negative.negative and negative.latency_us is None
    with pytest.raises(ValueError):
        cache.put(KEY, CONFIG, None, 1, 1)


@pytest.mark.parametrize("field", ["signature", "arch", "gpu", "compiler"])
def test_every_key_part_separates_entries(tmp_path, field):
    cache = TuningCache(tmp_path)
    cache.put(KEY, CONFIG, 1.0, 1, 1)
    other = _key(**{field: "something else"})
    assert cache.get(other) is None
    cache.put(other, CONFIG, 2.0, 1, 1)
    assert cache.get(KEY).latency_us == 1.0 and cache.get(other).latency_us == 2.0


@pytest.mark.parametrize(
    ("old", "new", "kept"),
    [
        ((10.0, 20), (8.0, 20), "new"),  # same search, faster
        ((10.0, 20), (12.0, 20), "old"),  # same search, slower
        ((10.0, 5), (12.0, 20), "new"),  # a wider search wins even if its time is higher
        ((10.0, 20), (8.0, 5), "old"),  # a narrower search never replaces a wider one
        ((None, 20), (12.0, 5), "new"),  # a valid config replaces a negative entry
        ((10.0, 5), (None, 20), "old"),  # a negative entry never replaces a valid config
        ((None, 5), (None, 20), "new"),  # a wider negative search replaces a narrower one
    ],
)
def test_an_entry_is_replaced_only_by_a_better_founded_one(tmp_path, old, new, kept):
    cache = TuningCache(tmp_path)

    def put(latency, topk):
        cache.put(KEY, CONFIG if latency is not None else None, latency, topk, topk)

    put(*old)
    put(*new)
    entry = cache.get(KEY)
    assert (entry.latency_us, entry.topk) == (old if kept == "old" else new)


def test_location_from_argument_environment_and_home(tmp_path, monkeypatch):
    monkeypatch.setenv("WELDER_CACHE_DIR", str(tmp_path / "env"))
    assert default_cache_path() == tmp_path / "env" / DB_NAME
    assert TuningCache().path == tmp_path / "env" / DB_NAME
    monkeypatch.delenv("WELDER_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_path() == tmp_path / "home" / ".cache" / "welder" / DB_NAME
    explicit = TuningCache(tmp_path / "elsewhere.db")
    explicit.put(KEY, CONFIG, 1.0, 1, 1)
    assert (tmp_path / "elsewhere.db").is_file()


def test_connections_use_wal_and_a_busy_timeout(tmp_path):
    cache = TuningCache(tmp_path, timeout_s=7.5)
    with cache.connect() as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA busy_timeout").fetchone()[0] == 7500
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_stats_and_clear(tmp_path):
    cache = TuningCache(tmp_path)
    cache.put(KEY, CONFIG, 1.0, 3, 3)
    cache.put(_key(signature="b"), None, None, 3, 3)
    cache.put(_key(gpu="NVIDIA H200"), CONFIG, 1.0, 3, 3)
    stats = cache.stats()
    assert (stats.entries, stats.negative) == (3, 1)
    assert stats.by_target == {(KEY.gpu, "H100"): 2, ("NVIDIA H200", "H100"): 1}
    assert stats.file_bytes > 0 and "3 tuned groups" in stats.format()
    assert cache.clear(gpu="NVIDIA H200") == 1
    assert cache.clear() == 2
    assert cache.stats().entries == 0


def test_unusable_files_are_user_errors(tmp_path):
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not a database" * 100)
    with pytest.raises(CacheError, match="delete it") as info:
        TuningCache(junk).get(KEY)
    assert isinstance(info.value, WelderError)
    newer = tmp_path / "newer.db"
    with sqlite3.connect(newer) as conn:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(CacheError, match="newer welder"):
        TuningCache(newer).get(KEY)


# -- several processes -------------------------------------------------------------------------------


def _writer(args: tuple[str, int]) -> int:
    """Worker of the concurrency test: 40 writes, half of them to keys every writer uses."""
    path, worker = args
    cache = TuningCache(path, timeout_s=120)
    for i in range(40):
        shared = i % 2 == 0
        key = _key(signature=f"shared{i}" if shared else f"w{worker}-{i}")
        cache.put(key, CONFIG, float(worker + 1), 4, 4)
        assert cache.get(key) is not None
    return worker


def test_concurrent_writers_keep_every_entry(tmp_path):
    path = str(tmp_path / DB_NAME)
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        assert sorted(pool.map(_writer, [(path, w) for w in range(4)])) == [0, 1, 2, 3]
    cache = TuningCache(path)
    entries = cache.entries()
    assert len(entries) == 20 + 4 * 20
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    # Every writer offered the same shared keys; the fastest (worker 0: 1.0 us) was kept.
    assert {e.latency_us for e in entries if e.key.signature.startswith("shared")} == {1.0}


_KILLED_WRITER = """
import os, signal, sys, json
sys.path.insert(0, {root!r})
from welder.tune.cache import CacheKey, TuningCache
cache = TuningCache({path!r})
cache.put(CacheKey(*{complete!r}), {config!r}, 1.0, 1, 1)
with cache.connect() as conn:
    conn.execute("BEGIN IMMEDIATE")
    conn.execute("INSERT INTO tuned VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                 ("half", "H100", "gpu", "nvcc", json.dumps({config!r}), 2.0, 1, 1, 0.0))
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_writer_killed_mid_transaction_leaves_only_complete_entries(tmp_path):
    path = tmp_path / DB_NAME
    complete = ("done", "H100", "gpu", "nvcc")
    code = textwrap.dedent(_KILLED_WRITER).format(
        root=str(ROOT), path=str(path), complete=complete, config=CONFIG
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    cache = TuningCache(path)
    assert [e.key.signature for e in cache.entries()] == ["done"]
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    cache.put(_key(signature="after"), CONFIG, 3.0, 1, 1)  # the lock died with the writer
    assert cache.get(_key(signature="after")) is not None
    assert os.path.exists(path)
