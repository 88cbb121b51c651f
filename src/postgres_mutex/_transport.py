"""How a Mutex (and its siblings) or a watcher reaches PostgreSQL.

A `Transport` holds the sync and async connection sources for one set of
connection arguments, hands out runners over them, and knows the identity
(instance_id, ``application_name``) its connections carry. After ``fork()``
every transport forgets the parent's connections and, unless the user chose
the id, takes a new instance_id: a forked child is another instance.
"""

from __future__ import annotations

import asyncio
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from ._connections import AsyncConnections, SyncConnections, connect_defaults
from ._runners import AsyncRunner, SyncRunner, _Failures
from ._secrets import Redactor
from ._settings import default_instance_id
from .errors import MutexError

if TYPE_CHECKING:
    from psycopg_pool import AsyncConnectionPool, ConnectionPool

_TRANSPORTS: weakref.WeakSet[Transport] = weakref.WeakSet()


class Transport:
    """Connection sources and identity shared by a Mutex and the siblings its `singleton` makes."""

    def __init__(
        self,
        *,
        dsn: str | None,
        pool: ConnectionPool[Any] | None,
        async_pool: AsyncConnectionPool[Any] | None,
        instance_id: str | None,
        operation_timeout: float,
        table_name: str,
        application_name: str | None = None,
    ) -> None:
        redactor = check_connection_args(dsn, pool, async_pool)
        self._dsn = dsn
        self._operation_timeout = operation_timeout
        self._application_name = application_name
        # Ids chosen by the user must be unique per process; default ones are
        # renewed in a forked child, so parent and children never share one.
        self.explicit_id = instance_id is not None
        self.instance_id = default_instance_id() if instance_id is None else instance_id
        self.pid = os.getpid()
        self.conninfo = dsn if dsn is not None else str(getattr(pool or async_pool, "conninfo", "") or "")
        kwargs = self._connect_kwargs()
        self.sync = (
            SyncConnections(dsn=dsn, pool=pool, connect_kwargs=kwargs) if dsn is not None or pool is not None else None
        )
        self.async_ = (
            AsyncConnections(dsn=dsn, pool=async_pool, connect_kwargs=kwargs)
            if dsn is not None or async_pool is not None
            else None
        )
        self.failures = _Failures(table=table_name, redact=redactor.redact)
        _TRANSPORTS.add(self)

    def _connect_kwargs(self) -> dict[str, Any]:
        if self._dsn is None:
            return {}
        name = self._application_name or f"postgres-mutex {self.instance_id}"
        return connect_defaults(self._dsn, application_name=name, operation_timeout=self._operation_timeout)

    def after_fork(self) -> None:
        if not self.explicit_id:
            self.instance_id = default_instance_id()
        kwargs = self._connect_kwargs()
        for conns in (self.sync, self.async_):
            if conns is not None:
                conns.forget_after_fork(kwargs)

    def check_process(self) -> None:
        if self.explicit_id and self.pid != os.getpid():
            raise MutexError(
                f"this Mutex was created in process {self.pid} with instance_id {self.instance_id!r}; "
                "a forked child would share that id with its parent and siblings. Create the Mutex "
                "in the process that uses it, or let it choose its own instance_id"
            )

    def sync_runner(self, stop: threading.Event | None = None) -> SyncRunner:
        if self.sync is None:
            raise MutexError("only an async_pool was given: use the *_async methods, or pass pool= as well")
        return SyncRunner(self.sync, self.failures, stop)

    def async_runner(self, stop: asyncio.Event | None = None) -> AsyncRunner:
        if self.async_ is None:
            raise MutexError("only a (sync) pool was given: use the sync methods, or pass async_pool= as well")
        return AsyncRunner(self.async_, self.failures, stop)

    def close(self) -> None:
        if self.sync is not None:
            self.sync.close()

    async def aclose(self) -> None:
        if self.async_ is not None:
            await self.async_.aclose()


def check_connection_args(dsn: object, pool: object, async_pool: object) -> Redactor:
    if dsn is not None and not isinstance(dsn, str):
        raise TypeError(f"dsn must be a str, not {type(dsn).__name__}")
    if dsn is not None and (pool is not None or async_pool is not None):
        raise ValueError("pass either dsn or pool/async_pool, not both: with a pool, the Mutex opens no connection")
    if dsn is None and pool is None and async_pool is None:
        raise ValueError("Mutex needs a way to reach PostgreSQL: pass dsn, or pool and/or async_pool")
    redactor = Redactor(dsn)
    if dsn is not None:
        try:
            conninfo_to_dict(dsn)
        except psycopg.Error as exc:
            # libpq quotes the part it could not parse, which may be part of
            # a password (an unquoted one with a space, say): then say less.
            detail = redactor.redact(str(exc)) if not _may_hold_password(dsn) else "libpq could not parse it"
            raise ValueError(
                f"dsn is not a valid connection string ({detail}); quote values with spaces: password='a b'"
            ) from None
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


def _forget_after_fork() -> None:
    for transport in list(_TRANSPORTS):
        transport.after_fork()


os.register_at_fork(after_in_child=_forget_after_fork)
