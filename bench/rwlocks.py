"""Read/write locks beside the Mutex, measured in the same run: cycle, hand-off, contention, writer starvation.

- ``cycle``: ``with rw.read()`` and ``with rw.write()`` (non-blocking,
  uncontended), in interleaved rounds with ``with mutex.acquire()``, each a
  median and p99 with its ratio to the Mutex cycle of the same rounds;
- ``handoff``: an RWLock's writer and reader hand it back and forth
  (`bench.handoff.Pair`), so hand-offs alternate writer to blocked reader and
  reader to blocked writer, taking turns with a pair of Mutexes;
- ``contended``: `bench.contention` with `bench.contention.HOLD` holds, on a
  Mutex, on an RWLock held by writers only, and by a mix of writers and
  readers, each over the same window, each set against the Mutex's cycles/s;
- ``starvation``: `STREAM_READERS` reader processes hold the lock on beats
  ``hold`` apart, staggered, re-acquiring at once, so that the lock is never
  free of readers; a writer in this process asks for it, again and again, and
  its wait is reported over ``hold`` (p50 and max). Writers are preferred: the
  wait is bounded by the longest a reader holding at the ask still holds (one
  ``hold``) plus a hand-off. The readers holding when the writer asked are
  counted from their logged sections (at least one each time, or the stream
  was not continuous and the figure means nothing).
"""

from __future__ import annotations

import math
import select
import sys
import time
from typing import TYPE_CHECKING, Any

import psycopg

from postgres_mutex import LockAcquisitionTimeout, MutexClient, RWLock

from . import contention, handoff
from .latency import Sizes
from .processes import workers
from .statements import insert_delete
from .timing import Measure, interleave, median

if TYPE_CHECKING:
    from .channel import Channel

STREAM_READERS = 4
"""Readers of the starvation measure: each on its own beat, a quarter of the hold apart."""

STARVED = "bench-rwlock-starved"


def run(
    dsn: str,
    table: str,
    sizes: Sizes,
    *,
    handoffs: int,
    processes: int,
    seconds: float,
    floor: float,
    rounds: int,
    hold: float,
    mutex_contended: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Every measure of the section; ``mutex_contended``: the Mutex's contended row of this run, with the same
    processes and window, if measured already."""
    out: dict[str, Any] = {"cycle": cycle(dsn, table, sizes)}
    made = handoff.pairs(
        dsn,
        table,
        {
            "mutex": ({"flavour": "mutex"}, {"flavour": "mutex"}),
            "rwlock": ({"flavour": "rwlock", "mode": "write"}, {"flavour": "rwlock", "mode": "read"}),
        },
        handoffs,
        60 + handoffs * 0.2,
    )
    mutex = made["mutex"].figures()
    out["handoff"] = {"mutex": mutex}
    for name, released_by in (("write_to_read", "write"), ("read_to_write", "read")):
        figures = made["rwlock"].figures(released_by)
        figures["p50_to_mutex"] = round(figures["p50_ms"] / mutex["p50_ms"], 3)
        figures["p99_to_mutex"] = round(figures["p99_ms"] / mutex["p99_ms"], 3)
        out["handoff"][name] = figures
    writers = processes // 2
    contended = {
        "mutex": mutex_contended or contention.run(dsn, table, processes, seconds, floor),
        "writers": contention.run(dsn, table, processes, seconds, floor, modes=["write"] * processes),
        "mix": contention.run(
            dsn, table, processes, seconds, floor, modes=["write"] * writers + ["read"] * (processes - writers)
        ),
    }
    for figures in contended.values():
        figures["to_mutex"] = round(figures["cycles_per_s"] / contended["mutex"]["cycles_per_s"], 3)
    out["contended"] = contended
    out["starvation"] = starvation(dsn, table, rounds=rounds, hold=hold)
    return out


def floor(dsn: str, table: str, sizes: Sizes) -> float:
    """The plain INSERT + DELETE of a lock row, median in seconds: the contended sections' ideal, when this
    section runs alone (`bench.latency` measures it otherwise)."""
    insert, delete = insert_delete(table)
    with psycopg.connect(dsn, autocommit=True) as conn:

        def op() -> None:
            conn.execute(insert, ("bench-rw-floor", "bench-rw-floor-instance"))
            conn.execute(delete, ("bench-rw-floor",))

        measure = Measure("insert_delete", op)
        interleave([measure], rounds=sizes.rounds, per_round=sizes.per_round, warmup=sizes.warmup)
    return measure.timed.median


def cycle(dsn: str, table: str, sizes: Sizes) -> dict[str, Any]:
    # A client of its own, closed at the end: nothing of it outlives the section (nor the server).
    with MutexClient(dsn) as client:
        mutex = client.mutex("bench-rw-cycle-mutex", table=table)
        rwlock = client.rwlock("bench-rw-cycle", table=table)
        measures = [
            Measure("mutex", _cycle(mutex.acquire, "the Mutex")),
            Measure("read", _cycle(rwlock.read, "the read")),
            Measure("write", _cycle(rwlock.write, "the write")),
        ]
        interleave(measures, rounds=sizes.rounds, per_round=sizes.per_round, warmup=sizes.warmup)
    baseline = measures[0].timed
    out: dict[str, Any] = {}
    for measure in measures:
        figures: dict[str, Any] = dict(measure.timed.summary())
        figures["median_to_mutex"] = round(measure.timed.median / baseline.median, 3)
        figures["p99_to_mutex"] = round(measure.timed.p99 / baseline.p99, 3)
        out[measure.name] = figures
    return out


def _cycle(acquire: Any, what: str) -> Any:
    def op() -> None:
        with acquire() as acquired:
            if not acquired:
                raise RuntimeError(f"{what} was not acquired")

    return op


def starvation(dsn: str, table: str, *, rounds: int, hold: float) -> dict[str, Any]:
    """A writer's waits behind a stream of overlapping readers, each holding on beats ``hold`` apart."""
    lead, settle = 0.5, 2 * hold
    seconds = settle + rounds * (hold + settle) * 2 + 5.0  # room for slow rounds; the readers are told to stop
    configs = [
        {"dsn": dsn, "table": table, "hold": hold, "offset": k * hold / STREAM_READERS} for k in range(STREAM_READERS)
    ]
    asks: list[tuple[float, float]] = []
    with workers("rwlocks", configs) as started:
        start = time.monotonic() + lead
        end = start + seconds
        for worker in started:
            worker.send(cmd="go", start=start, end=end)
        with MutexClient(dsn) as client:
            writer = client.rwlock(STARVED, table=table)
            time.sleep(max(0.0, start + settle - time.monotonic()))  # the stream forms on its beats
            while len(asks) < rounds and time.monotonic() < end - 2 * hold - 1.0:
                asked = time.monotonic()
                with writer.write(blocking=True, timeout=end - asked) as got:
                    granted = time.monotonic()
                    if not got:
                        raise RuntimeError("the writer was not granted the lock")
                asks.append((asked, granted))
                time.sleep(settle)  # the readers blocked behind it come back, onto their beats
        for worker in started:
            worker.send(cmd="stop")
        reports = [worker.receive(seconds + 30.0) for worker in started]
    sections = [(float(a), float(b)) for report in reports for a, b in report["sections"]]
    waits = [granted - asked for asked, granted in asks]
    holding = [sum(1 for a, b in sections if a <= asked < b) for asked, _ in asks]
    return {
        "readers": STREAM_READERS,
        "hold_s": hold,
        "rounds": len(asks),
        "reader_holds": len(sections),
        "wait_p50_s": round(median(waits), 4) if waits else None,
        "wait_max_s": round(max(waits), 4) if waits else None,
        "wait_p50_to_hold": round(median(waits) / hold, 3) if waits else None,
        "wait_max_to_hold": round(max(waits) / hold, 3) if waits else None,
        "readers_holding_at_ask_min": min(holding) if holding else None,
    }


def work(config: dict[str, Any], channel: Channel) -> None:
    """A reader of the starvation stream: holds until its next beat, re-acquires at once, until told to stop
    (or the window ends)."""
    rwlock = RWLock(config["dsn"], STARVED, table=config["table"])
    hold, offset = float(config["hold"]), float(config["offset"])
    channel.send(ready=True)
    start, end = channel.window()
    first = start + offset
    sections: list[tuple[float, float]] = []
    while (left := end - time.monotonic()) > 0 and not select.select([sys.stdin], [], [], 0)[0]:
        try:
            with rwlock.read(blocking=True, timeout=left) as got:
                entered = time.monotonic()
                if not got:
                    break
                beat = first + (math.floor((entered - first) / hold) + 1) * hold
                time.sleep(max(0.0, min(beat, end) - entered))
                sections.append((entered, time.monotonic()))
        except LockAcquisitionTimeout:
            break
    rwlock.close()
    channel.send(sections=sections)
