"""Running a whole scheduled model on the CPU: every group's generated kernel, one after
another, through the CUDA emulator.  It is a test instrument: correctness, not speed."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from welder.codegen import Kernel, model_source
from welder.graph import Graph
from welder.ir.interpret import np_dtype
from welder.resources import TEMPLATE_DIR
from welder.runtime.emu import compile_kernels


class EmulatedModel:
    """Compiled kernels of a model plus the order to launch them in."""

    def __init__(
        self,
        graph: Graph,
        kernels: Sequence[Kernel],
        check_races: bool = True,
        defines: Sequence[str] = (),
    ) -> None:
        """``defines`` are preprocessor macros for the build, e.g. ``WELDER_UNCHECKED_INDICES``
        to give data-dependent indices the GPU's clamping instead of the emulator's error."""
        self.graph = graph
        self.kernels = list(kernels)
        self.check_races = check_races
        flags = [f"-I{TEMPLATE_DIR}", *(f"-D{d}" for d in defines)]
        self.module = compile_kernels(
            model_source(self.kernels), [k.name for k in self.kernels], extra_flags=flags
        )

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        env: dict[str, np.ndarray] = {**self.graph.constants, **{k: np.asarray(v) for k, v in feeds.items()}}
        for k in self.kernels:
            args = []
            for p in k.params:
                if p.is_output:
                    env[p.tensor] = np.zeros(p.shape, dtype=np_dtype(p.dtype))
                args.append(np.require(env[p.tensor], requirements="C"))
                env[p.tensor] = args[-1]
            args.extend(k.tensor_maps)  # encoded by the emulator over the arrays they name
            self.module.launch(k.name, k.grid, k.threads, k.smem_bytes, args, check_races=self.check_races)
        return {o: env[o] for o in self.graph.outputs}
