"""ONNX operator lowerings, one module per operator family.

Importing this package fills :data:`welder.frontend.registry.LOWERINGS`.
"""

from welder.frontend.ops import (  # noqa: F401
    constant,
    einsum,
    elementwise,
    linalg,
    nn,
    norm,
    reduce,
    resize,
    shape,
)
