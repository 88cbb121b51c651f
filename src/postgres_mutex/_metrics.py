"""The metrics hook: what the library reports, and the guard that keeps it harmless.

`MetricsHook` is a `typing.Protocol` listing every call. A hook implements any
subset: subclass `MetricsHook` to get no-op defaults (and have a type checker
check your signatures), or write a plain class, whose missing methods are
skipped. Every call goes through `guard`, which swallows (and logs, once per
method) whatever a hook raises: a broken metrics backend must never cost a
lock or a heartbeat. Keywords added after a hook was written (``token``) are
passed only to methods that accept them, so hooks written for earlier
releases keep working.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, cast, runtime_checkable

from . import metric_names as names

logger = logging.getLogger("postgres_mutex")


@dataclass(frozen=True)
class LockObservation:
    """One held lock as a watcher (or `LockTable.holders`) saw it, timed by the server's clock."""

    lock_name: str
    holder: str
    seconds_since_heartbeat: float
    seconds_held: float
    alerting: bool
    """Silent for ``alert_threshold`` or longer."""
    reclaimable: bool
    """Silent for ``stale_threshold`` or longer: any instance may take it over."""
    token: int | None = None
    """The hold's fencing token; None on a table without tokens, or for a row written without one."""


@runtime_checkable
class MetricsHook(Protocol):
    """Every call the library makes to a metrics hook; implement any subset.

    Calls are made from the thread or task that observed the event, or from
    the client's event thread for what happens in the background (heartbeats,
    losses), so they should be quick and must not block. ``instance_id`` is
    this Mutex's id; ``holder`` and ``previous_holder`` are other instances'
    ids. ``token`` (the hold's fencing token, or None on a table without
    tokens) is passed only to methods that accept it: it must never become a
    metric label.
    """

    def acquired(self, lock_name: str, *, instance_id: str, token: int | None = None) -> None:
        """The lock was acquired (fresh, or by reclaiming a stale row)."""
        return None

    def released(self, lock_name: str, *, instance_id: str) -> None:
        """The lock was released and its row deleted."""
        return None

    def contended(self, lock_name: str, *, instance_id: str) -> None:
        """An acquire attempt found the lock held by another instance."""
        return None

    def stale_reclaimed(
        self, lock_name: str, *, instance_id: str, previous_holder: str, token: int | None = None
    ) -> None:
        """The lock was taken over from ``previous_holder``, silent past ``stale_threshold``."""
        return None

    def alert(self, lock_name: str, *, holder: str, seconds_since_heartbeat: float) -> None:
        """The holder has not heartbeated for ``alert_threshold``: slow, or dead?

        Fired once per stale episode (by a contender, or a watcher): again only
        after the holder heartbeats or changes.
        """
        return None

    def heartbeat_latency(self, lock_name: str, *, instance_id: str, seconds: float) -> None:
        """A heartbeat succeeded after ``seconds`` (one round trip, shared by the client's holds)."""
        return None

    def heartbeat_failed(self, lock_name: str, *, instance_id: str, error: BaseException) -> None:
        """A heartbeat failed, and not merely on a connection the server had closed while idle.

        It is retried until the local lease runs out.
        """
        return None

    def lost(self, lock_name: str, *, instance_id: str, reason: str) -> None:
        """This Mutex lost a lock it held: its lease ran out, or its row was gone."""
        return None

    def acquire_wait(self, lock_name: str, *, instance_id: str, seconds: float, outcome: str) -> None:
        """An acquire ended after ``seconds``, waiting included.

        ``outcome`` is one of ``acquired``, ``reclaimed``, ``contended``
        (non-blocking, held elsewhere), ``timeout``, ``error``.
        """
        return None

    def release_failed(self, lock_name: str, *, instance_id: str, error: BaseException) -> None:
        """A release could not delete the row: this process no longer holds the lock, but the row may remain."""
        return None

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
        return None

    def watcher_failed(self, *, error: BaseException) -> None:
        """A watcher could not read the lock table (it keeps trying)."""
        return None

    def watcher_stopped(self, *, watched: frozenset[str] | None) -> None:
        """A watcher stopped: what it last reported about ``watched`` (None: every lock) is no longer known."""
        return None

    # -- elections (added in 0.2.0: hooks written earlier simply do not get these) --

    def election_started(self, lock_name: str, *, instance_id: str) -> None:
        """A candidate began campaigning in the election ``lock_name`` (`Election.run` started)."""
        return None

    def election_stopped(self, lock_name: str, *, instance_id: str) -> None:
        """A candidate's `Election.run` ended: it no longer campaigns (nor leads)."""
        return None

    def election_term_began(self, lock_name: str, *, instance_id: str, token: int | None = None) -> None:
        """The candidate ``instance_id`` became leader; ``lead`` is called next."""
        return None

    def election_term_ended(
        self, lock_name: str, *, instance_id: str, ended: str, seconds: float, token: int | None = None
    ) -> None:
        """A term ended after ``seconds``, its lock released: ``ended`` is one of `TERM_ENDINGS`.

        ``returned`` (``lead`` returned), ``resigned``, ``stopped``, ``lost``
        (the lock was lost), ``failed`` (``lead`` raised).
        """
        return None

    def election_lead_failed(self, lock_name: str, *, instance_id: str, error: BaseException, backoff: float) -> None:
        """``lead`` raised ``error``; the candidate campaigns again after ``backoff`` seconds."""
        return None

    def election_grace_overrun(self, lock_name: str, *, instance_id: str, seconds: float, reason: str) -> None:
        """``lead`` was told to stop leading (``reason``) ``seconds`` ago, past ``grace_period``, and still runs."""
        return None


HOOK_METHODS = frozenset(
    name for name, value in vars(MetricsHook).items() if not name.startswith("_") and callable(value)
)


class NullMetrics(MetricsHook):
    """A hook that does nothing: the default when no ``metrics`` is given.

    Kept for programs written against 0.1.0, which exported it; passing
    ``metrics=None`` does the same.
    """


class _Guarded:
    """Calls one hook best-effort: never raises, never lets a hook break the lock."""

    def __init__(self, hook: object) -> None:
        self._hook = hook
        self._calls: dict[str, Callable[..., None]] = {}
        self._complained: set[str] = set()
        self._lock = threading.Lock()

    def __getattr__(self, method: str) -> Callable[..., None]:
        if method not in HOOK_METHODS:
            raise AttributeError(method)
        call = self._calls.get(method)
        if call is None:
            call = self._calls[method] = self._wrap(method)
        return call

    def _wrap(self, method: str) -> Callable[..., None]:
        func = getattr(self._hook, method, None)
        if not callable(func):
            return _nothing
        accepts = _accepted_keywords(func)

        def call(*args: object, **kwargs: object) -> None:
            if accepts is not None:
                kwargs = {key: value for key, value in kwargs.items() if key in accepts}
            try:
                func(*args, **kwargs)
            except Exception:
                self._complain(method)

        return call

    def _complain(self, method: str) -> None:
        with self._lock:
            first = method not in self._complained
            self._complained.add(method)
        name = type(self._hook).__name__
        if first:
            logger.warning(
                "metrics hook %s.%s raised; ignoring it (further errors from it are logged at debug level)",
                name,
                method,
                exc_info=True,
            )
        else:
            logger.debug("metrics hook %s.%s raised", name, method, exc_info=True)


def _nothing(*args: object, **kwargs: object) -> None:
    pass


def _accepted_keywords(func: Callable[..., object]) -> frozenset[str] | None:
    """The keywords ``func`` takes, or None if it takes any (``**kwargs``, or no signature to read)."""
    try:
        parameters = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return frozenset(p.name for p in parameters if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))


class _Silent:
    """The hook of a Mutex without one: every call is a no-op, at no cost."""

    def __getattr__(self, method: str) -> Callable[..., None]:
        if method not in HOOK_METHODS:
            raise AttributeError(method)
        setattr(self, method, _nothing)  # found without this call from now on
        return _nothing


def guard(hook: object | None) -> MetricsHook:
    """``hook`` wrapped so that each call is checked by name (by the type checker) and can never raise."""
    if hook is None or type(hook) is NullMetrics or type(hook) is MetricsHook:
        return cast(MetricsHook, _Silent())
    return cast(MetricsHook, _Guarded(hook))


class FanOutMetrics:
    """A hook that forwards every call to several hooks, each guarded on its own.

    ``Mutex(dsn, "job", metrics=FanOutMetrics(PrometheusMetrics(), OtelMetrics(), MyStatsd()))``:
    one failing hook neither stops the others nor reaches the lock.
    """

    def __init__(self, *hooks: object) -> None:
        self._hooks = hooks
        self._guarded = tuple(guard(hook) for hook in hooks)

    @property
    def hooks(self) -> tuple[object, ...]:
        return self._hooks

    def __getattr__(self, method: str) -> Callable[..., None]:
        if method not in HOOK_METHODS:
            raise AttributeError(method)
        targets = [getattr(hook, method) for hook in self._guarded]

        def fan_out(*args: object, **kwargs: object) -> None:
            for target in targets:
                target(*args, **kwargs)

        return fan_out


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
        self, lock_name: str, *, instance_id: str, previous_holder: str, token: int | None = None
    ) -> None:
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
