"""Code generation: CUDA kernels for scheduled groups, rendered from welder/codegen_templates/."""

from __future__ import annotations

from collections.abc import Sequence

from welder.codegen.kernel import Kernel, KernelParam, generate_kernel, sanitize_identifier
from welder.graph import Graph
from welder.schedule.config import GroupConfig
from welder.schedule.group import Group


def kernel_name(index: int, group: Group) -> str:
    """A readable, valid and unique C name for a group's kernel."""
    return f"welder_k{index}_{sanitize_identifier(group.root, 32)}"


def generate_model(graph: Graph, groups: Sequence[tuple[Group, GroupConfig]]) -> list[Kernel]:
    """One kernel per group that is not a library call (``cfg.gemm``), in the groups' order;
    kernel names keep the group's index."""
    return [
        generate_kernel(graph, g, cfg, kernel_name(k, g))
        for k, (g, cfg) in enumerate(groups)
        if cfg.gemm is None
    ]


def model_source(kernels: Sequence[Kernel]) -> str:
    """All kernels as one translation unit (the includes are guarded)."""
    return "\n".join(k.source for k in kernels)


__all__ = ["Kernel", "KernelParam", "generate_kernel", "generate_model", "kernel_name", "model_source"]
