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
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import queue
import socket
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from . import _flows as flows
from ._acompat import start_thread
from ._clock import MAX_SLICE, now, slice_until
from ._connections import connect_defaults
from ._engine import Engine
from ._engine_async import AsyncEngine
from ._secrets import Redactor
from ._settings import DEFAULT_OPERATION_TIMEOUT, check_operation_timeout, default_instance_id
from ._sql import Statements
from ._state import LEASE_EXPIRED, Hold, HoldStatus, LockState, Phase
from ._tracing import Tracing, database_attributes
from .errors import MutexError

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider
    from psycopg_pool import AsyncConnectionPool, ConnectionPool

    from ._mutex import Mutex
    from .table import LockTable

logger = logging.getLogger("postgres_mutex")

__all__ = ["MutexClient"]

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
        self._redactor = check_connection_args(dsn, pool, async_pool)
        self._dsn = dsn
        self._pool = pool
        self._async_pool = async_pool
        self.operation_timeout = check_operation_timeout(operation_timeout)
        self._conninfo = dsn if dsn is not None else str(getattr(pool or async_pool, "conninfo", "") or "")
        self._state_lock = threading.Lock()
        self._shapes: dict[str, Statements] = {}
        self._with_history: set[str] = set()
        """Tables last inspected with a history: one inspected without it again had it dropped."""
        self._engine: Engine | None = None
        self._async_engines: dict[asyncio.AbstractEventLoop, AsyncEngine] = {}
        self._events = _EventThread(self)
        self._tracings: dict[tuple[int, str], Tracing] = {}
        self._locks: weakref.WeakSet[LockState] = weakref.WeakSet()
        self._explicit_ids: weakref.WeakKeyDictionary[LockState, int] = weakref.WeakKeyDictionary()
        self._stray_cleanups: list[flows.Cleanup] = []
        self._attached = 0
        self._shared = False
        self._closed = False
        self._pid = os.getpid()
        _CLIENTS.add(self)

    @property
    def dsn(self) -> str | None:
        return self._dsn

    @property
    def pool(self) -> ConnectionPool[Any] | None:
        return self._pool

    @property
    def async_pool(self) -> AsyncConnectionPool[Any] | None:
        return self._async_pool

    # -- making things on it -----------------------------------------------------

    def mutex(self, lock_name: str, **options: Any) -> Mutex:
        """A `Mutex` on this client: ``client.mutex("job", heartbeat_interval=5)``.

        Takes every option of `Mutex` but the connection ones (``dsn``,
        ``pool``, ``async_pool``).
        """
        from ._mutex import Mutex

        for given in ("dsn", "pool", "async_pool", "client"):
            if given in options:
                raise TypeError(f"mutex() takes no {given}=: the client already knows how to reach PostgreSQL")
        return Mutex(lock_name=lock_name, client=self, **options)

    def table(self, table: str = "mutex_lock") -> LockTable:
        """The admin API (`LockTable`) for one lock table, on this client's connections."""
        from .table import LockTable

        return LockTable(client=self, table=table)

    # -- what the engines and Mutexes share ------------------------------------------

    def _connect_kwargs(self, role: str) -> dict[str, Any]:
        """How the engines connect; ``application_name`` says what the connection is for, and whose it is.

        ``postgres-mutex <host>:<pid>`` (or ``postgres-mutex listener ...``): a
        DBA finds the library's sessions, and which process they serve, in
        ``pg_stat_activity``; the holders themselves are in the lock table.
        """
        assert self._dsn is not None
        name = f"{role} {socket.gethostname() or 'host'}:{os.getpid()}"
        return connect_defaults(self._dsn, application_name=name, operation_timeout=self.operation_timeout)

    def _redact(self, text: str) -> str:
        return self._redactor.redact(text)

    def _shown_cause(self, exc: BaseException) -> BaseException | None:
        """psycopg's error, to chain for the traceback, unless it holds a secret.

        Its text may quote one; and a failed connect's error keeps the
        connection's options (``pgconn.info``), the password among them.
        """
        if self._redact(str(exc)) != str(exc) or getattr(exc, "pgconn", None) is not None:
            return None
        return exc

    def _tracing(self, tracer_provider: TracerProvider | None, table_name: str) -> Tracing:
        """One `Tracing` per provider and table: the Mutexes sharing it share heartbeat statements."""
        key = (id(tracer_provider), table_name)
        with self._state_lock:
            tracing = self._tracings.get(key)
            if tracing is None:
                attributes = database_attributes(self._conninfo, table_name)
                tracing = self._tracings[key] = Tracing(tracer_provider, attributes)
            return tracing

    def _register(self, lock: LockState, *, explicit_id: bool) -> None:
        """Know ``lock`` (for close, exit and fork); ``explicit_id``: its instance_id was chosen by the user."""
        with self._state_lock:
            self._locks.add(lock)
            if explicit_id:
                self._explicit_ids[lock] = os.getpid()
            else:
                self._explicit_ids.pop(lock, None)

    def _check_process(self, lock: LockState) -> None:
        """A Mutex with a chosen instance_id may not acquire in a forked child: it would share the id."""
        created_in = self._explicit_ids.get(lock)
        if created_in is not None and created_in != os.getpid():
            raise MutexError(
                f"this Mutex was created in process {created_in} with instance_id {lock.instance_id!r}; "
                "a forked child would share that id with its parent and siblings. Create the Mutex "
                "in the process that uses it, or let it choose its own instance_id"
            )
        if self._closed:
            raise MutexError("this MutexClient is closed: create a new one")

    def _get_engine(self) -> Engine:
        """The engine of sync code (threads)."""
        with self._state_lock:
            if self._closed:
                raise MutexError("this MutexClient is closed: create a new one")
            if self._engine is None:
                if self._dsn is None and self._pool is None:
                    raise _WrongFlavour("only an async_pool was given: use the *_async methods, or pass pool= as well")
                self._engine = Engine(self, dsn=self._dsn, pool=self._pool)
            return self._engine

    def _get_engine_async(self) -> AsyncEngine:
        """The engine of the running event loop (one per loop)."""
        loop = asyncio.get_running_loop()
        with self._state_lock:
            if self._closed:
                raise MutexError("this MutexClient is closed: create a new one")
            engine = self._async_engines.get(loop)
            if engine is not None:
                return engine
            if self._dsn is None and self._async_pool is None:
                raise _WrongFlavour("only a (sync) pool was given: use the sync methods, or pass async_pool= as well")
            # A loop that ended (a previous asyncio.run) left its engine behind: close its connections.
            stale = [self._async_engines.pop(old) for old in list(self._async_engines) if old.is_closed()]
            engine = self._async_engines[loop] = AsyncEngine(self, dsn=self._dsn, pool=self._async_pool)
        for old_engine in stale:
            cleanups = old_engine.take_cleanups()
            old_engine.abandon()
            with self._state_lock:
                self._stray_cleanups.extend(cleanups)
        return engine

    def _has_sync(self) -> bool:
        return self._dsn is not None or self._pool is not None

    def _post(self, report: Callable[[], object]) -> None:
        """Run ``report`` on the client's event thread (user callbacks, in order, off the heartbeat)."""
        self._events.post(report)

    def _lease_added(self, deadline: float) -> None:
        """A hold was added: the event thread keeps its lease (it looks again at least every second)."""
        if deadline - now() < MAX_SLICE:
            self._events.nudge()
        else:
            self._events.ensure()

    def _forget(self, hold: Hold) -> None:
        """Stop renewing ``hold`` (released, or being released)."""
        with self._state_lock:
            group = hold.group
            if group is not None:
                group.holds.pop(hold, None)
                hold.group = None

    def _adopt_cleanup(self, cleanup: flows.Cleanup) -> None:
        """A clean-up whose engine closed: the sync engine takes it, or it waits for exit."""
        engine = self._engine if self._has_sync() and not self._closed else None
        if engine is not None and not engine.closed:
            engine.schedule(cleanup)
        else:
            with self._state_lock:
                self._stray_cleanups.append(cleanup)

    def _engines(self) -> list[Engine | AsyncEngine]:
        engines: list[Engine | AsyncEngine] = list(self._async_engines.values())
        if self._engine is not None:
            engines.append(self._engine)
        return engines

    # -- leases ------------------------------------------------------------------

    def _earliest_lease(self) -> float | None:
        """When the next lease of a hold of this client runs out (None: nothing is held)."""
        with self._state_lock:
            deadlines = [
                hold.lease_deadline
                for engine in self._engines()
                for group in engine.groups.values()
                for hold in group.holds
                if hold.status is HoldStatus.HELD
            ]
        return min(deadlines) if deadlines else None

    def _expire_leases(self) -> None:
        """Declare lost every hold whose lease ran out; on the event thread, on time."""
        current = now()
        with self._state_lock:
            expired = [
                hold
                for engine in self._engines()
                for group in engine.groups.values()
                for hold in group.holds
                if hold.status is HoldStatus.HELD and hold.lease_deadline <= current
            ]
        for hold in expired:
            error = hold.lock.lose(hold, LEASE_EXPIRED, only_if_expired=True)
            if error is not None:
                self._forget(hold)
                hold.lock.events.lost(error)

    # -- lifetime -------------------------------------------------------------------

    def _attach(self) -> None:
        with self._state_lock:
            self._attached += 1

    def _detach(self) -> None:
        """A Mutex of a shared client closed: the last one out closes the sync connections."""
        with self._state_lock:
            self._attached = max(0, self._attached - 1)
            idle = self._shared and self._attached == 0
        if idle:
            self._close_idle_connections()

    def _close_idle_connections(self) -> None:
        engine = self._engine
        if engine is not None and not self._busy(engine):
            engine.close_connections()

    def _busy(self, engine: Engine | AsyncEngine) -> bool:
        with self._state_lock:
            holding = any(group.holds for group in engine.groups.values())
        return holding or engine.has_cleanups()

    def close(self) -> None:
        """Release every lock held through this client, stop its threads, close its connections.

        Returns within about one ``operation_timeout`` per lock still held.
        A pool is never closed: it belongs to the application. The client
        cannot be used afterwards.
        """
        for lock in self._held_locks():
            with contextlib.suppress(Exception):
                self._release_for_close(lock)
        with self._state_lock:
            self._closed = True
            engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()
        for loop, async_engine in list(self._async_engines.items()):
            if loop.is_closed() or loop is not _running_loop():
                async_engine.abandon()
        self._events.stop()
        _SHARED.forget(self)

    async def aclose(self) -> None:
        """`close`, from async code: releases through the running loop's engine and closes it."""
        for lock in self._held_locks():
            with contextlib.suppress(Exception):
                await self._get_engine_async().run(flows.release(lock, lock.tracing, caller=None))
        loop = asyncio.get_running_loop()
        async_engine = self._async_engines.pop(loop, None)
        if async_engine is not None:
            await async_engine.close()
        self.close()

    def _held_locks(self) -> list[LockState]:
        with self._state_lock:
            return [lock for lock in list(self._locks) if lock.phase is Phase.HOLDING]

    def _release_for_close(self, lock: LockState) -> None:
        if not self._has_sync():
            logger.warning(
                "lock %r is still held and only an async_pool is available to release it: close the "
                "client with aclose(); the lock stays until another instance reclaims it after "
                "stale_threshold",
                lock.lock_name,
            )
            return
        self._get_engine().run(flows.release(lock, lock.tracing, caller=None))

    def __enter__(self) -> MutexClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> MutexClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        where = "pool" if self._dsn is None else _describe_dsn(self._dsn)
        return f"<MutexClient {where}{' closed' if self._closed else ''}>"

    # -- exit and fork ----------------------------------------------------------------

    def _release_at_exit(self, budget: float) -> None:
        """At interpreter exit: release what is held and delete what may remain, within ``budget`` seconds.

        In the exiting thread, never a new one: Python 3.12 refuses to start
        threads in ``atexit`` callbacks. The engine's deadline caps every
        statement, so the budget holds however many locks there are; what does
        not fit stays until reclaimed.
        """
        if not self._held_locks() and not self._pending_cleanups():
            return
        if not self._has_sync() or self._closed:
            if any(lock.phase is Phase.HOLDING for lock in list(self._locks)):
                logger.warning(
                    "locks are still held at exit and only an async_pool is available: they stay until "
                    "another instance reclaims them after stale_threshold"
                )
            return
        deadline = now() + budget
        self._get_engine().deadline = deadline
        self._finish_at_exit(deadline)
        if self._held_locks() or self._pending_cleanups():
            logger.warning("could not release every lock within %.3gs at exit; they stay until reclaimed", budget)

    def _pending_cleanups(self) -> bool:
        with self._state_lock:
            engines = self._engines()
            stray = bool(self._stray_cleanups)
        return stray or any(engine.has_cleanups() for engine in engines)

    def _exit_budget(self) -> float:
        """How long exit may spend on this client's locks: one statement deadline of theirs."""
        timeouts = [lock.timing.operation_timeout for lock in list(self._locks)]
        return max(timeouts) if timeouts else self.operation_timeout

    def _finish_at_exit(self, deadline: float) -> None:
        engine = self._get_engine()
        for lock in self._held_locks():
            if now() >= deadline:
                return
            try:
                engine.run(flows.release(lock, lock.tracing, caller=None))
            except Exception as exc:
                logger.warning("releasing lock %r at exit: %s", lock.lock_name, exc)
        with self._state_lock:
            pending = list(self._stray_cleanups)
            self._stray_cleanups.clear()
            async_engines = list(self._async_engines.values())
        for async_engine in async_engines:
            pending.extend(async_engine.take_cleanups())
        pending.extend(engine.take_cleanups())
        for cleanup in pending:
            if now() >= deadline:
                return
            with contextlib.suppress(Exception):
                engine.run(flows.clean_up(cleanup))
        engine.close_connections()

    def _after_fork_in_child(self) -> None:
        """In a forked child: the parent's connections, threads and holds are not ours."""
        self._state_lock = threading.Lock()
        for engine in self._engines():
            _INHERITED.append(engine)
        self._engine = None
        self._async_engines = {}
        self._events = _EventThread(self)
        self._stray_cleanups = []
        self._pid = os.getpid()
        for lock in list(self._locks):
            explicit = lock in self._explicit_ids
            lock.reset_after_fork(lock.instance_id if explicit else default_instance_id(), self._state_lock)


class _WrongFlavour(MutexError, ValueError):
    """Sync use of a client that has only an async pool, or the reverse (a `ValueError` too, as in 0.1.0)."""


class _EventThread:
    """Keeps the leases of a client's holds and runs its callbacks, in order, on one thread.

    It exists while something is held or to be reported, and ends when idle.
    """

    def __init__(self, client: MutexClient) -> None:
        self._client = weakref.ref(client)
        self._queue: queue.SimpleQueue[Callable[[], object] | _Stop | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def post(self, report: Callable[[], object]) -> None:
        self._queue.put(report)
        self._ensure()

    def nudge(self) -> None:
        self._queue.put(None)
        self._ensure()

    def ensure(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._ensure()

    def stop(self) -> None:
        self._queue.put(_Stop())

    def _ensure(self) -> None:
        inline = False
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = start_thread(self._run, "postgres-mutex-events")
                inline = self._thread is None
        if inline:
            # The interpreter is shutting down and starts no thread: tell now, in order.
            self._report_now()

    def _report_now(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if callable(item):
                try:
                    item()
                except Exception:
                    logger.exception("a postgres-mutex callback failed")

    def _run(self) -> None:
        idle_since: float | None = None
        while True:
            client = self._client()
            if client is None:
                return
            deadline = client._earliest_lease()
            del client
            try:
                item = self._queue.get(timeout=MAX_SLICE if deadline is None else max(slice_until(deadline), 0.001))
            except queue.Empty:
                item = None
            if isinstance(item, _Stop):
                return
            if item is not None:
                try:
                    item()
                except Exception:
                    logger.exception("a postgres-mutex callback failed")
            client = self._client()
            if client is None:
                return
            client._expire_leases()
            holding = client._earliest_lease() is not None
            del client
            if holding or not self._queue.empty():
                idle_since = None
                continue
            # Nothing held, nothing to tell: end after a while (locks come and go in bursts).
            idle_since = idle_since if idle_since is not None else now()
            if now() - idle_since >= _LINGER:
                with self._lock:
                    if self._queue.empty():
                        self._thread = None
                        return


_LINGER = 10.0
"""How long the event thread stays once nothing is held (holds come and go in bursts)."""


class _Stop:
    """Tells the event thread to end."""


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _describe_dsn(dsn: str) -> str:
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.Error:
        return "dsn"
    host = params.get("host") or os.environ.get("PGHOST") or "localhost"
    port = params.get("port") or os.environ.get("PGPORT") or "5432"
    dbname = params.get("dbname") or os.environ.get("PGDATABASE") or ""
    return f"{host}:{port}/{dbname}"


def check_connection_args(dsn: object, pool: object, async_pool: object) -> Redactor:
    """Validate how to reach PostgreSQL (exactly one way); returns what masks the DSN's password."""
    if dsn is not None and not isinstance(dsn, str):
        raise TypeError(f"dsn must be a str, not {type(dsn).__name__}")
    if dsn is not None and (pool is not None or async_pool is not None):
        raise ValueError("pass either dsn or pool/async_pool, not both: with a pool, the library opens no connection")
    if dsn is None and pool is None and async_pool is None:
        raise ValueError("Mutex needs a connection source: pass dsn, or pool and/or async_pool")
    redactor = Redactor(dsn)
    if dsn is not None:
        detail = None
        try:
            conninfo_to_dict(dsn)
        except psycopg.Error as exc:
            # libpq quotes the part it could not parse, which may be part of
            # a password (an unquoted one with a space, say): then say less.
            detail = redactor.redact(str(exc)) if not _may_hold_password(dsn) else "libpq could not parse it"
            detail = " ".join(detail.split())
        if detail is not None:
            # Raised out here: inside the except block psycopg's error, which may
            # quote the password, would be this one's __context__.
            raise ValueError(
                f"dsn is not a valid connection string ({detail}); quote values with spaces: password='a b'"
            )
    if pool is not None or async_pool is not None:
        try:
            from psycopg_pool import AsyncConnectionPool, ConnectionPool
        except ImportError:  # pragma: no cover - a pool object implies the package
            raise ImportError("pool mode needs psycopg-pool: pip install 'postgres-mutex[pool]'") from None
        if pool is not None and not isinstance(pool, ConnectionPool):
            raise TypeError(f"pool must be a psycopg_pool.ConnectionPool, not {type(pool).__name__}")
        if async_pool is not None and not isinstance(async_pool, AsyncConnectionPool):
            raise TypeError(f"async_pool must be a psycopg_pool.AsyncConnectionPool, not {type(async_pool).__name__}")
    return redactor


def _may_hold_password(dsn: str) -> bool:
    lowered = dsn.lower()
    return "password" in lowered or "@" in lowered


class _SharedClients:
    """The clients `Mutex(dsn, ...)` shares: one per DSN (or pool) per process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_dsn: dict[str, MutexClient] = {}
        self._by_pool: list[MutexClient] = []

    def get(self, dsn: str | None, pool: object, async_pool: object) -> MutexClient:
        with self._lock:
            if dsn is not None:
                client = self._by_dsn.get(dsn)
                if client is None or client._closed:
                    client = self._by_dsn[dsn] = MutexClient(dsn)
                    client._shared = True
                return client
            for client in self._by_pool:
                if client._pool is pool and client._async_pool is async_pool and not client._closed:
                    return client
            client = MutexClient(pool=pool, async_pool=async_pool)  # type: ignore[arg-type]
            client._shared = True
            self._by_pool.append(client)
            return client

    def forget(self, client: MutexClient) -> None:
        with self._lock:
            for dsn, found in list(self._by_dsn.items()):
                if found is client:
                    del self._by_dsn[dsn]
            if client in self._by_pool:
                self._by_pool.remove(client)

    def clients(self) -> Iterable[MutexClient]:
        with self._lock:
            return [*self._by_dsn.values(), *self._by_pool]

    def reset_after_fork(self) -> None:
        self._lock = threading.Lock()


_SHARED = _SharedClients()
_CLIENTS: weakref.WeakSet[MutexClient] = weakref.WeakSet()


def shared_client(dsn: str | None, pool: object, async_pool: object) -> MutexClient:
    """The process's shared client for this DSN or pool (validated first)."""
    check_connection_args(dsn, pool, async_pool)
    return _SHARED.get(dsn, pool, async_pool)


@atexit.register
def _release_all_at_exit() -> None:
    """A normal interpreter exit releases every lock still held, so nobody waits out stale_threshold.

    Each client gets one ``operation_timeout`` for it (plus a connect): an exit
    is never held up longer by a database that does not answer.
    """
    for client in list(_CLIENTS):
        client._release_at_exit(client._exit_budget())


def _forget_after_fork() -> None:
    _SHARED.reset_after_fork()
    for client in list(_CLIENTS):
        client._after_fork_in_child()


os.register_at_fork(after_in_child=_forget_after_fork)
