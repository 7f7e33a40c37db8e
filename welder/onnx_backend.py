"""welder as an ONNX backend (``onnx.backend.base``), running on the reference interpreter.

This is the interface ONNX's conformance suite (``onnx.backend.test``) drives, and a small
public API for code written against it::

    import welder.onnx_backend as backend

    rep = backend.prepare(model, "CPU")
    outputs = rep.run([x, y])            # or rep.run({"x": x, "y": y})
    outputs = backend.run_model(model, [x, y])
    outputs = backend.run_node(node, [x, y])

welder compiles for static shapes, while the backend API hands a model over before any
input is known.  So :meth:`WelderBackendRep.run` imports the model for the shapes of the
inputs it receives and caches the imported graph per input signature.  Two more
adaptations keep the conformance models within what the importer accepts:

* a model outside opsets 11 to 21 is converted with ``onnx.version_converter`` first (the
  conversion the importer's own error message recommends); a model the converter cannot
  bring into range fails with the importer's opset error;
* inputs the importer needs as constants (the ``shape`` of a Reshape, the ``axes`` of a
  reduction, the ``pads`` of a Pad, ...) are specialised on the values passed to ``run``:
  if the model does not import with every input left dynamic, the inputs of rank 0 or 1
  are frozen into initializers and the import is retried.  The cache key then includes
  their values, so other values give another specialisation rather than a wrong result.

Only the ``"CPU"`` device is supported: it is where the interpreter runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper, version_converter
from onnx.backend.base import Backend, BackendRep, Device, DeviceType, namedtupledict

from welder.errors import ModelError, UnsupportedError, WelderError
from welder.frontend.onnx import (
    MAX_OPSET,
    MIN_OPSET,
    check_model,
    graph_inputs,
    import_onnx,
    model_opset,
    upgrade_opset,
)
from welder.frontend.registry import array_dtype, dtype_to_onnx
from welder.graph import Graph

__all__ = [
    "WelderBackend",
    "WelderBackendRep",
    "is_compatible",
    "prepare",
    "run_model",
    "run_node",
    "supports_device",
]

# Inputs up to this rank are candidates for specialisation: shapes, axes, pads, scales,
# starts/ends and scalar bounds are all vectors or scalars.
_SPECIALISE_MAX_RANK = 1

_SignatureItem = tuple[str, tuple[int, ...], str, bytes | None]


def convert_opset(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` itself if its opset is one welder imports, else a copy converted into the
    range 11..21.  Raises :class:`UnsupportedError` when ONNX has no conversion."""
    opset = model_opset(model)
    if MIN_OPSET <= opset <= MAX_OPSET:
        return model
    if opset < MIN_OPSET:
        try:
            return upgrade_opset(model)  # the import's upgrade: it keeps pre-11 Resize semantics
        except ModelError as e:
            raise UnsupportedError(str(e)) from None
    try:
        return version_converter.convert_version(model, MAX_OPSET)
    except Exception as e:  # the converter raises bare RuntimeErrors from C++ assertions
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UnsupportedError(
            f"the model uses opset {opset}; welder supports opsets {MIN_OPSET} to {MAX_OPSET} "
            f"and onnx.version_converter cannot convert it to opset {MAX_OPSET}: {first_line}"
        ) from None


class WelderBackendRep(BackendRep):
    """A prepared model: imports (once per input signature) and interprets it."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.input_names = [vi.name for vi in graph_inputs(model)]
        self.output_names = [o.name for o in model.graph.output]
        self._graphs: dict[tuple[_SignatureItem, ...], Graph] = {}
        self._specialise: bool | None = None  # decided by the first import

    def run(self, inputs: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Outputs, in the model's output order, for ``inputs``: a sequence in the order
        of the model's (non-initializer) inputs, a mapping by name, or a single array for
        a one-input model."""
        feeds = self._feeds(inputs)
        graph = self._graph_for(feeds)
        results = graph.run({t.name: feeds[t.name] for t in graph.inputs})
        return namedtupledict("Outputs", self.output_names)(*(results[n] for n in self.output_names))

    def _feeds(self, inputs: Any) -> dict[str, np.ndarray]:
        if isinstance(inputs, Mapping):
            feeds = {k: np.asarray(v) for k, v in inputs.items()}
        else:
            values = [inputs] if isinstance(inputs, np.ndarray) else list(inputs)
            if len(values) != len(self.input_names):
                raise WelderError(
                    f"got {len(values)} input(s); the model takes {len(self.input_names)}: {self.input_names}"
                )
            feeds = {k: np.asarray(v) for k, v in zip(self.input_names, values)}
        missing = [n for n in self.input_names if n not in feeds]
        if missing:
            raise WelderError(f"missing input(s) {missing}; the model takes {self.input_names}")
        return feeds

    def _graph_for(self, feeds: Mapping[str, np.ndarray]) -> Graph:
        """The imported graph for these inputs, importing on a cache miss."""
        if self._specialise is None:
            try:
                graph = self._import(feeds, frozen=())
                self._specialise = False
                self._graphs[self._signature(feeds, ())] = graph
                return graph
            except UnsupportedError as first_error:
                frozen = self._frozen(feeds)
                if not frozen:
                    raise
                # An error after freezing got further than the first one, so it names the
                # real problem (e.g. an unsupported attribute value); keep both.
                try:
                    graph = self._import(feeds, frozen)
                except WelderError as retry_error:
                    raise retry_error from first_error
                self._specialise = True
                self._graphs[self._signature(feeds, frozen)] = graph
                return graph
        frozen = self._frozen(feeds) if self._specialise else ()
        key = self._signature(feeds, frozen)
        if key not in self._graphs:
            self._graphs[key] = self._import(feeds, frozen)
        return self._graphs[key]

    def _frozen(self, feeds: Mapping[str, np.ndarray]) -> tuple[str, ...]:
        return tuple(n for n in self.input_names if feeds[n].ndim <= _SPECIALISE_MAX_RANK)

    @staticmethod
    def _signature(feeds: Mapping[str, np.ndarray], frozen: Sequence[str]) -> tuple[_SignatureItem, ...]:
        return tuple(
            (n, v.shape, v.dtype.str, v.tobytes() if n in frozen else None) for n, v in sorted(feeds.items())
        )

    def _import(self, feeds: Mapping[str, np.ndarray], frozen: Sequence[str]) -> Graph:
        model = self.model
        if frozen:
            model = onnx.ModelProto()
            model.CopyFrom(self.model)
            keep = [vi for vi in model.graph.input if vi.name not in frozen]
            del model.graph.input[:]
            model.graph.input.extend(keep)
            model.graph.initializer.extend(numpy_helper.from_array(feeds[n], n) for n in frozen)
        shapes = {n: feeds[n].shape for n in self.input_names if n not in frozen}
        return import_onnx(model, input_shapes=shapes)


class WelderBackend(Backend):
    """``onnx.backend.base.Backend`` for welder's reference interpreter (CPU only)."""

    @classmethod
    def is_compatible(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> bool:
        """Whether the opset (after conversion) and every operator are supported."""
        if not cls.supports_device(device):
            return False
        try:
            check_model(convert_opset(model))
        except WelderError:
            return False
        return True

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> WelderBackendRep:
        """Check ``model`` (opset, operators) and return a rep that runs it.  Errors about
        the model as a whole are raised here; shape-dependent ones on the first ``run``."""
        if not cls.supports_device(device):
            raise UnsupportedError(f"device {device!r} is not supported; welder's backend runs on 'CPU'")
        model = convert_opset(model)
        check_model(model)
        return WelderBackendRep(model)

    @classmethod
    def run_model(cls, model: onnx.ModelProto, inputs: Any, device: str = "CPU", **kwargs: Any) -> tuple:
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def run_node(
        cls,
        node: onnx.NodeProto,
        inputs: Any,
        device: str = "CPU",
        outputs_info: Sequence[tuple[np.dtype, tuple[int, ...]]] | None = None,
        **kwargs: Any,
    ) -> tuple:
        """Run one node on ``inputs`` (one array per non-empty node input, in order).
        ``opset_version`` (keyword) picks the opset; the newest welder supports by default."""
        arrays = [np.asarray(v) for v in inputs]
        names = [n for n in node.input if n]
        if len(arrays) != len(names):
            raise WelderError(f"node {node.op_type} has {len(names)} input(s), got {len(arrays)} array(s)")
        graph = helper.make_graph(
            [node],
            f"{node.op_type}_node",
            [
                helper.make_tensor_value_info(n, dtype_to_onnx(array_dtype(a, n)), a.shape)
                for n, a in zip(names, arrays)
            ],
            [helper.make_value_info(o, onnx.TypeProto()) for o in node.output if o],
        )
        opset = int(kwargs.pop("opset_version", MAX_OPSET))
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        return cls.run_model(model, arrays, device, **kwargs)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        try:
            return Device(device).type == DeviceType.CPU
        except AttributeError:  # an unknown device type name
            return False


is_compatible = WelderBackend.is_compatible
prepare = WelderBackend.prepare
run_model = WelderBackend.run_model
run_node = WelderBackend.run_node
supports_device = WelderBackend.supports_device
