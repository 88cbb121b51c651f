"""`LockTable`: the lock table itself, for operators and tools.

Create it, add fencing tokens to an older one, see who holds what (ages by
the server's clock), and remove a lock whose holder is known to be gone.
The ``postgres-mutex`` command and the stale-holder watcher are built on it.

Its methods are written once, async (`_table.methods_async`), and their sync twins
generated (`_table.methods`); what both share is `_table.base`'s.
"""

from __future__ import annotations

from ._table.base import ForcedRelease, HoldRecord, PermitsChanged
from ._table.methods import TableMethods
from ._table.methods_async import AsyncTableMethods
from .client import BUILT_ON_IT

__all__ = ["ForcedRelease", "HoldRecord", "LockTable", "PermitsChanged"]


class LockTable(AsyncTableMethods, TableMethods):
    """One lock table: ``LockTable(dsn)``, ``LockTable(pool=pool)``, or ``client.table()``.

    Every method has an ``_async`` twin. Statements run on the process's
    shared client for the DSN (or pool), or on ``client``; each must finish
    within ``operation_timeout`` seconds.
    """


BUILT_ON_IT.table = LockTable
