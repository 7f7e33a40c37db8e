"""Device access: the GPU for profiling (pycuda), nvcc, and the worker process that runs
candidate kernels so that a fault or a hang cannot take the tuner down (``gpu.py``)."""
