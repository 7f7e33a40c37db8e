"""Where a tune's wall time goes, phase by phase.

The tuner's main thread waits for nvcc, makes each group's inputs, times candidates on the
GPU, runs the reference interpreter and checks outputs; which of these dominates depends on
the model (NeRF's 2M-point tensors make inputs and references expensive, a transformer's
many distinct groups make compiles the long pole).  :class:`Phases` adds up the seconds the
main thread spends in each, exclusive of the phases nested in it, so the shares add up to
no more than the tune's total and the rest is the search itself.  :func:`watch` reads the
same phases while they run, to say which one a quiet tune is in.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class Phases:
    """Wall seconds per named phase (a phase's own time, without the phases it encloses)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._stack: list[float] = []  # per open phase: seconds its nested phases took
        # Work done on any thread, by what it was (kernels compiled, nvcc's seconds summed
        # over its parallel calls): the phases say how long the main thread waited for it.
        self.work: dict[str, float] = {}
        self._lock = threading.Lock()
        # What the main thread is in, for :func:`watch`: the open phases, when the innermost
        # one last changed (on its own clock, apart from the seconds counted), and what it
        # works on (a group's root).
        self._open: list[str] = []
        self._changed = time.monotonic()
        self.subject = ""

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        self._stack.append(0.0)
        self._open.append(name)
        self._changed = time.monotonic()
        try:
            yield
        finally:
            self._open.pop()
            self._changed = time.monotonic()
            elapsed = time.perf_counter() - start
            nested = self._stack.pop()
            self.seconds[name] = self.seconds.get(name, 0.0) + elapsed - nested
            if self._stack:
                self._stack[-1] += elapsed

    def count(self, name: str, amount: float = 1.0) -> None:
        """Add ``amount`` to the work counter ``name`` (thread-safe: compiles run on a pool)."""
        with self._lock:
            self.work[name] = self.work.get(name, 0.0) + amount

    def work_done(self) -> dict[str, float]:
        """The work counters, sorted by name, to 0.1 (``tuned.json``'s form)."""
        return {name: round(v, 1) for name, v in sorted(self.work.items())}

    def rounded(self) -> dict[str, float]:
        """The phases, longest first, in seconds to 0.1 (``tuned.json``'s form)."""
        ordered = sorted(self.seconds.items(), key=lambda kv: -kv[1])
        return {name: round(s, 1) for name, s in ordered}

    def current(self) -> tuple[str | None, float]:
        """The innermost open phase (None: none is) and the seconds since it, or since the
        last phase closed, began."""
        open_ = list(self._open)
        return (open_[-1] if open_ else None), time.monotonic() - self._changed


@contextmanager
def watch(phases: Phases, every_s: float, say: Callable[[str], None]) -> Iterator[None]:
    """Inside, a thread that says (``say``) where the main thread has been for ``every_s``
    seconds or more, once every ``every_s``: a tune that logs a line a group goes quiet
    while it waits on one step -- a hung kernel, a slow nvcc, the interpreter on a large
    reference -- and then names it.  Only where threads run anyway: the fusion search and
    the cost model fork worker processes only from a process of one thread."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(every_s):
            name, seconds = phases.current()
            if seconds < every_s:
                continue
            where = f"still in {name!r}" if name else "outside the timed phases"
            on = f" ({phases.subject})" if phases.subject else ""
            say(f"{where} for {seconds:.0f} s{on}")

    thread = threading.Thread(target=run, name="welder-watch", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
