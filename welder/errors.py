"""Errors raised for bad user input.

Everything a user can cause -- a malformed model, an unsupported operator, a missing
input shape -- raises a subclass of :class:`WelderError` whose message names the thing at
fault.  The command line prints the message without a traceback; anything else reaching
the user is a bug in welder.
"""


class WelderError(Exception):
    """Base of all user-facing errors."""


class ModelError(WelderError):
    """The model is malformed, or inconsistent with what welder was told about it."""


class UnsupportedError(WelderError):
    """The model uses operators, dtypes or attributes welder does not implement."""


class ShapeError(WelderError):
    """Shapes are missing, symbolic or do not match."""


class IndexRangeError(WelderError):
    """A tensor value used as an index (Gather's indices, a token id) lies outside the
    dimension it indexes.  The message names the ONNX node, the value and the valid range,
    and the model input when the value came straight from one."""
