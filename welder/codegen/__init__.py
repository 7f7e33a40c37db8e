"""Code generation: CUDA kernels for scheduled groups, rendered from welder/codegen_templates/.

``kernel.py`` assembles a group's kernel and dispatches each stage on its kernel kind
(``STAGE_EMITTERS``); each kind's module (``simt.py``) fills in the context its template
reads.  Groups a library computes are no kernel (``GroupConfig.kernel`` is False): the
runtime calls the library for them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from welder.codegen.common import (
    TEMPLATE_DIR,
    Kernel,
    KernelParam,
    StageCtx,
    sanitize_comment,
    sanitize_identifier,
)
from welder.codegen.kernel import STAGE_EMITTERS, UnsupportedStage, generate_kernel
from welder.graph import Graph
from welder.schedule.config import GroupConfig
from welder.schedule.group import Group


def kernel_name(index: int, group: Group) -> str:
    """A readable, valid and unique C name for a group's kernel."""
    return f"welder_k{index}_{sanitize_identifier(group.root, 32)}"


def generate_model(
    graph: Graph,
    groups: Sequence[tuple[Group, GroupConfig]],
    layouts: Mapping[str, tuple[int, ...]] | None = None,
) -> list[Kernel]:
    """One kernel per group that is a generated kernel (not a library call), in the groups'
    order; kernel names keep the group's index.  ``layouts`` offers outputs storage shapes
    (:func:`~welder.codegen.kernel.generate_kernel`)."""
    return [
        generate_kernel(graph, g, cfg, kernel_name(k, g), layouts)
        for k, (g, cfg) in enumerate(groups)
        if cfg.kernel
    ]


def model_source(kernels: Sequence[Kernel]) -> str:
    """All kernels as one translation unit (the includes are guarded)."""
    return "\n".join(k.source for k in kernels)


__all__ = [
    "STAGE_EMITTERS",
    "TEMPLATE_DIR",
    "Kernel",
    "KernelParam",
    "StageCtx",
    "UnsupportedStage",
    "generate_kernel",
    "generate_model",
    "kernel_name",
    "model_source",
    "sanitize_comment",
    "sanitize_identifier",
]
