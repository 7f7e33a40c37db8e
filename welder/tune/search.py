"""The cost model's fusion search in a process of its own, its groups sent to the tuner as
the search settles them.

The search is a third of a cold tune of mobilevit_s at batch 64 (32 of 143 s on the H100's
16 cores), and its first groups are settled before half of it is over; run on the tuner's
main thread, it left the compile pool idle the whole time.  It cannot simply run beside
the tuner's threads in one process: its cost model proposes in worker processes it forks
(:meth:`welder.schedule.engine.CostModel.parallel`), and a fork must not copy other threads'
locks.  So the tuner forks this process before it starts any thread; the search forks its
own workers from here, and sends each group (its members and the configs the cost model
proposed for it) down a pipe, then the whole result and everything the cost model
memoised, which the tuner's own cost model takes over for the fusion checks.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import pickle
import threading
from collections.abc import Sequence
from typing import Any

from welder.errors import WelderError
from welder.graph import Graph
from welder.schedule.engine import CostModel, fuse, group_signature
from welder.schedule.group import Group, make_group
from welder.schedule.kinds.library import LibraryGroup

#: Cores below which the search runs before the tune instead: on two, the search's workers
#: and the compiles took turns on the same cores, and the tuner's tests (two at a time)
#: ran 25% longer with the search apart (110 s against 88 s).
MIN_CORES = 4


class SearchProcess:
    """``fuse(graph, cost, library=...)`` in a forked process; :meth:`receive` returns the
    groups it has settled so far, built again here, and their configs memoised in ``cost``;
    once it is done, :attr:`log` is the search's log."""

    def __init__(self, graph: Graph, cost: CostModel, library: Sequence[LibraryGroup]) -> None:
        self.graph = graph
        self.cost = cost
        context = multiprocessing.get_context("fork")
        self._conn, child = context.Pipe(duplex=False)
        self._process = context.Process(
            target=_search, args=(child, graph, cost, list(library)), name="welder-search"
        )
        self._process.start()
        child.close()
        self.log: list[str] | None = None  # set when the search is done

    @staticmethod
    def usable(cost: CostModel) -> bool:
        """Whether the search should run apart: ``fork`` exists, no other thread runs yet
        (the fork would copy its locks), and the cost model has at least
        :data:`MIN_CORES` cores for its workers, which then share them with the compiles."""
        forks = "fork" in multiprocessing.get_all_start_methods()
        return forks and cost.workers >= MIN_CORES and threading.active_count() == 1

    def receive(self, block: bool) -> list[Group]:
        """The groups the search sent since the last call (waiting for one where ``block``
        and the search is not done); raises what the search raised."""
        groups: list[Group] = []
        while self.log is None and (self._conn.poll() or (block and not groups)):
            try:
                kind, payload = self._conn.recv()
            except EOFError:
                raise WelderError(f"the fusion search process ended ({self._process.exitcode})") from None
            if kind == "group":
                members, configs = payload
                group = make_group(self.graph, members)
                self.cost.learn(group_signature(self.graph, group), configs)
                groups.append(group)
            elif kind == "done":
                log, learned = payload
                for key, configs in learned.items():
                    self.cost.learn(key, configs)
                self.log = log
                self._process.join()
            else:
                raise payload
        return groups

    def close(self) -> None:
        """Stop the search if it still runs (the tune failed or was interrupted)."""
        if self._process.is_alive():
            self._process.terminate()
        self._process.join()
        self._conn.close()


def _search(
    conn: multiprocessing.connection.Connection,
    graph: Graph,
    cost: CostModel,
    library: list[LibraryGroup],
) -> None:
    """The search process: each group down ``conn`` as it is settled, then the result."""
    before = set(cost.memoised())

    def send(group: Group) -> None:
        conn.send(("group", (list(group.members), cost.memoised().get(group_signature(graph, group)))))

    try:
        result = fuse(graph, cost, library=library, on_group=send)
    except BaseException as e:  # the tuner raises it as the search would have in its place
        conn.send(("error", _picklable(e)))
        return
    learned = {k: v for k, v in cost.memoised().items() if k not in before}
    conn.send(("done", (result.log, learned)))


def _picklable(e: BaseException) -> Any:
    try:
        pickle.dumps(e)
        return e
    except Exception:
        return WelderError(f"{type(e).__name__}: {e}")
