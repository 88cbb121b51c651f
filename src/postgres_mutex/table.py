"""`LockTable`: the lock table itself, for operators and tools.

Create it, add fencing tokens to an older one, see who holds what (ages by
the server's clock), and remove a lock whose holder is known to be gone.
The ``postgres-mutex`` command and the stale-holder watcher are built on it.

Its methods are written once, async (`_table.methods_async`), and their sync twins
generated (`_table.methods`); what both share is `_table.base`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._sql import Names
from ._state.settings import DEFAULT_OPERATION_TIMEOUT, check_operation_timeout
from ._table.base import ForcedRelease, HoldRecord, PermitsChanged
from ._table.methods import TableMethods
from ._table.methods_async import AsyncTableMethods
from .client import BUILT_ON_IT, MutexClient, client_for, core_of

if TYPE_CHECKING:
    from psycopg_pool import AsyncConnectionPool, ConnectionPool

__all__ = ["ForcedRelease", "HoldRecord", "LockTable", "PermitsChanged"]


class LockTable(AsyncTableMethods, TableMethods):
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
        self._client = client_for(dsn, pool, async_pool, client)
        self._core = core_of(self._client)


BUILT_ON_IT.table = LockTable
