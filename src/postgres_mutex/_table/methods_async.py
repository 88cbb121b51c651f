"""`LockTable`'s methods that run statements: each builds its flow (`TableBase`) and runs it on the client's engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._state import admin_flows
from .._state.settings import check_permit_count
from .base import (
    HoldRecord,
    PermitsChanged,
    TableBase,
    forced_release,
    history_options,
    hold_record,
    integration_tables,
)

if TYPE_CHECKING:
    from collections.abc import Iterable
    from datetime import datetime, timedelta

    from .._observe.hooks import LockObservation
    from .base import ForcedRelease


class AsyncTableMethods(TableBase):
    """`LockTable`'s methods of one flavour (``create_async``, ``holders_async`` ...)."""

    # -- creating and upgrading ----------------------------------------------------

    async def create_async(
        self,
        *,
        history: bool = False,
        history_retention: float | None = None,
        celery_beat: bool | str = False,
        apscheduler: bool | str = False,
    ) -> bool:
        """Create the table (with its token column) if it does not exist; idempotent, safe to race.

        With ``history=True``, also the history table (``<table>_history``,
        see `history_async`), kept ``history_retention`` seconds after each hold
        ends (default 30 days; given for an existing history, it changes it).
        With ``celery_beat``, also the table where the leader-elected Celery
        beat records its runs (True: ``celery_beat_state``, or its name); with
        ``apscheduler``, `FleetExecutor`'s ledger (True:
        ``mutex_apscheduler_runs``, or its name). A table that exists is left
        as it is, and asked about before anything is created, so a role
        without CREATE on the schema may call this where the tables exist.
        Returns True if the lock table has fencing tokens. Raises
        `SchemaError` if the role may not create a table that is missing.
        """
        flow = admin_flows.create_table(self._names, self._timeout, **history_options(history, history_retention))
        flow = admin_flows.with_integration_tables(flow, integration_tables(celery_beat, apscheduler), self._timeout)
        try:
            return await self._core.engine_async().run(flow)
        finally:
            self._core.shapes.forget(self.name)

    async def migrate_async(
        self,
        *,
        history: bool = False,
        history_retention: float | None = None,
        celery_beat: bool | str = False,
        apscheduler: bool | str = False,
    ) -> bool:
        """Add fencing tokens to a table made without them (the README's DDL, or an earlier release).

        One idempotent call, online: no table rewrite, no lock held longer
        than a catalog change takes, holders keep heartbeating meanwhile, and
        many instances may run it at once. It needs the role that owns the
        table. Locks acquired before the migration have no token until they
        are acquired again. With ``history=True`` it adds the history table
        too (options as in `create_async`); processes write it from the next time
        they start. ``celery_beat`` and ``apscheduler`` add the integrations'
        tables if missing, as in `create_async`. It adds the columns of this
        version's other features too (early reclaims, semaphores, read/write
        locks, the minimum hold's ``hold_until``), each NULL in every row
        that does not use it. Returns True if it changed the lock table.
        """
        timeout = max(self._timeout, 5.0)
        flow = admin_flows.migrate(self._names, timeout, **history_options(history, history_retention))
        flow = admin_flows.with_integration_tables(flow, integration_tables(celery_beat, apscheduler), timeout)
        try:
            return await self._core.engine_async().run(flow)
        finally:
            self._core.shapes.forget(self.name)

    async def has_tokens_async(self) -> bool:
        """Whether the table has the token column (False also if it does not exist)."""
        return (await self._core.engine_async().run(admin_flows.inspect(self._names, self._timeout)))[1].tokens

    async def has_history_async(self) -> bool:
        """Whether the table keeps a history (see `history_async`)."""
        return (await self._core.engine_async().run(admin_flows.inspect(self._names, self._timeout)))[1].history

    # -- reading -----------------------------------------------------------------------

    async def holders_async(
        self,
        lock_names: Iterable[str] | None = None,
        *,
        alert_threshold: float = 30.0,
        stale_threshold: float = 600.0,
    ) -> list[LockObservation]:
        """Every held lock (or those named), sorted by name: holder, held for, seconds since heartbeat, token.

        Each holder of a `Semaphore` is a record of its own, with its
        ``semaphore`` and ``permit``; each holder of an `RWLock` too, with its
        ``rwlock`` and ``mode`` (``"read"`` or ``"write"``). Naming a
        semaphore or a read/write lock in ``lock_names`` asks for its every
        holder. Ages come from the server's clock. ``alerting`` and ``reclaimable``
        are judged against the thresholds given (those of the Mutexes, which
        the table does not know).
        """
        return await self._core.engine_async().run(self._holders(lock_names, alert_threshold, stale_threshold))

    async def history_async(
        self, lock_name: str | None = None, *, since: datetime | timedelta | None = None, limit: int = 100
    ) -> list[HoldRecord]:
        """The holds the history recorded, newest first: of ``lock_name`` (or of every lock).

        The name of a `Semaphore` or of an `RWLock` gives the holds of its
        every permit, or of its readers and writers: each record says which
        (``semaphore`` and ``permit``, or ``rwlock`` and ``mode``); a row's
        own ``lock_name`` (one permit's, one reader's) gives that row's.

        ``since`` keeps the holds that had not ended by then: an aware
        datetime, or a timedelta before now by the server's clock; at most
        ``limit`` rows. Raises `SchemaError` if the table keeps no history
        (`create_async` / `migrate_async` with ``history=True``).
        """
        flow = self._history(lock_name, since, limit)
        return [hold_record(row) for row in await self._core.engine_async().run(flow)]

    # -- an operator's override ------------------------------------------------------

    async def force_release_async(
        self, lock_name: str, *, permit: int | None = None, writer: bool = False, reader: str | None = None
    ) -> ForcedRelease | None:
        """Delete a lock's row whoever holds it, and wake its waiters; returns whom it removed (None if free).

        With ``permit=K``, ``lock_name`` names a semaphore, and only the holder
        of its permit K (from 0, as `holders_async` shows it) is released: one
        holder, not the semaphore's every holder. With ``writer=True``,
        ``lock_name`` names an `RWLock` and its writer is released; with
        ``reader=INSTANCE_ID``, that one of its readers (its ``holder`` in
        `holders_async`). At most one of ``permit``, ``writer`` and ``reader``.

        For an operator who knows the holder is gone and does not want to wait
        out the stale threshold: a holder that is still alive learns of the
        loss at its next heartbeat, and may have worked unlocked meanwhile
        (fencing stops its writes in the database). Waits for a holder's
        fenced transaction to end, up to ``operation_timeout``.
        """
        flow = self._force_release(lock_name, permit, writer, reader)
        return forced_release(lock_name, await self._core.engine_async().run(flow))

    # -- semaphores ------------------------------------------------------------------

    async def set_permits_async(self, name: str, permits: int) -> PermitsChanged:
        """Change how many holders semaphore ``name`` allows at once, for the whole fleet.

        In one transaction: the holders of permits at or above the new number
        are released (each learns it at its next heartbeat, as after
        `force_release_async`), the semaphore's waiters are woken, and the number is
        changed; once it returns, never more than ``permits`` hold. A semaphore
        nobody used yet is declared with it. Semaphores of the process that
        still say the old number are refused at their next acquire
        (`PermitsMismatchError`): give them the new one.
        """
        permits = check_permit_count(name, permits)
        found = await self._core.engine_async().run(admin_flows.set_permits(self._names, name, permits, self._timeout))
        return PermitsChanged(name, permits, *found)
