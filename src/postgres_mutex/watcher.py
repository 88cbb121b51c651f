"""The stale-holder watcher: alerts on a silent holder without anyone trying to acquire.

Contenders alert when they find a holder silent past ``alert_threshold``, but
a nightly job nobody else is waiting for has no contender. A watcher reads the
lock table every ``interval`` seconds — one query, ages computed with the
server's clock — and:

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
watch=True)``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from . import _flows as flows
from ._background import SyncBackground
from ._metrics import LockObservation, MetricsDispatch
from ._rules import AlertGate, WatchAlerts
from ._settings import check_name, check_seconds
from ._sql import Statements
from ._transport import Transport

if TYPE_CHECKING:
    from psycopg_pool import AsyncConnectionPool, ConnectionPool

logger = logging.getLogger("postgres_mutex")

__all__ = ["StaleWatcher"]


class StaleWatcher:
    """Watch the lock table for holders that stopped heartbeating.

    Give it a ``dsn`` (it opens its own connection, named
    ``postgres-mutex watcher`` in ``pg_stat_activity``) or a ``pool`` /
    ``async_pool``. ``lock_names`` limits it to some locks (default: every
    lock in the table). Raises `TypeError` / `ValueError` naming the argument
    on bad input.
    """

    def __init__(
        self,
        dsn: str | None = None,
        *,
        pool: ConnectionPool[Any] | None = None,
        async_pool: AsyncConnectionPool[Any] | None = None,
        table: str = "mutex_lock",
        lock_names: Iterable[str] | None = None,
        alert_threshold: float = 30.0,
        stale_threshold: float = 600.0,
        interval: float = 5.0,
        operation_timeout: float = 5.0,
        metrics: object | None = None,
    ) -> None:
        statements = Statements(table)
        alert = check_seconds(alert_threshold, "alert_threshold")
        stale = check_seconds(stale_threshold, "stale_threshold")
        if not alert < stale:
            raise ValueError(f"alert_threshold ({alert:g}s) must be shorter than stale_threshold ({stale:g}s)")
        names = None if lock_names is None else frozenset(check_name(name, "lock_names") for name in lock_names)
        transport = Transport(
            dsn=dsn,
            pool=pool,
            async_pool=async_pool,
            instance_id=None,
            operation_timeout=check_seconds(operation_timeout, "operation_timeout"),
            table_name=statements.table_name,
            application_name="postgres-mutex watcher",
        )
        self._setup(
            transport,
            flows.WatchContext(
                statements=statements,
                lock_names=names,
                alert_threshold=alert,
                stale_threshold=stale,
                interval=check_seconds(interval, "interval"),
                operation_timeout=operation_timeout,
                alerts=WatchAlerts(alert),
                metrics=MetricsDispatch(metrics),
            ),
        )

    def _setup(self, transport: Transport, context: flows.WatchContext) -> None:
        self._transport = transport
        self._context = context
        self._thread: SyncBackground | None = None
        self._lock = threading.Lock()

    @classmethod
    def _for_lock(
        cls, transport: Transport, context: flows.WatchContext, *, shared_gate: tuple[str, AlertGate]
    ) -> StaleWatcher:
        """A watcher of one Mutex's own lock, on its connections, sharing its alert gate."""
        watcher = object.__new__(cls)
        name, gate = shared_gate
        context.alerts = WatchAlerts(context.alert_threshold, {name: gate})
        watcher._setup(transport, context)
        return watcher

    @property
    def observations(self) -> list[LockObservation]:
        """The held locks seen at the last successful read."""
        return list(self._context.latest)

    @property
    def healthy(self) -> bool | None:
        """Whether the last read succeeded; None before the first."""
        return self._context.healthy

    def check(self) -> list[LockObservation]:
        """Read the table once now, alerting and reporting as a tick does. Raises `DatabaseError`."""
        return self._transport.sync_runner().run(flows.watch(self._context))

    async def check_async(self) -> list[LockObservation]:
        """Async `check`."""
        return await self._transport.async_runner().run(flows.watch(self._context))

    def start(self) -> None:
        """Watch in a daemon thread until `stop`; does nothing if already started."""
        with self._lock:
            if self._thread is None or not self._thread.running:
                self._thread = SyncBackground(
                    self._transport,
                    flows.watch_forever(self._context),
                    name="postgres-mutex-watcher",
                    on_crash=lambda exc: None,
                )

    def stop(self, timeout: float | None = None) -> None:
        """Stop the thread, waiting up to ``timeout`` seconds (None: its current read's deadline)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.stop()
            thread.join(self._context.operation_timeout + 1.0 if timeout is None else timeout)

    async def run(self) -> None:
        """Watch until cancelled: ``task = asyncio.create_task(watcher.run())``."""
        await self._transport.async_runner().run(flows.watch_forever(self._context))

    def close(self) -> None:
        """Stop, and close the connection the watcher opened (never a pool)."""
        self.stop()
        self._transport.close()

    async def aclose(self) -> None:
        """Async `close` (also closes the async connection)."""
        self.stop()
        await self._transport.aclose()
