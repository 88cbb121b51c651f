"""`Holder`: what Mutex, Semaphore and a read/write lock's holders share, as siblings.

Each of them is one hold at a time of something in the lock table, renewed by
the client's heartbeat, with the same lease, doubt, early reclaim, fencing,
decorators and closing. They differ in what they hold (a lock, a permit, a
mode of a read/write lock: the `LockState` made for them), how they are
named and described, and what a sibling of another name is. A Semaphore is
therefore no Mutex (``isinstance`` says so): neither can stand in for the other.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, ClassVar, ParamSpec, Self, TypeVar, overload

from .._io.acquisition import Acquisition
from .._io.acquisition_async import AsyncAcquisition
from .._observe.hooks import guard
from .._state.events import LockEvents, LostCallback
from .._state.kind import MUTEX, LockKind
from .._state.locks import LockState
from .._state.settings import (
    MutexConfig,
    Settings,
    check_hold_at_least,
    check_mutex_name,
    check_wait,
    default_instance_id,
)
from ..client import MutexClient, client_for, core_of
from ..errors import InvalidArgument
from .fair import FAIR_MUTEX
from .holder_methods import HolderMethods
from .holder_methods_async import AsyncHolderMethods
from .siblings import Siblings
from .singleton import singleton_decorator
from .singleton_async import singleton_decorator_async

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider
    from psycopg_pool import AsyncConnectionPool, ConnectionPool

    from .._state.steps import StopSignal
    from ..client import ClientCore
    from ..watcher import OwnLockWatch, StaleWatcher


P = ParamSpec("P")
R = TypeVar("R")


class Holder(AsyncHolderMethods, HolderMethods):
    """One hold at a time of something in the lock table, with every guarantee of a `Mutex`.

    Not used on its own: `Mutex`, `Semaphore` and `RWLock`'s holders are made
    of it, and each says what it holds (its `LockState`), how it is described
    and what a sibling of another name is. The docstrings below speak of the
    Mutex; for the others, "the lock" is what they hold (a permit, a mode).
    """

    _settings: Settings
    """Its options, checked, as its constructor was given them: its siblings are made of them too."""
    _kind: LockKind
    """What it holds (a mutex, a `Semaphore`'s permit, a read/write lock's mode), and all that differs with it."""
    _watched_by: ClassVar[type[OwnLockWatch]]
    """What ``watch=True`` runs on the holders of its lock, named by each kind (Mutex, Semaphore, an
    RWLock's modes): the holder they share uses a watch, it does not make one of its own accord."""

    def __init__(
        self,
        dsn: str | None = None,
        lock_name: str | None = None,
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
        hold_at_least: float | None = None,
        fair: bool = False,
    ) -> None:
        name = check_mutex_name(lock_name)
        settings = Settings.from_arguments(locals())
        if not isinstance(fair, bool):
            raise InvalidArgument("{fair} must be True or False, not {value!r}", value=fair)
        self._setup(name, client_for(dsn, pool, async_pool, client), settings, FAIR_MUTEX if fair else MUTEX)

    @classmethod
    def _made(
        cls,
        lock_name: str,
        client: MutexClient,
        settings: Settings,
        kind: LockKind = MUTEX,
        *,
        instance_id: str | None = None,
    ) -> Self:
        """One made inside the library, of a name and settings already checked (a sibling, an election's)."""
        holder = cls.__new__(cls)
        holder._setup(lock_name, client, settings, kind, instance_id=instance_id)
        return holder

    def _setup(
        self,
        lock_name: str,
        client: MutexClient,
        settings: Settings,
        kind: LockKind = MUTEX,
        *,
        instance_id: str | None = None,
    ) -> None:
        """Make this holder of ``lock_name`` (a ``kind`` of lock) on ``client``, with ``settings``.

        ``instance_id`` is the identity it shares with the holder that made it
        (a sibling of another name, the other mode of an RWLock) when the user
        chose none: one default id for both, but neither counted as chosen.
        """
        check_reclaim_source(settings, client)
        if settings.hold_at_least is not None and not kind.takes_minimum_hold:
            raise _not_a_mutexs_hold()
        self._client = client
        self._settings = settings
        self._kind = kind
        core = self._core = core_of(client)
        chosen_id = settings.instance_id is not None
        self._lock = new_lock_state(
            core,
            lock_name,
            settings.instance_id or instance_id or default_instance_id(),
            settings,
            kind,
        )
        self._engine_for = functools.partial(core.engine_for, self._lock)
        self._engine_async_for = functools.partial(core.engine_async_for, self._lock)
        core.register(self._lock, explicit_id=chosen_id)
        # Attached until close(), or until nothing refers to this Mutex nor to an acquisition of it (each
        # refers to these two): a Mutex made for one block and never closed lets its shared client idle.
        self._attachments = (core.attach_while(self._engine_for), core.attach_while(self._engine_async_for))
        # What it makes refers back to it weakly: no cycle keeps a Mutex nobody uses alive until a collection.
        self._siblings = Siblings(self, self._new_sibling)
        self._watch: OwnLockWatch | None = None
        if settings.watch:
            self._watch = self._watched_by(client, self._lock, settings)
            self._watch.start_at_creation(core.has_sync)

    # -- introspection -------------------------------------------------------------

    @property
    def lock_name(self) -> str:
        """The name of what is held, as the table, metrics, spans and errors show it."""
        return self._lock.lock_name

    @property
    def instance_id(self) -> str:
        """This Mutex's id, as written in the table's ``instance_id`` column."""
        return self._lock.instance_id

    @property
    def table(self) -> str:
        return self._lock.names.table_name

    @property
    def dsn(self) -> str | None:
        """The connection string this Mutex's client uses (None in pool mode). Never printed by the library."""
        return self._client.dsn

    @property
    def pool(self) -> ConnectionPool[Any] | None:
        return self._client.pool

    @property
    def async_pool(self) -> AsyncConnectionPool[Any] | None:
        return self._client.async_pool

    @property
    def client(self) -> MutexClient:
        """The client whose connections and heartbeats this Mutex uses."""
        return self._client

    @property
    def metrics(self) -> object | None:
        """The metrics hook given to this Mutex (None if none)."""
        return self._settings.metrics

    @property
    def config(self) -> MutexConfig:
        """This Mutex's settings, validated (defaults filled in)."""
        return MutexConfig(
            self.lock_name,
            self.instance_id,
            self.table,
            **dataclasses.asdict(self._lock.timing),
            hold_at_least=self._settings.hold_at_least,
        )

    @property
    def held(self) -> bool:
        """True while this Mutex holds the lock and its lease has not run out (nor, with
        ``reclaim_disconnected_after``, is its hold in doubt).

        Reading it never touches the database; it turns false the moment the
        lease runs out, even if the heartbeat has not noticed yet.
        """
        return self._lock.held

    @property
    def lease_remaining(self) -> float | None:
        """Seconds this hold stays held without another successful heartbeat (None when not held).

        Renewed by every heartbeat; a long job can checkpoint when it runs low
        (the ``lease_running_out`` metrics call comes at two thirds of it).
        """
        return self._lock.lease_remaining()

    @property
    def token(self) -> int | None:
        """The fencing token of the current hold: an `int` while held, None otherwise.

        Strictly greater than every token the table issued before this
        acquisition began. None also while held on a table without a token
        column (see `LockTable.migrate`).
        """
        hold = self._lock.hold
        return hold.token if hold is not None and self._lock.held else None

    @property
    def last_holder(self) -> str | None:
        """Who held the lock at this Mutex's last attempt that found it taken (None if unknown), for messages."""
        return self._lock.last_holder

    def ensure_held(self) -> None:
        """Raise `LockNotHeldError` unless the lock is still held.

        Call it between steps of long work to stop promptly after a loss.
        """
        self._lock.require_held()

    @property
    def watcher(self) -> StaleWatcher | None:
        """The watcher of this Mutex's own lock (``watch=True``), else None."""
        return None if self._watch is None else self._watch.watcher

    # -- acquire and release ----------------------------------------------------------

    def _checked_hold(self, hold_at_least: object) -> float | None:
        """An acquire's ``hold_at_least``, checked; None: the holder's own. A minimum hold is a Mutex's alone."""
        if hold_at_least is None:
            return self._settings.hold_at_least
        if not self._kind.takes_minimum_hold:
            raise _not_a_mutexs_hold()
        return check_hold_at_least(hold_at_least, self._lock.timing)

    def acquire(
        self, blocking: bool | None = None, timeout: float | None = None, *, hold_at_least: float | None = None
    ) -> Acquisition:
        """Hold the lock for the ``with`` block; yields whether it was acquired.

        With neither argument it tries once and yields False if another
        instance holds the lock. With ``blocking=True`` or a ``timeout`` it
        waits, woken at once by the holder's release, polling every
        ``poll_interval`` otherwise, and raises `LockAcquisitionTimeout` after
        ``timeout`` seconds (None: no limit), so the block never runs
        unlocked. ``blocking=False`` with a ``timeout`` raises `ValueError`,
        as ``threading.Lock.acquire`` does.

        Leaving the block releases the lock, whether it ends normally, by an
        exception or by KeyboardInterrupt. If the lock was lost meanwhile, a
        normal exit raises `LockNotHeldError`. Raises `LockAlreadyHeldError`
        if this Mutex already holds the lock, `DatabaseError` if PostgreSQL
        cannot be used.

        With ``hold_at_least`` (seconds; by default the Mutex's own
        ``hold_at_least``), the lock stays taken until at least that long
        after it was acquired, however soon the block ends or the process
        exits or dies: what makes a job scheduled on several hosts, which
        fire a few seconds apart, run once (ShedLock's ``lockAtLeastFor``).
        Released sooner, the row stays in the table, marked released, until
        then: no instance takes it before, this Mutex included, none alerts
        on it, and a blocking acquire waits for its end without polling. At
        most ``stale_threshold`` (`ValueError` otherwise); the table needs
        the column ``postgres-mutex migrate`` adds (`SchemaError` otherwise).
        Mutex only: a Semaphore's acquire raises `ValueError` for it.
        """
        if timeout is None and (blocking is None or blocking is True or blocking is False):
            blocking = blocking is True  # `check_wait`'s common case, inline: no timeout to check
        else:
            blocking, timeout = check_wait(blocking, timeout)
        # `_checked_hold` and `_start_watch`, their common case inline: a call each fewer per acquire.
        hold = self._settings.hold_at_least if hold_at_least is None else self._checked_hold(hold_at_least)
        if self._watch is not None:
            self._watch.start_sync()
        return Acquisition(self._engine_for, self._lock, blocking=blocking, timeout=timeout, hold_at_least=hold)

    def acquire_async(
        self, blocking: bool = True, timeout: float | None = None, *, hold_at_least: float | None = None
    ) -> AsyncAcquisition:
        """Async `acquire`; blocking by default. Cancelling the task releases the lock."""
        blocking, timeout = check_wait(blocking, timeout)
        hold = self._settings.hold_at_least if hold_at_least is None else self._checked_hold(hold_at_least)
        if self._watch is not None:
            self._watch.start_async()
        return AsyncAcquisition(
            self._engine_async_for, self._lock, blocking=blocking, timeout=timeout, hold_at_least=hold
        )

    # -- decorators ----------------------------------------------------------------

    @overload
    def singleton(self, lock_name: Callable[P, R]) -> Callable[P, R | None]: ...

    @overload
    def singleton(
        self, lock_name: str | None = None, *, blocking: bool | None = None, timeout: float | None = None
    ) -> Callable[[Callable[P, R]], Callable[P, R | None]]: ...

    def singleton(
        self,
        lock_name: str | Callable[P, R] | None = None,
        *,
        blocking: bool | None = None,
        timeout: float | None = None,
    ) -> Any:
        """Decorate a function to run only while holding the lock.

        ``lock_name`` defaults to this Mutex's; another name gets a Mutex on
        the same client with the same settings. When the lock is held
        elsewhere (or by another call in this process) the function does not
        run and the call returns None. ``blocking`` and ``timeout`` are
        `acquire`'s: given a ``timeout``, a call waits up to it and raises
        `LockAcquisitionTimeout` instead. Also usable bare: ``@mutex.singleton``.
        """
        return singleton_decorator(self._siblings, lock_name, blocking=blocking, timeout=timeout)

    @overload
    def singleton_async(self, lock_name: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R | None]]: ...

    @overload
    def singleton_async(
        self, lock_name: str | None = None, *, blocking: bool = True, timeout: float | None = None
    ) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Awaitable[R | None]]]: ...

    def singleton_async(
        self,
        lock_name: str | Callable[P, Awaitable[R]] | None = None,
        *,
        blocking: bool = True,
        timeout: float | None = None,
    ) -> Any:
        """Async `singleton` for coroutine functions; blocking by default, like `acquire_async`."""
        return singleton_decorator_async(self._siblings, lock_name, blocking=blocking, timeout=timeout)

    def _new_sibling(self, lock_name: str) -> Holder:
        """A holder of the same kind for another name (see `Siblings`): each kind says how it is made."""
        raise NotImplementedError

    # -- shutdown ------------------------------------------------------------------

    async def close_async(self) -> None:
        """Async `close`, under the name 0.1.0 gave it; `aclose` is the name to use."""
        await self.aclose()

    # -- the watcher of this Mutex's own lock ------------------------------------------

    @property
    def own_watch(self) -> OwnLockWatch | None:
        """The watcher of this lock's holders that ``watch=True`` runs, if any."""
        return self._watch

    def watch_with(self, other: Holder) -> None:
        """Share ``other``'s watcher, if it has one (``watch=True``): an RWLock's modes have one.

        One watcher sees every holder of the lock, for either mode: it starts
        with either, and alerts for both.
        """
        watching = other.own_watch
        if watching is not None:
            watching.leave_alerts_of(self._lock)
            self._watch = watching

    def _campaign(self, stop: StopSignal) -> Acquisition:
        """An election's campaign for this lock, entered with ``with``: yields True once the lock is won, False
        if ``stop`` came first (a stop, unlike a timeout, wakes the wait the moment it is set, from any thread)."""
        self._start_watch()
        return Acquisition(self._engine_for, self._lock, blocking=True, timeout=None, stop=stop)

    def _campaign_async(self, stop: StopSignal) -> AsyncAcquisition:
        """An async campaign (see `_campaign`), entered with ``async with``."""
        self._start_watch_async()
        return AsyncAcquisition(self._engine_async_for, self._lock, blocking=True, timeout=None, stop=stop)

    def _start_watch(self) -> None:
        if self._watch is not None:
            self._watch.start_sync()

    def _start_watch_async(self) -> None:
        if self._watch is not None:
            self._watch.start_async()


def check_reclaim_source(settings: Settings, client: MutexClient) -> None:
    """``reclaim_disconnected_after`` needs connections of the library's own: it names their sessions.

    A pool's connections are the application's: one may be closed by the pool
    while this process lives on, or outlive it behind a pooler. Refused at
    construction, rather than reclaim a live holder or never reclaim early.
    """
    if settings.reclaim_disconnected_after is not None and client.dsn is None:
        raise InvalidArgument(
            "{reclaim_disconnected_after} needs the library's own connections (a dsn): it names this process's "
            "database session in the lock's row, and a pool's connections are not this process's to vouch for"
        )


def new_lock_state(
    core: ClientCore,
    lock_name: str,
    instance_id: str,
    settings: Settings,
    kind: LockKind,
) -> LockState:
    """The state of one holder's lock on ``core``'s client, with how its events are told."""
    timing = settings.timing
    events = LockEvents(
        lock_name=lock_name,
        instance_id=instance_id,
        hook=guard(settings.metrics),
        on_lost=settings.on_lost,
        alert_threshold=timing.alert_threshold,
        stale_threshold=timing.stale_threshold,
        kind=kind,
    )
    return LockState(
        names=settings.names,
        lock_name=lock_name,
        instance_id=instance_id,
        timing=timing,
        events=events,
        tracing=core.tracing(settings.tracer_provider, settings.names.table_name),
        state_lock=core.state_lock,
        kind=kind,
    )


def _not_a_mutexs_hold() -> InvalidArgument:
    return InvalidArgument(
        "{hold_at_least} is a Mutex's, and not a fair one's (whose release hands the lock to the next waiter): "
        "a semaphore's permits and a read/write lock's holds end when released"
    )
