"""How many CPU cores this process may use.

``os.cpu_count()`` counts the machine's cores, not the ones this process is allowed to run
on: a tune started under ``taskset`` or a container's CPU set (the benchmark runs one tune
per GPU, each on its own slice of the cores) would start as many nvcc processes as the whole
machine has cores and crowd its neighbours.  The affinity mask is the honest answer where the
platform has one.  Where other work fills the same cores (a test suite's parallel workers,
several tunes started side by side), ``$WELDER_JOBS`` caps it: forking planning workers onto
busy cores adds their start and their copies of the memo (about a fifth more CPU time for
the same plan) and wins nothing.
"""

from __future__ import annotations

import os

from welder.errors import WelderError

#: The variable that caps :func:`usable_cores`.
JOBS_VARIABLE = "WELDER_JOBS"


def usable_cores() -> int:
    """Cores in this process's affinity mask (``os.cpu_count()`` where there is none), at
    most ``$WELDER_JOBS`` where that is set."""
    try:
        cores = max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return min(cores, jobs_limit() or cores)


def jobs_limit() -> int | None:
    """``$WELDER_JOBS`` as a whole number of processes (None where unset or empty); a
    :class:`WelderError` naming the variable where it is anything else."""
    text = os.environ.get(JOBS_VARIABLE, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise WelderError(f"${JOBS_VARIABLE} must be a whole number of processes, 1 or more, not {text!r}")
    return int(text)
