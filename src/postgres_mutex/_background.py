"""Flows that run on their own: a daemon thread for sync code, a task for async code.

Heartbeats, the watcher's ticks and the clean-up of a row an unanswered
acquire left all run this way. A background flow never dies silently: if it
fails, ``on_crash`` is told (the heartbeat then declares the lock lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable

from ._flows import Flow
from ._transport import Transport

logger = logging.getLogger("postgres_mutex")

Crash = Callable[[BaseException], object]


class SyncBackground:
    """Runs ``flow`` in a daemon thread until it returns or `stop` is called."""

    def __init__(self, transport: Transport, flow: Flow[None], *, name: str, on_crash: Crash) -> None:
        self._stop = threading.Event()
        self._runner = transport.sync_runner(self._stop)
        self._flow = flow
        self._on_crash = on_crash
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._runner.run(self._flow)
        except BaseException as exc:
            logger.exception("postgres-mutex background work %r failed", self._thread.name)
            self._on_crash(exc)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        """Ask it to end at its next pause (a statement in flight finishes first, within its deadline)."""
        self._stop.set()

    def join(self, timeout: float) -> None:
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)


class AsyncBackground:
    """Runs ``flow`` in a task of the running loop until it returns or `stop` is called."""

    def __init__(self, transport: Transport, flow: Flow[None], *, name: str, on_crash: Crash) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._runner = transport.async_runner(self._stop)
        self._flow = flow
        self._on_crash = on_crash
        self._task = self._loop.create_task(self._run(), name=name)

    async def _run(self) -> None:
        try:
            await self._runner.run(self._flow)
        except asyncio.CancelledError:
            raise  # the loop is shutting down
        except BaseException as exc:
            logger.exception("postgres-mutex background work %r failed", self._task.get_name())
            self._on_crash(exc)

    @property
    def running(self) -> bool:
        return not self._task.done()

    def stop(self) -> None:
        # Callable from any thread; a closed loop raises RuntimeError: its task is gone already.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._stop.set)

    async def join(self, timeout: float) -> None:
        if asyncio.get_running_loop() is self._loop and self._task is not asyncio.current_task():
            await asyncio.wait([self._task], timeout=timeout)


Background = SyncBackground | AsyncBackground
