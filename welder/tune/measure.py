"""Measuring a group's compiled candidates on the device: seeded inputs, timing, and the
check of the fastest against the reference interpreter's outputs.

:func:`time_candidates` times each candidate (roughly once it is clearly behind the fastest
so far); :func:`first_correct` runs them fastest first and returns the first whose outputs
match the reference within its limits.  :class:`HostSide` makes a group's inputs and
reference on host threads, ahead of the group's timing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from welder.check import error_metric, normal, random_inputs
from welder.device.gpu import KernelTimeout, LaunchError
from welder.graph import Graph
from welder.ir.expr import Binary, loads, nonnegative
from welder.schedule.group import Group
from welder.tune.compile import Candidates, Device, Dropped, one_line
from welder.tune.phases import Phases
from welder.tune.reference import Reference, reference

# A candidate this many times slower than the group's fastest so far is not timed precisely:
# it is picked only if every faster one fails its check, and then its rough time will do.
GIVE_UP_RATIO = 1.25


def group_inputs(graph: Graph, group: Group, seed: int = 0) -> dict[str, np.ndarray]:
    """The group's inputs: the model's weights where an input is a constant, seeded random
    values otherwise (normal floats, their magnitudes where the model never makes the input
    negative; indices within the dimension they index; masks of ones).  A floating-point
    constant that is all zeros (a zero-initialised buffer) is replaced by random values
    too: timing must not run on zeros, and the reference is computed from the same inputs,
    so the check stays exact."""
    feeds = random_inputs(graph.subgraph(group.members), seed)
    rng = np.random.default_rng(seed + 1)
    scales = _input_scales(graph, group)
    out = {}
    for t in group.inputs:
        value = graph.constants[t] if t in graph.constants else feeds[t]
        if t in graph.constants and np.issubdtype(value.dtype, np.floating) and not np.any(value):
            value = normal(rng, value.shape, value.dtype)
        elif _never_negative(graph, t) and np.issubdtype(value.dtype, np.floating):
            value = np.abs(value)
        if t in scales:
            value = (value.astype(np.float32) * scales[t]).astype(value.dtype)
        out[t] = np.require(value, requirements="C")
    return out


def _never_negative(graph: Graph, tensor: str) -> bool:
    """Whether the model computes ``tensor`` by an operator that never makes a negative
    value (an exponential, a ReLU).  Such an input gets no negative random values: a
    softmax split after its exponential divides by the sum of its input, and normal values
    summed over a row can cancel to near zero, where a correct fp32 kernel's rounding of the
    sum (in another order than the reference's) is a relative error past the check's 1e-4:
    every candidate of that normalisation failed on Conformer, MobileViT and Restormer."""
    node = graph.nodes.get(tensor)
    return (
        node is not None
        and node.compute.reduce_op in (None, "sum", "max", "min")
        and nonnegative(node.compute.body)
    )


#: When the inputs of the candidates' check last changed (seconds since the epoch, 2026-11-30
#: 03:40 UTC: :func:`_never_negative`; before it, 2026-11-28 21:00: :data:`LONG_SUM`).  A
#: negative tuning-cache entry written before it may record correct candidates failing a
#: check they now pass; it is tuned again.
CHECK_CHANGED = 1796010000.0

#: Sums of at least this many terms (not products) get their random inputs scaled by
#: ``n ** -0.5``: a correct fp32 kernel's rounding of 4,096 unit terms summed by one thread
#: already reaches the 1e-4 limit where the terms cancel to a result near zero.
LONG_SUM = 1024


def _input_scales(graph: Graph, group: Group) -> dict[str, float]:
    """Factors for random inputs whose sums would otherwise round past the check's limit
    in a correct kernel, which the model's own scales keep small:

    - inputs that a stage multiplies with each other and sums over ``K`` (attention's
      queries and keys): ``K ** -0.25`` each, so that their products come out of unit
      variance, as the model's projections and scales make them.  Unscaled, scores of
      standard deviation ``sqrt(K)`` turn the last bit of an fp16 score into percents of a
      softmax after them, and a correct kernel that rounds one score the other way (its sums
      run in another order) fails the check;
    - inputs of a plain sum of ``n >= LONG_SUM`` terms (a global average pool's sum):
      ``n ** -0.5``, so that the sum comes out of unit variance, as the model's mean makes
      it.  Unscaled, the sum of 65,536 unit terms is of size 256 and rounds by about 6e-4
      in fp32, which is an error of 6e-4 where the terms cancel to a result near zero: a
      correct kernel failed on NAFNet at batch 64 (1,024 such sums), where one missing
      term still shows as an error of ``n ** -0.5``, 4e-3."""
    scales: dict[str, float] = {}
    variable = set(group.inputs) - set(graph.constants)

    def scale(tensors: set[str], factor: float) -> None:
        for t in tensors:
            scales[t] = min(scales.get(t, 1.0), factor)

    for s in group.stages:
        c = group.computes[s]
        terms = math.prod(a.extent for a in c.reduce_axes)
        if c.is_product:
            body = c.body
            assert isinstance(body, Binary)
            sides = [{ld.tensor for ld in loads(e)} & variable for e in (body.a, body.b)]
            if all(sides):
                scale(sides[0] | sides[1], terms**-0.25)
        elif c.reduce_op == "sum" and terms >= LONG_SUM:
            scale({ld.tensor for ld in c.loads()} & variable, terms**-0.5)
    return scales


def time_candidates(device: Device, cands: Candidates, inputs: list[np.ndarray]) -> dict[int, float]:
    """Each compiled candidate's time; one already ``GIVE_UP_RATIO`` times slower than the
    fastest so far is timed roughly (it will be checked, if ever, only after those)."""
    timings: dict[int, float] = {}
    for i in sorted(cands.programs):
        give_up = GIVE_UP_RATIO * min(timings.values()) if timings else None
        try:
            us = float(device.time(cands.programs[i], cands.kernels[i], inputs, give_up))
        except LaunchError as e:
            cands.drop(i, _launch_reason(e), str(e))
            continue
        if not np.isfinite(us) or us <= 0:
            cands.drop(i, "launch", f"implausible time {us} us")
            continue
        timings[i] = us
    return timings


def first_correct(
    device: Device,
    cands: Candidates,
    inputs: list[np.ndarray],
    reference: Callable[[], Reference],
    timings: dict[int, float],
    limits: dict[int, dict[str, float]],
    phases: Phases,
) -> int | None:
    """The fastest candidate whose outputs match the reference within its ``limits``."""
    for i in sorted(timings, key=lambda k: (timings[k], k)):
        kernel = cands.kernels[i]
        expected = reference()  # first: its sampled rows are all the device need send back
        try:
            with phases("checking"):
                outputs = device.run(cands.programs[i], kernel, inputs, expected.rows)
        except LaunchError as e:
            cands.drop(i, _launch_reason(e), str(e))
            continue
        with phases("checking"):
            problem = _compare(kernel, outputs, expected, limits[i])
        if problem:
            cands.drop(i, "wrong", problem)
            continue
        return i
    return None


def _compare(
    kernel: Any, outputs: Sequence[np.ndarray], reference: Reference, limits: dict[str, float]
) -> str | None:
    """Why the outputs are wrong, or None."""
    params = [p for p in kernel.params if p.is_output]
    if len(outputs) != len(params):
        return f"{len(outputs)} outputs, expected {len(params)}"
    for p, got in zip(params, outputs):
        err = error_metric(got, reference.values[p.tensor])
        limit = limits[p.tensor]
        if not err <= limit:
            return f"output {p.tensor}: error {err:.3e} > {limit:.0e}"
    return None


def drop_summary(dropped: Sequence[Dropped]) -> str:
    """The dropped candidates by reason, each with its first detail: ``4 wrong (output y:
    error 5.1e-04 > 1e-04)``."""
    by_reason: dict[str, list[Dropped]] = {}
    for d in dropped:
        by_reason.setdefault(d.reason, []).append(d)
    if not by_reason:
        return "no candidate to try"
    return ", ".join(f"{len(ds)} {r} ({one_line(ds[0].detail, 120)})" for r, ds in by_reason.items())


def _launch_reason(e: LaunchError) -> str:
    return "timeout" if isinstance(e, KernelTimeout) else "launch"


@dataclass
class HostSide:
    """A group's inputs and its reference outputs, being made on host threads.

    Both are numpy work on the CPU -- seconds for a batch-64 group -- that the tuner's main
    thread would otherwise do between its GPU launches; made a few groups ahead, they
    overlap the waits for nvcc and the GPU's timing of earlier groups."""

    feeds: Future[dict[str, np.ndarray]]
    reference: Future[Reference]

    @classmethod
    def submit(cls, pool: ThreadPoolExecutor, graph: Graph, group: Group, seed: int) -> HostSide:
        feeds = pool.submit(group_inputs, graph, group, seed)
        return cls(feeds, pool.submit(lambda: reference(graph, group, feeds.result(), seed)))
