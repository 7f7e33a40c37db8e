"""``welder.InferenceSession``: the onnxruntime-shaped Python API.

    sess = welder.InferenceSession("model.onnx", backend="interpret")
    [out] = sess.run(None, {"input": x})

Back ends: ``interpret`` (the numpy reference), ``emulate`` (generated kernels on the CPU)
and ``gpu`` (the runtime ``welder tune`` built in a PREFIX folder; the default for such a
folder on a machine with a GPU).  A back end is anything with
``run(feeds) -> {output name: array}`` built from the imported graph; ``BACKENDS`` maps
the names users pass to their constructors.  ``run`` checks the feeds first, whatever the
back end: dtypes and shapes, and integer inputs used as indices against the dimensions they
index (``welder.index_check``; a GPU kernel would only clamp a bad index).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from welder.check import (
    CheckReport,
    compare,
    model_file,
    onnxruntime_outputs,
    output_thresholds,
    random_inputs,
    recorded_precision,
    reference_name,
)
from welder.errors import ModelError, WelderError
from welder.frontend.onnx import import_onnx
from welder.graph import Graph, TensorInfo
from welder.index_check import check_index_inputs, index_sites
from welder.ir.interpret import np_dtype


class Backend(Protocol):
    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]: ...


class InterpretBackend:
    """The numpy reference interpreter: slow, exact, needs nothing but numpy."""

    def __init__(self, graph: Graph, **_: object) -> None:
        self.graph = graph

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.graph.run(feeds)


class EmulateBackend:
    """The whole compiler pipeline -- fusion and configs from the cost model, CUDA from the
    templates -- with the kernels executed on the CPU by the emulator.  Slow; it exists to
    check generated code without a GPU."""

    def __init__(self, graph: Graph, arch: str = "H100", **_: object) -> None:
        from welder.arch import get_arch
        from welder.codegen import generate_model
        from welder.runtime.emulate import EmulatedModel
        from welder.schedule.plan import plan_model

        plan = plan_model(graph, get_arch(arch), topk=1)
        kernels = generate_model(graph, [(p.group, p.configs[0]) for p in plan.groups])
        self.plan = plan
        self.model = EmulatedModel(graph, kernels)

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.model.run(feeds)


def _gpu_backend(graph: Graph, prefix: str | os.PathLike | None = None, **options: object) -> Backend:
    from welder.runtime.library import GpuBackend

    return GpuBackend(graph, prefix=prefix, **options)


BACKENDS: dict[str, Callable[..., Backend]] = {
    "interpret": InterpretBackend,
    "emulate": EmulateBackend,
    "gpu": _gpu_backend,
}


def default_backend(path: str | os.PathLike) -> str:
    """``gpu`` for a folder holding a built runtime on a machine with an NVIDIA driver,
    else the reference interpreter."""
    from welder.runtime.layout import library_path

    folder = Path(path)
    if folder.is_dir() and library_path(folder).is_file() and shutil.which("nvidia-smi"):
        return "gpu"
    return "interpret"


_ORT_TYPES = {"float32": "float", "float64": "double"}


@dataclass(frozen=True)
class NodeArg:
    """Mirrors onnxruntime's NodeArg: ``name``, ``shape``, ``type`` ('tensor(float)')."""

    name: str
    shape: list[int]
    type: str


def _node_arg(t: TensorInfo) -> NodeArg:
    return NodeArg(t.name, list(t.shape), f"tensor({_ORT_TYPES.get(t.dtype, t.dtype)})")


class InferenceSession:
    def __init__(
        self,
        path: str | os.PathLike,
        backend: str | None = None,
        input_shapes: Mapping[str, Sequence[int]] | None = None,
        **options: object,
    ) -> None:
        backend = backend or default_backend(path)
        if backend == "gpu":
            options.setdefault("prefix", path if Path(path).is_dir() else Path(path).parent)
        if backend not in BACKENDS:
            raise WelderError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        self.path = os.fspath(path)
        self.backend_name = backend
        self.graph = import_onnx(path, input_shapes)
        self._index_sites = index_sites(self.graph)
        self._backend = BACKENDS[backend](self.graph, **options)

    def get_inputs(self) -> list[NodeArg]:
        return [_node_arg(t) for t in self.graph.inputs]

    def get_outputs(self) -> list[NodeArg]:
        return [_node_arg(self.graph.tensor(o)) for o in self.graph.outputs]

    def get_providers(self) -> list[str]:
        return [self.backend_name]

    def run(
        self, output_names: Sequence[str] | None, input_feed: Mapping[str, object], run_options: object = None
    ) -> list[np.ndarray]:
        feeds = self._validate(input_feed)
        # Every back end, because GPU kernels would only clamp a bad index.
        check_index_inputs(self.graph, self._index_sites, feeds)
        names = list(output_names) if output_names else list(self.graph.outputs)
        unknown = [n for n in names if n not in self.graph.outputs]
        if unknown:
            raise ModelError(f"unknown output(s) {unknown}; the model has {self.graph.outputs}")
        results = self._backend.run(feeds)
        return [np.asarray(results[n]) for n in names]

    def _validate(self, feed: Mapping[str, object]) -> dict[str, np.ndarray]:
        expected = {t.name: t for t in self.graph.inputs}
        extra = sorted(set(feed) - set(expected))
        if extra:
            raise ModelError(f"unknown input(s) {extra}; the model takes {list(expected)}")
        out = {}
        for name, t in expected.items():
            if name not in feed:
                raise ModelError(f"missing input {name!r} (shape {list(t.shape)}, {t.dtype})")
            arr = np.asarray(feed[name])
            if arr.dtype != np_dtype(t.dtype):
                raise ModelError(f"input {name!r} has dtype {arr.dtype}, the model expects {t.dtype}")
            if arr.shape != t.shape:
                raise ModelError(
                    f"input {name!r} has shape {list(arr.shape)}, the model was imported with "
                    f"{list(t.shape)} (pass input_shapes= to import it with another)"
                )
            out[name] = arr
        return out


def check_model(
    model: str | os.PathLike,
    backend: str = "interpret",
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    seed: int = 0,
    precision: str | None = None,
    **options: object,
) -> CheckReport:
    """Run ``model`` through ``backend`` and onnxruntime on the same random inputs.  The fp32
    outputs' limit follows ``precision``; by default, for the ``gpu`` back end the precision
    its runtime was tuned for (``welder tune --tf32``: TF32), else exact fp32."""
    sess = InferenceSession(model, backend=backend, input_shapes=input_shapes, **options)
    if precision is None:
        prefix = options.get("prefix", model if Path(model).is_dir() else Path(model).parent)
        precision = recorded_precision(prefix) if sess.backend_name == "gpu" else "fp32"
    feeds = random_inputs(sess.graph, seed)
    names = list(sess.graph.outputs)
    ours = dict(zip(names, sess.run(names, feeds)))
    reference = onnxruntime_outputs(model_file(model), feeds, names)
    limits = output_thresholds(sess.graph, names, precision=precision)
    results = compare(ours, reference, precision, limits)
    return CheckReport(str(model), backend, seed, results, reference_name(model_file(model)))
