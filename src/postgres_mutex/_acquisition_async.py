"""What ``acquire_async()`` returns, and the fence a hold puts in the caller's own transaction.

`AsyncAcquisition` is the ``async with`` block: acquire on entering, release
on leaving, whichever way the block ends. `fence_async` checks, in one round
trip on the caller's connection, that a hold is still the lock's current one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import pq
from psycopg.rows import tuple_row

from . import _flows as flows
from . import _steps as steps
from ._acompat import ato_the_end, current_owner
from ._connections import FAILURES
from ._state import LEASE_EXPIRED, RELEASED_ELSEWHERE, Hold, LockState, Phase
from ._watchdog import Cutter
from .errors import LockNotHeldError, MutexError, OperationTimeout, SchemaError, phrase

if TYPE_CHECKING:
    from ._engine_async import AsyncEngine

logger = logging.getLogger("postgres_mutex")


class AsyncAcquisition:
    """Acquire on entering the block, release on leaving it; enter it once.

    Entering yields whether the lock was acquired (a blocking acquire that
    runs out of time raises `LockAcquisitionTimeout` instead, so the body
    never runs unlocked). Leaving releases the lock, whichever way the block
    ends; if the lock was lost meanwhile (or released elsewhere in the process
    while the block ran), a normal exit raises `LockNotHeldError`. An
    acquisition that is entered and never left keeps the lock until
    ``release()``.

    Made by `Mutex.acquire_async`, not by hand: its ``engine`` gives the
    engine each step runs on (refusing, with the error the user sees, for a
    closed client or a forked child).
    """

    def __init__(
        self,
        engine: Callable[[], AsyncEngine],
        lock: LockState,
        *,
        blocking: bool,
        timeout: float | None,
        stop: steps.StopSignal | None = None,
        hold_at_least: float | None = None,
    ) -> None:
        self._engine = engine
        self._lock = lock
        self._blocking = blocking
        self._timeout = timeout
        self._stop = stop
        self._hold_at_least = hold_at_least
        self._entered = False
        self._hold: Hold | None = None
        self._acquirer = object()
        """Names this acquire to the lock's state, which ends it for nobody else."""

    async def __aenter__(self) -> bool:
        if self._entered:
            raise MutexError("this acquisition was entered already: call acquire() again for another one")
        self._entered = True
        engine = self._engine()
        lock = self._lock
        flow = flows.acquire(
            lock,
            lock.tracing,
            blocking=self._blocking,
            timeout=self._timeout,
            owner=current_owner(),
            acquirer=self._acquirer,
            stop=self._stop,
            hold_at_least=self._hold_at_least,
        )
        try:
            self._hold = await engine.run(flow)
            return self._hold is not None
        except BaseException:
            # Raised before the block got the hold, wherever it landed (a signal handler's
            # exception after the flow returned, say): the block will never release it.
            self._hold = None
            await engine.run(flows.abandon(lock, self._acquirer))
            raise

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        hold = self._hold
        if hold is None:
            return
        lock = self._lock
        if lock.hold is hold and lock.phase is Phase.HOLDING:
            engine = self._engine()
            # Run to its end even if the caller is cancelled again meanwhile: no row left behind.
            if exc_type is None:
                await ato_the_end(engine.run(flows.release(lock, lock.tracing, caller=current_owner())))
                return
            try:
                await ato_the_end(engine.run(flows.release(lock, lock.tracing, caller=current_owner())))
            except MutexError as error:
                # The block's own exception is what the caller must see.
                logger.warning("while leaving the block after an error: %s", error)
            return
        if exc_type is None and hold.reason in (RELEASED_ELSEWHERE, LEASE_EXPIRED):
            raise hold.error()


async def fence_async(lock: LockState, conn: psycopg.AsyncConnection[Any]) -> int:
    """Check, in the caller's open transaction on ``conn``, that this hold is still the lock's current one.

    One round trip on the caller's connection; nothing of the library's is
    opened. On success the row is share-locked until that transaction ends,
    so no other instance can take the lock over meanwhile; returns the token.
    Within one ``operation_timeout``, else `OperationTimeout` (the caller's
    connection is then closed, and its transaction rolled back).
    """
    hold = lock.require_held()
    if hold.token is None:
        raise SchemaError(
            phrase(
                "lock {lock!r} was acquired without a fencing token: the lock table {table} has no token column. "
                "Run {LockTable.migrate()}; the lock's next acquire gets a token",
                lock=lock.lock_name,
                table=lock.names.table_name,
            )
        )
    if conn.info.transaction_status == pq.TransactionStatus.IDLE and conn.autocommit:
        raise ValueError(
            "fence() needs an open transaction on conn: call it inside 'with conn.transaction():' "
            "(or with autocommit off), before the writes it protects"
        )
    params = {
        "lock_name": hold.row_name,
        "instance_id": lock.instance_id,
        "acquired_at": hold.acquired_at,
        "token": hold.token,
    }
    # Bounded like every statement, though on the caller's connection: past the
    # deadline its socket is shut down, so the server ends the session and
    # rolls the transaction back; nothing it wrote can commit after that.
    timeout = lock.timing.operation_timeout
    cutter = Cutter(conn.fileno())
    ticket = cutter.arm(timeout)
    try:
        # The caller's connection may read rows as dicts (row_factory=dict_row): this row is read by position.
        cursor = conn.cursor(row_factory=tuple_row)
        await cursor.execute(lock.names.fence, params, prepare=False)
        row = await cursor.fetchone()
    except FAILURES as exc:
        if not cutter.fired:
            raise
        raise OperationTimeout(
            f"fencing {lock.kind} {lock.lock_name!r} did not finish within operation_timeout ({timeout:g}s): "
            "the connection was closed, and the server rolls its transaction back; "
            "nothing the transaction wrote is committed",
            transient=True,
            outcome_unknown=True,
        ) from exc
    finally:
        cutter.disarm(ticket)
        cutter.close()
    if row is None or row[0] is None:
        holder = None if row is None else row[1]
        now_held = f"it is now held by {holder}" if holder else "it is not held by anyone now"
        raise LockNotHeldError(
            f"{lock.kind} {lock.lock_name!r} changed hands: the hold with token {hold.token} is no longer current "
            f"({now_held}); roll back the writes of this transaction",
            lock_name=lock.lock_name,
            instance_id=lock.instance_id,
            reason=FENCE_REJECTED,
        )
    return int(row[0])


FENCE_REJECTED = "fenced out: the lock changed hands (reclaimed, force-released, or its row was lost)"
