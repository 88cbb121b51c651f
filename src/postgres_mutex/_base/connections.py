"""How the library's own connections are opened, and how one that died while idle is recognised.

A client opens (in dsn mode) at most two connections per engine: one for
statements and one that listens for releases. Both run in autocommit (every
lock statement is its own transaction: one round trip), with
``application_name``, TCP keepalives and a connect timeout unless the DSN or
the ``PG*`` environment already sets them. The DSN itself is passed to
psycopg untouched; it is checked first (`check_connection_args`), in words
that never quote its password.
"""

from __future__ import annotations

import math
import os
import secrets
from typing import Any

import psycopg
from psycopg import pq
from psycopg.conninfo import conninfo_to_dict

from ..errors import InvalidArgument
from .acompat import ready_to_read
from .secrets import Redactor

FAILURES = (psycopg.Error, OSError)
"""What a failing psycopg call can raise: its own errors (pool errors derive
from them) and OS errors from a socket the watchdog shut down."""

_ENV_FOR_PARAM = {
    "application_name": "PGAPPNAME",
    "connect_timeout": "PGCONNECT_TIMEOUT",
    "tcp_user_timeout": None,
    "keepalives": None,
    "keepalives_idle": None,
    "keepalives_interval": None,
    "keepalives_count": None,
}


def connect_defaults(dsn: str, *, application_name: str, operation_timeout: float) -> dict[str, Any]:
    """Connection parameters the library adds, only where the DSN and environment are silent.

    These are keyword parameters; any the user set (in the DSN or a PG*
    variable) wins.
    """
    given = conninfo_to_dict(dsn)
    wanted: dict[str, Any] = {
        # Visible in pg_stat_activity; libpq caps it at 63 bytes.
        "application_name": application_name.encode()[:63].decode(errors="ignore"),
        # libpq's minimum is 2 s; a dead server must not hang a connect for minutes.
        "connect_timeout": max(2, math.ceil(operation_timeout)),
        # Drop a connection whose sent data stays unacknowledged (a real partition).
        "tcp_user_timeout": max(1, int(operation_timeout * 1000)),
        # Notice a dead peer on an idle connection (the listener, a holder between heartbeats).
        "keepalives": 1,
        "keepalives_idle": 10,
        "keepalives_interval": 5,
        "keepalives_count": 3,
    }
    return {
        key: value
        for key, value in wanted.items()
        if key not in given and not ((env := _ENV_FOR_PARAM[key]) and os.environ.get(env))
    }


def closed_while_idle(conn: psycopg.BaseConnection[Any]) -> bool:
    """True if the server closed this idle connection (``idle_session_timeout``, a restart, a proxy).

    An idle connection of ours has nothing to say; if its socket is readable,
    the server spoke: usually its goodbye. Reading it now, before sending,
    turns what would be a failed statement into a quiet reconnect.
    """
    if conn.closed or conn.broken:
        return True
    try:
        spoke = ready_to_read((conn.fileno(),), 0)
    except (OSError, ValueError):
        return True
    if not spoke:
        return False
    pgconn = conn.pgconn
    try:
        pgconn.consume_input()
    except psycopg.OperationalError:
        return True
    return pgconn.status != pq.ConnStatus.OK


def unusable(conn: psycopg.BaseConnection[Any]) -> bool:
    """Whether a connection must not serve another statement: broken, or left mid-command.

    An exception raised into a statement (a signal handler's, a job runner's
    timeout) leaves the connection with a command in flight; it cannot be
    trusted with the next one, so it is discarded.
    """
    # `closed` and `broken` alike read the status BAD (a broken connection is closed): read once.
    pgconn = conn.pgconn
    return pgconn.status == BAD or pgconn.transaction_status != IDLE


BAD = pq.ConnStatus.BAD
IDLE = pq.TransactionStatus.IDLE


def discard(conn: psycopg.BaseConnection[Any]) -> None:
    """Close a connection at once, whatever state it is in.

    `pgconn.finish` rather than `close`: a pool configured with
    ``close_returns`` would otherwise take a closed connection back twice.
    """
    conn.pgconn.finish()


class ServerSession:
    """What the library knows of, and set on, the server session of one connection of its own.

    Found out with the connection's first lock statement (`_sql.session_setup`),
    set again with any whose deadline does not fit the session's, and
    forgotten with the connection: a new connection starts a new session.
    """

    __slots__ = ("backend_pid", "direct", "key", "longest_ms", "pooler_told", "retired", "timeout_ms")

    def __init__(self, backend_pid: int) -> None:
        self.backend_pid = backend_pid
        """The server process of the connection (read once: psycopg's ``info`` is a new object each time)."""
        self.key = secrets.randbits(63) or 1
        """The session's key: a holder that opts in to ``reclaim_disconnected_after`` names its session by it
        (`_sql.sessions`); the first statement that writes it takes it as a session-level advisory lock."""
        self.direct: bool | None = None
        """Whether it reaches PostgreSQL with no pooler between; None until the first statement asks."""
        self.timeout_ms: int | None = None
        """The session's ``statement_timeout`` as the library last set it (direct connections only)."""
        self.longest_ms: int | None = None
        """The ``statement_timeout`` the session was last set for a statement of the longest deadline yet: a
        shorter one is set for the session only while that deadline still fits it (`_io.engine_async`)."""
        self.pooler_told = False
        """Told that behind a pooler a hold with ``reclaim_disconnected_after`` falls back to the thresholds."""
        self.retired = False
        """Its prepared statements no longer fit the table (a column changed type): the connection is replaced."""


def describe_dsn(dsn: str) -> str:
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.Error:
        return "dsn"
    host = params.get("host") or os.environ.get("PGHOST") or "localhost"
    port = params.get("port") or os.environ.get("PGPORT") or "5432"
    dbname = params.get("dbname") or os.environ.get("PGDATABASE") or ""
    return f"{host}:{port}/{dbname}"


SERVER_VARIABLES = ("PGHOST", "PGHOSTADDR", "PGPORT", "PGDATABASE", "PGUSER", "PGSERVICE")
"""libpq's variables that say which server (or database on it) to reach: one set means the environment is
configured for PostgreSQL, as psql and the command line use it."""


def dsn_or_environment(dsn: str | None, pool: object, async_pool: object) -> str | None:
    """The DSN to use: as given, or, with no dsn and no pool, the environment's (``""``), as libpq and psql do.

    libpq fills an empty conninfo from the ``PG*`` variables and its defaults, and
    with none set its default is a local socket. Without any of `SERVER_VARIABLES`
    a forgotten ``dsn`` is far more likely than a deliberate local socket, so it is
    refused at construction, in words that say how to ask for either.
    """
    if dsn is not None or pool is not None or async_pool is not None:
        return dsn
    if any(os.environ.get(name) for name in SERVER_VARIABLES):
        return ""
    raise ValueError(
        "Mutex needs a connection source: pass dsn, or pool and/or async_pool, or set PGHOST (or another of "
        f"{', '.join(SERVER_VARIABLES)}) for libpq to read; dsn='' connects with libpq's defaults (a local socket)"
    )


def check_connection_args(dsn: object, pool: object, async_pool: object) -> Redactor:
    """Validate how to reach PostgreSQL (exactly one way); returns what masks the DSN's password."""
    if dsn is not None and not isinstance(dsn, str):
        raise TypeError(f"dsn must be a str, not {type(dsn).__name__}")
    if dsn is not None and (pool is not None or async_pool is not None):
        raise ValueError("pass either dsn or pool/async_pool, not both: with a pool, the library opens no connection")
    dsn = dsn_or_environment(dsn if isinstance(dsn, str) else None, pool, async_pool)
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
            raise InvalidArgument(
                "{dsn} is not a valid connection string ({detail}); quote values with spaces: password='a b'",
                detail=detail,
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
