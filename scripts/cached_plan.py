"""The plan a warm ``welder tune`` would build, rebuilt from a tuning cache alone (no GPU).

    python scripts/cached_plan.py MODEL.onnx --cache DB --gpu NAME [--arch H200] [--topk 20]
        [--no-tc | --tf32] [--nofusion] [--compiler LINE] [-o OUT [--cuda-arch 90]]

A tune cut short after its plan was stored (a call's limit, a runtime that hung while it was
timed) writes no tuned.json, but the tuning cache it returns holds the plan and every
group's winner.  This runs the tuner on MODEL with a device that only answers to the cache:
the GPU is named as its driver names it (``--gpu "NVIDIA H200"``), the compiler defaults to
the one the cache's entries for that GPU were timed with, and ``--arch``, ``--topk`` and the
kind flags must be the tune's, since they are part of the keys; so is the search version, so
run it from a checkout of the commit that tuned.  It prints each kernel of the
plan (family, block tile, grid, threads, shared memory) and, with ``-o``, emits the runtime
sources into OUT to build and run (``welder build OUT``).

The cache is read from a copy: nothing is written to DB.  A group the cache does not hold
is named (exit 1); a missing or unreadable file is an error (exit 2).
"""

from __future__ import annotations

import argparse
import shutil
import sqlite3
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from welder.arch import get_arch  # noqa: E402
from welder.codegen import generate_model  # noqa: E402
from welder.errors import WelderError  # noqa: E402
from welder.pipeline import TuneOptions, planned_import  # noqa: E402
from welder.runtime.emit import emit_runtime  # noqa: E402
from welder.tune.cache import DB_NAME, TuningCache  # noqa: E402
from welder.tune.compile import CANDIDATE_PREFIX  # noqa: E402
from welder.tune.tuner import TunedGroup, tune_model  # noqa: E402


class NotCached(Exception):
    """The tuner asked to compile: a group of the plan is not in the cache."""


class CacheOnlyDevice:
    """A device named like the GPU a tune ran on, which compiles nothing: every group must
    come from the cache."""

    arch = "sm_90a"

    def __init__(self, name: str, compiler: str) -> None:
        self.name = name
        self.compiler = compiler

    def compile(self, kernels, timeout_s=None):
        names = sorted({k.name.split("_", 2)[-1] for k in kernels if k.name.startswith(CANDIDATE_PREFIX)})
        raise NotCached(", ".join(names) or "a group")

    def run(self, *args, **kwargs):
        raise NotCached("a group")

    def time(self, *args, **kwargs):
        raise NotCached("a group")


def cache_compiler(db: Path, gpu: str) -> str | None:
    """The compiler most of the cache's entries for ``gpu`` were timed with."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        rows = con.execute("SELECT compiler FROM tuned WHERE gpu = ?", (gpu,)).fetchall()
    counts = Counter(r[0] for r in rows)
    return counts.most_common(1)[0][0] if counts else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path, help="the ONNX model the tune read")
    p.add_argument("--cache", type=Path, required=True, help="the tuning cache (tuning.db, or its folder)")
    p.add_argument("--gpu", required=True, help='the GPU timed on, as its driver names it: "NVIDIA H200"')
    p.add_argument("--arch", default="H200", help="the tune's --arch (default: H200)")
    p.add_argument("--topk", type=int, default=20, help="the tune's --topk (default: 20)")
    p.add_argument("--compiler", help="nvcc's release line the cache was timed with (default: the cache's)")
    p.add_argument("--nofusion", action="store_true", help="the tune ran with --nofusion")
    flags = p.add_mutually_exclusive_group()
    flags.add_argument("--no-tc", action="store_true", help="the tune ran with --no-tc")
    flags.add_argument("--tf32", action="store_true", help="the tune ran with --tf32")
    p.add_argument("-o", "--output", type=Path, help="emit the runtime sources into this folder")
    p.add_argument("--cuda-arch", default="90", help="what the emitted runtime builds for (default: 90)")
    args = p.parse_args(argv)

    db = args.cache / DB_NAME if args.cache.is_dir() else args.cache
    try:
        if not db.is_file():
            raise WelderError(f"{db} is not a tuning cache")
        compiler = args.compiler or cache_compiler(db, args.gpu)
        if compiler is None:
            raise WelderError(f"{db} holds no entry timed on {args.gpu!r}")
        arch = get_arch(args.arch)
        graph = planned_import(str(args.model), arch)
    except (WelderError, OSError, sqlite3.Error) as e:
        print(f"cached_plan: {e}", file=sys.stderr)
        return 2
    kinds = TuneOptions(tensor_cores=not args.no_tc, tf32=args.tf32).kinds
    with tempfile.TemporaryDirectory(prefix="welder-cached-plan-") as scratch:
        copy = Path(scratch) / DB_NAME
        with sqlite3.connect(db) as source, sqlite3.connect(copy) as target:
            source.backup(target)  # the file may be in WAL mode: a file copy could miss entries
        device = CacheOnlyDevice(args.gpu, compiler)
        try:
            cache, fusion = TuningCache(copy), {"nofusion": args.nofusion, "kinds": kinds}
            plan = tune_model(graph, arch, args.topk, cache, device, workers=1, **fusion)
        except NotCached as e:
            print(f"cached_plan: not in the cache for {args.gpu} ({compiler}): group {e}", file=sys.stderr)
            return 1
    groups = [(g.group, g.configs[0]) for g in plan.groups]
    kernels = generate_model(graph, groups)
    print(f"{'kernel':<48} {'family':<14} {'block tile':<16} {'grid':>7} {'thr':>4} {'smem':>7}  us")
    for (_, cfg), kernel, tuned in zip(groups, kernels, plan.groups):
        tile = "x".join(map(str, cfg.block_tile))
        us = f"{tuned.measured_us:.1f}" if isinstance(tuned, TunedGroup) else "-"
        print(
            f"{kernel.name[:48]:<48} {cfg.family:<14} {tile:<16} {kernel.grid:>7} {kernel.threads:>4} "
            f"{kernel.smem_bytes:>7}  {us}"
        )
    if args.output is not None:
        args.output.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(args.model, args.output / "model.onnx")
        emit_runtime(args.output, graph, groups, kernels, args.cuda_arch)
        print(f"wrote the runtime sources into {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
