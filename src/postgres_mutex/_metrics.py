"""The metrics hook: what a Mutex reports, and the guard that keeps it harmless.

A hook is any object with any subset of `MetricsHook`'s methods. Subclass
`MetricsHook` to get no-op defaults, or write a plain class: missing methods
are skipped. Every call goes through `MetricsDispatch`, which swallows (and
logs, once per method) whatever a hook raises: a broken metrics backend must
never cost a lock or a heartbeat.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from . import metric_names as names

logger = logging.getLogger("postgres_mutex")


@dataclass(frozen=True)
class LockObservation:
    """One held lock as a watcher saw it, timed by the server's clock."""

    lock_name: str
    holder: str
    seconds_since_heartbeat: float
    seconds_held: float
    alerting: bool
    """Silent for ``alert_threshold`` or longer."""
    reclaimable: bool
    """Silent for ``stale_threshold`` or longer: any instance may take it over."""


class MetricsHook:
    """No-op base class documenting every call a Mutex (or a watcher) makes.

    Calls are made from the thread or task that observed the event (the
    heartbeat thread for heartbeat calls), so they should be quick and must not
    block. ``instance_id`` is this Mutex's id; ``holder`` and
    ``previous_holder`` are other instances' ids.
    """

    def acquired(self, lock_name: str, *, instance_id: str) -> None:
        """The lock was acquired (fresh, or by reclaiming a stale row)."""

    def released(self, lock_name: str, *, instance_id: str) -> None:
        """The lock was released and its row deleted."""

    def contended(self, lock_name: str, *, instance_id: str) -> None:
        """An acquire attempt found the lock held by another instance."""

    def stale_reclaimed(self, lock_name: str, *, instance_id: str, previous_holder: str) -> None:
        """The lock was taken over from ``previous_holder``, silent past ``stale_threshold``."""

    def alert(self, lock_name: str, *, holder: str, seconds_since_heartbeat: float) -> None:
        """The holder has not heartbeated for ``alert_threshold``: slow, or dead?

        Fired once per stale episode (by a contender, or a watcher): again only
        after the holder heartbeats or changes.
        """

    def heartbeat_latency(self, lock_name: str, *, instance_id: str, seconds: float) -> None:
        """A heartbeat succeeded after ``seconds`` (one round trip)."""

    def heartbeat_failed(self, lock_name: str, *, instance_id: str, error: BaseException) -> None:
        """A heartbeat failed (it is retried until the local lease runs out)."""

    def lost(self, lock_name: str, *, instance_id: str, reason: str) -> None:
        """This Mutex lost a lock it held: its lease ran out, or its row was gone."""

    def acquire_wait(self, lock_name: str, *, instance_id: str, seconds: float, outcome: str) -> None:
        """An acquire ended after ``seconds``, waiting included.

        ``outcome`` is one of ``acquired``, ``reclaimed``, ``contended``
        (non-blocking, held elsewhere), ``timeout``, ``error``.
        """

    def observed(
        self,
        observations: Sequence[LockObservation],
        *,
        watched: frozenset[str] | None,
        alert_threshold: float,
        stale_threshold: float,
    ) -> None:
        """A watcher read the lock table: ``observations`` are the held locks among ``watched``.

        ``watched`` is None when the watcher watches every lock in the table;
        a watched lock missing from ``observations`` is free.
        """

    def watcher_failed(self, *, error: BaseException) -> None:
        """A watcher could not read the lock table (it keeps trying)."""

    def watcher_stopped(self, *, watched: frozenset[str] | None) -> None:
        """A watcher stopped: what it last reported about ``watched`` (None: every lock) is no longer known."""

    def release_failed(self, lock_name: str, *, instance_id: str, error: BaseException) -> None:
        """A release could not delete the row: this process no longer holds the lock, but the row may remain."""


HOOK_METHODS = frozenset(name for name in vars(MetricsHook) if not name.startswith("_"))


class MetricsDispatch:
    """Calls a user's hook best-effort: never raises, never lets a hook break the lock."""

    def __init__(self, hook: object | None) -> None:
        self.hook = hook
        self._complained: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, method: str, *args: object, **kwargs: object) -> None:
        if self.hook is None:
            return
        try:
            func = getattr(self.hook, method, None)
            if callable(func):
                func(*args, **kwargs)
        except Exception:
            with self._lock:
                first = method not in self._complained
                self._complained.add(method)
            name = type(self.hook).__name__
            if first:
                logger.warning(
                    "metrics hook %s.%s raised; ignoring it (further errors from it are logged at debug level)",
                    name,
                    method,
                    exc_info=True,
                )
            else:
                logger.debug("metrics hook %s.%s raised", name, method, exc_info=True)


class FanOutMetrics:
    """A hook that forwards every call to several hooks, each guarded on its own.

    ``Mutex(dsn, "job", metrics=FanOutMetrics(PrometheusMetrics(), OtelMetrics(), MyStatsd()))``:
    one failing hook neither stops the others nor reaches the lock.
    """

    def __init__(self, *hooks: object) -> None:
        self._dispatchers = tuple(MetricsDispatch(hook) for hook in hooks)

    @property
    def hooks(self) -> tuple[object, ...]:
        return tuple(dispatch.hook for dispatch in self._dispatchers)

    def __getattr__(self, method: str) -> Callable[..., None]:
        if method not in HOOK_METHODS:
            raise AttributeError(method)

        def fan_out(*args: object, **kwargs: object) -> None:
            for dispatch in self._dispatchers:
                dispatch(method, *args, **kwargs)

        return fan_out


class ExporterHook(MetricsHook):
    """The hook calls, mapped once onto metrics; the built-in exporters supply three primitives.

    Subclasses create their instruments and implement `_add` (a counter),
    `_record` (a histogram) and `_held_changed` (the locks-held gauge). The
    watcher's per-lock gauges are read from `view` at collection time.
    """

    def __init__(self) -> None:
        self._held = HeldLocks()
        self.view = LockTableView()

    def _add(self, metric: names.MetricName, labels: dict[str, str]) -> None:
        raise NotImplementedError

    def _record(self, metric: names.MetricName, value: float, labels: dict[str, str]) -> None:
        raise NotImplementedError

    def _held_changed(self, lock_name: str, delta: int) -> None:
        raise NotImplementedError

    def acquired(self, lock_name: str, *, instance_id: str) -> None:
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

    def stale_reclaimed(self, lock_name: str, *, instance_id: str, previous_holder: str) -> None:
        self._add(names.STALE_RECLAIMS, {"lock_name": lock_name})

    def alert(self, lock_name: str, *, holder: str, seconds_since_heartbeat: float) -> None:
        self._add(names.ALERTS, {"lock_name": lock_name})

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

    def release_failed(self, lock_name: str, *, instance_id: str, error: BaseException) -> None:
        if self._held.discard(lock_name, instance_id):
            self._held_changed(lock_name, -1)


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
            if watched is None:
                self._locks.clear()
            else:
                for name in watched:
                    self._locks.pop(name, None)
            for observation in observations:
                self._locks[observation.lock_name] = WatchedLock(observation, alert_threshold, stale_threshold)
            self._up = True

    def failed(self) -> None:
        with self._lock:
            self._up = False

    def forget(self, watched: frozenset[str] | None) -> None:
        """A watcher stopped: stop exporting what it saw, rather than freeze it."""
        with self._lock:
            if watched is None:
                self._locks.clear()
            else:
                for name in watched:
                    self._locks.pop(name, None)
            if not self._locks:
                self._up = None

    def snapshot(self) -> tuple[list[WatchedLock], bool | None]:
        """The watched locks, and whether the last read succeeded (None: no watcher reported yet)."""
        with self._lock:
            return sorted(self._locks.values(), key=lambda lock: lock.observation.lock_name), self._up
