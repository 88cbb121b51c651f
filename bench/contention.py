"""Contended throughput: several processes, one lock, a short hold.

Each worker loops ``acquire(blocking=True)`` / hold `HOLD` (``time.sleep``) /
release over the same window. The total of completed cycles per second is set
against the ideal ``1 / (hold + floor)``, where the floor is the plain INSERT
+ DELETE measured in the same run: a lock can change hands no faster than a
row can be written and removed. Every critical section is logged on the
machine's monotonic clock and checked for overlaps; each process's share of
the cycles shows how fair the lock was.

With ``permits``, the same on a `Semaphore` of that many permits: the ideal
is N times the lock's, and "overlaps" counts the sections that began while
N others were in theirs (none may).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from postgres_mutex import LockAcquisitionTimeout, Mutex, Semaphore

from .processes import run_window, workers

if TYPE_CHECKING:
    from .channel import Channel

HOLD = 0.002
"""How long each cycle holds the lock (seconds)."""

LOCK = "bench-contended"
SEMAPHORE = "bench-contended-semaphore"


def run(
    dsn: str, table: str, processes: int, seconds: float, floor: float, permits: int | None = None
) -> dict[str, Any]:
    config = {"dsn": dsn, "table": table, "hold": HOLD, "permits": permits}
    with workers("contention", [config] * processes) as started:
        reports = run_window(started, seconds)
    sections = sorted((float(a), float(b)) for report in reports for a, b in report["sections"])
    most, overlaps = _most_at_once(sections, permits or 1)
    counts = [len(report["sections"]) for report in reports]
    total = sum(counts)
    held = [b - a for a, b in sections]
    ideal = (permits or 1) / (HOLD + floor)
    rate = total / seconds
    return {
        "permits": permits,
        "processes": processes,
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


def work(config: dict[str, Any], channel: Channel) -> None:
    mutex: Mutex | Semaphore
    if config["permits"] is None:
        mutex = Mutex(config["dsn"], LOCK, table=config["table"])
    else:
        mutex = Semaphore(config["dsn"], SEMAPHORE, permits=int(config["permits"]), table=config["table"])
    hold = float(config["hold"])
    # A first cycle outside the window: connections open, table shape known.
    with mutex.acquire(blocking=True, timeout=30):
        pass
    channel.send(ready=True)
    _, end = channel.window()
    sections: list[tuple[float, float]] = []
    while (left := end - time.monotonic()) > 0:
        try:
            with mutex.acquire(blocking=True, timeout=left):
                entered = time.monotonic()
                time.sleep(hold)
                sections.append((entered, time.monotonic()))
        except LockAcquisitionTimeout:
            break
    mutex.close()
    channel.send(sections=[(a, b) for a, b in sections if b <= end])
