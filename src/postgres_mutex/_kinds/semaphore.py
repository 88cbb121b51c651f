"""`Semaphore`: at most N holders at once, across the fleet, with every guarantee of `Mutex`.

A Semaphore is a sibling of `Mutex` (both are `Holder`s) whose lock has N permits: each hold is one permit, a
row of the lock table of its own (`_sql.semaphores`), so the client's one
heartbeat statement renews it with the mutexes' holds, and its lease, doubt,
early reclaim, fencing, history and ``on_lost`` are the mutex's, unchanged.
The acquire, the waiting (woken by any release of a permit of the same
semaphore) and the messages are what differ; the rest is the code every holder shares.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from .._state.events import LostCallback
from .._state.failures import FOREIGN_KEY_VIOLATION
from .._state.kind import LockKind
from .._state.outcome import PermitReply, read_acquire
from .._state.rows import SEPARATOR
from .._state.settings import Settings, check_permit_count
from ..client import BUILT_ON_IT, MutexClient, client_for
from ..errors import InvalidArgument, PermitsMismatchError
from ..watcher import OwnLockWatch
from .fair import waiter_live_seconds
from .holder import Holder

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider
    from psycopg_pool import AsyncConnectionPool, ConnectionPool

    from .._sql import Statement, Statements
    from .._state.settings import Timing


class Permits(LockKind):
    """A semaphore's kind: one of its ``count`` permits, each a row of its own (`_sql.semaphores`)."""

    noun: ClassVar[str] = "semaphore"
    holder_type: ClassVar[str] = "Semaphore"
    takes_minimum_hold: ClassVar[bool] = False
    direct: ClassVar[bool] = False
    alerts_left_to_watcher: ClassVar[bool] = True
    follows_lease: ClassVar[bool] = False  # its rows are taken over by statements that judge their own heartbeat

    def __init__(self, count: int) -> None:
        self.count = count
        # One permit is one hold: a change of the count wakes every waiter (`WAKE_ALL`), and a Semaphore that
        # says another count than the table's is refused.
        self.single_hold = count == 1

    def params(self, lock_name: str, row_name: str, timing: Timing) -> dict[str, object]:
        return {"semaphore": lock_name, "permits": self.count}

    def migrated(self, statements: Statements) -> bool:
        return statements.acquire_permit is not None

    def acquire_statement(self, statements: Statements, name: str) -> Statement:
        if statements.acquire_permit is None:
            raise self.missing(name, statements, "semaphores' table and columns")
        return statements.acquire_permit

    def stray_cleanup(self, statements: Statements) -> Statement | None:
        return statements.cleanup_permit

    def read(self, row: Sequence[object] | None, instance_id: str) -> PermitReply:
        return read_acquire(row, instance_id, self.count)

    def refusal(self, reply: PermitReply, table: str, name: str) -> PermitsMismatchError | None:
        stored = reply.stored_permits
        if stored is None or stored == self.count:
            return None
        return PermitsMismatchError(
            f"semaphore {name!r} has {stored} permits in table {table}, but this Semaphore says "
            f"permits={self.count}: use permits={stored}, or change it for everyone with "
            f"LockTable.set_permits({name!r}, {self.count})",
            semaphore=name,
            permits=self.count,
            stored_permits=stored,
        )

    def again_at_once(self, reply: PermitReply) -> bool:
        return reply.retry_at_once(self.count)

    def changed_meanwhile(self, sqlstate: str | None) -> bool:
        # A permit row named its semaphore with an N an administrator changed meanwhile.
        return sqlstate == FOREIGN_KEY_VIOLATION

    def permit_of(self, row: str | None) -> int | None:
        number = "" if row is None else row.rpartition(SEPARATOR)[2]
        return int(number) if number.isdigit() else None

    def still_busy(self, name: str, holder: str | None, held: int | None, waited: float) -> str:
        held_now = self.count if held is None else held
        return f"semaphore {name!r} has no permit free: {held_now} of {self.count} held after {waited:g}s"

    def not_held(self, name: str, instance_id: str) -> str:
        return f"semaphore {name!r}: no permit is held by instance {instance_id!r}"

    def one_hold(self, name: str) -> str:
        return f"a permit of semaphore {name!r}"


class FairPermits(Permits):
    """A fair Semaphore's kind: a permit released goes to the oldest live waiter (`_sql.fair`, `_sql.queue`).

    Its release hands the permit's row to that waiter, which takes it with
    an attempt of its own (the notification does not say which permit), so a
    hand-off costs the receiver one statement; a waiter that gives up leaves
    the line and hands on a permit handed to it meanwhile, as a fair Mutex's.
    """

    queues: ClassVar[bool] = True
    handed_whole: ClassVar[bool] = False

    def params(self, lock_name: str, row_name: str, timing: Timing) -> dict[str, object]:
        return {**super().params(lock_name, row_name, timing), "waiter_live_seconds": waiter_live_seconds(timing)}

    def migrated(self, statements: Statements) -> bool:
        return statements.acquire_permit_fair is not None

    def acquire_statement(self, statements: Statements, name: str) -> Statement:
        if statements.acquire_permit_fair is None:
            raise self.missing(name, statements, "semaphores' table and the queue of waiters that fair=True uses")
        return statements.acquire_permit_fair

    def release_statement(self, statements: Statements) -> Statement:
        # A hold acquired before the table lost its queue (it never does, short of a DROP): released as a permit's.
        return statements.release_permit_fair or statements.release

    def stray_cleanup(self, statements: Statements) -> Statement | None:
        return statements.leave_permit_fair

    def again_at_once(self, reply: PermitReply) -> bool:
        # Free permits left to waiters ahead are the rule here, not a lost race: wait to be woken.
        return not reply.result.outcome.acquired and reply.stored_permits is None


class Semaphore(Holder):
    """A distributed semaphore: at most ``permits`` holders of ``name`` at once, enforced by the database.

    ``Semaphore(dsn, "partner-api", permits=3)`` takes every option of
    `Mutex`, and is used like one: ``with sem.acquire(blocking=True) as got:``
    holds one permit for the block; `held`, `token`, `fence`, `fenced`,
    ``on_lost``, `lease_remaining`, `release`, `heartbeat` and the decorators
    mean what they mean for a Mutex, for that permit. Each Semaphore object
    holds at most one permit at a time: use one per concurrent holder (in
    threads, or tasks), each with its own ``instance_id`` (the default one is).

    ``watch=True`` watches every holder of the semaphore (a `StaleWatcher`,
    as `Mutex` has for its lock): each permit's holder is alerted on once per
    episode, and reported to ``metrics``, under the semaphore's name and its
    permit.

    The first Semaphore to use a name declares its number of permits in the
    table; one that says another number is refused (`PermitsMismatchError`,
    naming both) when it acquires. `LockTable.set_permits` changes it
    deliberately. The table must have been created (or migrated) by this
    version: `SchemaError` says to run ``postgres-mutex migrate`` otherwise.
    A semaphore's name leaves room for its permits' numbers in the table's
    64 characters: at most 62 characters with 10 permits, say.

    With ``fair=True``, a permit released goes to the oldest waiter still
    alive, across processes: waiters acquire in the order they came, and a
    free permit goes to the oldest ones first. The table needs the queue of
    waiters (``create_schema()`` makes it, ``LockTable.migrate()`` adds it).
    Use one kind, fair or not, per semaphore name.
    """

    _watched_by = OwnLockWatch

    def __init__(
        self,
        dsn: str | None = None,
        name: str | None = None,
        *,
        permits: int,
        pool: ConnectionPool[Any] | None = None,
        async_pool: AsyncConnectionPool[Any] | None = None,
        instance_id: str | None = None,
        table: str = "mutex_lock",
        heartbeat_interval: float = 10.0,
        alert_threshold: float = 30.0,
        stale_threshold: float = 600.0,
        poll_interval: float = 0.5,
        metrics: object | None = None,
        on_lost: LostCallback | None = None,
        operation_timeout: float | None = None,
        watch: bool = False,
        tracer_provider: TracerProvider | None = None,
        client: MutexClient | None = None,
        reclaim_disconnected_after: float | None = None,
        fair: bool = False,
    ) -> None:
        if name is None:
            raise TypeError("Semaphore() needs a name: Semaphore(dsn, 'partner-api', permits=3)")
        count = check_permit_count(name, permits)
        if not isinstance(fair, bool):
            raise InvalidArgument("{fair} must be True or False, not {value!r}", value=fair)
        kind = FairPermits(count) if fair else Permits(count)
        self._setup(name, client_for(dsn, pool, async_pool, client), Settings.from_arguments(locals()), kind)

    @property
    def name(self) -> str:
        """The semaphore's name (also `lock_name`: metrics, spans and errors use it)."""
        return self.lock_name

    @property
    def permits(self) -> int:
        """How many holders the semaphore allows at once, as this Semaphore declares it."""
        assert isinstance(self._kind, Permits)  # set by __init__
        return self._kind.count

    @property
    def permit(self) -> int | None:
        """The number of the permit held (0 to ``permits - 1``), None when none is held."""
        hold = self._lock.hold
        if hold is None or not self._lock.held:
            return None
        return self._kind.permit_of(hold.row_name)

    def __repr__(self) -> str:
        return (
            f"<Semaphore name={self.lock_name!r} permits={self.permits} instance_id={self.instance_id!r} "
            f"table={self.table!r} status={self._lock.phase.value}>"
        )

    def _new_sibling(self, lock_name: str) -> Semaphore:
        """A Semaphore of another name (see `Siblings`), on the same client, with the same permits and settings."""
        permits = check_permit_count(lock_name, self.permits)
        settings = self._settings.replace(watch=False)  # watch=True watches its own semaphore only
        assert isinstance(self._kind, Permits)  # set by __init__
        kind = type(self._kind)(permits)  # fair or not, as this one
        return Semaphore._made(lock_name, self.client, settings, kind, instance_id=self.instance_id)


BUILT_ON_IT.semaphore = Semaphore
