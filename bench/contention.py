"""Contended throughput: several processes, one lock, a short hold.

Each worker loops ``acquire(blocking=True)`` / hold `HOLD` (``time.sleep``) /
release over the same window. The total of completed cycles per second is set
against the ideal ``1 / (hold + floor)``, where the floor is the plain INSERT
+ DELETE measured in the same run: a lock can change hands no faster than a
row can be written and removed. Every critical section is logged on the
machine's monotonic clock and checked for overlaps; each process's share of
the cycles shows how fair the lock was.
"""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING, Any

from postgres_mutex import LockAcquisitionTimeout, Mutex

from .processes import run_window, workers

if TYPE_CHECKING:
    from .channel import Channel

HOLD = 0.002
"""How long each cycle holds the lock (seconds)."""

LOCK = "bench-contended"


def run(dsn: str, table: str, processes: int, seconds: float, floor: float) -> dict[str, Any]:
    config = {"dsn": dsn, "table": table, "hold": HOLD}
    with workers("contention", [config] * processes) as started:
        reports = run_window(started, seconds)
    sections = sorted((float(a), float(b)) for report in reports for a, b in report["sections"])
    overlaps = sum(1 for (_, left), (entered, _) in itertools.pairwise(sections) if entered < left)
    counts = [len(report["sections"]) for report in reports]
    total = sum(counts)
    held = [b - a for a, b in sections]
    ideal = 1.0 / (HOLD + floor)
    rate = total / seconds
    return {
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
    }


def work(config: dict[str, Any], channel: Channel) -> None:
    mutex = Mutex(config["dsn"], LOCK, table=config["table"])
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
