"""Time onnxruntime on PREFIX/model.onnx with the best provider it has.

    python artifacts/run_onnxrt.py runs/bert_b1 [--provider cuda|cpu] [--json out.json]

The CUDA provider is used when this onnxruntime has it: inputs are copied to the GPU once
and bound, outputs are bound to GPU buffers, so a call does no host transfers -- the
protocol every system shares.  Otherwise the CPU provider runs, and the output says so:
a CPU figure is a reference point, not a like-for-like GPU comparison.  A call of
``run_with_iobinding`` returns when the GPU work is done, so wall time is the latency.

Inputs are the exported module's (rebuilt from export.json) when torch is present, else
welder's seeded random inputs for the model.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run_torch import Result, TimingPlan, WallClock, measure

PROVIDERS = {"cuda": "CUDAExecutionProvider", "cpu": "CPUExecutionProvider"}


def model_file(prefix: str | Path) -> Path:
    p = Path(prefix)
    return p / "model.onnx" if p.is_dir() else p


def choose_provider(requested: str | None = None) -> str:
    """The ONNX Runtime provider to use: the one asked for, else CUDA when available."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    if requested:
        name = PROVIDERS.get(requested, requested)
        if name not in available:
            raise SystemExit(f"run_onnxrt: provider {name} is not in this onnxruntime ({available})")
        return name
    return PROVIDERS["cuda"] if PROVIDERS["cuda"] in available else PROVIDERS["cpu"]


def model_inputs(prefix: str | Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """``(feeds, description)``: the exported module's inputs when they can be rebuilt,
    otherwise welder's seeded random inputs (token ids below the vocabulary)."""
    from welder.errors import WelderError
    from welder.export import rebuild, to_numpy

    try:
        _, inputs, info = rebuild(prefix)
        return to_numpy(inputs), {"model": info.model, "batch": info.batch, "dtype": info.dtype}
    except WelderError:  # no export.json, or no torch to rebuild with
        from welder.check import random_inputs
        from welder.frontend.onnx import import_onnx

        graph = import_onnx(str(model_file(prefix)))
        batch = graph.inputs[0].shape[0] if graph.inputs and graph.inputs[0].shape else 1
        dtype = graph.tensor(graph.outputs[0]).dtype  # the precision the model computes in
        return random_inputs(graph), {"model": Path(prefix).name, "batch": batch, "dtype": dtype}


def open_session(path: Path, provider: str) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    providers = [provider] if provider == PROVIDERS["cpu"] else [provider, PROVIDERS["cpu"]]
    return ort.InferenceSession(str(path), opts, providers=providers)


def gpu_call(sess: Any, feeds: Mapping[str, np.ndarray]) -> Callable[[], object]:
    """A call with inputs and outputs resident on the GPU: inputs bound once; outputs bound
    to the buffers the first run allocated, so later runs reuse them."""
    import onnxruntime as ort

    binding = sess.io_binding()
    for name, value in feeds.items():
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(value, "cuda", 0))
    for out in sess.get_outputs():
        binding.bind_output(out.name, "cuda", 0)
    sess.run_with_iobinding(binding)
    for out, value in zip(sess.get_outputs(), binding.get_outputs()):
        binding.bind_ortvalue_output(out.name, value)
    return lambda: sess.run_with_iobinding(binding)


def cpu_call(sess: Any, feeds: Mapping[str, np.ndarray]) -> Callable[[], object]:
    wanted = {i.name for i in sess.get_inputs()}
    feed = {k: v for k, v in feeds.items() if k in wanted}
    return lambda: sess.run(None, feed)


def run_onnxrt(prefix: str | Path, provider: str | None = None, plan: TimingPlan | None = None) -> Result:
    """onnxruntime's latency on the model; an error is recorded in the result."""
    name = choose_provider(provider)
    feeds, desc = model_inputs(prefix)
    short = "cuda" if name == PROVIDERS["cuda"] else "cpu"
    res = Result(f"onnxruntime-{short}", desc["model"], int(desc["batch"]), str(desc["dtype"]), short)
    try:
        sess = open_session(model_file(prefix), name)
        used = sess.get_providers()[0]
        if used != name:
            res.notes.append(f"asked for {name}, onnxruntime used {used}")
        call = gpu_call(sess, feeds) if used == PROVIDERS["cuda"] else cpu_call(sess, feeds)
        res.timing = measure(call, WallClock(), plan)
    except Exception as e:
        res.error = f"{type(e).__name__}: {e}".strip()
    return res


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prefix", help="folder holding model.onnx (and export.json), or an .onnx file")
    p.add_argument("--provider", choices=sorted(PROVIDERS), help="default: cuda when available, else cpu")
    p.add_argument("--budget-s", type=float, default=15.0, help="measuring time cap (default 15)")
    p.add_argument("--json", help="also write the result as JSON to this file")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    import onnxruntime as ort

    args = build_parser().parse_args(argv)
    res = run_onnxrt(args.prefix, args.provider, TimingPlan(budget_s=args.budget_s))
    print(f"# onnxruntime {ort.__version__}, provider {PROVIDERS.get(res.device, res.device)}")
    if res.device == "cpu":
        print("# CPU provider: no CUDA provider in this onnxruntime; not a GPU figure")
    print(res.format())
    if args.json:
        Path(args.json).write_text(json.dumps([res.to_dict()], indent=2) + "\n")
    return 1 if res.error else 0


if __name__ == "__main__":
    sys.exit(main())
