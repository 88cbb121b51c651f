"""Contended throughput: several processes, one lock, a short hold.

Each worker loops ``acquire(blocking=True)`` / hold `HOLD` (``time.sleep``) /
release over the same window. The total of completed cycles per second is set
against the ideal ``1 / (hold + floor)``, where the floor is the plain INSERT
+ DELETE measured in the same run: a lock can change hands no faster than a
row can be written and removed. Every critical section is logged on the
machine's monotonic clock and checked for overlaps; each process's share of
the cycles shows how fair the lock was.

With ``fair``, the same on a fair Mutex (``fair=True``).

With ``permits``, the same on a `Semaphore` of that many permits: the ideal
is N times the lock's, and "overlaps" counts the sections that began while
N others were in theirs (none may).

With ``modes`` (one per process, ``"read"`` or ``"write"``), the same on one
`RWLock`, each process holding it in its mode: the ideal is the lock's (a
writer's cycle, for writers only), and "overlaps" counts the sections that
began while a writer was in its own, or, for a writer, while anyone was.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from postgres_mutex import LockAcquisitionTimeout, Mutex, RWLock, Semaphore

from .processes import run_window, workers

if TYPE_CHECKING:
    from .channel import Channel

HOLD = 0.002
"""How long each cycle holds the lock (seconds)."""

LOCK = "bench-contended"
FAIR_LOCK = "bench-contended-fair"
SEMAPHORE = "bench-contended-semaphore"
RWLOCK = "bench-contended-rwlock"


def run(
    dsn: str,
    table: str,
    processes: int,
    seconds: float,
    floor: float,
    permits: int | None = None,
    modes: list[str] | None = None,
    *,
    fair: bool = False,
) -> dict[str, Any]:
    config = {"dsn": dsn, "table": table, "hold": HOLD, "permits": permits, "fair": fair}
    configs = [{**config, "mode": mode} for mode in modes] if modes else [config] * processes
    with workers("contention", configs) as started:
        reports = run_window(started, seconds)
    sections = sorted((float(a), float(b)) for report in reports for a, b in report["sections"])
    if modes:
        writes = [
            (float(a), float(b))
            for report, mode in zip(reports, modes, strict=True)
            if mode == "write"
            for a, b in report["sections"]
        ]
        most, overlaps = _most_at_once(sections, len(sections) or 1)[0], _beside_a_writer(sections, writes)
    else:
        most, overlaps = _most_at_once(sections, permits or 1)
    counts = [len(report["sections"]) for report in reports]
    total = sum(counts)
    held = [b - a for a, b in sections]
    ideal = (permits or 1) / (HOLD + floor)
    rate = total / seconds
    return {
        "permits": permits,
        "modes": modes,
        "fair": fair,
        "processes": len(configs),
        "seconds": seconds,
        "hold_ms": HOLD * 1e3,
        "hold_measured_ms": round(sum(held) / len(held) * 1e3, 3) if held else None,
        "floor_ms": round(floor * 1e3, 4),
        "cycles": total,
        "cycles_per_s": round(rate, 1),
        "ideal_per_s": round(ideal, 1),
        "of_ideal": round(rate / ideal, 3),
        "share_min": round(min(counts) / total, 3) if total else None,
        "share_max": round(max(counts) / total, 3) if total else None,
        "overlaps": overlaps,
        "most_at_once": most,
    }


def _most_at_once(sections: list[tuple[float, float]], limit: int) -> tuple[int, int]:
    """The most sections in progress at once, and how many began with ``limit`` others in progress."""
    events = sorted([(entered, 1) for entered, _ in sections] + [(left, -1) for _, left in sections])
    inside = most = overlaps = 0
    for _, step in events:  # at equal times a leave (-1) sorts first: touching sections do not overlap
        if step > 0 and inside >= limit:
            overlaps += 1
        inside += step
        most = max(most, inside)
    return most, overlaps


def _beside_a_writer(sections: list[tuple[float, float]], writes: list[tuple[float, float]]) -> int:
    """How many sections overlapped a writer's other than themselves (touching is not overlapping)."""
    return sum(
        1 for section in sections if any(w != section and section[0] < w[1] and w[0] < section[1] for w in writes)
    )


def work(config: dict[str, Any], channel: Channel) -> None:
    mutex: Mutex | Semaphore | RWLock
    mode = config.get("mode")
    if mode is not None:
        mutex = RWLock(config["dsn"], RWLOCK, table=config["table"])
        acquire = mutex.read if mode == "read" else mutex.write
    elif config["permits"] is None:
        fair = bool(config.get("fair"))
        mutex = Mutex(config["dsn"], FAIR_LOCK if fair else LOCK, table=config["table"], fair=fair)
        acquire = mutex.acquire
    else:
        mutex = Semaphore(config["dsn"], SEMAPHORE, permits=int(config["permits"]), table=config["table"])
        acquire = mutex.acquire
    hold = float(config["hold"])
    # A first cycle outside the window: connections open, table shape known.
    with acquire(blocking=True, timeout=30):
        pass
    channel.send(ready=True)
    _, end = channel.window()
    sections: list[tuple[float, float]] = []
    while (left := end - time.monotonic()) > 0:
        try:
            with acquire(blocking=True, timeout=left):
                entered = time.monotonic()
                time.sleep(hold)
                sections.append((entered, time.monotonic()))
        except LockAcquisitionTimeout:
            break
    mutex.close()
    channel.send(sections=[(a, b) for a, b in sections if b <= end])
