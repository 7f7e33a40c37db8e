"""Runtime: the standalone library that runs generated kernels, and their CPU emulation (``emu``)."""
