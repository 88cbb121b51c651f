"""What the peers run on: a throwaway redis-server and etcd, and postgres-mutex 0.1.0 in a venv of its own.

Each is started by the bench on 127.0.0.1 (a free port) and removed at the
end. When one cannot be had (a binary missing, PyPI out of reach), its
context manager raises `Unavailable` with the reason, and the peers that need
it get a row that says so instead of figures. Servers that refuse root (or
should not run as root) run as the ``postgres`` OS user, as PgBouncer does
(`bench.servers.pgbouncer`).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from postgres_mutex._cli._embedded import free_port

PUBLISHED = "0.1.0"
"""The release of postgres-mutex on PyPI measured as a peer."""

START_TIMEOUT = 20.0


class Unavailable(RuntimeError):
    """A peer's server or package cannot be had here; the message says why, in a table cell."""


def _owner() -> pwd.struct_passwd | None:
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise Unavailable("running as root, and no 'postgres' or 'nobody' user to run the server as")


@contextlib.contextmanager
def _daemon(name: str, command: list[str], ready: Callable[[], bool], *, memory: bool = False) -> Iterator[Path]:
    """Run ``command`` (its ``{dir}`` replaced by a fresh directory) until the block ends.

    ``memory``: the directory in /dev/shm where there is one, so that the server's fsyncs cost
    nothing, as PostgreSQL's do with fsync off.
    """
    if shutil.which(command[0]) is None:
        raise Unavailable(f"`{command[0]}` is not installed (Debian: apt-get install {name})")
    shm = Path("/dev/shm")  # noqa: S108 - mkdtemp makes a private directory there
    base = str(shm) if memory and shm.is_dir() and os.access(shm, os.W_OK) else None
    root = Path(tempfile.mkdtemp(prefix=f"postgres-mutex-bench-{name}-", dir=base))
    owner = _owner()
    kwargs: dict[str, object] = {}
    if owner is not None:
        os.chown(root, owner.pw_uid, owner.pw_gid)
        kwargs = {"user": owner.pw_uid, "group": owner.pw_gid, "extra_groups": []}
    log = root / "log"
    with log.open("wb") as out:
        if owner is not None:
            os.chown(log, owner.pw_uid, owner.pw_gid)
        proc = subprocess.Popen(
            [part.replace("{dir}", str(root)) for part in command],
            cwd=root,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            **kwargs,  # type: ignore[call-overload]
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not ready():
            if proc.poll() is not None:
                raise Unavailable(f"{command[0]} exited at start: {_tail(log)}")
            if time.monotonic() > deadline:
                raise Unavailable(f"{command[0]} was not ready within {START_TIMEOUT:g} s: {_tail(log)}")
            time.sleep(0.05)
        yield root
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        shutil.rmtree(root, ignore_errors=True)


def _tail(log: Path) -> str:
    text = log.read_text(errors="replace").strip() if log.exists() else ""
    return " ".join(text[-300:].split()) or "(no output)"


@contextlib.contextmanager
def redis() -> Iterator[int]:
    """Debian's redis-server on a free loopback port, nothing persisted; yields the port."""
    port = free_port()

    def ready() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    command = ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"]
    with _daemon("redis-server", [*command, "--dir", "{dir}"], ready):
        yield port


@contextlib.contextmanager
def etcd() -> Iterator[int]:
    """Debian's etcd (etcd-server) alone on free loopback ports, its data in memory; yields the client port."""
    client, peer = free_port(), free_port()

    def ready() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{client}/health", timeout=1) as answer:
                return bool(json.loads(answer.read()).get("health") == "true")
        except (OSError, ValueError):
            return False

    command = [
        "etcd",
        "--data-dir",
        "{dir}/data",
        "--listen-client-urls",
        f"http://127.0.0.1:{client}",
        "--advertise-client-urls",
        f"http://127.0.0.1:{client}",
        "--listen-peer-urls",
        f"http://127.0.0.1:{peer}",
        "--initial-advertise-peer-urls",
        f"http://127.0.0.1:{peer}",
        "--initial-cluster",
        f"default=http://127.0.0.1:{peer}",
        "--log-level",
        "error",
    ]
    # etcd 3.4 has no switch to skip its fsyncs: its data lives in memory instead.
    with _daemon("etcd-server", command, ready, memory=True):
        yield client


def etcd_version() -> str:
    return _first_word_after("etcd", ["etcd", "--version"], "etcd Version:")


def redis_version() -> str:
    return _first_word_after("redis-server", ["redis-server", "--version"], "v=")


def _first_word_after(binary: str, command: list[str], marker: str) -> str:
    if shutil.which(binary) is None:
        return "not installed"
    found = subprocess.run(command, capture_output=True, text=True, timeout=10, check=False)
    text = found.stdout + found.stderr
    if marker not in text:
        return "unknown"
    return text.split(marker, 1)[1].split()[0]


@contextlib.contextmanager
def release_0_1_0() -> Iterator[str]:
    """postgres-mutex 0.1.0 from PyPI in a venv of its own (as the upgrade tests make it); yields its python."""
    root = Path(tempfile.mkdtemp(prefix="postgres-mutex-bench-0.1.0-"))
    try:
        venv = root / "venv"
        # Without ensurepip (seconds instead of tens on a busy machine): this interpreter's pip installs
        # into it (pip --python, pip 22.3 and later).
        made = subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", str(venv)], capture_output=True, text=True, timeout=120
        )
        if made.returncode != 0:
            raise Unavailable(f"could not make a venv for {PUBLISHED}: {' '.join(made.stderr.split())[-200:]}")
        python = venv / "bin" / "python"
        install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet"]
        install += ["--disable-pip-version-check", "--no-input"]
        try:
            subprocess.run(
                [*install, f"postgres-mutex=={PUBLISHED}", "psycopg[binary]"],
                check=True,
                capture_output=True,
                text=True,
                timeout=300,
            )
        except subprocess.CalledProcessError as exc:
            raise Unavailable(
                f"pip could not install postgres-mutex=={PUBLISHED}: {exc.stderr.strip()[-200:]}"
            ) from None
        except subprocess.TimeoutExpired:
            raise Unavailable(f"installing postgres-mutex=={PUBLISHED} from PyPI took over 300 s") from None
        found = subprocess.run(
            [str(python), "-I", "-c", "import postgres_mutex; print(postgres_mutex.__version__)"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if found.stdout.strip() != PUBLISHED:
            raise Unavailable(f"the venv's postgres_mutex is not {PUBLISHED}: {(found.stdout + found.stderr)[-200:]}")
        yield str(python)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def create_table_0_1_0(python: str, dsn: str, table: str) -> None:
    """0.1.0's own ``create_schema()`` for its table, run by its interpreter."""
    code = (
        "import sys; from postgres_mutex import Mutex; Mutex(sys.argv[1], 'bench', table=sys.argv[2]).create_schema()"
    )
    done = subprocess.run(
        [python, "-I", "-c", code, dsn, table], capture_output=True, text=True, timeout=60, check=False
    )
    if done.returncode != 0:
        raise Unavailable(f"0.1.0's create_schema failed: {done.stderr.strip()[-200:]}")
