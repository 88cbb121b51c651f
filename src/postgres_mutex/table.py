"""`LockTable`: the lock table itself, for operators and tools.

Create it, add fencing tokens to an older one, see who holds what (ages by
the server's clock), and remove a lock whose holder is known to be gone.
The ``postgres-mutex`` command and the stale-holder watcher are built on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from . import _admin_flows as admin_flows
from . import _steps as steps
from ._metrics import LockObservation
from ._settings import (
    DEFAULT_OPERATION_TIMEOUT,
    check_name,
    check_names,
    check_operation_timeout,
    check_permit_count,
    check_seconds,
    check_thresholds,
)
from ._sql import APSCHEDULER_RUNS, CELERY_BEAT_STATE, Names, row_of
from .client import BUILT_ON_IT, MutexClient, core_of, shared_client
from .errors import InvalidArgument

if TYPE_CHECKING:
    from collections.abc import Iterable

    from psycopg_pool import AsyncConnectionPool, ConnectionPool

__all__ = ["ForcedRelease", "HoldRecord", "LockTable", "PermitsChanged"]


@dataclass(frozen=True)
class ForcedRelease:
    """Whom `LockTable.force_release` removed."""

    lock_name: str
    holder: str
    seconds_since_heartbeat: float
    """By the server's clock, at the moment of the release."""
    token: int | None
    """The removed hold's fencing token (None on a table without tokens)."""


@dataclass(frozen=True)
class PermitsChanged:
    """What `LockTable.set_permits` did."""

    name: str
    permits: int
    """The semaphore's number of permits now."""
    previous: int | None
    """Its number before (None: nobody had used it)."""
    released: int
    """How many holders of permits at or above the new number were released."""


@dataclass(frozen=True)
class HoldRecord:
    """One hold of a lock, as the history recorded it (times by the server's clock)."""

    lock_name: str
    token: int | None
    """The hold's fencing token (None on a table without tokens)."""
    holder: str
    """The holder's instance_id."""
    acquired_at: datetime
    ended_at: datetime | None
    """None while the hold lasts. For an end nobody recorded (``ended_how`` None), when the next
    acquire found the hold over."""
    ended_how: str | None
    """``released``, ``reclaimed`` (by ``ended_by``, after the stale threshold), ``replaced`` (taken
    back by its own instance), ``lost`` (its lease ran out; its holder deleted the row after),
    ``abandoned`` (a row an unanswered acquire left, deleted once the database answered),
    ``force_released`` (an operator's override); None while the hold lasts, or once ended by a
    process that keeps no history (a release before 0.2.0, or one started before the history)."""
    ended_by: str | None
    """Who reclaimed the lock, for ``reclaimed`` and ``replaced``."""
    alerts: int
    """Alert episodes during the hold: heartbeat silences past the alert threshold."""
    held_for: float
    """Seconds from acquired_at to ended_at (or to now, while the hold lasts)."""
    semaphore: str | None = None
    """For a permit of a `Semaphore`: the semaphore's name (``lock_name`` is then its permit row's)."""
    permit: int | None = None
    """For a permit of a `Semaphore`: the permit's number, from 0."""
    rwlock: str | None = None
    """For a hold of an `RWLock`: the read/write lock's name (``lock_name`` is then its holder's row's)."""
    mode: str | None = None
    """For a hold of an `RWLock`: ``"read"`` or ``"write"``."""


class LockTable:
    """One lock table: ``LockTable(dsn)``, ``LockTable(pool=pool)``, or ``client.table()``.

    Every method has an ``_async`` twin. Statements run on the process's
    shared client for the DSN (or pool), or on ``client``; each must finish
    within ``operation_timeout`` seconds.
    """

    def __init__(
        self,
        dsn: str | None = None,
        *,
        pool: ConnectionPool[Any] | None = None,
        async_pool: AsyncConnectionPool[Any] | None = None,
        client: MutexClient | None = None,
        table: str = "mutex_lock",
        operation_timeout: float | None = None,
    ) -> None:
        self._names = Names(table)
        self._timeout = (
            DEFAULT_OPERATION_TIMEOUT if operation_timeout is None else check_operation_timeout(operation_timeout)
        )
        if client is None:
            client = shared_client(dsn, pool, async_pool)
        elif dsn is not None or pool is not None or async_pool is not None:
            raise ValueError("pass either client or dsn/pool/async_pool, not both")
        self._client = client
        self._core = core_of(client)

    @property
    def name(self) -> str:
        """The table's name, as given (``"mutex_lock"``, ``"ops.mutex_lock"``)."""
        return self._names.table_name

    def __repr__(self) -> str:
        return f"<LockTable {self.name} on {self._client!r}>"

    # -- creating and upgrading ----------------------------------------------------

    def create(
        self,
        *,
        history: bool = False,
        history_retention: float | None = None,
        celery_beat: bool | str = False,
        apscheduler: bool | str = False,
    ) -> bool:
        """Create the table (with its token column) if it does not exist; idempotent, safe to race.

        With ``history=True``, also the history table (``<table>_history``,
        see `history`), kept ``history_retention`` seconds after each hold
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
        flow = admin_flows.create_table(self._names, self._timeout, **_history_options(history, history_retention))
        flow = admin_flows.with_integration_tables(flow, _integration_tables(celery_beat, apscheduler), self._timeout)
        try:
            return self._core.engine().run(flow)
        finally:
            self._core.host.shapes.forget(self.name)

    async def create_async(
        self,
        *,
        history: bool = False,
        history_retention: float | None = None,
        celery_beat: bool | str = False,
        apscheduler: bool | str = False,
    ) -> bool:
        """Async `create`."""
        flow = admin_flows.create_table(self._names, self._timeout, **_history_options(history, history_retention))
        flow = admin_flows.with_integration_tables(flow, _integration_tables(celery_beat, apscheduler), self._timeout)
        try:
            return await self._core.engine_async().run(flow)
        finally:
            self._core.host.shapes.forget(self.name)

    def migrate(
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
        too (options as in `create`); processes write it from the next time
        they start. ``celery_beat`` and ``apscheduler`` add the integrations'
        tables if missing, as in `create`. It adds the columns of this
        version's other features too (early reclaims, semaphores, read/write
        locks, the minimum hold's ``hold_until``), each NULL in every row
        that does not use it. Returns True if it changed the lock table.
        """
        timeout = max(self._timeout, 5.0)
        flow = admin_flows.migrate(self._names, timeout, **_history_options(history, history_retention))
        flow = admin_flows.with_integration_tables(flow, _integration_tables(celery_beat, apscheduler), timeout)
        try:
            return self._core.engine().run(flow)
        finally:
            self._core.host.shapes.forget(self.name)

    async def migrate_async(
        self,
        *,
        history: bool = False,
        history_retention: float | None = None,
        celery_beat: bool | str = False,
        apscheduler: bool | str = False,
    ) -> bool:
        """Async `migrate`."""
        timeout = max(self._timeout, 5.0)
        flow = admin_flows.migrate(self._names, timeout, **_history_options(history, history_retention))
        flow = admin_flows.with_integration_tables(flow, _integration_tables(celery_beat, apscheduler), timeout)
        try:
            return await self._core.engine_async().run(flow)
        finally:
            self._core.host.shapes.forget(self.name)

    def has_tokens(self) -> bool:
        """Whether the table has the token column (False also if it does not exist)."""
        return self._core.engine().run(admin_flows.inspect(self._names, self._timeout))[1].tokens

    async def has_tokens_async(self) -> bool:
        """Async `has_tokens`."""
        return (await self._core.engine_async().run(admin_flows.inspect(self._names, self._timeout)))[1].tokens

    def has_history(self) -> bool:
        """Whether the table keeps a history (see `history`)."""
        return self._core.engine().run(admin_flows.inspect(self._names, self._timeout))[1].history

    async def has_history_async(self) -> bool:
        """Async `has_history`."""
        return (await self._core.engine_async().run(admin_flows.inspect(self._names, self._timeout)))[1].history

    # -- reading -----------------------------------------------------------------------

    def holders(
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
        return self._core.engine().run(self._holders(lock_names, alert_threshold, stale_threshold))

    async def holders_async(
        self,
        lock_names: Iterable[str] | None = None,
        *,
        alert_threshold: float = 30.0,
        stale_threshold: float = 600.0,
    ) -> list[LockObservation]:
        """Async `holders`."""
        return await self._core.engine_async().run(self._holders(lock_names, alert_threshold, stale_threshold))

    def _holders(
        self, lock_names: Iterable[str] | None, alert_threshold: float, stale_threshold: float
    ) -> steps.Flow[list[LockObservation]]:
        alert, stale = check_thresholds(alert_threshold, stale_threshold)
        names = check_names(lock_names, "lock_names")
        return admin_flows.holders(self._names, names, self._timeout, alert_threshold=alert, stale_threshold=stale)

    def history(
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
        (`create` / `migrate` with ``history=True``).
        """
        flow = self._history(lock_name, since, limit)
        return [_hold(row) for row in self._core.engine().run(flow)]

    async def history_async(
        self, lock_name: str | None = None, *, since: datetime | timedelta | None = None, limit: int = 100
    ) -> list[HoldRecord]:
        """Async `history`."""
        flow = self._history(lock_name, since, limit)
        return [_hold(row) for row in await self._core.engine_async().run(flow)]

    def _history(
        self, lock_name: str | None, since: datetime | timedelta | None, limit: int
    ) -> steps.Flow[list[tuple[Any, ...]]]:
        if lock_name is not None:
            check_name(lock_name, "lock_name")
        moment: datetime | None = None
        age: float | None = None
        if isinstance(since, timedelta):
            age = check_seconds(since.total_seconds(), "since", allow_zero=True)
        elif since is not None:
            if not isinstance(since, datetime) or since.tzinfo is None:
                raise InvalidArgument(
                    "{since} must be a timezone-aware datetime or a timedelta, got {value!r}", value=since
                )
            moment = since
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise InvalidArgument("{limit} must be a positive integer, got {value!r}", value=limit)
        return admin_flows.read_history(
            self._names, self._timeout, lock_name=lock_name, since=moment, since_seconds=age, limit=limit
        )

    # -- an operator's override ------------------------------------------------------

    def force_release(
        self, lock_name: str, *, permit: int | None = None, writer: bool = False, reader: str | None = None
    ) -> ForcedRelease | None:
        """Delete a lock's row whoever holds it, and wake its waiters; returns whom it removed (None if free).

        With ``permit=K``, ``lock_name`` names a semaphore, and only the holder
        of its permit K (from 0, as `holders` shows it) is released: one
        holder, not the semaphore's every holder. With ``writer=True``,
        ``lock_name`` names an `RWLock` and its writer is released; with
        ``reader=INSTANCE_ID``, that one of its readers (its ``holder`` in
        `holders`). At most one of ``permit``, ``writer`` and ``reader``.

        For an operator who knows the holder is gone and does not want to wait
        out the stale threshold: a holder that is still alive learns of the
        loss at its next heartbeat, and may have worked unlocked meanwhile
        (fencing stops its writes in the database). Waits for a holder's
        fenced transaction to end, up to ``operation_timeout``.
        """
        flow = self._force_release(lock_name, permit, writer, reader)
        return _forced(lock_name, self._core.engine().run(flow))

    async def force_release_async(
        self, lock_name: str, *, permit: int | None = None, writer: bool = False, reader: str | None = None
    ) -> ForcedRelease | None:
        """Async `force_release`."""
        flow = self._force_release(lock_name, permit, writer, reader)
        return _forced(lock_name, await self._core.engine_async().run(flow))

    def _force_release(
        self, lock_name: str, permit: int | None, writer: bool, reader: str | None
    ) -> steps.Flow[tuple[str, float, int | None] | None]:
        _check_release(lock_name, permit, writer, reader)
        return admin_flows.force_release(
            self._names, lock_name, self._timeout, permit=permit, writer=writer, reader=reader
        )

    # -- semaphores ------------------------------------------------------------------

    def set_permits(self, name: str, permits: int) -> PermitsChanged:
        """Change how many holders semaphore ``name`` allows at once, for the whole fleet.

        In one transaction: the holders of permits at or above the new number
        are released (each learns it at its next heartbeat, as after
        `force_release`), the semaphore's waiters are woken, and the number is
        changed; once it returns, never more than ``permits`` hold. A semaphore
        nobody used yet is declared with it. Semaphores of the process that
        still say the old number are refused at their next acquire
        (`PermitsMismatchError`): give them the new one.
        """
        permits = check_permit_count(name, permits)
        found = self._core.engine().run(admin_flows.set_permits(self._names, name, permits, self._timeout))
        return PermitsChanged(name, permits, *found)

    async def set_permits_async(self, name: str, permits: int) -> PermitsChanged:
        """Async `set_permits`."""
        permits = check_permit_count(name, permits)
        found = await self._core.engine_async().run(admin_flows.set_permits(self._names, name, permits, self._timeout))
        return PermitsChanged(name, permits, *found)


def _hold(row: tuple[Any, ...]) -> HoldRecord:
    """A row of the history read, with what its row's name says it held (`row_of`)."""
    return HoldRecord(*row, **row_of(str(row[0]))._asdict())


def _history_options(history: bool, retention: float | None) -> dict[str, Any]:
    if not isinstance(history, bool):
        raise InvalidArgument("{history} must be True or False, got {value!r}", value=history)
    if retention is not None:
        if not history:
            raise InvalidArgument("{history_retention} applies to a history: pass {history=True} with it")
        retention = check_seconds(retention, "history_retention")
    return {"history": history, "history_retention": retention}


def _integration_tables(celery_beat: bool | str, apscheduler: bool | str) -> dict[str, str]:
    """``{integration: its table's name}`` for the integrations asked for (True: the default name)."""
    tables: dict[str, str] = {}
    for integration, value, default in (
        ("celery_beat", celery_beat, CELERY_BEAT_STATE),
        ("apscheduler", apscheduler, APSCHEDULER_RUNS),
    ):
        if value is False:
            continue
        name = default if value is True else value
        try:
            tables[integration] = Names(name).table_name
        except (TypeError, ValueError):
            raise InvalidArgument(
                "{" + integration + "} must be True, False or a table's name ('name' or 'schema.name'), got {value!r}",
                value=value,
            ) from None
    return tables


def _check_release(lock_name: str, permit: int | None, writer: bool, reader: str | None) -> None:
    """``force_release``'s arguments checked: a lock's name, or a semaphore's and one of its permits, or a
    read/write lock's and its writer or one of its readers."""
    check_name(lock_name, "lock_name")
    if permit is not None and (isinstance(permit, bool) or not isinstance(permit, int) or permit < 0):
        raise ValueError(f"permit must be a permit's number, an int from 0 (as holders() shows it), not {permit!r}")
    if not isinstance(writer, bool):
        raise InvalidArgument("{writer} must be True or False, got {value!r}", value=writer)
    if reader is not None:
        check_name(reader, "reader")
    if (permit is not None) + writer + (reader is not None) > 1:
        raise InvalidArgument(
            "{permit}, {writer} and {reader} each name one holder (of a semaphore, or of a read/write lock): "
            "pass one of them"
        )


def _forced(lock_name: str, found: tuple[str, float, int | None] | None) -> ForcedRelease | None:
    if found is None:
        return None
    holder, age, token = found
    return ForcedRelease(lock_name, holder, age, token)


BUILT_ON_IT.table = LockTable
