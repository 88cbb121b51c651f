"""``Mutex(..., watch=True)``: the watcher of a Mutex's own lock (or of a Semaphore's or an RWLock's holders)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from .._state.rules import AlertGate
from ..watcher import StaleWatcher

if TYPE_CHECKING:
    from .._state.locks import LockState
    from .._state.settings import Settings
    from ..client import MutexClient


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
        self.watcher: StaleWatcher = StaleWatcher(
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
