"""`MutexClient`: one per process and database, shared by every Mutex that uses it.

A client owns, per flavour, an engine: in dsn mode at most two connections
(one for statements, one listening for releases) for the sync API and two per
event loop for the async API, whatever the number of locks held or waited
on. Every hold of a client that shares a heartbeat interval is renewed by one
statement per interval. One event thread per client keeps the leases (it
declares a lock lost the moment its lease runs out, even while a heartbeat is
stuck) and calls what users gave the library (``on_lost``, metrics hooks) for
what happens in the background, so a slow callback never delays a heartbeat.

``Mutex(dsn, "job")`` uses the process's shared client for that DSN (or
pool): no code change is needed to share. Create a client yourself to own
its lifetime::

    client = MutexClient(dsn)
    nightly = client.mutex("nightly-report")
    ...
    client.close()

What a client is made of is `ClientCore`, here too: the engines per flavour,
the `Session` (heartbeat groups, leases, the event thread), every lock
state made on it (for close, exit and fork); it is the `EngineHost` of each
engine it makes. `Mutex`, `LockTable`, `Election` and `StaleWatcher` use its
declared interface (`core_of`), never the client's private attributes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._base.clock import now
from ._base.connections import check_connection_args, connect_defaults, describe_dsn, dsn_or_environment
from ._io import heartbeat, heartbeat_async
from ._io.engine import Engine
from ._io.engine_async import AsyncEngine
from ._io.host import Shapes
from ._io.shared import SharedClients, track
from ._observe.tracing import Tracing, database_attributes
from ._state import flows, steps
from ._state.locks import LockState, Phase
from ._state.session import Session
from ._state.settings import DEFAULT_OPERATION_TIMEOUT, check_operation_timeout, default_instance_id
from .errors import MutexError

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider
    from psycopg_pool import AsyncConnectionPool, ConnectionPool

    from ._kinds.mutex import Mutex
    from ._kinds.rwlock import RWLock
    from ._kinds.semaphore import Semaphore
    from ._state.locks import StateLock
    from .table import LockTable

__all__ = ["MutexClient"]

logger = logging.getLogger("postgres_mutex")

# Connections inherited through fork() belong to the parent: closing them in
# the child would end the parent's session, so they are kept, unused.
_INHERITED: list[object] = []


class MutexClient:
    """The connections, heartbeats and listener that the Mutexes of one process share.

    Give it a ``dsn`` (it then opens at most two connections for sync use, and
    two per event loop for async use, each on first use) or a psycopg_pool
    ``pool`` and/or ``async_pool`` (it then borrows one connection per
    statement and opens nothing; waiters poll, since LISTEN needs a session of
    its own). ``operation_timeout`` is the deadline of the client's own
    statements (inspections, admin commands) and sets the connect timeout;
    each Mutex has its own for its lock statements.

    Use `mutex` to make Mutexes on it and `table` for the admin API; `close`
    (or ``with``) releases every lock its Mutexes hold and closes its
    connections. Raises `TypeError` / `ValueError` naming the argument on bad
    input.
    """

    def __init__(
        self,
        dsn: str | None = None,
        *,
        pool: ConnectionPool[Any] | None = None,
        async_pool: AsyncConnectionPool[Any] | None = None,
        operation_timeout: float = DEFAULT_OPERATION_TIMEOUT,
    ) -> None:
        timeout = check_operation_timeout(operation_timeout)
        self._core = ClientCore(dsn, pool, async_pool, timeout)
        """What Mutexes, tables, elections and watchers built on this client use (`ClientCore`)."""

    @property
    def dsn(self) -> str | None:
        return self._core.dsn

    @property
    def pool(self) -> ConnectionPool[Any] | None:
        return self._core.pool

    @property
    def async_pool(self) -> AsyncConnectionPool[Any] | None:
        return self._core.async_pool

    @property
    def operation_timeout(self) -> float:
        """The deadline of the client's own statements (inspections, admin commands)."""
        return self._core.operation_timeout

    @property
    def closed(self) -> bool:
        """Whether `close` was called: a closed client cannot be used again."""
        return self._core.closed

    # -- making things on it -----------------------------------------------------

    def mutex(self, lock_name: str, **options: Any) -> Mutex:
        """A `Mutex` on this client: ``client.mutex("job", heartbeat_interval=5)``.

        Takes every option of `Mutex` but the connection ones (``dsn``,
        ``pool``, ``async_pool``).
        """
        _refuse_connection("mutex", options)
        return BUILT_ON_IT.mutex(lock_name=lock_name, client=self, **options)

    def semaphore(self, name: str, *, permits: int, **options: Any) -> Semaphore:
        """A `Semaphore` on this client: ``client.semaphore("partner-api", permits=3)``.

        Takes every option of `Semaphore` but the connection ones.
        """
        _refuse_connection("semaphore", options)
        return BUILT_ON_IT.semaphore(name=name, permits=permits, client=self, **options)

    def rwlock(self, name: str, **options: Any) -> RWLock:
        """An `RWLock` on this client: ``client.rwlock("catalogue")``.

        Takes every option of `RWLock` but the connection ones.
        """
        _refuse_connection("rwlock", options)
        return BUILT_ON_IT.rwlock(name=name, client=self, **options)

    def table(self, table: str = "mutex_lock") -> LockTable:
        """The admin API (`LockTable`) for one lock table, on this client's connections."""
        return BUILT_ON_IT.table(client=self, table=table)

    # -- lifetime -------------------------------------------------------------------

    def close(self) -> None:
        """Release every lock held through this client, stop its threads, close its connections.

        Returns within about one ``operation_timeout`` per lock still held.
        A pool is never closed: it belongs to the application. The client
        cannot be used afterwards.
        """
        self._core.close()
        _SHARED.forget(self)

    async def aclose(self) -> None:
        """`close`, from async code: releases through the running loop's engine and closes it."""
        await self._core.aclose()
        _SHARED.forget(self)

    def __enter__(self) -> MutexClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> MutexClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        dsn = self._core.dsn
        where = "pool" if dsn is None else describe_dsn(dsn)
        return f"<MutexClient {where}{' closed' if self.closed else ''}>"


def _refuse_connection(made: str, options: dict[str, Any]) -> None:
    for given in ("dsn", "pool", "async_pool", "client"):
        if given in options:
            raise TypeError(f"{made}() takes no {given}=: the client already knows how to reach PostgreSQL")


def core_of(client: MutexClient) -> ClientCore:
    """The machinery of ``client`` that `Mutex`, `LockTable`, `Election` and `StaleWatcher` are built on.

    The one way in: what they share with the client is `ClientCore`'s
    declared interface, not the client's private attributes.
    """
    return client._core


class _BuiltOnIt:
    """What `MutexClient.mutex` and `MutexClient.table` make: set by the modules that define them.

    The client sits below what is built on it and never imports it: `Mutex`
    and `LockTable` import the client, and register here as they are
    imported (the package imports both).
    """

    mutex: Callable[..., Mutex]
    semaphore: Callable[..., Semaphore]
    rwlock: Callable[..., RWLock]
    table: Callable[..., LockTable]


BUILT_ON_IT = _BuiltOnIt()

_SHARED: SharedClients[MutexClient] = SharedClients()


def client_for(dsn: str | None, pool: object, async_pool: object, client: MutexClient | None) -> MutexClient:
    """The client a primitive is made on: the one given, else the process's shared one for its DSN or pool."""
    if client is None:
        return shared_client(dsn, pool, async_pool)
    if dsn is not None or pool is not None or async_pool is not None:
        raise ValueError("pass either client or dsn/pool/async_pool, not both")
    return client


def shared_client(dsn: str | None, pool: object, async_pool: object) -> MutexClient:
    """The process's shared client for this DSN or pool (validated first)."""
    check_connection_args(dsn, pool, async_pool)
    dsn = dsn_or_environment(dsn, pool, async_pool)

    def make() -> MutexClient:
        client = MutexClient(dsn, pool=pool, async_pool=async_pool)  # type: ignore[arg-type]
        core_of(client).shared = True
        return client

    return _SHARED.get(dsn, pool, async_pool, make)


# -- what a client is made of ----------------------------------------------------------


class ClientCore:
    """The engines, session and lock states of one client; what the primitives built on it use.

    A core owns, per flavour, an engine: in dsn mode at most two connections
    (one for statements, one listening for releases) for the sync API and two
    per event loop for the async API, whatever the number of locks held or
    waited on. It releases what is held when the interpreter exits or the
    client closes.
    """

    def __init__(
        self,
        dsn: str | None,
        pool: ConnectionPool[Any] | None,
        async_pool: AsyncConnectionPool[Any] | None,
        operation_timeout: float,
    ) -> None:
        self.redactor = check_connection_args(dsn, pool, async_pool)
        self.dsn = dsn_or_environment(dsn, pool, async_pool)
        self.pool = pool
        self.async_pool = async_pool
        self.operation_timeout = operation_timeout
        self.shared = False
        """One of the process's shared clients: the last Mutex out closes its sync connections."""
        self._conninfo = dsn if dsn is not None else str(getattr(pool or async_pool, "conninfo", "") or "")
        self._engine: Engine | None = None
        self._async_engines: dict[asyncio.AbstractEventLoop, AsyncEngine] = {}
        self._tracings: dict[tuple[int, str], Tracing] = {}
        self._locks: weakref.WeakSet[LockState] = weakref.WeakSet()
        self._explicit_ids: weakref.WeakKeyDictionary[LockState, int] = weakref.WeakKeyDictionary()
        self._orphaned_cleanups: list[steps.Cleanup] = []
        self._attached = 0
        self.closed = False
        self._start_session()
        track(self, at_exit=self.release_at_exit, after_fork=self.after_fork_in_child)

    def _start_session(self) -> None:
        self.session = Session()
        self.shapes = Shapes(self.session.state_lock)

    @property
    def state_lock(self) -> StateLock:
        """The one lock under which every lock state, hold and heartbeat group of this client changes."""
        return self.session.state_lock

    @property
    def has_sync(self) -> bool:
        """Whether sync code can use this client (a dsn, or a sync pool)."""
        return self.dsn is not None or self.pool is not None

    # -- what the primitives use -------------------------------------------------------

    def tracing(self, tracer_provider: TracerProvider | None, table_name: str) -> Tracing:
        """One `Tracing` per provider and table: the Mutexes sharing it share heartbeat statements."""
        key = (id(tracer_provider), table_name)
        with self.state_lock:
            tracing = self._tracings.get(key)
            if tracing is None:
                attributes = database_attributes(self._conninfo, table_name)
                tracing = self._tracings[key] = Tracing(tracer_provider, attributes)
            return tracing

    def register(self, lock: LockState, *, explicit_id: bool) -> None:
        """Know ``lock`` (for close, exit and fork); ``explicit_id``: its instance_id was chosen by the user."""
        with self.state_lock:
            self._locks.add(lock)
            if explicit_id:
                self._explicit_ids[lock] = os.getpid()
            else:
                self._explicit_ids.pop(lock, None)

    def attach(self) -> None:
        """A Mutex began to use this client."""
        with self.state_lock:
            self._attached += 1

    def attach_while(self, user: object) -> weakref.finalize[[], object]:
        """`attach` for as long as ``user`` lives (what a Mutex and its acquisitions share): the attachment's
        ``detach()`` (then `detach`) lets go of it at close, and the collection of ``user`` does by itself."""
        self.attach()
        attachment = weakref.finalize(user, self._collected)
        attachment.atexit = False  # the exit releases what is held; nothing is left to idle then
        return attachment

    def _collected(self) -> None:
        # A finalizer runs wherever the collector did, in this client's own code under its lock perhaps:
        # it only posts the detach to the event thread (none for a closed client: nothing left to idle).
        if not self.closed:
            self.session.post_from_finalizer(self.detach)

    def detach(self) -> None:
        """A Mutex closed: the last one out of a shared client closes its sync connections."""
        with self.state_lock:
            self._attached = max(0, self._attached - 1)
            idle = self.shared and self._attached == 0
        if idle:
            engine = self._engine
            if engine is not None and not self._busy(engine):
                engine.close_connections()

    def engine(self) -> Engine:
        """The engine of sync code (threads)."""
        with self.session.state_lock:  # `state_lock`, read without the property: once per statement
            if self.closed:
                raise MutexError("this MutexClient is closed: create a new one")
            if self._engine is None:
                if not self.has_sync:
                    raise WrongFlavour("only an async_pool was given: use the *_async methods, or pass pool= as well")
                self._engine = Engine(self, dsn=self.dsn, pool=self.pool, heartbeats=heartbeat.HeartbeatWorker)
            return self._engine

    def engine_async(self) -> AsyncEngine:
        """The engine of the running event loop (one per loop)."""
        loop = asyncio.get_running_loop()
        with self.state_lock:
            if self.closed:
                raise MutexError("this MutexClient is closed: create a new one")
            engine = self._async_engines.get(loop)
            if engine is not None:
                return engine
            if self.dsn is None and self.async_pool is None:
                raise WrongFlavour("only a (sync) pool was given: use the sync methods, or pass async_pool= as well")
            # A loop that ended (a previous asyncio.run) left its engine behind: close its connections.
            stale = [self._async_engines.pop(old) for old in list(self._async_engines) if old.is_closed()]
            engine = self._async_engines[loop] = AsyncEngine(
                self, dsn=self.dsn, pool=self.async_pool, heartbeats=heartbeat_async.HeartbeatWorker
            )
        for old_engine in stale:
            cleanups = old_engine.take_cleanups()
            old_engine.abandon()
            self.session.drop(old_engine)
            with self.state_lock:
                self._orphaned_cleanups.extend(cleanups)
        return engine

    def engine_for(self, lock: LockState) -> Engine:
        """The sync engine, for an acquire of ``lock`` (refused in a forked child, see `check_process`)."""
        self.check_process(lock)
        return self.engine()

    def engine_async_for(self, lock: LockState) -> AsyncEngine:
        """The running loop's engine, for an acquire of ``lock``."""
        self.check_process(lock)
        return self.engine_async()

    def check_process(self, lock: LockState) -> None:
        """A Mutex with a chosen instance_id may not acquire in a forked child: it would share the id."""
        created_in = self._explicit_ids.get(lock)
        if created_in is not None and created_in != os.getpid():
            raise MutexError(
                f"this Mutex was created in process {created_in} with instance_id {lock.instance_id!r}; "
                "a forked child would share that id with its parent and siblings. Create the Mutex "
                "in the process that uses it, or let it choose its own instance_id"
            )
        if self.closed:
            raise MutexError("this MutexClient is closed: create a new one")

    # -- what the engines get from it (it is their `EngineHost`) ---------------------

    def connect_kwargs(self, role: str) -> dict[str, Any]:
        """How the engines connect; ``application_name`` says what the connection is for, and whose it is.

        ``postgres-mutex <host>:<pid>`` (or ``postgres-mutex listener ...``): a
        DBA finds the library's sessions, and which process they serve, in
        ``pg_stat_activity``; the holders themselves are in the lock table.
        """
        assert self.dsn is not None
        name = f"{role} {socket.gethostname() or 'host'}:{os.getpid()}"
        return connect_defaults(self.dsn, application_name=name, operation_timeout=self.operation_timeout)

    def adopt_cleanup(self, cleanup: steps.Cleanup) -> None:
        """A clean-up whose engine closed: the sync engine takes it, or it waits for exit."""
        engine = self._engine if self.has_sync and not self.closed else None
        if engine is not None and not engine.closed:
            engine.schedule(cleanup)
        else:
            with self.state_lock:
                self._orphaned_cleanups.append(cleanup)

    def _engines(self) -> list[Engine | AsyncEngine]:
        engines: list[Engine | AsyncEngine] = list(self._async_engines.values())
        if self._engine is not None:
            engines.append(self._engine)
        return engines

    def _busy(self, engine: Engine | AsyncEngine) -> bool:
        with self.state_lock:
            holding = any(group.holds for group in engine.groups.values())
        return holding or engine.has_cleanups()

    # -- lifetime -------------------------------------------------------------------

    def close(self) -> None:
        """Release every lock held, stop the threads, close the connections (never a pool)."""
        for lock in self._held_locks():
            try:
                self._release_for_close(lock)
            except Exception as exc:  # closing goes on: the client's other locks, its threads
                _release_failed_on_close(lock, exc)
        with self.state_lock:
            self.closed = True
            engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()
            self.session.drop(engine)
        for loop, async_engine in list(self._async_engines.items()):
            if loop.is_closed() or loop is not _running_loop():
                async_engine.abandon()
        self.session.stop()

    async def aclose(self) -> None:
        """`close`, from async code: releases through the running loop's engine and closes it."""
        for lock in self._held_locks():
            try:
                await self.engine_async().run(flows.release(lock, lock.tracing, caller=None))
            except Exception as exc:
                _release_failed_on_close(lock, exc)
        loop = asyncio.get_running_loop()
        async_engine = self._async_engines.pop(loop, None)
        if async_engine is not None:
            await async_engine.close()
            self.session.drop(async_engine)
        self.close()

    def _held_locks(self) -> list[LockState]:
        with self.state_lock:
            return [lock for lock in list(self._locks) if lock.phase is Phase.HOLDING]

    def _release_for_close(self, lock: LockState) -> None:
        if not self.has_sync:
            logger.warning(
                "lock %r is still held and only an async_pool is available to release it: close the "
                "client with aclose(); the lock stays until another instance reclaims it after "
                "stale_threshold",
                lock.lock_name,
            )
            return
        self.engine().run(flows.release(lock, lock.tracing, caller=None))

    # -- exit and fork ----------------------------------------------------------------

    def release_at_exit(self) -> None:
        """At interpreter exit: release what is held and delete what may remain, within one statement deadline.

        In the exiting thread, never a new one: Python 3.12 refuses to start
        threads in ``atexit`` callbacks. The engine's deadline caps every
        statement, so the budget holds however many locks there are; what does
        not fit stays until reclaimed.
        """
        if not self._held_locks() and not self._pending_cleanups():
            return
        if not self.has_sync or self.closed:
            if any(lock.phase is Phase.HOLDING for lock in list(self._locks)):
                logger.warning(
                    "locks are still held at exit and only an async_pool is available: they stay until "
                    "another instance reclaims them after stale_threshold"
                )
            return
        budget = self._exit_budget()
        deadline = now() + budget
        self.engine().deadline = deadline
        left = self._finish_at_exit(deadline)
        if self._held_locks() or self._pending_cleanups():
            logger.warning("could not release every lock within %.3gs at exit; they stay until reclaimed", budget)
        elif left:
            logger.warning(
                "could not delete, within %.3gs at exit, the rows unanswered statements may have left for %s; "
                "they stay until reclaimed after stale_threshold",
                budget,
                ", ".join(sorted({repr(name) for name in left})),
            )

    def _pending_cleanups(self) -> bool:
        with self.state_lock:
            engines = self._engines()
            stray = bool(self._orphaned_cleanups)
        return stray or any(engine.has_cleanups() for engine in engines)

    def _exit_budget(self) -> float:
        """How long exit may spend on this client's locks: one statement deadline of theirs."""
        timeouts = [lock.timing.operation_timeout for lock in list(self._locks)]
        return max(timeouts) if timeouts else self.operation_timeout

    def _finish_at_exit(self, deadline: float) -> list[str]:
        """Release and clean up within ``deadline``; returns the locks whose clean-up was skipped or failed."""
        engine = self.engine()
        for lock in self._held_locks():
            if now() >= deadline:
                return []
            try:
                engine.run(flows.release(lock, lock.tracing, caller=None))
            except Exception as exc:
                logger.warning("releasing lock %r at exit: %s", lock.lock_name, exc)
        with self.state_lock:
            pending = list(self._orphaned_cleanups)
            self._orphaned_cleanups.clear()
            async_engines = list(self._async_engines.values())
        for async_engine in async_engines:
            pending.extend(async_engine.take_cleanups())
        pending.extend(engine.take_cleanups())
        left: list[str] = []
        for cleanup in pending:
            if now() >= deadline:
                left.append(cleanup.lock.lock_name)
                continue
            try:
                engine.run(flows.clean_up(cleanup))
            except Exception as exc:
                logger.debug("deleting a row lock %r may have left, at exit: %s", cleanup.lock.lock_name, exc)
                left.append(cleanup.lock.lock_name)
        engine.close_connections()
        return left

    def after_fork_in_child(self) -> None:
        """In a forked child: the parent's connections, threads and holds are not ours."""
        _INHERITED.extend(self._engines())
        self._engine = None
        self._async_engines = {}
        self._orphaned_cleanups = []
        self._start_session()
        for lock in list(self._locks):
            explicit = lock in self._explicit_ids
            lock.reset_after_fork(lock.instance_id if explicit else default_instance_id(), self.state_lock)


def _release_failed_on_close(lock: LockState, exc: Exception) -> None:
    """Say which lock a client's close could not release, and why (the library's error says what becomes of
    the row); a defect, not a `MutexError`, with its traceback."""
    logger.warning(
        "releasing lock %r on close failed: %s: %s",
        lock.lock_name,
        type(exc).__name__,
        exc,
        exc_info=not isinstance(exc, MutexError),
    )


class WrongFlavour(MutexError, ValueError):
    """Sync use of a client that has only an async pool, or the reverse (a `ValueError` too, as in 0.1.0)."""


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
