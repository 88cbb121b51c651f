"""`Holder`'s methods that talk to the database or close it: release, heartbeat, fence, close.

`Holder` is made of them and of what is its own (its state, acquiring, the
decorators); the docstrings speak of the Mutex, as `Holder`'s do.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from .._base.acompat import current_owner
from .._io import acquisition_async as _acquisition_async
from .._state import flows, heartbeat_flows
from .closing_async import release_on_close_async

if TYPE_CHECKING:
    import weakref

    import psycopg

    from .._state.locks import LockState
    from ..client import ClientCore, MutexClient
    from ..watcher import OwnLockWatch
    from .siblings import Siblings


class AsyncHolderMethods:
    """What a holder does with the database in one flavour (``release_async``, ``fence_async`` ...)."""

    # What `Holder` sets up for them.
    _client: MutexClient
    _core: ClientCore
    _lock: LockState
    _watch: OwnLockWatch | None
    _siblings: Siblings
    _attachments: tuple[weakref.finalize[[], object], ...]

    # -- schema --------------------------------------------------------------------

    async def create_schema_async(self) -> None:
        """Create the lock table if it does not exist. Idempotent, safe to race.

        Raises `SchemaError` if the role may not create it.
        """
        await self._client.table(self._lock.names.table_name).create_async()

    # -- release -------------------------------------------------------------------

    async def release_async(self) -> None:
        """Delete this Mutex's lock row (waking waiters at once).

        Raises `LockNotHeldError` if this Mutex does not hold the lock (as
        ``threading.Lock.release`` does), or if the lock had been lost (a row
        that may still be ours is then deleted in the background). Raises
        `DatabaseError` if the row could not be deleted within
        ``operation_timeout``: it is deleted in the background as soon as the
        database answers, and is reclaimable after ``stale_threshold`` anyway.

        Called from elsewhere than the ``async with`` block that holds the lock,
        it releases the lock and that block's exit raises `LockNotHeldError`:
        the block learns that it ran partly unlocked.
        """
        await self._core.engine_async().run(flows.release(self._lock, self._lock.tracing, caller=current_owner()))

    async def heartbeat_async(self) -> None:
        """Renew the lock now (the client's heartbeat does this on its own).

        Raises `LockNotHeldError` if the lock is not held or turns out lost,
        `DatabaseError` if the heartbeat failed.
        """
        await self._core.engine_async().run(heartbeat_flows.heartbeat_now(self._lock, self._lock.tracing))

    # -- fencing -------------------------------------------------------------------

    async def fence_async(self, conn: psycopg.AsyncConnection[Any]) -> int:
        """Check, inside the caller's open transaction on ``conn``, that this hold is still current.

        ``conn`` is any connection to the lock table's database; the check is
        one round trip on it and opens nothing. On success it returns the
        token, and until that transaction ends no other instance can take the
        lock over (a reclaim or a forced release waits for it), while this
        holder's heartbeats carry on. If the lock changed hands, raises
        `LockNotHeldError` (reason: fenced out), so the transaction's writes
        are rolled back by the caller. Raises `SchemaError` on a table without
        tokens, `ValueError` if ``conn`` has no open transaction.

        It takes one ``operation_timeout`` at most, like the library's own
        statements: past it (a silent network, a row locked elsewhere) it
        closes ``conn`` and raises `OperationTimeout`. The server then rolls
        the transaction back, so nothing it wrote commits; use a new
        connection (a pool replaces a closed one by itself).
        """
        return await _acquisition_async.fence_async(self._lock, conn)

    @contextlib.asynccontextmanager
    async def fenced_async(self, conn: psycopg.AsyncConnection[Any]) -> AsyncIterator[int]:
        """A transaction on ``conn`` that is fenced first; yields the token.

        ``async with mutex.fenced_async(conn) as token:`` opens a transaction (a savepoint
        inside one already open), calls `fence_async`, and commits when the block
        ends, or rolls back if it raises: writes made in the block land only
        while this hold is the lock's current one.
        """
        async with conn.transaction():
            yield await self.fence_async(conn)

    # -- shutdown ------------------------------------------------------------------

    async def aclose(self) -> None:
        """Release any lock held, stop the watcher, and let go of the client.

        Returns within about one ``operation_timeout``: a lock known to be lost
        is not released over the network in the caller's time (a row that may
        remain is deleted in the background). The last Mutex of a shared
        client closes its connections; a pool is never closed.
        """
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.stop()
        # async-only
        await release_on_close_async(self._lock, self.release_async)
        # end async-only
        # sync-only
        # release_on_close(self._lock, self.release, has_sync=self._core.has_sync)
        # end sync-only
        for attachment in self._attachments:
            if attachment.detach() is not None:  # not let go of already
                self._core.detach()
        await self._siblings.aclose()
