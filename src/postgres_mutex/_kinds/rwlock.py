"""`RWLock`: any number of readers or one writer, across the fleet, with every guarantee of `Mutex`.

An RWLock is two holders of one name, siblings of `Mutex` on `Holder`: a
reader's and a writer's. Each hold is a row of the lock table of its own
(`_sql.rwlocks`), so the client's one heartbeat statement renews it, and its
lease, doubt, early reclaim, fencing and ``on_lost`` are a mutex's. The
acquire statements are what differ, and the exclusion is the table's: a row's
mode must match its lock's gate, which cannot change mode while rows of the
other mode exist.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from .._io.acquisition import Acquisition
from .._io.acquisition_async import AsyncAcquisition
from .._state.events import LostCallback
from .._state.failures import RW_LOST_RACE
from .._state.kind import LockKind
from .._state.outcome import PermitReply, read_acquire
from .._state.rows import SEPARATOR, rw_row_name
from .._state.settings import Settings, check_name, default_instance_id
from ..client import BUILT_ON_IT, MutexClient, client_for
from ..errors import InvalidArgument, LockNotHeldError
from ..watcher import OwnLockWatch
from .fair import waiter_live_seconds
from .holder import Holder
from .rwlock_methods import RWLockMethods
from .rwlock_methods_async import AsyncRWLockMethods

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider
    from psycopg_pool import AsyncConnectionPool, ConnectionPool

    from .._sql import Statement, Statements
    from .._state.settings import Timing
    from ..watcher import StaleWatcher

MAX_RWLOCK_NAME = 50
"""A reader's row adds a separator, ``r`` and a 12-character digest to the name, in 64 characters."""


class Mode(LockKind):
    """A read/write lock's kind: its ``mode``, ``"read"`` or ``"write"``, each holder a row of its own
    (`_sql.rwlocks`)."""

    noun: ClassVar[str] = "read/write lock"
    holder_type: ClassVar[str] = "RWLock"
    takes_minimum_hold: ClassVar[bool] = False
    single_hold = False
    direct: ClassVar[bool] = False
    alerts_left_to_watcher: ClassVar[bool] = True
    follows_lease: ClassVar[bool] = False  # its rows are taken over by statements that judge their own heartbeat

    mode: str

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def row_name(self, lock_name: str, instance_id: str) -> str:
        return rw_row_name(lock_name, instance_id, self.mode)

    def params(self, lock_name: str, row_name: str, timing: Timing) -> dict[str, object]:
        return {
            "rwlock": lock_name,
            "row_name": row_name,
            "waiting": False,
            "waiting_seconds": writer_claim_seconds(timing),
        }

    def acquiring(self, params: dict[str, object], *, blocking: bool) -> None:
        # Only a writer that will wait claims the lock ahead of new readers.
        params["waiting"] = blocking

    def migrated(self, statements: Statements) -> bool:
        return statements.acquire_read is not None

    def acquire_statement(self, statements: Statements, name: str) -> Statement:
        chosen = statements.acquire_read if self.mode == "read" else statements.acquire_write
        if chosen is None:
            raise self.missing(name, statements, "read/write locks' table and columns")
        return chosen

    def read(self, row: Sequence[object] | None, instance_id: str) -> PermitReply:
        return read_acquire(row, instance_id, None, wide=True)

    def again_at_once(self, reply: PermitReply) -> bool:
        # Another reader was opening the gate this one found closed: it is open now.
        return reply.stored_permits == 1

    def lost_race(self, sqlstate: str | None) -> bool:
        return sqlstate in RW_LOST_RACE

    def still_busy(self, name: str, holder: str | None, held: int | None, waited: float) -> str:
        by = holder or "another instance"
        return f"read/write lock {name!r} not granted for {self.mode} after {waited:g}s (held by {by})"

    def not_held(self, name: str, instance_id: str) -> str:
        return f"read/write lock {name!r} is not held for {self.mode} by instance {instance_id!r}"

    def already_held(self, name: str, instance_id: str) -> str:
        return (
            f"this RWLock already holds or is acquiring read/write lock {name!r} for {self.mode} "
            f"(instance_id {instance_id!r}); use a separate RWLock per concurrent holder"
        )


class FairWriter(Mode):
    """A fair read/write lock's writer: writers are served in the order they came (`_sql.fair`, `_sql.queue`).

    A writer queues while it does not win, and wins only if no live writer
    came before it; a writer's release hands its row to the oldest live
    writer in line (readers keep waiting: the row stays a writer's), and
    notifies it alone, which holds it with no statement of its own, as a
    fair Mutex's waiter does. Readers do not queue: a writer in line holds
    new readers back (the gate's stamp), as every waiting writer does.
    """

    queues: ClassVar[bool] = True

    def __init__(self) -> None:
        super().__init__("write")

    def params(self, lock_name: str, row_name: str, timing: Timing) -> dict[str, object]:
        return {**super().params(lock_name, row_name, timing), "waiter_live_seconds": waiter_live_seconds(timing)}

    def migrated(self, statements: Statements) -> bool:
        return statements.acquire_write_fair is not None

    def acquire_statement(self, statements: Statements, name: str) -> Statement:
        if statements.acquire_write_fair is None:
            raise self.missing(name, statements, "read/write locks' table and the queue of waiters that fair=True uses")
        return statements.acquire_write_fair

    def release_statement(self, statements: Statements) -> Statement:
        # A hold acquired before the table lost its queue (it never does, short of a DROP): released as a writer's.
        return statements.release_write_fair or statements.release

    def stray_cleanup(self, statements: Statements) -> Statement | None:
        return statements.leave_write_fair


def writer_claim_seconds(timing: Timing) -> float:
    """How long a waiting writer's claim keeps new readers out without being renewed.

    A blocking writer renews it at every attempt, at least every ``poll_interval``; an attempt may take
    up to ``operation_timeout``. Twice the one plus the other leaves room for one late attempt.
    """
    return 2 * timing.poll_interval + timing.operation_timeout


class _Modes:
    """What an RWLock's two holders share: the mode last asked for, and the rule that one is held at a time.

    It refers to the holders weakly: no cycle keeps an RWLock nobody refers to
    from being let go of at once (and its client's connection with it).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.last: str | None = None
        """The mode last asked for."""
        self._holders: dict[str, weakref.ref[ModeHolder]] = {}

    def add(self, holder: ModeHolder) -> None:
        self._holders[holder.mode] = weakref.ref(holder)

    def entering(self, mode: str) -> None:
        """Before ``mode`` is acquired (by a ``with`` block or a decorator): refused while the other is held."""
        found = self._holders.get("write" if mode == "read" else "read")
        other = None if found is None else found()
        if other is not None and other.held:
            # Its own rows would exclude each other: waiting could never end.
            raise InvalidArgument(
                "this RWLock holds {value!r} for {mode} already: leave that block first (or use another RWLock)",
                value=self.name,
                mode=other.mode,
            )
        self.last = mode


class ModeHolder(Holder):
    """One mode of an `RWLock`: what its ``read`` or ``write`` blocks hold."""

    _watched_by = OwnLockWatch

    def __init__(
        self, kind: Mode, name: str, client: MutexClient, settings: Settings, *, instance_id: str, modes: _Modes
    ) -> None:
        self._modes = modes
        self._setup(name, client, settings, kind, instance_id=instance_id)
        modes.add(self)

    @property
    def mode(self) -> str:
        """``"read"`` or ``"write"``."""
        assert self._kind.mode is not None  # set by __init__
        return self._kind.mode

    def __repr__(self) -> str:
        return f"<RWLock {self._kind.mode} name={self.lock_name!r} instance_id={self.instance_id!r}>"

    def acquire(
        self, blocking: bool | None = None, timeout: float | None = None, *, hold_at_least: float | None = None
    ) -> Acquisition:
        """`Holder.acquire`, once its `RWLock` has said this mode may be asked for (see `RWLock.read`).

        ``hold_at_least`` is a Mutex's: given here, it raises `ValueError`.
        """
        self._modes.entering(self.mode)
        return super().acquire(blocking=blocking, timeout=timeout, hold_at_least=hold_at_least)

    def acquire_async(
        self, blocking: bool = True, timeout: float | None = None, *, hold_at_least: float | None = None
    ) -> AsyncAcquisition:
        """`Holder.acquire_async`, once its `RWLock` has said this mode may be asked for."""
        self._modes.entering(self.mode)
        return super().acquire_async(blocking=blocking, timeout=timeout, hold_at_least=hold_at_least)

    def _new_sibling(self, lock_name: str) -> ModeHolder:
        raise InvalidArgument("an RWLock's holders take no other name: make an RWLock for {value!r}", value=lock_name)


class RWLock(AsyncRWLockMethods, RWLockMethods):
    """A distributed read/write lock: any number of readers of ``name``, or one writer, never both.

    ``RWLock(dsn, "catalogue")`` takes every option of `Mutex`.
    ``with rw.read(blocking=True) as got:`` holds it for reading for the block,
    ``with rw.write(...)`` for writing; both yield whether it was acquired,
    with `Mutex.acquire`'s defaults, timeouts and errors (``read_async`` and
    ``write_async`` wait by default, like `Mutex.acquire_async`). One RWLock
    holds one mode at a time: use one per concurrent holder.

    The database enforces the exclusion, whatever a client sends. Writers are
    preferred: once a writer waits (blocking), new readers wait behind it, so
    a stream of overlapping readers cannot starve it; a writer that stops
    waiting, or dies while waiting, holds readers back for at most
    ``2 * poll_interval + operation_timeout`` more. Each holder heartbeats as a
    Mutex's does: a crashed reader or writer is reclaimed at ``stale_threshold``
    (earlier with ``reclaim_disconnected_after``), and its holder learns it
    lost the lock before anyone may take it. `token`, `fence` and `fenced`
    work for the mode held: a writer's fence refuses once another writer (or
    a reader) has come since.

    ``watch=True`` watches every holder of the read/write lock (a `StaleWatcher`,
    as `Mutex` has for its lock): each reader and the writer is alerted on once
    per episode, and reported to ``metrics``, under the lock's name and its mode.

    With ``fair=True``, writers are served in the order they came, across
    processes: a writer's release hands the lock to the oldest writer still
    alive that waits, in the same statement, and wakes that one alone.
    Readers do not queue: a reader that comes while a writer waits waits
    behind it (and behind the writers that come while it waits), so under a
    steady stream of writers readers wait until the line empties. The table
    needs the queue of waiters (``create_schema()`` makes it,
    ``LockTable.migrate()`` adds it).

    The table must have been created (or migrated) by this version: `SchemaError`
    says to run ``postgres-mutex migrate`` otherwise. The name is at most 50
    characters long.
    """

    def __init__(
        self,
        dsn: str | None = None,
        name: str | None = None,
        *,
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
            raise TypeError("RWLock() needs a name: RWLock(dsn, 'catalogue')")
        if not isinstance(fair, bool):
            raise InvalidArgument("{fair} must be True or False, not {value!r}", value=fair)
        name = check_name(name, "name")
        if len(name) > MAX_RWLOCK_NAME or SEPARATOR in name:
            raise InvalidArgument(
                "{name} must be at most {n} characters long, without the unit separator (its rows add to it in a "
                "64-character column), got {length}",
                n=MAX_RWLOCK_NAME,
                length=len(name),
            )
        settings = Settings.from_arguments(locals())
        connected = client_for(dsn, pool, async_pool, client)
        # One identity for both modes; chosen by the user or not, as the settings say.
        identity = settings.instance_id or default_instance_id()
        self._modes = _Modes(name)
        self._reader = ModeHolder(Mode("read"), name, connected, settings, instance_id=identity, modes=self._modes)
        # The reader's watcher sees the holders of either mode: the writer shares it rather than run its own.
        unwatched = settings.replace(watch=False)
        writer = FairWriter() if fair else Mode("write")
        self._writer = ModeHolder(writer, name, connected, unwatched, instance_id=identity, modes=self._modes)
        self._writer.watch_with(self._reader)

    # -- introspection -------------------------------------------------------------

    @property
    def name(self) -> str:
        """The read/write lock's name (metrics, spans and errors use it)."""
        return self._reader.lock_name

    @property
    def instance_id(self) -> str:
        """This RWLock's id, in the table's ``instance_id`` column of its rows of either mode (in a forked
        child, each mode's holder chooses its own, unless the id was given)."""
        return self._reader.instance_id

    @property
    def table(self) -> str:
        return self._reader.table

    @property
    def client(self) -> MutexClient:
        return self._reader.client

    @property
    def watcher(self) -> StaleWatcher | None:
        """The watcher of this read/write lock's holders (``watch=True``), else None."""
        return self._reader.watcher

    @property
    def mode(self) -> str | None:
        """``"read"`` or ``"write"`` while held in that mode, None otherwise."""
        held = self._held()
        return None if held is None else held.mode

    @property
    def held(self) -> bool:
        """True while held in either mode and its lease has not run out (see `Mutex.held`)."""
        return self._held() is not None

    @property
    def token(self) -> int | None:
        """The fencing token of the current hold, of either mode (None when not held)."""
        held = self._held()
        return None if held is None else held.token

    @property
    def lease_remaining(self) -> float | None:
        """Seconds the current hold stays held without another heartbeat (None when not held)."""
        held = self._held()
        return None if held is None else held.lease_remaining

    @property
    def last_holder(self) -> str | None:
        """Who held the lock at the last attempt (in the mode last asked for) that found it taken (None if
        unknown), for messages: the writer, or one of the readers."""
        last = self._last or self._reader
        return last.last_holder

    @property
    def _last(self) -> ModeHolder | None:
        """The mode last asked for: whose fence says why it is not held, when neither is."""
        last = self._modes.last
        return None if last is None else self._writer if last == "write" else self._reader

    def __repr__(self) -> str:
        return f"<RWLock name={self.name!r} instance_id={self.instance_id!r} table={self.table!r} mode={self.mode}>"

    def _held(self) -> ModeHolder | None:
        for holder in (self._writer, self._reader):
            if holder.held:
                return holder
        return None

    def _holding(self) -> ModeHolder:
        held = self._held()
        if held is not None:
            return held
        if self._last is not None:
            return self._last  # its own error says why it is not held (lost, released, never acquired)
        raise LockNotHeldError(
            f"read/write lock {self.name!r} is not held by instance {self.instance_id!r}",
            lock_name=self.name,
            instance_id=self.instance_id,
            reason="this RWLock holds neither mode",
        )


BUILT_ON_IT.rwlock = RWLock
