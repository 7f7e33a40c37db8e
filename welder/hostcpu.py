"""How many CPU cores this process may use.

``os.cpu_count()`` counts the machine's cores, not the ones this process is allowed to run
on: a tune started under ``taskset`` or a container's CPU set (the benchmark runs one tune
per GPU, each on its own slice of the cores) would start as many nvcc processes as the whole
machine has cores and crowd its neighbours.  The affinity mask is the honest answer where the
platform has one.
"""

from __future__ import annotations

import os


def usable_cores() -> int:
    """Cores in this process's affinity mask (``os.cpu_count()`` where there is none)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
