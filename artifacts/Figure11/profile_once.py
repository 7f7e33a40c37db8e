"""One inference of one system inside a CUDA profiler range, for Nsight Compute.

    ncu --profile-from-start off ... python artifacts/Figure11/profile_once.py SYSTEM PREFIX

SYSTEM is a welder variant (the runtime built under PREFIX, launched kernel by kernel so
each kernel is profiled on its own), ``eager``, ``compile``, ``compile-max-autotune``
(the module rebuilt from PREFIX/export.json) or ``onnxruntime`` (its CUDA provider on
PREFIX/model.onnx).  Each is warmed up first -- compilation, autotuning, lazy
initialisation and CUDA-graph capture stay outside the range -- so the profile holds the
kernels of exactly one inference, which is what Figure 11 counts.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

WARMUP = 5


def welder_call(prefix: str) -> tuple[Callable[[], object], Any]:
    """One run of the built runtime on the device buffers (no host copies), launched
    without a CUDA graph."""
    from welder.runtime.library import RuntimeLibrary

    lib = RuntimeLibrary(prefix)
    lib.use_cuda_graph(False)
    lib.run(lib.sample_inputs(0))
    return lambda: lib.time(iters=1, warmup=0), lib


def torch_call(system: str, prefix: str) -> tuple[Callable[[], object], Any]:
    import torch
    from run_torch import COMPILE_MODES, _compiled, _step, load

    module, args, _, _ = load(prefix, "cuda")
    fn = module if system == "eager" else _compiled(module, COMPILE_MODES[system])
    step = _step(fn, args, system != "eager")
    context = torch.inference_mode()
    context.__enter__()
    return step, context


def ort_call(prefix: str) -> tuple[Callable[[], object], Any]:
    from run_onnxrt import PROVIDERS, gpu_call, model_file, model_inputs, open_session

    sess = open_session(model_file(prefix), PROVIDERS["cuda"])
    if sess.get_providers()[0] != PROVIDERS["cuda"]:
        raise SystemExit("profile_once: onnxruntime has no CUDA provider here")
    feeds, _ = model_inputs(prefix)
    return gpu_call(sess, feeds), sess


def main(argv: Sequence[str] | None = None) -> int:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("system", help="welder[-VARIANT], eager, compile, compile-max-autotune, onnxruntime")
    parser.add_argument("prefix", help="the case's folder (model.onnx, export.json, the welder build)")
    args = parser.parse_args(argv)
    import torch

    if args.system.startswith("welder"):
        call, keep = welder_call(args.prefix)
    elif args.system == "onnxruntime":
        call, keep = ort_call(args.prefix)
    else:
        call, keep = torch_call(args.system, args.prefix)
    for _ in range(WARMUP):
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    del keep
    return 0


if __name__ == "__main__":
    sys.exit(main())
