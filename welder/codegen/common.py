"""What every kernel kind's code generator shares: the kernel a group becomes, its
parameters, names made safe for C, the template environment, and small C-printing helpers.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache

import jinja2

from welder.resources import TEMPLATE_DIR

from .cprint import HALF_FORMATS, STORAGE_TYPES
from .tensor_map import TensorMapArg


@dataclass
class KernelParam:
    """One pointer argument: group inputs (read-only) first, then outputs."""

    name: str
    tensor: str
    dtype: str
    shape: tuple[int, ...]
    is_output: bool
    # An output written into a concatenation's memory at its strides: the shape whose
    # row-major strides address it (``welder.ir.views.Slab.storage``); None: its own.
    storage: tuple[int, ...] | None = None

    @property
    def addressed(self) -> tuple[int, ...]:
        """The shape whose row-major strides address the tensor in memory."""
        return self.storage or self.shape

    @property
    def span(self) -> int:
        """Elements from the tensor's first in memory to its last, both included (more than
        it holds where it is laid out at a concatenation's strides)."""
        if 0 in self.shape:
            return 0
        strides = [math.prod(self.addressed[d + 1 :]) for d in range(len(self.shape))]
        return 1 + sum((n - 1) * s for n, s in zip(self.shape, strides))

    @property
    def decl(self) -> str:
        const = "" if self.is_output else "const "
        return f"{const}{STORAGE_TYPES[self.dtype]}* __restrict__ {self.name}"

    @property
    def comment(self) -> str:
        role = "out" if self.is_output else "in"
        laid = f", at the strides of {list(self.storage)}" if self.storage else ""
        return f"{role} {sanitize_comment(self.tensor)} {list(self.shape)} {self.dtype}{laid}"


@dataclass(frozen=True)
class TensorMapParam:
    """A ``CUtensorMap`` parameter of a kernel: its C name, the tensor it maps, and the map
    (over that tensor's pointer parameter) that whoever launches the kernel encodes."""

    name: str
    tensor: str
    map: TensorMapArg

    @property
    def decl(self) -> str:
        return f"const __grid_constant__ CUtensorMap {self.name}"

    @property
    def comment(self) -> str:
        m = self.map
        return f"TMA map of {sanitize_comment(self.tensor)}: box {list(m.box)} of {list(m.dims)}"


@dataclass
class Kernel:
    """A rendered kernel and how to launch it."""

    name: str
    source: str
    params: list[KernelParam]
    grid: int
    threads: int
    smem_bytes: int
    root: str
    # Holds instructions of the planned GPU's arch-specific feature set (sm_90a's wgmma):
    # compiled for that variant, the code runs on that GPU generation only.
    arch_specific: bool = False
    # CUtensorMap parameters after the pointer ones, each over the param it names by position;
    # the launcher encodes them (welder/codegen/tensor_map.py).
    tensor_maps: list[TensorMapArg] = field(default_factory=list)


def sanitize_identifier(text: str, limit: int = 40) -> str:
    """A C identifier fragment from a model name (which may hold any character)."""
    ident = re.sub(r"[^A-Za-z0-9_]", "_", text).strip("_")
    ident = re.sub(r"_+", "_", ident)[-limit:].strip("_")
    return ident or "t"


def sanitize_comment(text: str) -> str:
    return re.sub(r"[^\x20-\x7e]|\*/|/\*|\\", "?", text)[:80]


@dataclass(kw_only=True)
class StageCtx:
    """What ``group_kernel.cu.j2`` needs of every stage, whatever its kind: the kind's
    template (its ``stage(s, k)`` macro renders the stage), a comment, the origins of the
    stage's tile in this block (``o<k>_<d>``) and whether a barrier follows it.  Each kind's
    context extends it with what its template reads."""

    template: str
    comment: str
    origins: list[dict] = field(default_factory=list)
    barrier_after: bool = False
    headers: tuple[str, ...] = ()  # headers the kind's code needs beyond the prelude
    declares: bool = False  # whether the kind's ``declarations(s, k)`` macro has file-scope globals
    arch_specific: bool = False  # whether its instructions need the arch-specific variant (sm_90a)


@cache
def environment() -> jinja2.Environment:
    """The Jinja environment over codegen_templates/ (undefined names are errors)."""
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
        undefined=jinja2.StrictUndefined,
        trim_blocks=False,
        lstrip_blocks=False,
        keep_trailing_newline=True,
    )


def render_prelude(headers: Sequence[str] = ()) -> str:
    """The includes a kernel source starts with: the prelude, then ``headers``."""
    names = dict.fromkeys(("welder_prelude.cuh", "welder_math.cuh", *headers))
    return "".join(f'#include "{name}"\n' for name in names)


def read_value(access: str, dtype: str) -> str:
    """A stored element as its compute type (16-bit floats widen to float)."""
    half = HALF_FORMATS.get(dtype)
    return f"{half.to_float}({access})" if half is not None else access


def flat_index(idx: Sequence[str], shape: Sequence[int]) -> str:
    """Row-major offset of an index in a box of ``shape`` (one line of C)."""
    if not idx:
        return "0"
    terms, stride = [], 1
    for i, s in zip(reversed(idx), reversed(shape)):
        terms.append(i if stride == 1 else f"{i} * {stride}")
        stride *= s
    return " + ".join(reversed(terms))
