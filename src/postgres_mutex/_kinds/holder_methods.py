# Generated from holder_methods_async.py by tools/async_to_sync.py: do not edit.
# Change the async module and run `python tools/async_to_sync.py`.
"""`Holder`'s methods that talk to the database or close it: release, heartbeat, fence, close.

`Holder` is made of them and of what is its own (its state, acquiring, the
decorators); the docstrings speak of the Mutex, as `Holder`'s do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .._base.acompat import current_owner
from .._io import acquisition as _acquisition
from .._state import flows, heartbeat_flows
from .closing import release_on_close

if TYPE_CHECKING:
    import weakref

    import psycopg

    from .._state.locks import LockState
    from ..client import ClientCore, MutexClient
    from ..watcher import OwnLockWatch
    from .siblings import Siblings


class HolderMethods:
    """What a holder does with the database in one flavour (``release``, ``fence`` ...)."""

    # What `Holder` sets up for them.
    _client: MutexClient
    _core: ClientCore
    _lock: LockState
    _watch: OwnLockWatch | None
    _siblings: Siblings
    _attachments: tuple[weakref.finalize[[], object], ...]

    # -- schema --------------------------------------------------------------------

    def create_schema(self) -> None:
        """Create the lock table if it does not exist. Idempotent, safe to race.

        Raises `SchemaError` if the role may not create it.
        """
        self._client.table(self._lock.names.table_name).create()

    # -- release -------------------------------------------------------------------

    def release(self) -> None:
        """Delete this Mutex's lock row (waking waiters at once).

        Raises `LockNotHeldError` if this Mutex does not hold the lock (as
        ``threading.Lock.release`` does), or if the lock had been lost (a row
        that may still be ours is then deleted in the background). Raises
        `DatabaseError` if the row could not be deleted within
        ``operation_timeout``: it is deleted in the background as soon as the
        database answers, and is reclaimable after ``stale_threshold`` anyway.

        Called from elsewhere than the ``with`` block that holds the lock,
        it releases the lock and that block's exit raises `LockNotHeldError`:
        the block learns that it ran partly unlocked.
        """
        self._core.engine().run(flows.release(self._lock, self._lock.tracing, caller=current_owner()))

    def heartbeat(self) -> None:
        """Renew the lock now (the client's heartbeat does this on its own).

        Raises `LockNotHeldError` if the lock is not held or turns out lost,
        `DatabaseError` if the heartbeat failed.
        """
        self._core.engine().run(heartbeat_flows.heartbeat_now(self._lock, self._lock.tracing))

    # -- fencing -------------------------------------------------------------------

    def fence(self, conn: psycopg.Connection[Any]) -> int:
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
        return _acquisition.fence(self._lock, conn)

    @contextlib.contextmanager
    def fenced(self, conn: psycopg.Connection[Any]) -> Iterator[int]:
        """A transaction on ``conn`` that is fenced first; yields the token.

        ``with mutex.fenced(conn) as token:`` opens a transaction (a savepoint
        inside one already open), calls `fence`, and commits when the block
        ends, or rolls back if it raises: writes made in the block land only
        while this hold is the lock's current one.
        """
        with conn.transaction():
            yield self.fence(conn)

    # -- shutdown ------------------------------------------------------------------

    def close(self) -> None:
        """Release any lock held, stop the watcher, and let go of the client.

        Returns within about one ``operation_timeout``: a lock known to be lost
        is not released over the network in the caller's time (a row that may
        remain is deleted in the background). The last Mutex of a shared
        client closes its connections; a pool is never closed.
        """
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.stop()
        release_on_close(self._lock, self.release, has_sync=self._core.has_sync)
        for attachment in self._attachments:
            if attachment.detach() is not None:  # not let go of already
                self._core.detach()
        self._siblings.close()
