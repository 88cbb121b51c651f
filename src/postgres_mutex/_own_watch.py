"""``Mutex(..., watch=True)``: the watcher of a Mutex's own lock."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from .watcher import StaleWatcher

if TYPE_CHECKING:
    from ._state import LockState
    from .client import MutexClient


class OwnLockWatch:
    """``Mutex(..., watch=True)``: a watcher of the Mutex's own lock, through its own hook.

    It uses the Mutex's client and shares its alert gate (one alert per
    episode, whether a contender or the watcher saw it first), and starts with
    the Mutex, so that a process that only watches its lock is alerted too: a
    thread if the client has a sync path, else a task of the running loop (with
    only an ``async_pool`` and no running loop, at the first ``acquire_async``).
    """

    def __init__(self, client: MutexClient, table: str, lock: LockState, metrics: object | None) -> None:
        timing = lock.timing
        self.watcher: StaleWatcher = StaleWatcher(
            client=client,
            table=table,
            lock_names=[lock.lock_name],
            alert_threshold=timing.alert_threshold,
            stale_threshold=timing.stale_threshold,
            interval=min(5.0, timing.alert_threshold / 2),
            metrics=metrics,
            _shared_gates={lock.lock_name: lock.alert_gate},
        )

        self._in_thread = False

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
