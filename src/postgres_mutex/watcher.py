"""The stale-holder watcher: alerts on a silent holder without anyone trying to acquire.

Contenders alert when they find a holder silent past ``alert_threshold``, but
a nightly job nobody else is waiting for has no contender. A watcher reads the
lock table every ``interval`` seconds — one query, ages computed with the
server's clock (what `LockTable.holders` reads) — and:

- fires the hook's ``alert`` once per stale episode (re-armed when the holder
  heartbeats again or changes), within ``alert_threshold + interval`` of the
  last heartbeat;
- reports every held lock to the hook's ``observed`` (the gauges of
  `PrometheusMetrics` and `OtelMetrics`: seconds since heartbeat, seconds
  held, holder, alerting, reclaimable);
- rides out database outages: a failed read is logged, reported to
  ``watcher_failed``, and retried at the next tick.

Run it as a thread (`start` / `stop`) in sync code, as a task (`run`) in
async code, or switch it on for one Mutex's own lock with ``Mutex(...,
watch=True)`` (for every holder of a Semaphore or an RWLock with theirs):
the Mutex then runs one (`OwnLockWatch`).

A semaphore's or read/write lock's holders are rows of their own: each is
judged on its own, and told under the name the program gave (with its permit,
or its mode), never its row's.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from ._base.acompat import Event
from ._observe.hooks import LockObservation, guard
from ._sql import Names
from ._state import admin_flows
from ._state.alerts import AlertGate, WatchAlerts
from ._state.events import WatcherEvents
from ._state.settings import (
    DEFAULT_OPERATION_TIMEOUT,
    check_names,
    check_operation_timeout,
    check_seconds,
    check_thresholds,
)
from .client import MutexClient, core_of, shared_client
from .errors import DatabaseError

if TYPE_CHECKING:
    from psycopg_pool import AsyncConnectionPool, ConnectionPool

    from ._state import steps
    from ._state.locks import LockState
    from ._state.settings import Settings

__all__ = ["StaleWatcher"]


class StaleWatcher:
    """Watch the lock table for holders that stopped heartbeating.

    Give it a ``dsn``, a ``pool`` / ``async_pool``, or a ``client``; it reads
    through the process's shared client for that DSN or pool. ``lock_names``
    limits it to some locks (a list of names; default: every lock in the
    table); a semaphore's or read/write lock's name stands for every one of
    its holders. Raises `TypeError` / `ValueError` naming the argument on bad input.
    """

    def __init__(
        self,
        dsn: str | None = None,
        *,
        pool: ConnectionPool[Any] | None = None,
        async_pool: AsyncConnectionPool[Any] | None = None,
        client: MutexClient | None = None,
        table: str = "mutex_lock",
        lock_names: Iterable[str] | None = None,
        alert_threshold: float = 30.0,
        stale_threshold: float = 600.0,
        interval: float = 5.0,
        operation_timeout: float | None = None,
        metrics: object | None = None,
        _shared_gates: Mapping[str, AlertGate] | None = None,
    ) -> None:
        alert, stale = check_thresholds(alert_threshold, stale_threshold)
        self._lock_names = check_names(lock_names, "lock_names")
        self._interval = check_seconds(interval, "interval")
        if client is None:
            client = shared_client(dsn, pool, async_pool)
            core_of(client).attach()
            self._owns_attachment = True
        else:
            self._owns_attachment = False
        self._client = client
        self._core = core_of(client)
        self._names = Names(table)
        self._timeout = (
            DEFAULT_OPERATION_TIMEOUT if operation_timeout is None else check_operation_timeout(operation_timeout)
        )
        self._alert_threshold, self._stale_threshold = alert, stale
        self._alerts = WatchAlerts(alert, dict(_shared_gates or {}))
        self._events = WatcherEvents(
            guard(metrics), watched=self._lock_names, alert_threshold=alert, stale_threshold=stale
        )
        self._latest: list[LockObservation] = []
        self._healthy: bool | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        # Events a signal handler's stop() can set whatever it interrupted (`Event`), and a count of
        # the stops, which a run reads first: a stop() from then on ends it, however early it came.
        self._stop = Event()
        self._stops = 0
        self._task: asyncio.Task[None] | None = None

    @property
    def observations(self) -> list[LockObservation]:
        """The held locks seen at the last successful read."""
        return list(self._latest)

    @property
    def healthy(self) -> bool | None:
        """Whether the last read succeeded; None before the first."""
        return self._healthy

    # -- one read ----------------------------------------------------------------------

    def check(self) -> list[LockObservation]:
        """Read the table once now, alerting and reporting as a tick does. Raises `DatabaseError`."""
        try:
            observations = self._core.engine().run(self._read())
        except DatabaseError as exc:
            self._failed(exc)
            raise
        return self._saw(observations)

    async def check_async(self) -> list[LockObservation]:
        """Async `check`."""
        try:
            observations = await self._core.engine_async().run(self._read())
        except DatabaseError as exc:
            self._failed(exc)
            raise
        return self._saw(observations)

    def _read(self) -> steps.Flow[list[LockObservation]]:
        """One read of the table: the held locks watched, judged against this watcher's thresholds."""
        return admin_flows.holders(
            self._names,
            self._lock_names,
            self._timeout,
            alert_threshold=self._alert_threshold,
            stale_threshold=self._stale_threshold,
        )

    def _failed(self, error: DatabaseError) -> None:
        # Reported before `healthy` turns false: whoever sees it false finds the failure reported.
        self._events.failed(error)
        self._healthy = False

    def _saw(self, observations: list[LockObservation]) -> list[LockObservation]:
        for seen in observations:
            # Judged per row (each permit's or reader's holder alone), reported under the name users gave:
            # the semaphore's or read/write lock's, not its row's.
            if self._alerts.should_alert(seen.lock_name, seen.holder, seen.seconds_since_heartbeat):
                self._events.alert(seen)
        self._alerts.held_now({seen.lock_name for seen in observations})
        self._latest, self._healthy = observations, True
        self._events.observed(observations)
        return observations

    # -- running -------------------------------------------------------------------------

    def start(self) -> None:
        """Watch in a daemon thread until `stop`; does nothing if already started."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stop = Event()
            self._thread = threading.Thread(
                target=self._watch, args=(self._stop,), name="postgres-mutex-watcher", daemon=True
            )
            self._thread.start()

    def _watch(self, stop: Event) -> None:
        try:
            while not stop.is_set():
                with contextlib.suppress(DatabaseError):
                    self.check()
                stop.wait(self._interval)
        finally:
            self._stopped()

    def stop(self, timeout: float | None = None) -> None:
        """Stop the thread (or task), waiting up to ``timeout`` seconds (None: its current read's deadline)."""
        self._stops += 1
        # Not waiting for the lock: a signal handler may run this on the thread that holds it.
        locked = self._lock.acquire(blocking=False)
        try:
            thread, self._thread = self._thread, None
            task, self._task = self._task, None
        finally:
            if locked:
                self._lock.release()
        self._stop.set()
        if task is not None:
            with contextlib.suppress(RuntimeError):  # its loop is closed: the task is gone already
                task.get_loop().call_soon_threadsafe(task.cancel)
        if thread is not None and thread is not threading.current_thread():
            thread.join(self._client.operation_timeout + 1.0 if timeout is None else timeout)

    def run(self) -> None:
        """Watch in the calling thread until `stop` (from another thread or a signal handler), as
        `Election.run` campaigns; `start` does the same in a thread of its own.

        Raises `RuntimeError` if this watcher already watches in a thread.
        """
        stops = self._stops
        stop = Event()
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                raise RuntimeError("this StaleWatcher already watches in a thread: call stop() first")
            self._stop = stop
            self._thread = threading.current_thread()
        try:
            if self._stops != stops:  # stopped (by a signal handler) before its event was the one to set
                stop.set()
            self._watch(stop)
        finally:
            with self._lock:
                if self._thread is threading.current_thread():
                    self._thread = None

    async def run_async(self) -> None:
        """Watch until cancelled: ``task = asyncio.create_task(watcher.run_async())``."""
        try:
            while True:
                with contextlib.suppress(DatabaseError):
                    await self.check_async()
                await asyncio.sleep(self._interval)
        finally:
            self._stopped()

    def start_task(self) -> None:
        """Watch in a task of the running loop until `stop`; does nothing if already watching there."""
        with self._lock:
            if self._task is not None and not self._task.done():
                return
            self._task = asyncio.get_running_loop().create_task(self.run_async(), name="postgres-mutex-watcher")

    def _stopped(self) -> None:
        self._healthy = None
        self._events.stopped()

    def close(self) -> None:
        """Stop, and let go of the client (the last user of a shared client closes its connections)."""
        self.stop()
        if self._owns_attachment:
            self._owns_attachment = False
            self._core.detach()

    async def aclose(self) -> None:
        """Async `close`."""
        self.close()


class LeftToTheWatcher(AlertGate):
    """The alert gate of a contender whose lock's holders a watcher of its own judges: it never alerts.

    A semaphore's or read/write lock's holders are rows of their own, each judged by the watcher, once per
    episode; a contender sees one of them at a time, and alerting too would tell the same silence twice.
    """

    def should_alert(self, holder: str | None, heartbeat_age: float | None) -> bool:
        return False


class OwnLockWatch:
    """``Mutex(..., watch=True)``: a watcher of the Mutex's own lock, through its own hook.

    It uses the Mutex's client and shares its alert gate (one alert per
    episode, whether a contender or the watcher saw it first), and starts with
    the Mutex, so that a process that only watches its lock is alerted too: a
    thread if the client has a sync path, else a task of the running loop (with
    only an ``async_pool`` and no running loop, at the first ``acquire_async``).

    A Semaphore's (an RWLock's) watches every holder of the semaphore (the
    read/write lock), each alerted on once per episode by the watcher alone
    (`LeftToTheWatcher`), under the name users gave it, with its permit (mode).
    """

    def __init__(self, client: MutexClient, lock: LockState, settings: Settings) -> None:
        timing = settings.timing
        shared = {lock.lock_name: lock.alert_gate}
        if lock.kind.alerts_left_to_watcher:
            self.leave_alerts_of(lock)
            shared = {}
        self.watcher = StaleWatcher(
            client=client,
            table=settings.table,
            lock_names=[lock.lock_name],
            alert_threshold=timing.alert_threshold,
            stale_threshold=timing.stale_threshold,
            # Its contenders leave the alerts of a semaphore's or read/write lock's holders to it: it looks
            # at least twice between a holder's alert and its reclaim, so the alert comes first.
            interval=min(5.0, timing.alert_threshold / 2, (timing.stale_threshold - timing.alert_threshold) / 2),
            metrics=settings.metrics,
            _shared_gates=shared,
        )

        self._in_thread = False

    @staticmethod
    def leave_alerts_of(lock: LockState) -> None:
        """Leave the alerts on ``lock``'s holders to this watcher: its contenders no longer alert."""
        lock.alert_gate = LeftToTheWatcher(lock.timing.alert_threshold)

    def start_at_creation(self, has_sync: bool) -> None:
        if has_sync:
            self.start_sync()
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # the first acquire_async starts it, on its loop
        self.start_async()

    def start_sync(self) -> None:
        self._in_thread = True
        self.watcher.start()

    def start_async(self) -> None:
        if not self._in_thread:  # one watcher is enough: the thread watches for async code too
            self.watcher.start_task()

    def stop(self) -> None:
        self.watcher.stop()
