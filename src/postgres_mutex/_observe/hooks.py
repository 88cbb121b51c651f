"""The metrics hook: what the library reports, and the guard that keeps it harmless.

Two protocols, so that an implementer sees what is optional. `MetricsHook`
is the README's contract: six calls (acquired, released, contended,
stale_reclaimed, alert, heartbeat_latency). `ExtendedMetricsHook` adds every
other call the library makes (failures, losses, doubt, waiting, the watcher,
elections). A hook implements any subset of either: subclass one to get no-op
defaults (and have a type checker check your signatures), or write a plain
class, whose missing methods are skipped. Every call goes through `guard`,
which swallows (and logs, once per method) whatever a hook raises: a broken
metrics backend must never cost a lock or a heartbeat. Keywords added after a
hook was written (``token``) are passed only to methods that accept them, so
hooks written for earlier releases keep working.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol, cast, runtime_checkable

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
    """Silent for ``stale_threshold`` or longer, or (a holder with ``reclaim_disconnected_after``) for that
    long with its session ended: any instance may take it over."""
    token: int | None = None
    """The hold's fencing token; None on a table without tokens, or for a row written without one."""
    session_alive: bool | None = None
    """Whether the holder's database session still exists; None if its row names none (a holder without
    ``reclaim_disconnected_after``, one behind a pooler, 0.1.0, or a table without the session columns)."""
    reclaim_disconnected_after: float | None = None
    """The holder's ``reclaim_disconnected_after``, in seconds (None: it did not opt in)."""
    semaphore: str | None = None
    """For a permit of a `Semaphore`: the semaphore's name (``lock_name`` is then its permit row's)."""
    permit: int | None = None
    """For a permit of a `Semaphore`: the permit's number, from 0."""
    rwlock: str | None = None
    """For a hold of an `RWLock`: the read/write lock's name (``lock_name`` is then its row's)."""
    mode: str | None = None
    """For a hold of an `RWLock`: ``"read"`` or ``"write"``."""
    writer_waiting: bool | None = None
    """For a hold of an `RWLock`: whether a writer waits for the lock, so that new readers wait behind it."""
    held_until: datetime | None = None
    """For a Mutex its holder released before its minimum hold (``hold_at_least``) had passed: when the lock
    turns free (by the server's clock). Until then nobody may take it; ``holder`` is who released it, and its
    ages are 0 (nobody heartbeats it). None for every other hold."""

    @property
    def name(self) -> str:
        """The name users gave what is held: the mutex's, the semaphore's or the read/write lock's (not its row's)."""
        return self.semaphore or self.rwlock or self.lock_name


@runtime_checkable
class MetricsHook(Protocol):
    """The six calls of the README's contract; implement any subset.

    Every other call the library makes is in `ExtendedMetricsHook`, all optional too.
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
        self,
        lock_name: str,
        *,
        instance_id: str,
        previous_holder: str,
        token: int | None = None,
        reason: str = "stale",
        mode: str | None = None,
    ) -> None:
        """The lock was taken over from ``previous_holder``.

        ``reason`` (one of `RECLAIM_REASONS`) says why: ``stale``, silent past
        ``stale_threshold``; ``disconnected``, a holder that opted in to
        ``reclaim_disconnected_after`` whose database session had ended.
        ``mode``: given only for a read/write lock, the mode of the hold taken over.
        """
        return None

    def alert(self, lock_name: str, *, holder: str, seconds_since_heartbeat: float, mode: str | None = None) -> None:
        """The holder has not heartbeated for ``alert_threshold``: slow, or dead?

        Fired once per stale episode (by a contender, or a watcher): again only
        after the holder heartbeats or changes. ``lock_name`` is a semaphore's
        or read/write lock's own name for one of its holders; ``mode``, given
        only for a read/write lock's holder, is its mode (``"read"`` or
        ``"write"``).
        """
        return None

    def heartbeat_latency(self, lock_name: str, *, instance_id: str, seconds: float) -> None:
        """A heartbeat succeeded after ``seconds`` (one round trip, shared by the client's holds)."""
        return None


@runtime_checkable
class ExtendedMetricsHook(MetricsHook, Protocol):
    """`MetricsHook`'s six calls and every other call the library makes; implement any subset.

    Beyond the six: what goes wrong with a hold (failed heartbeats, losses,
    doubt, failed releases), how long acquires take and who waits, what a
    watcher reads, and elections. Subclass it for no-op defaults and checked
    signatures; a hook written for `MetricsHook` alone simply does not get
    these calls. The built-in exporters (``PrometheusMetrics``, ``OtelMetrics``)
    implement them all.
    """

    # -- holds: beyond acquired and released ------------------------------------

    def heartbeat_failed(self, lock_name: str, *, instance_id: str, error: BaseException) -> None:
        """A heartbeat failed, and not merely on a connection the server had closed while idle.

        It is retried until the local lease runs out.
        """
        return None

    def lost(self, lock_name: str, *, instance_id: str, reason: str) -> None:
        """This Mutex lost a lock it held: its lease ran out, or its row was gone."""
        return None

    def lease_running_out(self, lock_name: str, *, instance_id: str, seconds_left: float) -> None:
        """Two thirds of the time this hold is trusted went by without a heartbeat: ``seconds_left`` remain.

        A long job can checkpoint before it loses the lock (see ``Mutex.lease_remaining``).
        """
        return None

    def hold_in_doubt(self, lock_name: str, *, instance_id: str) -> None:
        """A hold of a Mutex with ``reclaim_disconnected_after`` is in doubt: not held until a heartbeat
        confirms it (`hold_confirmed`) or finds it lost (`lost`)."""
        return None

    def hold_confirmed(self, lock_name: str, *, instance_id: str, seconds_in_doubt: float) -> None:
        """A heartbeat found the row of a hold in doubt still this Mutex's: it is held again."""
        return None

    def acquire_wait(self, lock_name: str, *, instance_id: str, seconds: float, outcome: str) -> None:
        """An acquire ended after ``seconds``, waiting included.

        ``outcome`` is one of ``acquired``, ``reclaimed``, ``contended``
        (non-blocking, held elsewhere), ``timeout``, ``error``.
        """
        return None

    def waiting(self, lock_name: str, *, instance_id: str, mode: str | None = None) -> None:
        """A blocking acquire found the lock (or every permit of the semaphore) held and now waits for a release.

        Followed by `stopped_waiting` when that acquire ends, however it ends.
        ``mode``: given only for a read/write lock, the mode it waits to hold.
        """
        return None

    def stopped_waiting(self, lock_name: str, *, instance_id: str, mode: str | None = None) -> None:
        """A blocking acquire that was `waiting` ended: acquired, timed out, failed or interrupted."""
        return None

    def release_failed(self, lock_name: str, *, instance_id: str, error: BaseException) -> None:
        """A release could not delete the row: this process no longer holds the lock, but the row may remain."""
        return None

    # -- the stale-holder watcher ------------------------------------------------

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

    # -- elections -----------------------------------------------------------------

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


def _methods(protocol: type) -> frozenset[str]:
    return frozenset(name for name, value in vars(protocol).items() if not name.startswith("_") and callable(value))


CORE_METHODS = _methods(MetricsHook)
"""The README's six calls."""
EXTENDED_METHODS = _methods(ExtendedMetricsHook)
"""Every call beyond the six."""
HOOK_METHODS = CORE_METHODS | EXTENDED_METHODS
"""Every call the library makes to a hook."""


class NullMetrics(ExtendedMetricsHook):
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


def silent(hook: ExtendedMetricsHook) -> bool:
    """Whether ``hook`` is the one of a Mutex without a hook (`guard` of None): no call of it does anything."""
    return isinstance(hook, _Silent)


def guard(hook: object | None) -> ExtendedMetricsHook:
    """``hook`` wrapped so that each call is checked by name (by the type checker) and can never raise.

    Whichever protocol ``hook`` was written for, the library makes every call (`HOOK_METHODS`): those it
    lacks are skipped.
    """
    if hook is None or type(hook) in (NullMetrics, MetricsHook, ExtendedMetricsHook):
        return cast(ExtendedMetricsHook, _Silent())
    return cast(ExtendedMetricsHook, _Guarded(hook))


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
