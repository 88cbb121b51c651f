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

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._io.connections import check_connection_args, describe_dsn, dsn_or_environment
from ._io.core import ClientCore
from ._io.shared import SharedClients
from ._state.settings import DEFAULT_OPERATION_TIMEOUT, check_operation_timeout

if TYPE_CHECKING:
    from psycopg_pool import AsyncConnectionPool, ConnectionPool

    from ._kinds.mutex import Mutex
    from ._kinds.rwlock import RWLock
    from ._kinds.semaphore import Semaphore
    from .table import LockTable

__all__ = ["MutexClient"]


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
