"""Build CUDA kernel source with g++ against the CPU emulator and launch it on numpy arrays.

The emulator (``cuda_emu.h`` and its parts next to this file) lets the very kernel text that nvcc
compiles for the GPU run on the CPU, with checks a GPU does not make: shared-memory bounds and
races, divergent barriers, broken warp collectives, out-of-bounds global accesses.  This module
compiles a source into a shared library -- the source plus one generated C entry point per
kernel -- caches it by content, and marshals numpy arrays and scalars into launches.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import ml_dtypes
import numpy as np

from welder.codegen.tensor_map import TENSOR_MAP_ALIGN, TENSOR_MAP_BYTES, TensorMapArg, TensorMapError
from welder.errors import WelderError
from welder.resources import EMU_DIR, PRELUDE, TEMPLATE_DIR

#: Where the prelude lives: the kernel templates' folder.
PRELUDE_DIR = TEMPLATE_DIR

#: The name compiler messages and emulator errors give the kernel source.
SOURCE_NAME = "kernel.cu"
#: Per-thread fiber stack; register arrays of generated kernels live there.
DEFAULT_STACK_BYTES = 256 * 1024

_ABI_VERSION = 1  # WELDER_EMU_ABI_VERSION in emu_launch.h
_MESSAGE_BYTES = 16384
_NO_GUARD = 2**64 - 1
_COMPILER = "g++"
_BASE_FLAGS = (
    "-std=c++17",
    "-O1",
    "-fPIC",
    "-shared",
    "-pthread",
    "-fvisibility=hidden",  # every module has its own emulator state
    "-fstack-clash-protection",  # large frames probe each page, so fiber stack guards catch overflows
    "-Wno-unknown-pragmas",  # `#pragma unroll`
    "-DWELDER_EMULATE",
)
#: Where every emulated compile finds the kernel headers and the emulator's own.
_INCLUDES = ("-I", str(PRELUDE_DIR), "-I", str(EMU_DIR))
_KERNEL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_:]*(<[A-Za-z0-9_:<>, .*&+-]*>)?")

# Element types behind pointer parameters whose pointee is a vector: (component dtype, width).
_VECTOR_TYPES = {
    "half2": (np.float16, 2),
    "bfloat162": (ml_dtypes.bfloat16, 2),
    "float2": (np.float32, 2),
    "float4": (np.float32, 4),
    "double2": (np.float64, 2),
    "int2": (np.int32, 2),
    "int4": (np.int32, 4),
    "uint2": (np.uint32, 2),
    "uint4": (np.uint32, 4),
    "char4": (np.int8, 4),
    "uchar4": (np.uint8, 4),
}


class EmulationError(WelderError):
    """Kernels failed to build, or a launch failed a check of the emulator.

    The message is the compiler's diagnostics, or says which block and threads did what (for
    example a data race on a named shared view, or a thread that left a barrier unmet).
    """


@lru_cache(maxsize=1)
def available() -> bool:
    """Whether kernels can be emulated here: Linux, a working g++, and the prelude present."""
    if not sys.platform.startswith("linux") or shutil.which(_COMPILER) is None or not PRELUDE.is_file():
        return False
    try:
        subprocess.run([_COMPILER, "--version"], capture_output=True, check=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return True


@dataclass(frozen=True)
class _Param:
    """One kernel parameter as the emulator describes it (see ``signature_of`` in emu_launch.h)."""

    text: str  # e.g. "const float32*", "int32", "half2*", "tensormap"
    pointer: bool
    dtype: np.dtype | None  # scalar dtype, pointee dtype, or vector component dtype; None if unknown
    vector_width: int  # > 1 when the pointee is a vector type
    tensor_map: bool = False  # a CUtensorMap passed by value

    @classmethod
    def parse(cls, text: str) -> _Param:
        pointer = text.endswith("*")
        base = text.removesuffix("*").removeprefix("const ").strip()
        if base == "tensormap" and not pointer:
            return cls(text, False, None, 1, tensor_map=True)
        if base == "?":  # a type the emulator does not name (note: numpy reads "?" as bool)
            return cls(text, pointer, None, 1)
        if base in _VECTOR_TYPES:
            component, width = _VECTOR_TYPES[base]
            return cls(text, pointer, np.dtype(component), width)
        try:
            return cls(text, pointer, np.dtype(base), 1)
        except TypeError:
            return cls(text, pointer, None, 1)


class _LaunchParams(ctypes.Structure):
    """Mirror of ``welder_emu_launch_params`` in emu_launch.h."""

    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("smem_bytes", ctypes.c_ulonglong),
        ("stack_bytes", ctypes.c_ulonglong),
        ("check_races", ctypes.c_int),
        ("nargs", ctypes.c_int),
        ("args", ctypes.POINTER(ctypes.c_void_p)),
        ("arg_bytes", ctypes.POINTER(ctypes.c_ulonglong)),
        ("arg_readonly", ctypes.POINTER(ctypes.c_ubyte)),
    ]


Dim = int | Sequence[int]
Argument = np.ndarray | int | float | np.generic | TensorMapArg | None


def _dim3(value: Dim, what: str) -> tuple[int, int, int]:
    """Normalises a CUDA dimension given as an int or 1-3 ints to (x, y, z)."""
    dims = [value] if isinstance(value, int | np.integer) else list(value)
    if not 1 <= len(dims) <= 3 or not all(isinstance(d, int | np.integer) and d > 0 for d in dims):
        raise EmulationError(f"{what} must be a positive int or 1-3 positive ints, got {value!r}")
    dims += [1] * (3 - len(dims))
    return int(dims[0]), int(dims[1]), int(dims[2])


class _Kernel:
    """The C entry points of one kernel and the description of its parameters."""

    def __init__(self, library: ctypes.CDLL, name: str) -> None:
        symbol = _symbol(name)
        self.name = name
        self._library = library
        self._launch = getattr(library, f"welder_emu_launch__{symbol}")
        self._launch.restype = ctypes.c_int
        self._launch.argtypes = [ctypes.POINTER(_LaunchParams), ctypes.c_char_p, ctypes.c_ulonglong]
        signature = getattr(library, f"welder_emu_signature__{symbol}")
        signature.restype = ctypes.c_char_p
        text = signature().decode()
        self.params = tuple(_Param.parse(p) for p in text.split(",")) if text else ()

    def _fail(self, index: int, param: _Param, problem: str) -> EmulationError:
        return EmulationError(f"kernel {self.name!r} argument {index} ({param.text}): {problem}")

    def _pointer(self, index: int, param: _Param, value: Argument) -> tuple[ctypes.c_void_p, int, bool]:
        """(holder of the data pointer, bytes to guard, read-only) for an array argument."""
        if value is None:
            return ctypes.c_void_p(None), _NO_GUARD, False
        if not isinstance(value, np.ndarray):
            raise self._fail(index, param, f"needs a numpy array, got {type(value).__name__}")
        if not value.flags.c_contiguous:
            raise self._fail(index, param, "the array is not C-contiguous")
        if param.vector_width > 1:  # any dtype: vector pointers often move other types (uint4 = 8 halves)
            vector_bytes = param.dtype.itemsize * param.vector_width
            if value.nbytes % vector_bytes:
                raise self._fail(
                    index, param, f"{value.nbytes} bytes is not a whole number of {vector_bytes}-byte vectors"
                )
        elif param.dtype is not None and value.dtype != param.dtype:
            raise self._fail(index, param, f"got an array of {value.dtype}")
        return ctypes.c_void_p(value.ctypes.data), value.nbytes, not value.flags.writeable

    def _tensor_map(
        self, index: int, param: _Param, value: Argument, args: Sequence[Argument]
    ) -> tuple[ctypes.Array, int]:
        """A 64-byte-aligned buffer holding ``value`` encoded by the emulator over the array it
        names (the caller's array: the launch moves the map onto the guarded copy)."""
        if not isinstance(value, TensorMapArg):
            raise self._fail(index, param, f"needs a TensorMapArg, got {type(value).__name__}")
        target = args[value.pointer] if 0 <= value.pointer < len(args) else None
        is_pointer = 0 <= value.pointer < len(self.params) and self.params[value.pointer].pointer
        if not is_pointer or not isinstance(target, np.ndarray):
            raise self._fail(index, param, f"its pointer argument {value.pointer} is not an array argument")
        if value.offset + value.extent > target.nbytes:
            raise self._fail(
                index,
                param,
                f"the map covers {value.extent} bytes"
                + (f" from byte {value.offset}" if value.offset else "")
                + f" but argument {value.pointer} has {target.nbytes}",
            )
        try:
            data = encode_tensor_map(self._library, value, target.ctypes.data + value.offset)
        except TensorMapError as e:
            raise self._fail(index, param, str(e)) from None
        holder = (ctypes.c_ubyte * (TENSOR_MAP_BYTES + TENSOR_MAP_ALIGN))()
        offset = -ctypes.addressof(holder) % TENSOR_MAP_ALIGN
        ctypes.memmove(ctypes.addressof(holder) + offset, data, TENSOR_MAP_BYTES)
        return holder, offset

    def _scalar(self, index: int, param: _Param, value: Argument) -> ctypes.Array:
        """A buffer holding a scalar argument in the parameter's C type."""
        if param.dtype is None:
            raise self._fail(index, param, "parameters of this type cannot be passed from Python")
        if isinstance(value, np.ndarray) and value.ndim == 0:
            value = value[()]
        integral = isinstance(value, int | np.integer | np.bool_)
        if param.dtype.kind in "iub" and not integral:
            raise self._fail(index, param, f"needs an integer, got {value!r}")
        if param.dtype.kind == "f" and not (integral or isinstance(value, float | np.floating)):
            raise self._fail(index, param, f"needs a number, got {value!r}")
        if (
            param.dtype.kind in "iu"
            and not np.iinfo(param.dtype).min <= int(value) <= np.iinfo(param.dtype).max
        ):
            raise self._fail(index, param, f"{value} does not fit")
        data = np.array(value, dtype=param.dtype).tobytes()
        return ctypes.create_string_buffer(data, len(data))

    def launch(
        self,
        grid: Dim,
        block: Dim,
        smem_bytes: int,
        args: Sequence[Argument],
        stack_bytes: int,
        check_races: bool,
    ) -> None:
        """Marshals the arguments, runs the launch, and turns a failure status into an exception."""
        if len(args) != len(self.params):
            raise EmulationError(
                f"kernel {self.name!r} takes {len(self.params)} arguments, {len(args)} were given"
            )
        n = len(args)
        keep_alive: list[object] = []
        addresses = (ctypes.c_void_p * max(n, 1))()
        guard_bytes = (ctypes.c_ulonglong * max(n, 1))()
        readonly = (ctypes.c_ubyte * max(n, 1))()
        for i, (param, value) in enumerate(zip(self.params, args)):
            guard_bytes[i] = _NO_GUARD
            offset = 0
            if param.pointer:
                holder, guard_bytes[i], readonly[i] = self._pointer(i, param, value)
            elif param.tensor_map:
                holder, offset = self._tensor_map(i, param, value, args)
            else:
                holder = self._scalar(i, param, value)
            keep_alive.append(holder)
            addresses[i] = ctypes.addressof(holder) + offset
        params = _LaunchParams(
            grid=(ctypes.c_uint * 3)(*_dim3(grid, "grid")),
            block=(ctypes.c_uint * 3)(*_dim3(block, "block")),
            smem_bytes=int(smem_bytes),
            stack_bytes=int(stack_bytes),
            check_races=int(check_races),
            nargs=n,
            args=addresses,
            arg_bytes=guard_bytes,
            arg_readonly=readonly,
        )
        message = ctypes.create_string_buffer(_MESSAGE_BYTES)
        status = self._launch(ctypes.byref(params), message, _MESSAGE_BYTES)
        if status != 0:
            raise EmulationError(f"kernel {self.name!r}: {message.value.decode(errors='replace')}")


class EmulatedModule:
    """Kernels compiled for the emulator; launch them with :meth:`launch`."""

    def __init__(self, library_path: Path, kernel_names: Sequence[str]) -> None:
        self.path = library_path
        self._library = ctypes.CDLL(str(library_path))
        abi = self._library.welder_emu_abi_version
        abi.restype = ctypes.c_int
        if abi() != _ABI_VERSION:
            raise EmulationError(
                f"{library_path} was built for emulator ABI {abi()}, expected {_ABI_VERSION}"
            )
        self._kernels = {name: _Kernel(self._library, name) for name in kernel_names}

    @property
    def kernel_names(self) -> tuple[str, ...]:
        """The kernels this module was built with, in the order given to compile_kernels."""
        return tuple(self._kernels)

    def signature(self, name: str) -> tuple[str, ...]:
        """The parameter types of kernel `name`, e.g. ``("const float32*", "int32")``."""
        return tuple(p.text for p in self._kernel(name).params)

    def launch(
        self,
        name: str,
        grid: Dim,
        block: Dim,
        smem_bytes: int,
        args: Sequence[Argument],
        *,
        stack_bytes: int = DEFAULT_STACK_BYTES,
        check_races: bool = True,
    ) -> None:
        """Runs kernel `name` to completion; raises :class:`EmulationError` on any failed check.

        Arrays (C-contiguous, of the parameter's dtype) are passed by pointer and written in
        place; the kernel works on guarded copies, so an access past either end is reported
        instead of touching other memory.  Read-only arrays must come back unchanged.  Scalars
        are converted to the parameter's type; ``None`` passes a null pointer.  A
        ``CUtensorMap`` parameter takes a :class:`TensorMapArg` naming an array argument of the
        same launch; the emulator encodes it over that array (over its guarded copy, which the
        map's extent must fit).  A kernel declared with ``WELDER_CLUSTER_DIMS(name, X)`` runs in
        clusters of X blocks along x (``grid`` x a multiple of X; docs/emulator.md).
        """
        self._kernel(name).launch(grid, block, smem_bytes, args, stack_bytes, check_races)

    def encode_tensor_map(self, spec: TensorMapArg, base: int) -> bytes:
        """The emulator's encode of ``spec`` over global address ``base`` (what a launch does for
        a tensor-map argument); raises :class:`TensorMapError` saying what the encode refused."""
        return encode_tensor_map(self._library, spec, base)

    def _kernel(self, name: str) -> _Kernel:
        try:
            return self._kernels[name]
        except KeyError:
            raise EmulationError(
                f"no kernel {name!r} in this module (it has {', '.join(self._kernels)})"
            ) from None


def encode_tensor_map(library: ctypes.CDLL, spec: TensorMapArg, base: int) -> bytes:
    """128 bytes of ``spec`` encoded over ``base`` by the emulator's welder_encode_tensor_map (its
    own checks, not Python's: they are what a kernel meets)."""
    encode = library.welder_emu_encode_tensor_map
    encode.restype = ctypes.c_int
    rank = len(spec.dims)
    u64, u32 = ctypes.c_ulonglong, ctypes.c_uint
    dims = (u64 * max(rank, 1))(*spec.dims)
    strides = (u64 * max(len(spec.strides), 1))(*spec.strides)
    box = (u32 * max(len(spec.box), 1))(*spec.box)
    if (
        len(spec.box) != rank
        or len(spec.strides) != max(rank - 1, 0)
        or not all(0 <= v < 2**64 for v in (*spec.dims, *spec.strides, base))
        or not all(0 <= b < 2**32 for b in spec.box)
    ):
        raise TensorMapError(
            f"tensor map {spec}: dims, strides and box must have rank, rank - 1 and rank "
            "non-negative entries that fit the encode's integer types"
        )
    holder = (ctypes.c_ubyte * (TENSOR_MAP_BYTES + TENSOR_MAP_ALIGN))()
    at = ctypes.addressof(holder) + (-ctypes.addressof(holder) % TENSOR_MAP_ALIGN)
    message = ctypes.create_string_buffer(256)
    status = encode(
        ctypes.c_void_p(at),
        ctypes.c_int(spec.elem_bytes),
        ctypes.c_int(rank),
        u64(base),
        dims,
        strides,
        box,
        ctypes.c_int(spec.swizzle),
        message,
        u64(len(message)),
    )
    if status != 0:
        raise TensorMapError(f"tensor map {spec}: {message.value.decode()} (status {status})")
    return ctypes.string_at(at, TENSOR_MAP_BYTES)


def _symbol(kernel_name: str) -> str:
    """A C identifier for the entry points of `kernel_name` (template ids get a hash suffix)."""
    if re.fullmatch(r"[A-Za-z_]\w*", kernel_name):
        return kernel_name
    digest = hashlib.sha256(kernel_name.encode()).hexdigest()[:12]
    return re.sub(r"\W", "_", kernel_name) + "_" + digest


def _entry_points(source: str, kernel_names: Sequence[str]) -> str:
    """The translation unit: the kernel source (named SOURCE_NAME) plus one C entry per kernel."""
    export = '__attribute__((visibility("default")))'
    lines = [f'#line 1 "{SOURCE_NAME}"', source, '#line 1 "welder_emu_entry_points.cpp"', 'extern "C" {']
    lines.append(f"{export} int welder_emu_abi_version() {{ return WELDER_EMU_ABI_VERSION; }}")
    for name in kernel_names:
        symbol = _symbol(name)
        lines.append(
            f"{export} int welder_emu_launch__{symbol}("
            "const welder_emu_launch_params* p, char* message, unsigned long long capacity) "
            f"{{ return ::welder_emu::c_launch(&{name}, p, message, capacity); }}"
        )
        lines.append(
            f"{export} const char* welder_emu_signature__{symbol}() "
            f"{{ return ::welder_emu::signature_of(&{name}); }}"
        )
    lines.append("}")
    return "\n".join(lines) + "\n"


@lru_cache(maxsize=1)
def _compiler_identity() -> str:
    """Path and version of g++, part of every cache key (another compiler means another build)."""
    result = subprocess.run([_COMPILER, "--version"], capture_output=True, text=True, check=False)
    return f"{shutil.which(_COMPILER)}\n{result.stdout.splitlines()[0] if result.stdout else ''}"


def _emulator_digest() -> str:
    """Hash of the shared kernel headers and every emulator header: editing them invalidates
    the cache."""
    digest = hashlib.sha256()
    shared = sorted(PRELUDE_DIR.glob("*.cuh"))
    for path in [*shared, *sorted(EMU_DIR.glob("*.h")), *sorted(EMU_DIR.glob("*.cpp"))]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _cache_root(cache_dir: str | os.PathLike[str] | None) -> Path:
    """`cache_dir`, else $WELDER_CACHE_DIR/emu, else ~/.cache/welder/emu."""
    if cache_dir is not None:
        return Path(cache_dir)
    root = os.environ.get("WELDER_CACHE_DIR")
    return Path(root) / "emu" if root else Path.home() / ".cache" / "welder" / "emu"


def _compile_command(flags: Sequence[str], source: Path, output: Path, prelude: Path = PRELUDE) -> list[str]:
    """g++ with the prelude (or the header that stands for it precompiled, from
    :func:`_precompiled_prelude`) forced in first, as generated kernels expect, and both
    include dirs."""
    return [
        _COMPILER,
        *flags,
        "-include",
        str(prelude),
        *_INCLUDES,
        "-x",
        "c++",
        str(source),
        "-o",
        str(output),
    ]


@contextmanager
def _first_builder(lock: Path) -> Iterator[None]:
    """Holds ``lock`` exclusively for the body, waiting while another process or thread holds
    it.  Files every build shares (the runtime objects, a precompiled header) are built
    under one: a second builder that would compile them at the same moment waits and then
    finds the first's, instead of spending the same compile again."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        yield


def _precompiled_prelude(flags: Sequence[str], root: Path, digest: str) -> Path:
    """A header for modules compiled with ``flags`` to force in instead of the prelude, with
    the prelude precompiled beside it (:func:`_precompiled`): the emulator's headers are most
    of an emulated module's compile, 0.8 s of g++ for a module with no kernel in it against
    0.2 s with them precompiled.  Built for the second module a cache compiles, since a
    folder that compiles one module (a test's own) would pay 2.7 s for nothing."""
    return _precompiled(PRELUDE, flags, root, digest, build=any(root.glob("*.so"))) or PRELUDE


def _precompiled(
    header: Path, flags: Sequence[str], root: Path, digest: str, build: bool = True
) -> Path | None:
    """A header that includes ``header``, with ``header`` precompiled for ``flags`` beside it:
    forced in with ``-include``, GCC reads the .gch where it fits the compile, else the text.
    Kept in ``root`` by the flags, the compiler, the header's path and the emulator's sources;
    built (unless not ``build``) under a private name and renamed into place.  None where
    there is none and it was not built, or it failed to build."""
    key = hashlib.sha256("\0".join([*flags, str(header), _compiler_identity(), digest]).encode())
    folder = root / f"pch-{key.hexdigest()[:24]}"
    stub = folder / header.name
    if (folder / f"{header.name}.gch").is_file():
        return stub
    if not build:
        return None
    with _first_builder(root / f".{folder.name}.lock"):
        if not (folder / f"{header.name}.gch").is_file():
            with tempfile.TemporaryDirectory(dir=root, prefix=".build-") as scratch:
                work = Path(scratch) / folder.name
                work.mkdir()
                (work / header.name).write_text(f'#include "{header}"\n')
                command = [_COMPILER, *flags, *_INCLUDES, "-x", "c++-header", str(work / header.name)]
                if _run_compilers([[*command, "-o", str(work / f"{header.name}.gch")]])[0] is not None:
                    return None
                with suppress(OSError):  # a process that did not lock renamed its own first
                    work.rename(folder)
    return stub if (folder / f"{header.name}.gch").is_file() else None


def _run_compilers(commands: Sequence[list[str]]) -> list[str | None]:
    """Runs the commands concurrently; for each, None on success or the compiler's diagnostics."""
    processes = [
        subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace")
        for c in commands
    ]
    outcomes: list[str | None] = []
    for process in processes:
        _, stderr = process.communicate()
        outcomes.append(None if process.returncode == 0 else stderr.strip())
    return outcomes


def _raise_on_failure(outcomes: Sequence[str | None]) -> None:
    """Raises EmulationError carrying the first failed command's diagnostics."""
    failures = [o for o in outcomes if o is not None]
    if failures:
        raise EmulationError(f"g++ could not compile the kernels:\n{failures[0]}")


def _runtime_flags(extra_flags: Sequence[str]) -> list[str]:
    """The flags the emulator's own .cpp files compile with for modules built with
    ``extra_flags``: the module's but its include folders (the runtime's are
    :data:`_INCLUDES`) and optimisation levels, which change nothing the two share.  One set
    of objects then serves the modules compiled at ``-O0`` (each run once on small inputs)
    and at ``-O1``, and the emulator runs at ``-O1`` under both."""
    return [*_BASE_FLAGS, *(f for f in extra_flags if not f.startswith(("-I", "-O")))]


def _runtime_objects(flags: Sequence[str], root: Path, digest: str) -> dict[Path, Path]:
    """Where the emulator's own .cpp files (no kernel code) live compiled, once per flag set."""
    key = hashlib.sha256("\0".join([*flags, _compiler_identity(), digest]).encode()).hexdigest()[:24]
    return {source: root / f"runtime-{key}-{source.stem}.o" for source in sorted(EMU_DIR.glob("*.cpp"))}


def _runtime_lock(runtime: dict[Path, Path]) -> Path:
    """The lock the builders of one flag set's runtime objects take (:func:`_first_builder`)."""
    first = next(iter(runtime.values()))
    return first.parent / f".{first.name.rsplit('-', 1)[0]}.lock"


def _build(
    translation_unit: str, flags: Sequence[str], runtime_flags: Sequence[str], target: Path, digest: str
) -> None:
    """Compiles the kernels next to any runtime object not cached yet, links, renames into place.

    Everything is written in a private directory and renamed, so concurrent builds of the same
    module (or runtime) cannot leave a half-written file in the cache.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    compile_flags = [f for f in flags if f != "-shared"] + ["-c"]
    runtime = _runtime_objects(runtime_flags, target.parent, digest)
    runtime_compile_flags = [f for f in runtime_flags if f != "-shared"] + ["-c"]
    prelude = _precompiled_prelude([f for f in flags if f != "-shared"], target.parent, digest)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as scratch:
        work = Path(scratch)
        source, module_object, library = work / "module.cpp", work / "module.o", work / "module.so"
        source.write_text(translation_unit)
        # the module compiles beside the runtime objects it lacks, under their lock
        lacking = not all(obj.is_file() for obj in runtime.values())
        with _first_builder(_runtime_lock(runtime)) if lacking else nullcontext():
            missing = {src: obj for src, obj in runtime.items() if not obj.is_file()}
            outcomes = _run_compilers(
                [
                    _compile_command(compile_flags, source, module_object, prelude),
                    *(
                        _compile_command(runtime_compile_flags, src, work / obj.name)
                        for src, obj in missing.items()
                    ),
                ]
            )
            for obj, outcome in zip(missing.values(), outcomes[1:]):
                if outcome is None:
                    os.replace(work / obj.name, obj)
        _raise_on_failure(outcomes)
        objects = [str(module_object), *map(str, runtime.values())]
        _raise_on_failure(_run_compilers([[_COMPILER, *flags, *objects, "-o", str(library)]]))
        os.replace(library, target)


#: The flags an emulated runtime's CMake build compiles its sources with (CMakeLists.txt.j2
#: under WELDER_EMULATE: Release at -O1 with asserts on, position-independent, hidden).
#: -O1 like the kernel modules: an emulated build is compiled for a check, and its host
#: code at -O2 took a quarter longer to compile (nnfusion_rt.cu of the demo transformer:
#: 4.1 s of g++ against 3.1 s) for launches whose speed does not matter.
RUNTIME_BUILD_FLAGS = (
    "-O1",
    "-fPIC",
    "-fvisibility=hidden",
    "-Wno-unknown-pragmas",
    "-fstack-clash-protection",
    "-std=gnu++17",
    "-DWELDER_EMULATE",
)


def runtime_build_objects(cache_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """The emulator's own .cpp files compiled as an emulated runtime's build compiles them,
    for it to link (CMake's ``WELDER_EMU_OBJECTS``): the same objects for every model, 8 s
    of g++ that each emulated build repeated.  Cached like the kernel modules (``cache_dir``,
    default ``$WELDER_CACHE_DIR/emu``) by the flags, the compiler and the emulator's sources;
    written under a private name and renamed, so concurrent builds never see half a file."""
    objects = _runtime_objects(RUNTIME_BUILD_FLAGS, _cache_root(cache_dir), _emulator_digest())
    root = next(iter(objects.values())).parent
    if all(obj.is_file() for obj in objects.values()):
        return list(objects.values())
    with _first_builder(_runtime_lock(objects)):
        missing = {src: obj for src, obj in objects.items() if not obj.is_file()}
        with tempfile.TemporaryDirectory(dir=root, prefix=".build-") as scratch:
            compiled = {obj: Path(scratch) / obj.name for obj in missing.values()}
            outcomes = _run_compilers(
                [
                    [_COMPILER, *RUNTIME_BUILD_FLAGS, *_INCLUDES, "-c", str(src), "-o", str(compiled[obj])]
                    for src, obj in missing.items()
                ]
            )
            _raise_on_failure(outcomes)
            for obj, made in compiled.items():
                os.replace(made, obj)
    return list(objects.values())


#: The header an emulated runtime's sources start with (see the file).
RUNTIME_PRELUDE = EMU_DIR / "emu_runtime_prelude.h"


def runtime_build_prelude(cache_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """The header for an emulated runtime's build to force into its sources (CMake's
    ``WELDER_EMU_PCH``), with :data:`RUNTIME_PRELUDE` precompiled for the build's flags beside
    it, kept like :func:`runtime_build_objects`' objects; None where it does not build.  Each
    source parses the standard headers, the emulator's host API and the prelude otherwise:
    1.6 s of g++ for a kernel file of a small model, 3.9 s for its nnfusion_rt.cu."""
    return _precompiled(RUNTIME_PRELUDE, RUNTIME_BUILD_FLAGS, _cache_root(cache_dir), _emulator_digest())


_modules: dict[Path, EmulatedModule] = {}
_modules_lock = threading.Lock()


def compile_kernels(
    source: str,
    kernel_names: list[str],
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    extra_flags: Sequence[str] = (),
) -> EmulatedModule:
    """Builds `source` for the emulator and returns its kernels `kernel_names`.

    The library is cached under `cache_dir` (default ``$WELDER_CACHE_DIR/emu``, else
    ``~/.cache/welder/emu``) by a hash of the source, the kernel names, the flags, the compiler
    and the emulator headers, so unchanged kernels are compiled once.  Raises
    :class:`EmulationError` with the compiler's diagnostics when the source does not compile.
    """
    if not available():
        raise EmulationError("kernel emulation needs Linux and a working g++")
    names = list(kernel_names)
    if not names:
        raise EmulationError("compile_kernels needs at least one kernel name")
    for name in names:
        if not _KERNEL_NAME.fullmatch(name):
            raise EmulationError(f"{name!r} is not a kernel name")
    flags = [*_BASE_FLAGS, *extra_flags]
    translation_unit = _entry_points(source, names)
    digest = _emulator_digest()
    key = hashlib.sha256(
        "\0".join([translation_unit, *flags, _compiler_identity(), digest]).encode()
    ).hexdigest()[:32]
    root = _cache_root(cache_dir)
    target = root / f"{key}.so"
    with _modules_lock:
        module = _modules.get(target)
    if module is not None:
        return module
    if not target.is_file():
        _build(translation_unit, flags, _runtime_flags(extra_flags), target, digest)
    with _modules_lock:
        return _modules.setdefault(target, EmulatedModule(target, names))
