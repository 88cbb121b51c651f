"""A real PgBouncer in front of a test server: started, restarted and stopped by the tests.

Debian's ``pgbouncer`` package (1.18 on Debian 12). It refuses to run as
root, so when the suite runs as root it runs as the ``postgres`` OS user (else
``nobody``), like the test servers. It listens on 127.0.0.1 on a free port
chosen at start, with ``auth_type = trust`` on its side and the server's own
password (if any) in its ``[databases]`` line, and forwards every database
name (``*``) to the server.

    with PgBouncer(server, pool_mode="transaction", default_pool_size=2) as bouncer:
        dsn = bouncer.dsn()
        bouncer.restart()   # the process is killed and a new one listens on the same port

Readiness is polled with a deadline (a connection through it answers
``SELECT 1``); everything it wrote is removed when it stops, whichever way the
test ended.
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
from pathlib import Path
from types import TracebackType
from typing import Literal

import psycopg

from tests.support.fixtures import required_tool
from tests.support.postgres_server import PostgresServer, free_port

PoolMode = Literal["transaction", "session"]

START_TIMEOUT = 15.0
STOP_TIMEOUT = 10.0


def server_user() -> pwd.struct_passwd | None:
    """The OS user servers run as: None (ourselves) unless we are root, who may not run them."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise RuntimeError("running as root, and no 'postgres' or 'nobody' user exists to run servers")


def as_user(user: pwd.struct_passwd | None) -> dict[str, object]:
    """``subprocess`` arguments that run a child as ``user`` (nothing when None)."""
    if user is None:
        return {}
    return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}


def owned_tempdir(prefix: str, user: pwd.struct_passwd | None) -> Path:
    """A fresh temporary directory ``user`` owns (readable by all, for the logs)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    path.chmod(0o755)
    if user is not None:
        os.chown(path, user.pw_uid, user.pw_gid)
    return path


def _quote(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


class PgBouncer:
    """One PgBouncer process in front of ``server``; a context manager.

    ``pool_mode`` is ``transaction`` or ``session``; ``default_pool_size`` is
    the number of server connections per (database, user) pair, kept small so
    tests can exhaust it.
    """

    def __init__(
        self,
        server: PostgresServer,
        *,
        pool_mode: PoolMode = "transaction",
        default_pool_size: int = 5,
        max_client_conn: int = 200,
    ) -> None:
        self.binary = required_tool("pgbouncer", "pgbouncer")
        self.server = server
        self.pool_mode = pool_mode
        self.default_pool_size = default_pool_size
        self.max_client_conn = max_client_conn
        self.host = "127.0.0.1"
        self.port = free_port()
        self._user = server_user()
        self.root = owned_tempdir("postgres-mutex-pgbouncer-", self._user)
        self._proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self._write_config()

    @property
    def config_file(self) -> Path:
        return self.root / "pgbouncer.ini"

    @property
    def log_file(self) -> Path:
        return self.root / "pgbouncer.log"

    def _write_config(self) -> None:
        server = self.server
        target = f"host={server.host} port={server.port}"
        if server.password:
            target += f" password={_quote(server.password)}"
        users = self.root / "users.txt"
        users.write_text(f'"{server.user}" ""\n')
        self.config_file.write_text(
            "\n".join(
                [
                    "[databases]",
                    f"* = {target}",
                    "",
                    "[pgbouncer]",
                    f"listen_addr = {self.host}",
                    f"listen_port = {self.port}",
                    "unix_socket_dir =",
                    "auth_type = trust",
                    f"auth_file = {users}",
                    f"pool_mode = {self.pool_mode}",
                    f"default_pool_size = {self.default_pool_size}",
                    f"max_client_conn = {self.max_client_conn}",
                    f"logfile = {self.log_file}",
                    f"pidfile = {self.root / 'pgbouncer.pid'}",
                    f"admin_users = {server.user}",
                    # psycopg sends none of these, but libpq users often do.
                    "ignore_startup_parameters = extra_float_digits",
                    "log_connections = 0",
                    "log_disconnections = 0",
                    "",
                ]
            )
        )
        if self._user is not None:
            for path in (users, self.config_file):
                os.chown(path, self._user.pw_uid, self._user.pw_gid)

    def dsn(self, **overrides: str | int) -> str:
        """A DSN reaching the server through this PgBouncer (TLS and GSS off: PgBouncer has neither here)."""
        return self.server.dsn(host=self.host, port=self.port, sslmode="disable", gssencmode="disable", **overrides)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int:
        assert self._proc is not None, "not started"
        return self._proc.pid

    def start(self) -> None:
        """Start the process and wait until a connection through it answers."""
        assert not self.running, "already running"
        self._proc = subprocess.Popen(
            [self.binary, str(self.config_file)],
            cwd=self.root,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            **as_user(self._user),  # type: ignore[call-overload]
        )
        self.wait_ready()

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if not self.running:
                raise RuntimeError(f"pgbouncer exited at start: {self.log_tail()}")
            try:
                with psycopg.connect(self.dsn(), connect_timeout=2, autocommit=True) as conn:
                    conn.execute("SELECT 1", prepare=False)
                    return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"pgbouncer not ready within {timeout}s: {self.log_tail()}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        """Immediate shutdown (SIGTERM; SIGKILL if it lingers): every client connection breaks."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_TIMEOUT)

    def restart(self) -> float:
        """Kill the process and start a new one on the same port; return how long it took."""
        started = time.monotonic()
        self.stop()
        self.start()
        self.restarts += 1
        return time.monotonic() - started

    def log_tail(self, size: int = 2000) -> str:
        return self.log_file.read_text(errors="replace")[-size:] if self.log_file.exists() else ""

    def close(self) -> None:
        """Stop and remove everything it wrote."""
        try:
            self.stop()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> PgBouncer:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
