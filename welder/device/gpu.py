"""Device access for profiling generated kernels on an NVIDIA GPU, through pycuda.

pycuda is optional (the ``gpu`` extra): it is imported only when a GPU is actually used, so
the rest of welder -- and every test that fakes the device -- runs without it.

Layers, bottom up:

* queries and compilation: :func:`gpu_available`, :func:`device_name`,
  :func:`compute_capability`, :func:`nvcc_version`, :func:`compile_cubin` (one nvcc call for
  many kernels: the candidates of a group share one translation unit);
* in-process execution: :class:`DeviceBuffer`, :class:`GpuModule` and :func:`time_kernel`
  (CUDA events, warm-up, repeats until the median settles or the budget is spent, inputs
  rotated through several copies when they would otherwise sit in L2);
* :class:`GpuExecutor`, which owns a CUDA context and does whole jobs (load a module, upload
  inputs, run or time one kernel);
* :class:`GpuDevice`, the tuner's ``Device``: it compiles in the calling process and sends
  every launch to a :class:`GpuExecutor` in a *worker process*.

Why a worker process: a kernel that faults (an illegal address) leaves the CUDA context
unusable -- every later call in it fails -- and a kernel that never finishes cannot be
stopped from inside its process.  In the worker, a fault ends the worker, the tuner drops
that candidate, and the next call starts a fresh worker (modules and inputs are sent again);
a call that outlives its timeout kills the worker, which also ends the kernel.  The
in-process mode (``isolate=False``) starts faster but survives neither: a fault's error is
sticky for the whole process (even a new context cannot be created), so after one every
later call fails with a GpuError saying so.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import math
import os
import pickle
import re
import select
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

try:
    import fcntl
except ImportError:  # Windows has none: pipes keep their default size
    fcntl = None  # type: ignore[assignment]

import numpy as np

from welder.codegen.tensor_map import (
    TENSOR_MAP_ALIGN,
    TENSOR_MAP_BYTES,
    EncodedTensorMap,
    TensorMapArg,
    TensorMapError,
    check_tensor_map,
)
from welder.errors import WelderError
from welder.resources import TEMPLATE_DIR

PYCUDA_MISSING = "pycuda is not installed: pip install -e '.[gpu]'"
#: Launches above this much dynamic shared memory must opt in per function.
DEFAULT_SMEM_LIMIT = 48 * 1024
#: L2 size to assume when the driver does not report it (an H100 has 50 MiB).
FALLBACK_L2_BYTES = 64 * 2**20


class GpuError(WelderError):
    """Something on the GPU side went wrong."""


class GpuUnavailable(GpuError):
    """No usable GPU: pycuda missing, no driver, or no device."""


class CompileError(GpuError):
    """nvcc rejected the source; the message carries its diagnostics."""


class LaunchError(GpuError):
    """A kernel could not be launched or failed while running.

    ``fatal`` means the CUDA context did not survive (the usual outcome of a fault), so the
    executor that ran it had to be replaced."""

    def __init__(self, message: str, fatal: bool = False) -> None:
        super().__init__(message)
        self.fatal = fatal


class KernelTimeout(LaunchError):
    """A call did not finish within its time limit; its worker was killed."""

    def __init__(self, message: str) -> None:
        super().__init__(message, fatal=True)


# -- pycuda and the driver --------------------------------------------------------------------


def _driver() -> Any:
    """``pycuda.driver``, initialised; GpuUnavailable if pycuda or the driver is missing."""
    try:
        import pycuda.driver as drv
    except ImportError:
        raise GpuUnavailable(PYCUDA_MISSING) from None
    except OSError as e:  # pycuda is there but libcuda is not
        raise GpuUnavailable(f"pycuda cannot load the CUDA driver: {e}") from None
    try:
        drv.init()
    except drv.Error as e:
        raise GpuUnavailable(f"the CUDA driver cannot be initialised: {e}") from None
    return drv


@functools.lru_cache(maxsize=1)
def gpu_available() -> bool:
    """Whether pycuda is installed and the driver sees at least one GPU."""
    try:
        return _driver().Device.count() > 0
    except GpuError:
        return False
    except Exception:  # a driver error pycuda reports under another class
        return False


def device_name(ordinal: int = 0) -> str:
    """The driver's name for GPU ``ordinal``, e.g. ``NVIDIA H100 80GB HBM3``."""
    return str(_driver().Device(ordinal).name())


def compute_capability(ordinal: int = 0) -> tuple[int, int]:
    major, minor = _driver().Device(ordinal).compute_capability()
    return int(major), int(minor)


def sm_arch(capability: tuple[int, int], *, arch_specific: bool = False) -> str:
    """nvcc's name for a compute capability: (9, 0) -> ``sm_90``.

    ``arch_specific`` names the architecture-specific target instead (``sm_90a``): its code runs on
    that compute capability only, and may use the instructions outside the portable set (wgmma,
    setmaxnreg on 9.0).  Such targets exist from 9.0 on."""
    if arch_specific and capability < (9, 0):
        major, minor = capability
        raise CompileError(f"compute capability {major}.{minor} has no architecture-specific target")
    return f"sm_{capability[0]}{capability[1]}{'a' if arch_specific else ''}"


# -- nvcc ---------------------------------------------------------------------------------------


def nvcc_path() -> str:
    path = shutil.which("nvcc")
    if path is None:
        raise GpuUnavailable("nvcc is not on PATH: install the CUDA toolkit to compile kernels")
    return path


@functools.lru_cache(maxsize=1)
def nvcc_version() -> str:
    """nvcc's release line, e.g. ``Cuda compilation tools, release 13.0, V13.0.88`` (part of
    every tuning-cache key: another compiler may make another config the fastest)."""
    out = subprocess.run([nvcc_path(), "--version"], capture_output=True, text=True, check=False).stdout
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    release = [ln for ln in lines if "release" in ln]
    return (release or lines or ["nvcc (unknown version)"])[-1]


#: nvcc's time limit where the caller sets none: generous, since a stuck nvcc is rare.
NVCC_TIMEOUT_S = 1800.0
#: nvcc runs this much below the caller's priority.  The tuner keeps every core busy with
#: nvcc calls while its fusion search, its GPU timing and its reference outputs -- the work
#: the tune waits on -- run beside them: nvcc takes the cycles they leave (docs/tuning.md).
NVCC_NICENESS = 10


def compile_cubin(
    sources: Sequence[str] | str,
    arch: str = "sm_90",
    include_dirs: Sequence[str | os.PathLike[str]] | None = None,
    options: Sequence[str] = (),
    timeout_s: float = NVCC_TIMEOUT_S,
    report: Callable[[str], None] | None = None,
) -> bytes:
    """Compile CUDA source(s) into one cubin with a single nvcc call.

    Several sources become one translation unit, so each must define kernels with distinct
    names (their includes are guarded).  ``include_dirs`` defaults to the kernel templates' folder,
    where ``welder_prelude.cuh`` lives.  Raises :class:`CompileError` with nvcc's diagnostics.
    ``report`` receives what nvcc printed to stderr on success (``-Xptxas -v``'s registers)."""
    return _nvcc("cubin", sources, arch, include_dirs, options, timeout_s, report)


def compile_ptx(
    sources: Sequence[str] | str,
    arch: str = "sm_90",
    include_dirs: Sequence[str | os.PathLike[str]] | None = None,
    timeout_s: float = NVCC_TIMEOUT_S,
) -> str:
    """The PTX nvcc makes of the source(s), as :func:`compile_cubin` compiles them: where a
    study needs the code's structure (its loops) rather than the machine code."""
    return _nvcc("ptx", sources, arch, include_dirs, (), timeout_s, None).decode()


def _nvcc(
    output: str,
    sources: Sequence[str] | str,
    arch: str,
    include_dirs: Sequence[str | os.PathLike[str]] | None,
    options: Sequence[str],
    timeout_s: float,
    report: Callable[[str], None] | None,
) -> bytes:
    """One nvcc call from CUDA source(s) to ``output`` (``cubin`` or ``ptx``)."""
    text = sources if isinstance(sources, str) else "\n".join(sources)
    dirs = [TEMPLATE_DIR] if include_dirs is None else list(include_dirs)
    if not re.fullmatch(r"(sm|compute)_\d+[a-z]?", arch):
        raise CompileError(f"{arch!r} is not an nvcc architecture like sm_90")
    with tempfile.TemporaryDirectory(prefix="welder-nvcc-") as work:
        src, out = Path(work) / "kernels.cu", Path(work) / f"kernels.{output}"
        src.write_text(text)
        command = [
            *_niced(),
            nvcc_path(),
            f"-{output}",
            "-O3",
            f"-arch={arch}",
            *(f"-I{d}" for d in dirs),
            *options,
            str(src),
            "-o",
            str(out),
        ]
        try:
            result = subprocess.run(
                command, capture_output=True, text=True, errors="replace", timeout=timeout_s
            )
        except subprocess.TimeoutExpired:
            raise CompileError(f"nvcc did not finish within {timeout_s:.0f} s") from None
        if result.returncode != 0 or not out.is_file():
            raise CompileError(f"nvcc failed (exit {result.returncode}):\n{_tail(result.stderr, 4000)}")
        if report is not None:
            report(result.stderr)
        return out.read_bytes()


def _niced() -> list[str]:
    """The prefix that runs a command at :data:`NVCC_NICENESS` (none where ``nice`` is missing)."""
    nice = shutil.which("nice")
    return [nice, "-n", str(NVCC_NICENESS)] if nice and NVCC_NICENESS else []


def _tail(text: str, limit: int) -> str:
    text = text.strip()
    return text if len(text) <= limit else "...\n" + text[-limit:]


# -- memory and modules ---------------------------------------------------------------------------


class DeviceBuffer:
    """One allocation in GPU memory (at least one byte, so every argument has an address)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = int(nbytes)
        self._alloc = _driver().mem_alloc(max(1, self.nbytes))

    @classmethod
    def from_array(cls, array: np.ndarray) -> DeviceBuffer:
        host = np.ascontiguousarray(array)
        buf = cls(host.nbytes)
        if host.nbytes:
            _driver().memcpy_htod(buf._alloc, host)
        return buf

    @property
    def ptr(self) -> int:
        return int(self._alloc)

    def fill_bytes(self, value: int) -> None:
        """Set every byte (0xFF makes floats NaN and integers -1: unwritten output shows)."""
        if self.nbytes:
            _driver().memset_d8(self._alloc, value, self.nbytes)

    def copy_from(self, other: DeviceBuffer) -> None:
        if self.nbytes:
            _driver().memcpy_dtod(self._alloc, other._alloc, min(self.nbytes, other.nbytes))

    def to_array(
        self, shape: Sequence[int], dtype: np.dtype | str, rows: Sequence[tuple[int, int]] | None = None
    ) -> np.ndarray:
        """The buffer as an array of ``shape``; with ``rows``, only those ranges of its first
        axis, one after another (each a contiguous copy)."""
        if rows is None:
            out = np.empty(tuple(shape), dtype=np.dtype(dtype))
            if out.nbytes:
                _driver().memcpy_dtoh(out, self._alloc)
            return out
        row_shape = tuple(shape)[1:]
        out = np.empty((sum(b - a for a, b in rows), *row_shape), dtype=np.dtype(dtype))
        row_bytes = math.prod(row_shape) * out.itemsize
        at = 0
        for a, b in rows:
            if b > a and row_bytes:
                _driver().memcpy_dtoh(out[at : at + b - a], int(self._alloc) + a * row_bytes)
            at += b - a
        return out

    def free(self) -> None:
        self._alloc.free()


# Buffers and raw pointers, numpy scalars, and tensor maps over a buffer argument of the same launch
# (encoded per launch, or once per rotated copy of the buffers: EncodedTensorMap).
Argument = DeviceBuffer | int | np.generic | TensorMapArg | EncodedTensorMap


def _dim3(value: int | Sequence[int]) -> tuple[int, int, int]:
    dims = [int(value)] if isinstance(value, int | np.integer) else [int(v) for v in value]
    x, y, z = [*dims, 1, 1, 1][:3]
    return x, y, z


class GpuModule:
    """A loaded cubin (or PTX, which the driver compiles) and launches of its kernels."""

    def __init__(self, image: bytes) -> None:
        self._drv = _driver()
        # Launches with tensor maps go through the driver API (see RawModule).
        self._raw = RawModule(image)
        self._module = self._drv.module_from_buffer(image)
        self._functions: dict[str, Any] = {}
        self._smem_opt_in: dict[str, int] = {}

    def function(self, name: str) -> Any:
        if name not in self._functions:
            try:
                self._functions[name] = self._module.get_function(name)
            except self._drv.Error as e:
                raise LaunchError(f"no kernel {name!r} in the module: {e}") from None
        return self._functions[name]

    def launch(
        self,
        name: str,
        grid: int | Sequence[int],
        block: int | Sequence[int],
        smem: int,
        args: Sequence[Argument],
        stream: Any = None,
    ) -> None:
        """Enqueue one launch (asynchronous: faults surface at the next synchronisation)."""
        if any(isinstance(a, TensorMapArg | EncodedTensorMap) for a in args):
            self._raw.launch(name, grid, block, smem, args, getattr(stream, "handle", None))
            return
        fn = self.function(name)
        if smem > DEFAULT_SMEM_LIMIT and self._smem_opt_in.get(name, 0) < smem:
            fn.set_attribute(self._drv.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, int(smem))
            self._smem_opt_in[name] = smem
        fmt, values = _pack(args)
        fn.prepare(fmt)
        fn.prepared_async_call(_dim3(grid), _dim3(block), stream, *values, shared_size=int(smem))


class RawModule:
    """A module loaded through the driver API (ctypes on libcuda) into the context current at
    its first launch, for launches pycuda cannot make: parameters passed by pointer, through
    ``cuLaunchKernel``'s array, which tensor maps need.

    pycuda's prepared calls pass one packed parameter buffer (CU_LAUNCH_PARAM_BUFFER_POINTER);
    on an H100 (driver 580) a ``__grid_constant__`` CUtensorMap passed that way -- correctly
    laid out at a multiple of 64 -- makes the first TMA load an illegal instruction, while the
    same bytes passed by pointer work.  pycuda does not expose its function handles, so a
    :class:`GpuModule` loads its image a second time this way for such kernels; a script that
    launches from another library's context (torch's) uses this class directly."""

    def __init__(self, image: bytes) -> None:
        self._image = image
        self._module: ctypes.c_void_p | None = None
        self._functions: dict[str, ctypes.c_void_p] = {}
        self._smem_opt_in: dict[str, int] = {}

    def launch(
        self,
        name: str,
        grid: int | Sequence[int],
        block: int | Sequence[int],
        smem: int,
        args: Sequence[Argument],
        stream_handle: int | None = None,
    ) -> None:
        """Enqueue one launch of ``name`` with ``args`` (see :func:`kernel_params`) on the
        stream of handle ``stream_handle`` (the default stream when None)."""
        driver = _driver_library()
        fn = self._function(name)
        if smem > DEFAULT_SMEM_LIMIT and self._smem_opt_in.get(name, 0) < smem:
            _check(
                driver.cuFuncSetAttribute(fn, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, int(smem)),
                name,
            )
            self._smem_opt_in[name] = smem
        holders, params = kernel_params(args)
        gx, gy, gz = _dim3(grid)
        bx, by, bz = _dim3(block)
        stream = ctypes.c_void_p(stream_handle or None)
        result = driver.cuLaunchKernel(fn, gx, gy, gz, bx, by, bz, int(smem), stream, params, None)
        del holders  # the driver has copied the parameters
        _check(result, name)

    def _function(self, name: str) -> ctypes.c_void_p:
        driver = _driver_library()
        if self._module is None:
            module = ctypes.c_void_p()
            _check(driver.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(self._image)), "the module")
            self._module = module
        if name not in self._functions:
            fn = ctypes.c_void_p()
            if driver.cuModuleGetFunction(ctypes.byref(fn), self._module, name.encode()) != 0:
                raise LaunchError(f"no kernel {name!r} in the module")
            self._functions[name] = fn
        return self._functions[name]


_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


def _check(result: int, what: str) -> None:
    if result != 0:
        raise LaunchError(f"the driver failed to launch {what} (CUresult {result})")


@functools.lru_cache(maxsize=1)
def _driver_library() -> ctypes.CDLL:
    """The process's libcuda (the one pycuda loaded), for what pycuda does not wrap."""
    _driver()
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise GpuUnavailable(f"cannot open libcuda.so.1: {e}") from None


def kernel_params(
    args: Sequence[Argument], encode: TensorMapEncoder | None = None
) -> tuple[list[Any], ctypes.Array]:
    """``cuLaunchKernel``'s parameter array for ``args``: a pointer to each value -- a pointer
    as 8 bytes, a numpy scalar in its own type, a tensor map as its 128 bytes at a 64-byte
    aligned address (encoded here over the buffer it names, unless already encoded).  Returns
    the holders (keep them alive until the launch) and the array."""
    holders: list[Any] = []
    addresses: list[int] = []
    for i, a in enumerate(args):
        if isinstance(a, TensorMapArg):
            a = EncodedTensorMap((encode or encode_tensor_map)(a, _address(args, a, i)))
        if isinstance(a, EncodedTensorMap):
            holder: Any = (ctypes.c_ubyte * (TENSOR_MAP_BYTES + TENSOR_MAP_ALIGN))()
            at = ctypes.addressof(holder) + (-ctypes.addressof(holder) % TENSOR_MAP_ALIGN)
            ctypes.memmove(at, a.data, TENSOR_MAP_BYTES)
        elif isinstance(a, DeviceBuffer) or (isinstance(a, int) and not isinstance(a, bool)):
            holder = ctypes.c_uint64(a.ptr if isinstance(a, DeviceBuffer) else a)
            at = ctypes.addressof(holder)
        elif isinstance(a, np.generic):
            holder = ctypes.create_string_buffer(a.tobytes(), a.nbytes)
            at = ctypes.addressof(holder)
        else:
            raise TypeError(
                f"kernel arguments are DeviceBuffers, pointers, numpy scalars or tensor maps, not {type(a)}"
            )
        holders.append(holder)
        addresses.append(at)
    return holders, (ctypes.c_void_p * max(len(addresses), 1))(*addresses)


TensorMapEncoder = Callable[[TensorMapArg, int], bytes]


def encode_tensor_map(spec: TensorMapArg, base: int) -> bytes:
    """The 128 bytes of ``spec`` over device address ``base``, from the driver's
    ``cuTensorMapEncodeTiled`` (called through ctypes on the libcuda pycuda has loaded: pycuda
    does not wrap it).  FLOAT16 for 2-byte elements, FLOAT32 for 4; interleave none, L2
    promotion 128B, out-of-bounds elements zero, element strides 1.  Raises
    :class:`TensorMapError` for a description the driver's rules refuse, and when the driver
    refuses it anyway."""
    check_tensor_map(spec, base)
    encode = _driver_encode()
    rank = spec.rank
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    holder = (ctypes.c_ubyte * (TENSOR_MAP_BYTES + TENSOR_MAP_ALIGN))()
    at = ctypes.addressof(holder) + (-ctypes.addressof(holder) % TENSOR_MAP_ALIGN)
    result = encode(
        ctypes.c_void_p(at),
        _CU_TENSOR_MAP_DATA_TYPE[spec.elem_bytes],
        rank,
        ctypes.c_void_p(base),
        (u64 * rank)(*spec.dims),
        (u64 * max(rank - 1, 1))(*spec.strides),
        (u32 * rank)(*spec.box),
        (u32 * rank)(*([1] * rank)),
        0,  # CU_TENSOR_MAP_INTERLEAVE_NONE
        _CU_TENSOR_MAP_SWIZZLE[spec.swizzle],
        2,  # CU_TENSOR_MAP_L2_PROMOTION_L2_128B
        0,  # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: zeros
    )
    if result != 0:
        raise TensorMapError(f"cuTensorMapEncodeTiled refused {spec} at 0x{base:x} (CUresult {result})")
    return ctypes.string_at(at, TENSOR_MAP_BYTES)


# The driver's CUtensorMapDataType by element size.  bf16 (CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 = 9)
# needs a field of its own in TensorMapArg: 2 bytes cannot tell it from fp16.
_CU_TENSOR_MAP_DATA_TYPE = {2: 6, 4: 7}  # FLOAT16, FLOAT32
_CU_TENSOR_MAP_SWIZZLE = {0: 0, 32: 1, 64: 2, 128: 3}


@functools.lru_cache(maxsize=1)
def _driver_encode() -> Any:
    """``cuTensorMapEncodeTiled`` of the process's libcuda (the one pycuda loaded)."""
    try:
        encode = _driver_library().cuTensorMapEncodeTiled
    except AttributeError as e:
        raise GpuUnavailable(f"the driver has no cuTensorMapEncodeTiled (CUDA 12 or later): {e}") from None
    encode.restype = ctypes.c_int
    encode.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_uint32,
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(ctypes.c_uint32),
        ctypes.POINTER(ctypes.c_uint32),
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
    ]
    return encode


def _address(args: Sequence[Argument], spec: TensorMapArg, position: int) -> int:
    """The device address of the map at ``position``: its buffer argument's, plus its offset."""
    target = args[spec.pointer] if 0 <= spec.pointer < len(args) else None
    if isinstance(target, DeviceBuffer):
        if spec.offset + spec.extent > target.nbytes:
            raise TensorMapError(
                f"argument {position} (tensor map) covers {spec.extent} bytes"
                + (f" from byte {spec.offset}" if spec.offset else "")
                + f", but its buffer, argument {spec.pointer}, has {target.nbytes}"
            )
        return target.ptr + spec.offset
    if isinstance(target, int) and not isinstance(target, bool):
        return target + spec.offset
    raise TensorMapError(
        f"argument {position} (tensor map) names argument {spec.pointer}, which is not a buffer or pointer"
    )


def bind_tensor_maps(args: Sequence[Argument], encode: TensorMapEncoder | None = None) -> list[Argument]:
    """``args`` with every :class:`TensorMapArg` encoded over the buffer it names in ``args``:
    done once per set of buffers a launch rotates through (each copy has its own address)."""
    encode = encode or encode_tensor_map
    return [
        EncodedTensorMap(encode(a, _address(args, a, i))) if isinstance(a, TensorMapArg) else a
        for i, a in enumerate(args)
    ]


def _pack(args: Sequence[Argument]) -> tuple[str, list[Any]]:
    """pycuda's argument format string and values: pointers as ``P``, scalars by dtype (launches
    with tensor maps go through :func:`kernel_params` instead)."""
    fmt, values = [], []
    for a in args:
        if isinstance(a, DeviceBuffer):
            fmt.append("P")
            values.append(a.ptr)
        elif isinstance(a, np.generic):
            fmt.append(a.dtype.char)
            values.append(a)
        elif isinstance(a, int):
            fmt.append("P")
            values.append(a)
        else:
            raise TypeError(f"kernel arguments are DeviceBuffers, pointers or numpy scalars, not {type(a)}")
    return "".join(fmt), values


# -- timing --------------------------------------------------------------------------------------

#: A spin kernel: it waits ``ns`` nanoseconds on the GPU's global timer.  Timed launches are
#: queued behind it, so they run back to back even when Python enqueues them more slowly than
#: the GPU executes them (a 3 us kernel would otherwise be timed at pycuda's launch rate).
_SPIN_PTX = b"""
.version 7.0
.target sm_70
.address_size 64

.visible .entry welder_spin(.param .u64 welder_spin_ns)
{
  .reg .pred %p<2>;
  .reg .b64 %rd<5>;
  ld.param.u64 %rd1, [welder_spin_ns];
  mov.u64 %rd2, %globaltimer;
$L_spin:
  mov.u64 %rd3, %globaltimer;
  sub.u64 %rd4, %rd3, %rd2;
  setp.lt.u64 %p1, %rd4, %rd1;
  @%p1 bra $L_spin;
  ret;
}
\0"""  # the driver reads PTX as a NUL-terminated string
#: GPU time of one sample: long beside the events' half-microsecond resolution, short enough
#: that a tune's thousands of candidates (five samples or more each) are timed in seconds.
TARGET_BATCH_MS = 0.5
MAX_BATCH = 200
MAX_SPIN_S = 0.05


def sample_until_stable(
    sample: Callable[[], float],
    *,
    budget_s: float = 0.5,
    min_samples: int = 5,
    max_samples: int = 100,
    rel_tol: float = 0.01,
    clock: Callable[[], float] = time.perf_counter,
    give_up_above: float | None = None,
) -> list[float]:
    """Call ``sample`` until the median settles or the budget is spent.

    Settled: at least ``min_samples`` taken, and the median moved by at most ``rel_tol`` when
    the last sample was added and when the last two were.  One sample is always taken; the
    budget wins over ``min_samples`` (a slow kernel gets fewer repeats rather than a longer
    tune).  With ``give_up_above``, two samples whose median exceeds it end the sampling:
    a candidate that far behind another needs no precise time."""
    samples: list[float] = []
    start = clock()
    while len(samples) < max_samples:
        samples.append(sample())
        if give_up_above is not None and len(samples) >= 2 and statistics.median(samples) > give_up_above:
            break
        if len(samples) >= max(min_samples, 3):
            now = statistics.median(samples)
            moved = max(abs(now - statistics.median(samples[:-k])) for k in (1, 2))
            if moved <= rel_tol * abs(now):
                break
        if clock() - start >= budget_s:
            break
    return samples


def rotation_copies(set_bytes: int, l2_bytes: int, free_bytes: int, max_copies: int = 32) -> int:
    """How many copies of a launch's buffers to rotate through so that consecutive launches
    do not all find their inputs in L2: enough to span twice the L2, within a quarter of the
    free memory and ``max_copies``.  Buffers larger than L2 need no copies."""
    if set_bytes <= 0 or set_bytes >= l2_bytes:
        return 1
    want = math.ceil(2 * l2_bytes / set_bytes)
    room = max(1, free_bytes // 4 // set_bytes)
    return max(1, min(want, room, max_copies))


def time_kernel(
    module: GpuModule,
    name: str,
    grid: int | Sequence[int],
    block: int | Sequence[int],
    smem: int,
    args: Sequence[Argument],
    *,
    budget_s: float = 0.5,
    warmup: int = 3,
    min_samples: int = 5,
    max_samples: int = 100,
    rel_tol: float = 0.01,
    l2_bytes: int | None = None,
    max_copies: int = 32,
    give_up_ms: float | None = None,
    copies: Sequence[Sequence[Argument]] | None = None,
    spin_module: GpuModule | None = None,
) -> float:
    """Median milliseconds of one launch, by CUDA events.

    After ``warmup`` launches, each sample queues a batch of launches (about a millisecond
    of GPU time) behind a spin kernel and divides the event time by the batch size; samples
    repeat until :func:`sample_until_stable` is satisfied.  When the launch's buffers fit in
    L2 they are copied and launches rotate through the copies.  The caller provides the data:
    never time on all-zero inputs (some kernels run faster on zeros).  ``give_up_ms``: see
    :func:`sample_until_stable`'s ``give_up_above``.

    A caller timing many kernels on the same buffers (a group's candidates) passes the
    rotated copies it keeps (``copies``: argument lists like ``args``, from
    :func:`rotated_copies`; its own to free) and the spin kernel's module, so that each
    candidate does not allocate, copy and free the copies and load the module again."""
    drv = _driver()
    stream = drv.Stream()
    owned = copies is None
    if copies is None:
        copies = rotated_copies(args, l2_bytes, max_copies)
    sets = [bind_tensor_maps(args), *(bind_tensor_maps(c) for c in copies)]
    spin = (spin_module or GpuModule(_SPIN_PTX)).function("welder_spin")
    spin.prepare("Q")
    counter = itertools.count()

    def launch() -> None:
        module.launch(name, grid, block, smem, sets[next(counter) % len(sets)], stream)

    try:
        launch()
        stream.synchronize()
        t0 = time.perf_counter()
        for _ in range(warmup):
            launch()
        host_s = (time.perf_counter() - t0) / max(1, warmup)
        stream.synchronize()
        start, end = drv.Event(), drv.Event()
        start.record(stream)
        launch()
        end.record(stream)
        end.synchronize()
        single_ms = max(start.time_till(end), 1e-4)
        batch = max(1, min(MAX_BATCH, math.ceil(TARGET_BATCH_MS / single_ms)))
        spin_ns = int(min(MAX_SPIN_S, 2 * batch * host_s + 20e-6) * 1e9)

        def sample() -> float:
            spin.prepared_async_call((1, 1, 1), (1, 1, 1), stream, np.uint64(spin_ns))
            start.record(stream)
            for _ in range(batch):
                launch()
            end.record(stream)
            end.synchronize()
            return start.time_till(end) / batch

        samples = sample_until_stable(
            sample,
            budget_s=budget_s,
            min_samples=min_samples,
            max_samples=max_samples,
            rel_tol=rel_tol,
            give_up_above=give_up_ms,
        )
        return statistics.median(samples)
    finally:
        if owned:
            free_copies(copies)


def rotated_copies(
    args: Sequence[Argument], l2_bytes: int | None, max_copies: int = 32
) -> list[list[Argument]]:
    """Copies of ``args``' buffers (scalars and tensor-map arguments shared) for launches to
    rotate through besides ``args`` itself: :func:`rotation_copies` - 1 of them, none where
    the buffers exceed the L2.  Free them with :func:`free_copies`."""
    buffers = [a for a in args if isinstance(a, DeviceBuffer)]
    total = sum(b.nbytes for b in buffers)
    free, _ = _driver().mem_get_info()
    count = rotation_copies(total, l2_bytes or FALLBACK_L2_BYTES, free, max_copies)
    made: list[list[Argument]] = []
    try:
        for _ in range(count - 1):
            copy: list[Argument] = []
            made.append(copy)
            for a in args:
                if isinstance(a, DeviceBuffer):
                    b = DeviceBuffer(a.nbytes)
                    copy.append(b)
                    b.copy_from(a)
                else:
                    copy.append(a)
    except BaseException:
        free_copies(made)
        raise
    return made


def free_copies(copies: Sequence[Sequence[Argument]]) -> None:
    """Free the buffers of :func:`rotated_copies`' lists."""
    for copy in copies:
        for a in copy:
            if isinstance(a, DeviceBuffer):
                with suppress(_driver().Error):  # after a fault; the fault itself is being raised
                    a.free()


# -- the executor: whole jobs in one CUDA context ---------------------------------------------------


@dataclass(frozen=True)
class LaunchSpec:
    """One kernel's launch; ``tensor_maps`` follow the buffers (inputs, then outputs) as its last
    parameters, each naming the buffer it covers by position."""

    name: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int
    tensor_maps: tuple[TensorMapArg, ...] = ()


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    capability: tuple[int, int]
    l2_bytes: int
    smem_per_block_optin: int


OutputSpec = tuple[tuple[int, ...], str]  # shape, dtype name


class GpuExecutor:
    """Owns a CUDA context on GPU ``ordinal``; loads modules, keeps inputs on the device,
    and runs or times one kernel at a time.  Meant to live in a worker process."""

    def __init__(self, ordinal: int = 0) -> None:
        self._drv = _driver()
        self._device = self._drv.Device(ordinal)
        self._context = self._device.make_context()
        self._modules: dict[str, GpuModule] = {}
        self._data: dict[str, list[DeviceBuffer]] = {}
        # What timing one kernel after another on the same inputs shares, kept until the
        # inputs are released: per data key, the output specs, the outputs and the rotated
        # copies of inputs and outputs; and the spin kernel's module.
        self._timing: dict[str, tuple[tuple[OutputSpec, ...], list[DeviceBuffer], list[list[Argument]]]] = {}
        self._spin: GpuModule | None = None

    def info(self) -> DeviceInfo:
        attr = self._drv.device_attribute
        l2 = getattr(attr, "L2_CACHE_SIZE", None)
        name = str(self._device.name())
        return DeviceInfo(
            name,
            compute_capability_of(self._device),
            int(self._device.get_attribute(l2)) if l2 is not None else _l2_from_table(name),
            int(self._device.get_attribute(attr.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)),
        )

    def load(self, key: str, image: bytes) -> None:
        with self._guard(f"loading module {key}"):
            self._modules[key] = GpuModule(image)

    def upload(self, key: str, arrays: Sequence[np.ndarray]) -> None:
        with self._guard("uploading inputs"):
            self._data[key] = [DeviceBuffer.from_array(a) for a in arrays]

    def release(self, key: str) -> None:
        self._release_timing(key)
        for b in self._data.pop(key, []):
            b.free()

    def _release_timing(self, key: str) -> None:
        if key in self._timing:
            _, outs, copies = self._timing.pop(key)
            free_copies(copies)
            self._free(outs)

    def run(
        self,
        module: str,
        launch: LaunchSpec,
        data: str,
        outputs: Sequence[OutputSpec],
        rows: Sequence[tuple[int, int]] | None = None,
    ) -> list[np.ndarray]:
        """One launch on the uploaded inputs; outputs start as 0xFF bytes (NaN), so elements
        the kernel fails to write cannot pass the comparison by accident.  With ``rows``,
        only those ranges of each output's first axis come back."""
        outs = self._outputs(outputs)
        try:
            with self._guard(f"running {launch.name}"):
                self._launch(module, launch, [*self._data[data], *outs, *launch.tensor_maps])
                self._context.synchronize()
                return [b.to_array(shape, dtype, rows) for b, (shape, dtype) in zip(outs, outputs)]
        finally:
            self._free(outs)

    def time(
        self,
        module: str,
        launch: LaunchSpec,
        data: str,
        outputs: Sequence[OutputSpec],
        budget_s: float,
        give_up_ms: float | None = None,
    ) -> float:
        """Median milliseconds of one launch (see :func:`time_kernel`).  The outputs and the
        rotated copies are made at the first timing on ``data`` and kept for the next ones
        with the same outputs (a group's candidates), until ``data`` is released."""
        with self._guard(f"timing {launch.name}"):
            specs = tuple(outputs)
            if data in self._timing and self._timing[data][0] != specs:
                self._release_timing(data)
            if data not in self._timing:
                outs = self._outputs(outputs)
                try:
                    copies = rotated_copies([*self._data[data], *outs], self.info().l2_bytes)
                except BaseException:
                    self._free(outs)
                    raise
                self._timing[data] = (specs, outs, copies)
            if self._spin is None:
                self._spin = GpuModule(_SPIN_PTX)
            _, outs, copies = self._timing[data]
            return time_kernel(
                self._modules[module],
                launch.name,
                launch.grid,
                launch.block,
                launch.smem,
                [*self._data[data], *outs, *launch.tensor_maps],
                budget_s=budget_s,
                give_up_ms=give_up_ms,
                copies=[[*c, *launch.tensor_maps] for c in copies],
                spin_module=self._spin,
            )

    def close(self) -> None:
        """Free everything and destroy the context -- step by step, since after a fault
        each step may fail and the context must be destroyed regardless."""
        for key in list(self._data):
            with suppress(self._drv.Error):
                self.release(key)
        self._spin = None
        self._modules.clear()
        with suppress(self._drv.Error):
            self._context.pop()
        self._context.detach()

    def _outputs(self, outputs: Sequence[OutputSpec]) -> list[DeviceBuffer]:
        with self._guard("allocating outputs"):
            bufs = [
                DeviceBuffer(int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize)
                for shape, dt in outputs
            ]
            for b in bufs:
                b.fill_bytes(0xFF)
            return bufs

    def _free(self, bufs: Sequence[DeviceBuffer]) -> None:
        try:
            for b in bufs:
                b.free()
        except self._drv.Error:
            pass  # the context is gone; the error that killed it is already on its way

    def _launch(self, module: str, launch: LaunchSpec, args: Sequence[Argument]) -> None:
        self._modules[module].launch(launch.name, launch.grid, launch.block, launch.smem, args)

    @contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        """Driver errors become LaunchError, fatal when the context no longer works; so does a
        tensor map that cannot be encoded (not fatal: the tuner drops that candidate)."""
        try:
            yield
        except self._drv.Error as e:
            raise LaunchError(f"{what}: {e}", fatal=not self._context_alive()) from None
        except TensorMapError as e:
            raise LaunchError(f"{what}: {e}") from None

    def _context_alive(self) -> bool:
        try:
            self._context.synchronize()
            return True
        except self._drv.Error:
            return False


def compute_capability_of(device: Any) -> tuple[int, int]:
    major, minor = device.compute_capability()
    return int(major), int(minor)


def _l2_from_table(name: str) -> int:
    from welder.arch import match_gpu_name

    try:
        return match_gpu_name(name).l2_bytes
    except WelderError:
        return FALLBACK_L2_BYTES


# -- where the executor runs ------------------------------------------------------------------------


class Backend(Protocol):
    """Runs executor methods somewhere; ``generation`` changes whenever the executor is new
    (so whatever was loaded into the old one must be sent again)."""

    generation: int

    def start(self) -> int: ...

    def call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any: ...

    def close(self) -> None: ...


_ERRORS: dict[str, type[WelderError]] = {
    "TensorMapError": TensorMapError,
    "GpuError": GpuError,
    "GpuUnavailable": GpuUnavailable,
    "CompileError": CompileError,
}


def _rebuild_error(kind: str, message: str, fatal: bool) -> Exception:
    if kind == "KernelTimeout":
        return KernelTimeout(message)
    if kind == "LaunchError":
        return LaunchError(message, fatal)
    if kind in _ERRORS:
        return _ERRORS[kind](message)
    return RuntimeError(f"{kind} in the device worker: {message}")


class _Channel:
    """Length-prefixed pickles over a pair of pipes (one request, one reply at a time).

    Arrays travel out of band (pickle protocol 5): their bytes are written from the array's
    own memory and read straight into the buffer the received array keeps, instead of being
    copied into the pickle and out of it again -- a NeRF layer's inputs and outputs are a
    gigabyte each."""

    def __init__(self, reader: Any, writer: Any) -> None:
        self.reader = reader
        self.writer = writer
        for end in (reader, writer):
            _widen_pipe(end)

    def send(self, obj: Any) -> None:
        buffers: list[pickle.PickleBuffer] = []
        payload = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
        raws = [b.raw() for b in buffers]
        sizes = struct.pack(f"<{len(raws)}Q", *(r.nbytes for r in raws))
        for data in (struct.pack("<QQ", len(payload), len(raws)), sizes, payload, *raws):
            self._write(memoryview(data).cast("B"))
        self.writer.flush()

    def recv(self) -> Any:
        size, count = struct.unpack("<QQ", self._read(16))
        sizes = struct.unpack(f"<{count}Q", self._read(8 * count))
        payload = self._read(size)
        buffers = []
        for n in sizes:
            buffer = np.empty(n, np.uint8)  # not zero-filled first, as a bytearray would be
            self._read_into(memoryview(buffer))
            buffers.append(buffer)
        return pickle.loads(payload, buffers=buffers)

    def _write(self, data: memoryview) -> None:
        while data:  # unbuffered pipes may take a write in parts
            written = self.writer.write(data)
            data = data[written if written is not None else len(data) :]

    def poll(self, timeout_s: float) -> bool:
        """Whether a reply (or the end of the stream) arrived within ``timeout_s``."""
        readable, _, _ = select.select([self.reader], [], [], max(0.0, timeout_s))
        return bool(readable)

    def _read(self, size: int) -> bytes:
        buffer = bytearray(size)
        self._read_into(memoryview(buffer))
        return bytes(buffer)

    def _read_into(self, view: memoryview) -> None:
        while view:
            n = self.reader.readinto(view)
            if not n:
                raise EOFError("the other end closed the channel")
            view = view[n:]


#: Bytes a pipe of the channel holds: the default 64 KiB made a batch-64 output of 67 MB take
#: a thousand reads, 100-250 ms a transfer (a tune sends every group's inputs and checked
#: outputs this way).  Linux's limit for an unprivileged process is 1 MiB by default.
PIPE_BYTES = 1 << 20


def _widen_pipe(end: Any) -> None:
    """Ask for :data:`PIPE_BYTES` of buffer on a pipe (where the platform can; else as is)."""
    setsize = getattr(fcntl, "F_SETPIPE_SZ", None)  # Linux only
    if setsize is not None:
        with suppress(OSError):  # over the system's limit: the pipe keeps its size
            fcntl.fcntl(end.fileno(), setsize, PIPE_BYTES)


def worker_main() -> None:
    """Entry point of a worker process (see :class:`WorkerProcess`): read the executor
    factory, build the executor, then answer ``(method, args)`` requests until told to stop
    or the parent goes away.  After a fatal error it replies and exits: its context is of
    no further use."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    channel = _Channel(os.fdopen(os.dup(0), "rb", buffering=0), os.fdopen(os.dup(1), "wb", buffering=0))
    os.dup2(2, 1)  # stray prints of libraries go to stderr, not into the channel
    try:
        executor = channel.recv()()
    except BaseException as e:
        channel.send(("err", type(e).__name__, str(e), True))
        return
    channel.send(("ready",))
    try:
        _serve(channel, executor)
    finally:
        close = getattr(executor, "close", None)
        if close is not None:
            with suppress(Exception):
                close()


def _serve(channel: _Channel, executor: Any) -> None:
    while True:
        try:
            message = channel.recv()
        except EOFError:
            return
        if message is None:
            return
        method, args = message
        try:
            channel.send(("ok", getattr(executor, method)(*args)))
        except BaseException as e:
            fatal = getattr(e, "fatal", not isinstance(e, GpuError | TensorMapError))
            channel.send(("err", type(e).__name__, str(e), bool(fatal)))
            if fatal:
                return


_WORKER_COMMAND = "from welder.device.gpu import worker_main; worker_main()"


class WorkerProcess:
    """An executor in a child process: a fresh interpreter (CUDA does not survive ``fork``)
    that talks to this one over its stdin and stdout.

    ``factory`` builds the executor in the child and must be picklable (a module-level class
    or function, or a functools.partial of one); the child gets this process's ``sys.path``.
    A call that takes longer than its timeout kills the child (and with it any kernel still
    running) and raises KernelTimeout; a child that dies or reports a fatal error is
    replaced by the next call."""

    def __init__(
        self, factory: Callable[[], Any], timeout_s: float = 60.0, start_timeout_s: float = 300.0
    ) -> None:
        self.factory = factory
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self.generation = 0
        self._process: subprocess.Popen[bytes] | None = None
        self._channel: _Channel | None = None
        self._startup_error: Exception | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def start(self) -> int:
        if self._process is not None and self._process.poll() is None:
            return self.generation
        if self._startup_error is not None:
            raise self._startup_error
        self._reap()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in sys.path if p)
        process = subprocess.Popen(
            [sys.executable, "-c", _WORKER_COMMAND],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,  # raw pipes: select() sees every byte that has arrived
            env=env,
        )
        self._process, self._channel = process, _Channel(process.stdout, process.stdin)
        try:
            self._channel.send(self.factory)
            reply = self._channel.recv() if self._channel.poll(self.start_timeout_s) else ("timeout",)
        except (EOFError, OSError):
            reply = ("died",)
        if reply[0] != "ready":
            code = self._kill()
            error = _startup_failure(reply, code, self.start_timeout_s)
            if isinstance(error, GpuUnavailable):
                self._startup_error = error
            raise error
        self.generation += 1
        return self.generation

    def call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        self.start()
        assert self._channel is not None
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            self._channel.send((method, args))
            if not self._channel.poll(limit):
                self._kill()
                raise KernelTimeout(
                    f"{method} did not finish within {limit:.0f} s; the GPU worker was killed"
                )
            reply = self._channel.recv()
        except (EOFError, OSError):
            code = self._reap()
            raise LaunchError(f"the GPU worker died during {method} (exit code {code})", fatal=True) from None
        if reply[0] == "ok":
            return reply[1]
        kind, message, fatal = reply[1:]
        if fatal:
            self._reap()
        raise _rebuild_error(kind, message, fatal)

    def close(self) -> None:
        if self._process is not None and self._process.poll() is None and self._channel is not None:
            with suppress(OSError):
                self._channel.send(None)
            with suppress(subprocess.TimeoutExpired):
                self._process.wait(10)
        self._kill()

    def _kill(self) -> int | None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
        return self._reap()

    def _reap(self) -> int | None:
        """Forget the child (waiting for it to exit); its exit code."""
        process, self._process, self._channel = self._process, None, None
        if process is None:
            return None
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                with suppress(OSError):
                    stream.close()
        try:
            return process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            return process.wait()


def _startup_failure(reply: tuple, code: int | None, timeout_s: float) -> Exception:
    if reply[0] == "err":
        return _rebuild_error(*reply[1:])
    if reply[0] == "timeout":
        return GpuUnavailable(f"the GPU worker did not start within {timeout_s:.0f} s")
    return GpuUnavailable(f"the GPU worker exited at start (exit code {code})")


class InProcess:
    """The executor in this process: no start-up cost, but a hung kernel hangs the caller,
    and after a fatal error (a faulting kernel) the process cannot use the GPU again --
    CUDA keeps such errors for the life of the process."""

    def __init__(self, factory: Callable[[], Any]) -> None:
        self.factory = factory
        self.generation = 0
        self._executor: Any = None
        self._lost: str | None = None

    def start(self) -> int:
        if self._lost is not None:
            raise GpuError(
                f"the GPU context of this process was lost ({self._lost}); "
                "use GpuDevice(isolate=True), the default, to survive faulting kernels"
            )
        if self._executor is None:
            self._executor = self.factory()
            self.generation += 1
        return self.generation

    def call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        self.start()
        try:
            return getattr(self._executor, method)(*args)
        except LaunchError as e:
            if e.fatal:
                self._lost = str(e)
                self.close()
            raise

    def close(self) -> None:
        executor, self._executor = self._executor, None
        if executor is not None:
            with suppress(Exception):  # a context that faulted may refuse to be destroyed cleanly
                executor.close()


# -- the tuner's device ------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuProgram:
    """Compiled kernels: the cubin and the names of the kernels in it."""

    key: str
    image: bytes
    kernels: tuple[str, ...]


class GpuDevice:
    """The tuner's ``Device`` on a real GPU: ``compile`` runs nvcc here, ``run`` and ``time``
    go to an executor -- by default in a worker process (see the module docstring).

    ``executor_factory`` replaces :class:`GpuExecutor` (tests use it to exercise the worker
    machinery without a GPU); ``budget_s`` is the timing budget per kernel; ``timeout_s``
    bounds every call into the worker."""

    def __init__(
        self,
        ordinal: int = 0,
        *,
        isolate: bool = True,
        timeout_s: float = 60.0,
        budget_s: float = 0.5,
        executor_factory: Callable[[], Any] | None = None,
        compile_options: Sequence[str] = (),
    ) -> None:
        factory = executor_factory or functools.partial(GpuExecutor, ordinal)
        self.backend: Backend = WorkerProcess(factory, timeout_s) if isolate else InProcess(factory)
        self.budget_s = budget_s
        self.compile_options = tuple(compile_options)
        self.info: DeviceInfo = self.backend.call("info")
        self._generation = -1
        self._loaded: set[str] = set()
        self._data_key: str | None = None
        self._data_ref: list[np.ndarray] = []
        self._data_zero = False  # every float input of the uploaded data is zero

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def arch(self) -> str:
        return sm_arch(self.info.capability)

    @property
    def compiler(self) -> str:
        return nvcc_version()

    def compile(self, kernels: Sequence[Any], timeout_s: float | None = None) -> GpuProgram:
        """All ``kernels`` (codegen.Kernel) in one nvcc call, killed after ``timeout_s``."""
        specific = any(getattr(k, "arch_specific", False) for k in kernels)
        image = compile_cubin(
            [k.source for k in kernels],
            sm_arch(self.info.capability, arch_specific=specific),
            options=self.compile_options,
            timeout_s=NVCC_TIMEOUT_S if timeout_s is None else timeout_s,
        )
        return GpuProgram(hashlib.sha256(image).hexdigest()[:20], image, tuple(k.name for k in kernels))

    def run(
        self,
        program: GpuProgram,
        kernel: Any,
        inputs: Sequence[np.ndarray],
        rows: Sequence[tuple[int, int]] | None = None,
    ) -> list[np.ndarray]:
        """One launch of ``kernel`` on ``inputs`` (its input parameters, in order); returns
        its outputs (with ``rows``, those ranges of their first axis)."""
        self._prepare(program, kernel, inputs)
        return self.backend.call(
            "run", program.key, launch_spec(kernel), self._data_key, output_specs(kernel), rows
        )

    def time(
        self, program: GpuProgram, kernel: Any, inputs: Sequence[np.ndarray], give_up_us: float | None = None
    ) -> float:
        """Median microseconds of one launch of ``kernel`` on ``inputs`` (a rough one, once
        it is clearly above ``give_up_us``)."""
        self._prepare(program, kernel, inputs)
        if self._data_zero:
            raise ValueError(f"refusing to time {kernel.name} on all-zero inputs")
        give_up_ms = None if give_up_us is None else give_up_us / 1000.0
        ms = self.backend.call(
            "time",
            program.key,
            launch_spec(kernel),
            self._data_key,
            output_specs(kernel),
            self.budget_s,
            give_up_ms,
        )
        return float(ms) * 1000.0

    def close(self) -> None:
        self.backend.close()

    def __enter__(self) -> GpuDevice:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _prepare(self, program: GpuProgram, kernel: Any, inputs: Sequence[np.ndarray]) -> None:
        """Make sure the executor holds the module and these inputs -- sending them again
        after the executor was replaced."""
        if kernel.name not in program.kernels:
            raise ValueError(f"kernel {kernel.name!r} is not in this program")
        generation = self.backend.start()
        if generation != self._generation:
            self._generation, self._loaded, self._data_key = generation, set(), None
        if program.key not in self._loaded:
            self.backend.call("load", program.key, program.image)
            self._loaded.add(program.key)
        key = "data-" + "-".join(str(id(a)) for a in inputs)
        if key != self._data_key or len(inputs) != len(self._data_ref):
            if self._data_key is not None:
                self.backend.call("release", self._data_key)
            self._data_key = None
            self.backend.call("upload", key, [np.ascontiguousarray(a) for a in inputs])
            self._data_key, self._data_ref = key, list(inputs)
            # Checked once per upload, not per candidate: batch-64 inputs take milliseconds.
            floats = [a for a in inputs if np.issubdtype(np.asarray(a).dtype, np.floating)]
            self._data_zero = bool(floats) and not any(np.any(a) for a in floats)


def launch_spec(kernel: Any) -> LaunchSpec:
    maps = tuple(getattr(kernel, "tensor_maps", ()))
    return LaunchSpec(kernel.name, _dim3(kernel.grid), _dim3(kernel.threads), int(kernel.smem_bytes), maps)


def output_specs(kernel: Any) -> list[OutputSpec]:
    from welder.ir.interpret import np_dtype

    return [(tuple(p.shape), np_dtype(p.dtype).name) for p in kernel.params if p.is_output]
