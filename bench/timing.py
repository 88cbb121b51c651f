"""Medians, percentiles, and interleaved rounds.

Every latency is timed per operation with `time.perf_counter`. The measures
of one section run in interleaved rounds of a few operations each (a round of
each, in a rotating order, again and again) so that whatever else happens on
the machine falls on all of them alike and their ratios stay fair. The rounds
are short on purpose: a virtual CPU's idle governor (Linux ``haltpoll``)
adapts within a few hundred operations to how long it has been idle, and a
round trip costs four times more when a CPU must wake from halt than when it
is still polling; in long rounds each measure would settle into a state of
its own. Process CPU time
(`time.process_time`, every thread of the process) is summed over the same
operations: what the client itself spent on each.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def percentile(values: list[float], fraction: float) -> float:
    """Nearest-rank percentile: the smallest value with at least ``fraction`` of the values at or below it."""
    ordered = sorted(values)
    rank = max(1, math.ceil(fraction * len(ordered)))
    return ordered[rank - 1]


@dataclass
class Timed:
    """The samples of one measure, in seconds, and the process CPU time they cost."""

    samples: list[float] = field(default_factory=list)
    cpu: float = 0.0

    @property
    def median(self) -> float:
        return median(self.samples)

    @property
    def p99(self) -> float:
        return percentile(self.samples, 0.99)

    @property
    def cpu_per_op(self) -> float:
        return self.cpu / len(self.samples)

    def summary(self, baseline: float | None = None) -> dict[str, float | int]:
        """Milliseconds and microseconds for the JSON; ``ratio`` to ``baseline`` (seconds) when given."""
        out: dict[str, float | int] = {
            "n": len(self.samples),
            "median_ms": round(self.median * 1e3, 4),
            "p99_ms": round(self.p99 * 1e3, 4),
            "client_cpu_us": round(self.cpu_per_op * 1e6, 1),
        }
        if baseline:
            out["ratio_to_select_1"] = round(self.median / baseline, 3)
        return out


SyncOp = Callable[[], object]
AsyncOp = Callable[[], Awaitable[object]]


class Measure:
    """One thing to time: a sync callable, or an async one run on ``runner``'s event loop.

    ``setup`` (sync only) runs before each operation, outside its timing and its CPU time:
    what the operation needs to find, and must not be charged for.
    """

    def __init__(
        self, name: str, op: SyncOp | None = None, aop: AsyncOp | None = None, *, setup: SyncOp | None = None
    ) -> None:
        assert (op is None) != (aop is None)
        assert setup is None or op is not None, "setup is for sync measures"
        self.name = name
        self._op = op
        self._aop = aop
        self._setup = setup
        self.timed = Timed()

    def round(self, count: int, runner: asyncio.Runner | None, *, record: bool = True) -> None:
        if self._op is not None and self._setup is not None:
            samples, cpu = _sync_round_with_setup(self._op, self._setup, count)
        elif self._op is not None:
            samples, cpu = _sync_round(self._op, count)
        else:
            assert self._aop is not None
            assert runner is not None, "an async measure needs a runner"
            samples, cpu = runner.run(_async_round(self._aop, count))
        if record:
            self.timed.samples.extend(samples)
            self.timed.cpu += cpu


def _sync_round(op: SyncOp, count: int) -> tuple[list[float], float]:
    samples = []
    clock = time.perf_counter
    cpu0 = time.process_time()
    for _ in range(count):
        started = clock()
        op()
        samples.append(clock() - started)
    return samples, time.process_time() - cpu0


def _sync_round_with_setup(op: SyncOp, setup: SyncOp, count: int) -> tuple[list[float], float]:
    samples = []
    cpu = 0.0
    clock = time.perf_counter
    for _ in range(count):
        setup()
        cpu0 = time.process_time()
        started = clock()
        op()
        samples.append(clock() - started)
        cpu += time.process_time() - cpu0
    return samples, cpu


async def _async_round(op: AsyncOp, count: int) -> tuple[list[float], float]:
    samples = []
    clock = time.perf_counter
    cpu0 = time.process_time()
    for _ in range(count):
        started = clock()
        await op()
        samples.append(clock() - started)
    return samples, time.process_time() - cpu0


def interleave(
    measures: list[Measure], *, rounds: int, per_round: int, warmup: int, runner: asyncio.Runner | None = None
) -> None:
    """Warm each measure up, then time ``rounds`` rounds of ``per_round`` operations of each, interleaved."""
    for measure in measures:
        measure.round(warmup, runner, record=False)
    for index in range(rounds):
        shift = index % len(measures)
        for measure in measures[shift:] + measures[:shift]:
            measure.round(per_round, runner)
