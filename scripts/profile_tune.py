"""Where a cold ``welder tune`` spends its time, function by function, on the GPU machine.

    python scripts/profile_tune.py MODEL [--bs 64] [--fp16] [--topk 20] [--top 40]

Exports MODEL from the registry (into a temporary folder), then fuses and tunes it with a
fresh tuning cache under cProfile, the GPU executor in this process (not in its worker) so
that the timing and checking calls show up in the profile too.  Prints the phases the
tuner reports and the functions with the most cumulative and own time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a registry model (welder export's names)")
    p.add_argument("--bs", type=int, default=64)
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--topk", type=int, default=20)
    p.add_argument("--top", type=int, default=40, help="functions listed per ordering")
    args = p.parse_args(argv)

    import onnx

    from welder.arch import get_arch
    from welder.device.gpu import GpuDevice
    from welder.export import export_onnx
    from welder.frontend.onnx import import_onnx
    from welder.tune.cache import TuningCache
    from welder.tune.tuner import tune_model

    with tempfile.TemporaryDirectory(prefix="welder-profile-") as work:
        path = export_onnx(args.model, Path(work) / "model", args.bs, args.fp16)
        graph = import_onnx(onnx.load(str(path)))
        cache = TuningCache(Path(work) / "cache" / "tuning.db")
        profile = cProfile.Profile()
        start = time.perf_counter()
        with GpuDevice(isolate=False) as device:
            plan = profile.runcall(tune_model, graph, get_arch("auto"), args.topk, cache, device)
        seconds = time.perf_counter() - start
    kernels = len(plan.groups)
    print(f"{args.model} b{args.bs}: tune {seconds:.0f} s, {kernels} kernels, phases {plan.phase_seconds}")
    stats = pstats.Stats(profile, stream=sys.stdout)
    stats.sort_stats("cumulative").print_stats(args.top)
    stats.sort_stats("tottime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
