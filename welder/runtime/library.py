"""Loading a built runtime into Python with ctypes: numpy in, numpy out, and latency.

The library describes its own interface (input and output names, dtypes, shapes) through C
query functions, so this loader needs nothing but the ``.so``; it checks every feed against
that description before any pointer reaches C.  ``GpuBackend`` puts it behind the
``welder.InferenceSession`` back-end protocol.
"""

from __future__ import annotations

import ctypes
import math
import os
import re
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from welder.errors import WelderError
from welder.graph import Graph
from welder.ir.interpret import np_dtype
from welder.runtime.layout import library_path


class RuntimeLibraryError(WelderError):
    """The runtime library is missing, does not match the model, was fed wrong arrays, or
    reported a failure (the message is its own: file, call and CUDA's error text)."""


@dataclass(frozen=True)
class TensorMeta:
    """A graph input or output as the runtime library declares it."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def np_dtype(self) -> np.dtype:
        return np_dtype(self.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.np_dtype.itemsize


@dataclass(frozen=True)
class Latency:
    """CUDA-event times of single runs, in milliseconds."""

    times_ms: tuple[float, ...]

    @property
    def min(self) -> float:
        return min(self.times_ms)

    @property
    def max(self) -> float:
        return max(self.times_ms)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.times_ms)

    @property
    def median(self) -> float:
        return statistics.median(self.times_ms)

    def summary(self) -> str:
        """The line main_test ends with (:func:`parse_summary` reads it back)."""
        return f"Summary: [min, max, mean] = [{self.min:f}, {self.max:f}, {self.mean:f}] ms"


_SUMMARY = re.compile(r"^Summary: \[min, max, mean\] = \[(\S+), (\S+), (\S+)\] ms$", re.M)


def parse_summary(text: str) -> tuple[float, float, float] | None:
    """(min, max, mean) in ms from the ``Summary`` line that main_test and ``welder run``
    print, or None if ``text`` has none."""
    found = _SUMMARY.search(text)
    return None if found is None else (float(found[1]), float(found[2]), float(found[3]))


# get_input_fill's answers (0 is normal floats).
_FILL_INTEGERS, _FILL_ONES, _FILL_BITS = 1, 2, 3
_INT_FUNCTIONS = (
    "cuda_init",
    "cuda_free",
    "run_on_device",
    "get_num_inputs",
    "get_num_outputs",
    "get_num_steps",
)
_QUERY_FUNCTIONS = (
    "get_input_name",
    "get_output_name",
    "get_input_dtype",
    "get_output_dtype",
    "get_step_name",
    "get_step_group",
)


@dataclass(frozen=True)
class Step:
    """One step of a run: a kernel (its name) or a library call (``cublas``), and the root of
    the plan's group it runs (tuned.json's ``root``)."""

    name: str
    group: str


class RuntimeLibrary:
    """``PREFIX/nnfusion_rt/cuda_codegen/build/libnnfusion_naive_rt.so``, initialised.

    One process may hold several instances of the same library: they share its device state,
    which ``cuda_init`` / ``cuda_free`` reference-count.  Use as a context manager or call
    :meth:`close`.

    Runs replay one CUDA graph (``cuda_graph=False``: each run's launches are enqueued one by
    one).  :meth:`run` copies the inputs into fixed device buffers, so the graph captured at
    the first run replays on every later input; only new buffers would capture again.  The
    setting belongs to the library, so it is shared with other instances in the process.
    """

    def __init__(
        self,
        prefix: str | os.PathLike[str],
        library: str | os.PathLike[str] | None = None,
        *,
        cuda_graph: bool = True,
    ) -> None:
        path = Path(library) if library is not None else library_path(prefix)
        if not path.is_file():
            raise RuntimeLibraryError(f"no runtime library at {path}; build it with `welder build {prefix}`")
        self.path = path.resolve()
        try:
            self._lib = ctypes.CDLL(str(self.path))
        except OSError as e:
            raise RuntimeLibraryError(f"cannot load {self.path}: {e}") from None
        self._declare()
        self.inputs = [self._meta("input", i) for i in range(self._lib.get_num_inputs())]
        self.outputs = [self._meta("output", i) for i in range(self._lib.get_num_outputs())]
        self._check(self._lib.cuda_init(), "cuda_init")
        self._open = True
        try:
            self.use_cuda_graph(cuda_graph)
        except RuntimeLibraryError:
            self.close()
            raise

    def _declare(self) -> None:
        lib = self._lib
        try:
            for name in _INT_FUNCTIONS:
                getattr(lib, name).restype = ctypes.c_int
                getattr(lib, name).argtypes = []
            for name in _QUERY_FUNCTIONS:
                getattr(lib, name).restype = ctypes.c_char_p
                getattr(lib, name).argtypes = [ctypes.c_int]
            for kind in ("input", "output"):
                getattr(lib, f"get_{kind}_rank").restype = ctypes.c_int
                getattr(lib, f"get_{kind}_rank").argtypes = [ctypes.c_int]
                getattr(lib, f"get_{kind}_shape").restype = ctypes.POINTER(ctypes.c_int64)
                getattr(lib, f"get_{kind}_shape").argtypes = [ctypes.c_int]
            lib.get_input_fill.restype = ctypes.c_int
            lib.get_input_fill.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int64)]
            lib.get_last_error.restype = ctypes.c_char_p
            lib.get_last_error.argtypes = []
            lib.kernel_entry_host.restype = ctypes.c_int
            pointers = ctypes.POINTER(ctypes.c_void_p)
            lib.kernel_entry_host.argtypes = [pointers, pointers]
            lib.measure_latency.restype = ctypes.c_int
            lib.measure_latency.argtypes = [ctypes.c_int] * 3 + [ctypes.POINTER(ctypes.c_float)]
            lib.measure_steps.restype = ctypes.c_int
            lib.measure_steps.argtypes = [ctypes.c_int] * 2 + [ctypes.POINTER(ctypes.c_float)]
            lib.set_use_cuda_graph.restype = ctypes.c_int
            lib.set_use_cuda_graph.argtypes = [ctypes.c_int]
            lib.get_cuda_graph_state.restype = ctypes.c_int
            lib.get_cuda_graph_state.argtypes = []
        except AttributeError as e:
            raise RuntimeLibraryError(f"{self.path} is not a welder runtime library: {e}") from None

    def _meta(self, kind: str, i: int) -> TensorMeta:
        lib = self._lib
        name = getattr(lib, f"get_{kind}_name")(i).decode()
        dtype = getattr(lib, f"get_{kind}_dtype")(i).decode()
        rank = getattr(lib, f"get_{kind}_rank")(i)
        dims = getattr(lib, f"get_{kind}_shape")(i)
        return TensorMeta(name, dtype, tuple(int(dims[d]) for d in range(rank)))

    def _check(self, status: int, call: str) -> None:
        if status != 0:
            message = self._lib.get_last_error().decode(errors="replace")
            raise RuntimeLibraryError(f"{self.path.name}: {call} failed (status {status}): {message}")

    def _require_open(self) -> None:
        if not self._open:
            raise RuntimeLibraryError(f"{self.path.name} was closed")

    # -- running ------------------------------------------------------------------------------

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Runs the model on host arrays; returns every output by name."""
        self._require_open()
        arrays = self._inputs(feeds)
        outputs = [np.empty(t.shape, dtype=t.np_dtype) for t in self.outputs]
        in_ptrs = (ctypes.c_void_p * max(len(arrays), 1))(*[a.ctypes.data for a in arrays])
        out_ptrs = (ctypes.c_void_p * max(len(outputs), 1))(*[a.ctypes.data for a in outputs])
        self._check(self._lib.kernel_entry_host(in_ptrs, out_ptrs), "kernel_entry_host")
        return {t.name: a for t, a in zip(self.outputs, outputs)}

    def _inputs(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """The feeds in the library's input order, checked and made contiguous."""
        names = [t.name for t in self.inputs]
        unknown = sorted(set(feeds) - set(names))
        if unknown:
            raise RuntimeLibraryError(f"unknown input(s) {unknown}; the runtime takes {names}")
        arrays = []
        for t in self.inputs:
            if t.name not in feeds:
                raise RuntimeLibraryError(f"missing input {t.name!r} ({t.dtype} {list(t.shape)})")
            a = np.asarray(feeds[t.name])
            if a.dtype != t.np_dtype:
                raise RuntimeLibraryError(f"input {t.name!r} is {a.dtype}, the runtime takes {t.dtype}")
            if a.shape != t.shape:
                raise RuntimeLibraryError(
                    f"input {t.name!r} has shape {list(a.shape)}, the runtime was built for {list(t.shape)}"
                )
            arrays.append(np.ascontiguousarray(a))
        return arrays

    def sample_inputs(self, seed: int = 0) -> dict[str, np.ndarray]:
        """Seeded inputs drawn the way main_test draws them (the library says how per input:
        normal floats, integers below the dimension they index, ones for masks, random bits)."""
        rng = np.random.default_rng(seed)
        feeds = {}
        for i, t in enumerate(self.inputs):
            high = ctypes.c_int64(0)
            fill = self._lib.get_input_fill(i, ctypes.byref(high))
            if fill == _FILL_INTEGERS:
                value = rng.integers(0, max(high.value, 1), size=t.shape)
            elif fill == _FILL_ONES:
                value = np.ones(t.shape)
            elif fill == _FILL_BITS:
                value = rng.random(t.shape) < 0.5
            else:
                value = rng.standard_normal(t.shape)
            feeds[t.name] = np.asarray(value).astype(t.np_dtype)
        return feeds

    def time(self, iters: int = 100, warmup: int = 5, number: int = 1) -> Latency:
        """``iters`` CUDA-event times per run after ``warmup`` runs, on the inputs of the last
        :meth:`run` (or whatever the device buffers hold before the first).  Each time is of
        ``number`` back-to-back runs divided by ``number``; 1 times single runs, each waited for."""
        self._require_open()
        if iters < 1 or warmup < 0 or number < 1:
            raise RuntimeLibraryError(
                f"need iters >= 1, warmup >= 0 and number >= 1, got {iters}, {warmup} and {number}"
            )
        times = (ctypes.c_float * iters)()
        self._check(self._lib.measure_latency(warmup, iters, number, times), "measure_latency")
        return Latency(tuple(float(t) for t in times))

    def call_latency(self, iters: int = 100, warmup: int = 5) -> Latency:
        """``iters`` wall-clock times (ms) of one synchronised run each, after ``warmup``, on the
        inputs of the last :meth:`run`: what a caller with its tensors already on the device
        waits per call -- the launch (a graph launch, or every kernel's) and the host's
        overheads included, unlike :meth:`time` with ``number > 1``."""
        self._require_open()
        if iters < 1 or warmup < 0:
            raise RuntimeLibraryError(f"need iters >= 1 and warmup >= 0, got {iters} and {warmup}")
        for _ in range(warmup):
            self._check(self._lib.run_on_device(), "run_on_device")
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            status = self._lib.run_on_device()
            times.append((time.perf_counter() - start) * 1e3)
            self._check(status, "run_on_device")
        return Latency(tuple(times))

    @property
    def steps(self) -> list[Step]:
        """The steps of a run, in order: what each runs and the plan group it belongs to."""
        lib = self._lib
        count = lib.get_num_steps()
        return [Step(lib.get_step_name(i).decode(), lib.get_step_group(i).decode()) for i in range(count)]

    def time_steps(self, number: int = 20, warmup: int = 2) -> list[float]:
        """Milliseconds per launch of each step (:attr:`steps`' order), each timed apart as
        ``number`` back-to-back launches replayed as one CUDA graph after ``warmup`` replays, on
        the inputs of the last :meth:`run`.  Runs after it recompute every intermediate."""
        self._require_open()
        if number < 1 or warmup < 0:
            raise RuntimeLibraryError(f"need number >= 1 and warmup >= 0, got {number} and {warmup}")
        times = (ctypes.c_float * max(self._lib.get_num_steps(), 1))()
        self._check(self._lib.measure_steps(warmup, number, times), "measure_steps")
        return [float(times[i]) for i in range(self._lib.get_num_steps())]

    def use_cuda_graph(self, enable: bool = True) -> None:
        """Capture each run as a CUDA graph and replay it (fewer launch overheads), or not."""
        self._require_open()
        self._check(self._lib.set_use_cuda_graph(int(enable)), "set_use_cuda_graph")

    @property
    def cuda_graph_state(self) -> str:
        """``off`` (launches enqueued one by one), ``on`` (nothing captured yet) or
        ``captured`` (runs replay a captured graph)."""
        return ("off", "on", "captured")[self._lib.get_cuda_graph_state()]

    def close(self) -> None:
        """Releases this instance's hold on the device state (idempotent)."""
        if self._open:
            self._open = False
            self._check(self._lib.cuda_free(), "cuda_free")

    def __enter__(self) -> RuntimeLibrary:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def measure_runtime(
    prefix: str | os.PathLike[str],
    iters: int = 100,
    warmup: int = 5,
    number: int = 1,
    seed: int = 0,
    cuda_graph: bool = True,
) -> Latency:
    """Latency of the runtime built under ``prefix`` on seeded inputs (``welder run`` and
    artifacts/run_welder.py): one checked run first, so a failure is reported as such rather
    than timed, then :meth:`RuntimeLibrary.time`."""
    with RuntimeLibrary(prefix, cuda_graph=cuda_graph) as lib:
        lib.run(lib.sample_inputs(seed))
        return lib.time(iters, warmup, number)


class GpuBackend:
    """A ``welder.InferenceSession`` back end running the runtime built under ``prefix``.

    The library must have been built for this graph: same inputs and outputs, in order, with
    the same dtypes and shapes (the shapes the model was imported with).  Runs replay a CUDA
    graph unless ``cuda_graph=False`` (``welder.InferenceSession(prefix, cuda_graph=False)``).
    """

    def __init__(
        self,
        graph: Graph,
        prefix: str | os.PathLike[str] | None = None,
        cuda_graph: bool = True,
        **_: object,
    ) -> None:
        if prefix is None:
            raise RuntimeLibraryError("the gpu back end needs prefix= (the folder `welder tune` wrote)")
        self.graph = graph
        self.library = RuntimeLibrary(prefix, cuda_graph=cuda_graph)
        expected_in = [TensorMeta(t.name, t.dtype, t.shape) for t in graph.inputs]
        expected_out = [TensorMeta(o, graph.tensor(o).dtype, graph.tensor(o).shape) for o in graph.outputs]
        if self.library.inputs != expected_in or self.library.outputs != expected_out:
            self.library.close()
            raise RuntimeLibraryError(
                f"the runtime in {prefix} was built for another model or other shapes: it takes "
                f"{_describe(self.library.inputs)} and gives {_describe(self.library.outputs)}, the model "
                f"takes {_describe(expected_in)} and gives {_describe(expected_out)}; run `welder tune` again"
            )

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.library.run(feeds)


def _describe(tensors: list[TensorMeta]) -> str:
    return ", ".join(f"{t.name} {t.dtype}{list(t.shape)}" for t in tensors)
