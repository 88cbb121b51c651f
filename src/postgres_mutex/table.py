"""`LockTable`: the lock table itself, for operators and tools.

Create it, add fencing tokens to an older one, see who holds what (ages by
the server's clock), and remove a lock whose holder is known to be gone.
The ``postgres-mutex`` command and the stale-holder watcher are built on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import _flows as flows
from ._metrics import LockObservation
from ._settings import DEFAULT_OPERATION_TIMEOUT, check_name, check_names, check_operation_timeout, check_seconds
from ._sql import Names
from .client import MutexClient, shared_client

if TYPE_CHECKING:
    from collections.abc import Iterable

    from psycopg_pool import AsyncConnectionPool, ConnectionPool

__all__ = ["ForcedRelease", "LockTable"]


@dataclass(frozen=True)
class ForcedRelease:
    """Whom `LockTable.force_release` removed."""

    lock_name: str
    holder: str
    seconds_since_heartbeat: float
    """By the server's clock, at the moment of the release."""
    token: int | None
    """The removed hold's fencing token (None on a table without tokens)."""


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

    @property
    def name(self) -> str:
        """The table's name, as given (``"mutex_lock"``, ``"ops.mutex_lock"``)."""
        return self._names.table_name

    def __repr__(self) -> str:
        return f"<LockTable {self.name} on {self._client!r}>"

    # -- creating and upgrading ----------------------------------------------------

    def create(self) -> bool:
        """Create the table (with its token column) if it does not exist; idempotent, safe to race.

        An existing table is left as it is. Returns True if the table has
        fencing tokens. Raises `SchemaError` if the role may not create it.
        """
        try:
            return self._client._get_engine().run(flows.create_table(self._names, self._timeout))
        finally:
            self._client._shapes.pop(self.name, None)

    async def create_async(self) -> bool:
        """Async `create`."""
        try:
            return await self._client._get_engine_async().run(flows.create_table(self._names, self._timeout))
        finally:
            self._client._shapes.pop(self.name, None)

    def migrate(self) -> bool:
        """Add fencing tokens to a table made without them (the README's DDL, or an earlier release).

        One idempotent call, online: no table rewrite, no lock held longer
        than a catalog change takes, holders keep heartbeating meanwhile, and
        many instances may run it at once. It needs the role that owns the
        table. Returns True if it changed anything. Locks acquired before the
        migration have no token until they are acquired again.
        """
        try:
            return self._client._get_engine().run(flows.migrate(self._names, max(self._timeout, 5.0)))
        finally:
            self._client._shapes.pop(self.name, None)

    async def migrate_async(self) -> bool:
        """Async `migrate`."""
        try:
            return await self._client._get_engine_async().run(flows.migrate(self._names, max(self._timeout, 5.0)))
        finally:
            self._client._shapes.pop(self.name, None)

    def has_tokens(self) -> bool:
        """Whether the table has the token column (False also if it does not exist)."""
        _, tokens = self._client._get_engine().run(flows.inspect(self._names, self._timeout))
        return tokens

    async def has_tokens_async(self) -> bool:
        """Async `has_tokens`."""
        _, tokens = await self._client._get_engine_async().run(flows.inspect(self._names, self._timeout))
        return tokens

    # -- reading -----------------------------------------------------------------------

    def holders(
        self,
        lock_names: Iterable[str] | None = None,
        *,
        alert_threshold: float = 30.0,
        stale_threshold: float = 600.0,
    ) -> list[LockObservation]:
        """Every held lock (or those named), sorted by name: holder, held for, seconds since heartbeat, token.

        Ages come from the server's clock. ``alerting`` and ``reclaimable``
        are judged against the thresholds given (those of the Mutexes, which
        the table does not know).
        """
        return self._client._get_engine().run(self._holders(lock_names, alert_threshold, stale_threshold))

    async def holders_async(
        self,
        lock_names: Iterable[str] | None = None,
        *,
        alert_threshold: float = 30.0,
        stale_threshold: float = 600.0,
    ) -> list[LockObservation]:
        """Async `holders`."""
        return await self._client._get_engine_async().run(self._holders(lock_names, alert_threshold, stale_threshold))

    def _holders(
        self, lock_names: Iterable[str] | None, alert_threshold: float, stale_threshold: float
    ) -> flows.Flow[list[LockObservation]]:
        alert = check_seconds(alert_threshold, "alert_threshold")
        stale = check_seconds(stale_threshold, "stale_threshold")
        if not alert < stale:
            raise ValueError(f"alert_threshold ({alert:g}s) must be shorter than stale_threshold ({stale:g}s)")
        names = check_names(lock_names, "lock_names")
        return flows.holders(self._names, names, self._timeout, alert_threshold=alert, stale_threshold=stale)

    # -- an operator's override ------------------------------------------------------

    def force_release(self, lock_name: str) -> ForcedRelease | None:
        """Delete a lock's row whoever holds it, and wake its waiters; returns whom it removed (None if free).

        For an operator who knows the holder is gone and does not want to wait
        out the stale threshold: a holder that is still alive learns of the
        loss at its next heartbeat, and may have worked unlocked meanwhile
        (fencing stops its writes in the database). Waits for a holder's
        fenced transaction to end, up to ``operation_timeout``.
        """
        check_name(lock_name, "lock_name")
        return _forced(
            lock_name, self._client._get_engine().run(flows.force_release(self._names, lock_name, self._timeout))
        )

    async def force_release_async(self, lock_name: str) -> ForcedRelease | None:
        """Async `force_release`."""
        check_name(lock_name, "lock_name")
        found = await self._client._get_engine_async().run(flows.force_release(self._names, lock_name, self._timeout))
        return _forced(lock_name, found)


def _forced(lock_name: str, found: tuple[str, float, int | None] | None) -> ForcedRelease | None:
    if found is None:
        return None
    holder, age, token = found
    return ForcedRelease(lock_name, holder, age, token)
