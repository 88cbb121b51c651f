"""What the built-in exporters share: the hook calls mapped once onto metrics, and the watcher's last view.

`PrometheusMetrics` and `OtelMetrics` subclass `ExporterHook` and supply three
primitives (a counter, a histogram, the locks-held gauge); the names come
from `metric_names`, so both paths produce the same series.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from . import metric_names as names
from ._metrics import LockObservation, MetricsHook


class ExporterHook(MetricsHook):
    """The hook calls, mapped once onto metrics; the built-in exporters supply three primitives.

    Subclasses create their instruments and implement `_add` (a counter),
    `_record` (a histogram) and `_held_changed` (the locks-held gauge). The
    watcher's per-lock gauges are read from `view` at collection time.
    """

    def __init__(self) -> None:
        self._held = HeldLocks()
        self._candidates = HeldLocks()
        self._leading = HeldLocks()
        self.view = LockTableView()

    def _add(self, metric: names.MetricName, labels: dict[str, str]) -> None:
        raise NotImplementedError

    def _record(self, metric: names.MetricName, value: float, labels: dict[str, str]) -> None:
        raise NotImplementedError

    def _held_changed(self, lock_name: str, delta: int) -> None:
        raise NotImplementedError

    def _level(self, metric: names.MetricName, labels: dict[str, str], delta: int) -> None:
        """Move an up-down gauge (`ELECTION_CANDIDATES`, `ELECTION_LEADING`) by ``delta``; 0 makes it appear."""
        raise NotImplementedError

    def acquired(self, lock_name: str, *, instance_id: str, token: int | None = None) -> None:
        self._add(names.ACQUISITIONS, {"lock_name": lock_name})
        if self._held.add(lock_name, instance_id):
            self._held_changed(lock_name, +1)

    def released(self, lock_name: str, *, instance_id: str) -> None:
        self._add(names.RELEASES, {"lock_name": lock_name})
        if self._held.discard(lock_name, instance_id):
            self._held_changed(lock_name, -1)

    def lost(self, lock_name: str, *, instance_id: str, reason: str) -> None:
        self._add(names.LOSSES, {"lock_name": lock_name})
        if self._held.discard(lock_name, instance_id):
            self._held_changed(lock_name, -1)

    def contended(self, lock_name: str, *, instance_id: str) -> None:
        self._add(names.CONTENTIONS, {"lock_name": lock_name})

    def stale_reclaimed(
        self,
        lock_name: str,
        *,
        instance_id: str,
        previous_holder: str,
        token: int | None = None,
        reason: str = "stale",
        mode: str | None = None,
    ) -> None:
        self._add(names.STALE_RECLAIMS, {"lock_name": lock_name, "mode": mode or "", "reason": reason})

    def lease_running_out(self, lock_name: str, *, instance_id: str, seconds_left: float) -> None:
        self._add(names.LEASES_RUNNING_OUT, {"lock_name": lock_name})

    def hold_in_doubt(self, lock_name: str, *, instance_id: str) -> None:
        self._add(names.DOUBTS, {"lock_name": lock_name})

    def alert(self, lock_name: str, *, holder: str, seconds_since_heartbeat: float, mode: str | None = None) -> None:
        self._add(names.ALERTS, {"lock_name": lock_name, "mode": mode or ""})

    def heartbeat_latency(self, lock_name: str, *, instance_id: str, seconds: float) -> None:
        self._record(names.HEARTBEAT_DURATION, seconds, {"lock_name": lock_name})

    def heartbeat_failed(self, lock_name: str, *, instance_id: str, error: BaseException) -> None:
        self._add(names.HEARTBEAT_FAILURES, {"lock_name": lock_name})

    def acquire_wait(self, lock_name: str, *, instance_id: str, seconds: float, outcome: str) -> None:
        self._record(names.ACQUIRE_DURATION, seconds, {"lock_name": lock_name, "outcome": outcome})

    def observed(
        self,
        observations: Sequence[LockObservation],
        *,
        watched: frozenset[str] | None,
        alert_threshold: float,
        stale_threshold: float,
    ) -> None:
        self.view.update(
            observations, watched=watched, alert_threshold=alert_threshold, stale_threshold=stale_threshold
        )

    def watcher_failed(self, *, error: BaseException) -> None:
        self._add(names.WATCHER_ERRORS, {})
        self.view.failed()

    def watcher_stopped(self, *, watched: frozenset[str] | None) -> None:
        self.view.forget(watched)

    def waiting(self, lock_name: str, *, instance_id: str, mode: str | None = None) -> None:
        self._level(names.WAITERS, {"lock_name": lock_name, "mode": mode or ""}, +1)

    def stopped_waiting(self, lock_name: str, *, instance_id: str, mode: str | None = None) -> None:
        self._level(names.WAITERS, {"lock_name": lock_name, "mode": mode or ""}, -1)

    def release_failed(self, lock_name: str, *, instance_id: str, error: BaseException) -> None:
        if self._held.discard(lock_name, instance_id):
            self._held_changed(lock_name, -1)

    # Per candidate, counted from sets as the locks held are, so a repeated call cannot count twice.

    def election_started(self, lock_name: str, *, instance_id: str) -> None:
        labels = {"lock_name": lock_name}
        if self._candidates.add(lock_name, instance_id):
            self._level(names.ELECTION_CANDIDATES, labels, +1)
        self._level(names.ELECTION_LEADING, labels, 0)  # campaigning: the election's series exist, at 0

    def election_stopped(self, lock_name: str, *, instance_id: str) -> None:
        labels = {"lock_name": lock_name}
        if self._leading.discard(lock_name, instance_id):
            self._level(names.ELECTION_LEADING, labels, -1)
        if self._candidates.discard(lock_name, instance_id):
            self._level(names.ELECTION_CANDIDATES, labels, -1)

    def election_term_began(self, lock_name: str, *, instance_id: str, token: int | None = None) -> None:
        self._add(names.ELECTION_TERMS, {"lock_name": lock_name})
        if self._leading.add(lock_name, instance_id):
            self._level(names.ELECTION_LEADING, {"lock_name": lock_name}, +1)

    def election_term_ended(
        self, lock_name: str, *, instance_id: str, ended: str, seconds: float, token: int | None = None
    ) -> None:
        self._record(names.ELECTION_TERM_DURATION, seconds, {"lock_name": lock_name, "ended": ended})
        if self._leading.discard(lock_name, instance_id):
            self._level(names.ELECTION_LEADING, {"lock_name": lock_name}, -1)

    def election_lead_failed(self, lock_name: str, *, instance_id: str, error: BaseException, backoff: float) -> None:
        self._add(names.ELECTION_LEAD_FAILURES, {"lock_name": lock_name})

    def election_grace_overrun(self, lock_name: str, *, instance_id: str, seconds: float, reason: str) -> None:
        self._add(names.ELECTION_GRACE_OVERRUNS, {"lock_name": lock_name})


class HeldLocks:
    """Which (lock, instance) pairs this process holds, for a locks-held gauge.

    ``released`` after ``lost`` (a lost lock's row cleaned up on exit) must
    not count twice: changes are computed from a set, not from the calls.
    """

    def __init__(self) -> None:
        self._held: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def add(self, lock_name: str, instance_id: str) -> bool:
        with self._lock:
            new = (lock_name, instance_id) not in self._held
            self._held.add((lock_name, instance_id))
            return new

    def discard(self, lock_name: str, instance_id: str) -> bool:
        with self._lock:
            present = (lock_name, instance_id) in self._held
            self._held.discard((lock_name, instance_id))
            return present


@dataclass(frozen=True)
class WatchedLock:
    observation: LockObservation
    alert_threshold: float
    stale_threshold: float

    @property
    def name(self) -> str:
        """The name users gave it: the mutex's, the semaphore's or the read/write lock's (not its row's)."""
        return self.observation.name

    @property
    def labels(self) -> dict[str, str]:
        """The per-holder gauges' labels (`metric_names.PER_HOLDER`): the name, the permit of a semaphore's
        holder, the mode of a read/write lock's."""
        permit = self.observation.permit
        return {
            "lock_name": self.name,
            "permit": "" if permit is None else str(permit),
            "mode": self.observation.mode or "",
        }


def per_holder(locks: Sequence[WatchedLock]) -> list[WatchedLock]:
    """The holders the per-holder gauges show: each, but a read/write lock's readers as one.

    Readers come and go without bound, each with a row of its own; one series per reader would grow
    Prometheus without limit. The one shown is the reader silent longest: the one an alert is about.
    """
    shown: dict[tuple[str, str], WatchedLock] = {}
    for lock in locks:
        seen = lock.observation
        key = (lock.name, "read") if seen.mode == "read" else (seen.lock_name, "")  # else: by row, its own
        other = shown.get(key)
        if other is None or seen.seconds_since_heartbeat > other.observation.seconds_since_heartbeat:
            shown[key] = lock
    return list(shown.values())


def rwlock_holders(locks: Sequence[WatchedLock]) -> dict[tuple[str, str], int]:
    """Per read/write lock watched and held, how many hold it in each mode (both modes given, 0 included)."""
    counts: dict[tuple[str, str], int] = {}
    for lock in locks:
        seen = lock.observation
        if seen.rwlock is not None and seen.mode is not None:
            for mode in names.RW_MODES:
                counts.setdefault((seen.rwlock, mode), 0)
            counts[seen.rwlock, seen.mode] += 1
    return counts


def writers_waiting(locks: Sequence[WatchedLock]) -> dict[str, int]:
    """Per read/write lock watched and held: 1 while a writer waits for it, else 0."""
    waiting: dict[str, int] = {}
    for lock in locks:
        seen = lock.observation
        if seen.rwlock is not None and seen.writer_waiting is not None:
            waiting[seen.rwlock] = max(waiting.get(seen.rwlock, 0), int(seen.writer_waiting))
    return waiting


def permits_in_use(locks: Sequence[WatchedLock]) -> dict[str, int]:
    """Per semaphore watched, how many of its permits are held."""
    counts: dict[str, int] = {}
    for lock in locks:
        if lock.observation.semaphore is not None:
            counts[lock.name] = counts.get(lock.name, 0) + 1
    return counts


class LockTableView:
    """What watchers last reported, per lock: read by exporters at scrape time."""

    def __init__(self) -> None:
        self._locks: dict[str, WatchedLock] = {}
        self._up: bool | None = None
        self._lock = threading.Lock()

    def update(
        self,
        observations: Sequence[LockObservation],
        *,
        watched: frozenset[str] | None,
        alert_threshold: float,
        stale_threshold: float,
    ) -> None:
        with self._lock:
            self._drop(watched)
            for observation in observations:
                self._locks[observation.lock_name] = WatchedLock(observation, alert_threshold, stale_threshold)
            self._up = True

    def failed(self) -> None:
        with self._lock:
            self._up = False

    def forget(self, watched: frozenset[str] | None) -> None:
        """A watcher stopped: stop exporting what it saw, rather than freeze it."""
        with self._lock:
            self._drop(watched)
            if not self._locks:
                self._up = None

    def _drop(self, watched: frozenset[str] | None) -> None:
        # Kept by row: a semaphore's permits (a read/write lock's holds) are rows of their own, each watched
        # under the semaphore's (read/write lock's) name.
        if watched is None:
            self._locks.clear()
            return
        for row, lock in list(self._locks.items()):
            if lock.name in watched or row in watched:
                del self._locks[row]

    def snapshot(self) -> tuple[list[WatchedLock], bool | None]:
        """The watched locks, and whether the last read succeeded (None: no watcher reported yet)."""
        with self._lock:
            return sorted(self._locks.values(), key=lambda lock: lock.observation.lock_name), self._up
