"""`Mutex`: the public API, sync and async, over its client's engines and the shared flows.

What it shares with the other holders (`Semaphore`, a read/write lock's) is `Holder`'s; what is
the Mutex's own is its name, its description and its siblings. What is not the API has parts of
its own: the decorators and the sibling Mutexes they name (`_kinds.singleton`), what closing does
with the lock (`_kinds.closing`). An election campaigns with its Mutex's `Holder._campaign`.
"""

from __future__ import annotations

from .._state.settings import check_lock_name
from ..client import BUILT_ON_IT
from ..watcher import OwnLockWatch
from .holder import Holder


class Mutex(Holder):
    """A distributed mutex: one row per lock in a PostgreSQL table.

    Give it a ``dsn`` or a psycopg_pool ``pool`` and/or ``async_pool``: it then
    uses the process's shared `MutexClient` for that DSN or pool, so every
    Mutex of the process shares at most two connections per DSN (per event
    loop, for async use) and one heartbeat statement per interval. Or make it
    on a client you own: ``client.mutex("job")``.

    While held, the lock is renewed by a heartbeat every
    ``heartbeat_interval`` seconds. A holder silent for ``alert_threshold``
    triggers the ``alert`` metrics call in contenders (and watchers); one
    silent for ``stale_threshold`` may be reclaimed. The holder itself gives
    the lock up as lost one heartbeat interval before that (its *lease*):
    `held` turns false, `ensure_held` raises `LockNotHeldError`, ``on_lost``
    and the ``lost`` metrics call fire, and leaving the ``with`` block raises
    `LockNotHeldError`.

    With ``reclaim_disconnected_after`` (seconds, None by default), a holder
    whose database session ended (the process died, its connection was cut)
    may be reclaimed once its heartbeat is that old, long before
    ``stale_threshold``; a slow or frozen one keeps its session and its full
    threshold. The holder's side: its hold is *in doubt* (not held, not lost)
    from one heartbeat interval before that without a successful heartbeat,
    until a heartbeat confirms it or finds it lost.
    Needs a ``dsn``: refused with a pool.

    With ``hold_at_least`` (seconds, None by default), each acquire keeps the
    lock taken until at least that long after it was acquired, however soon it
    is released or its process dies (see `acquire`): a job fired on several
    hosts a few seconds apart runs once. At most ``stale_threshold``.

    Every database statement must finish within ``operation_timeout``
    seconds, even on a network that silently drops everything. By default it
    is 5 s, or less when the thresholds are short: enough room in the lease
    for a heartbeat and two retries.

    With ``fair=True``, waiters acquire the lock in the order they came,
    across processes: a release hands the lock to the oldest waiter still
    alive, in the same statement, and wakes that one alone. Its table needs the
    queue of waiters (``create_schema()`` makes it, ``LockTable.migrate()``
    adds it); a fair Mutex takes no ``hold_at_least``.

    Raises `TypeError` or `ValueError`, naming the argument, on bad input.
    """

    _watched_by = OwnLockWatch

    def __repr__(self) -> str:
        return (
            f"<Mutex lock_name={self.lock_name!r} instance_id={self.instance_id!r} "
            f"table={self.table!r} status={self._lock.phase.value}>"
        )

    def _new_sibling(self, lock_name: str) -> Mutex:
        """A Mutex for another lock name (see `Siblings`), on the same client, with the same settings."""
        # One identity for the Mutex, whichever of its names it holds; watch=True watches its own lock only.
        settings = self._settings.replace(watch=False)
        return Mutex._made(
            check_lock_name(lock_name, "lock_name"), self.client, settings, self._kind, instance_id=self.instance_id
        )


BUILT_ON_IT.mutex = Mutex
