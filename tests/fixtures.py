from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import psycopg
import pytest

from postgres_mutex import LockNotHeldError, Mutex
from tests.faultproxy import FaultProxy
from tests.postgres_server import PostgresServer, configured_server, local_server
from tests.timing import FAST as FAST  # the suite's one table of short thresholds, re-exported


def wait_until(predicate: Callable[[], object], *, timeout: float = 10.0, interval: float = 0.02) -> None:
    """Poll ``predicate`` until it is truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s: {predicate}")
        time.sleep(interval)


def skip_or_fail_in_ci(reason: str) -> NoReturn:
    """Skip a test that needs what this machine lacks; in CI (CI=true) such a gap fails instead."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}: CI must run this test, not skip it")
    pytest.skip(reason=reason)


def required_tool(name: str, package: str) -> str:
    """Path of a command-line tool, or skip (fail in CI) naming the Debian package that has it."""
    found = shutil.which(name)
    if found is None:
        skip_or_fail_in_ci(f"{name} not found: install Debian's {package} package")
    return found


@contextlib.contextmanager
def frozen_holder(mutex: Mutex) -> Iterator[None]:
    """Hold the lock, then stop heartbeating as a frozen process would.

    The row goes stale and the holder's lease runs out, so leaving the block
    raises LockNotHeldError: that is asserted here.
    """
    with pytest.raises(LockNotHeldError), mutex.acquire() as acquired:
        assert acquired
        freeze(mutex)
        yield


def freeze(mutex: Mutex) -> None:
    """Stop a holder's heartbeats, as if its process froze (its lease still runs out, and is noticed)."""
    hold = mutex._lock.hold
    assert hold is not None
    hold.paused = True


@pytest.fixture(scope="session")
def pg() -> Iterator[PostgresServer]:
    with configured_server() as server:
        yield server


@pytest.fixture
def own_pg(pg: PostgresServer) -> Iterator[PostgresServer]:
    """A server this test may restart: a fresh one when the suite starts servers, else a restartable one."""
    if pg.started_by_suite:
        with local_server() as server:
            yield server
        return
    if not pg.restartable:
        skip_or_fail_in_ci("restarting PostgreSQL needs POSTGRES_MUTEX_TEST_RESTART with POSTGRES_MUTEX_TEST_DSN")
    yield pg


@pytest.fixture
def needs_superuser(pg: PostgresServer) -> None:
    """For tests that create roles and log in with passwords."""
    if not pg.superuser:
        skip_or_fail_in_ci("needs a superuser DSN: it creates roles and uses password authentication")


@pytest.fixture(scope="session")
def dsn(pg: PostgresServer) -> str:
    return pg.dsn()


@pytest.fixture(scope="session")
def schema(dsn: str) -> None:
    """The default lock table exists."""
    bootstrap = Mutex(dsn, "schema-bootstrap")
    bootstrap.create_schema()
    bootstrap.close()


@pytest.fixture
def admin(dsn: str, schema: None) -> Iterator[psycopg.Connection[Any]]:
    """A connection of the suite's own, for inspecting the table from outside any Mutex.

    One per test: a test that restarts the server must not break the next one's.
    """
    with psycopg.connect(dsn, autocommit=True) as conn:
        yield conn


@pytest.fixture
def lock_name() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def make_mutex(dsn: str, lock_name: str, admin: psycopg.Connection[Any]) -> Iterator[Callable[..., Mutex]]:
    """Build Mutexes with fast thresholds; each is closed after the test."""
    made: list[Mutex] = []

    def make(*args: Any, **kwargs: Any) -> Mutex:
        if not args and "pool" not in kwargs and "async_pool" not in kwargs:
            kwargs.setdefault("dsn", dsn)
        kwargs.setdefault("lock_name", lock_name)
        for key, value in FAST.items():
            kwargs.setdefault(key, value)
        mutex = Mutex(*args, **kwargs)
        made.append(mutex)
        return mutex

    yield make
    for mutex in made:
        with contextlib.suppress(Exception):
            mutex.close()


@pytest.fixture
async def amake_mutex(make_mutex: Callable[..., Mutex]) -> AsyncIterator[Callable[..., Mutex]]:
    """Like make_mutex, also closing the async connections on the test's loop."""
    made: list[Mutex] = []

    def make(*args: Any, **kwargs: Any) -> Mutex:
        mutex = make_mutex(*args, **kwargs)
        made.append(mutex)
        return mutex

    yield make
    for mutex in made:
        with contextlib.suppress(Exception):
            await mutex.aclose()


@pytest.fixture
def row(admin: psycopg.Connection[Any], lock_name: str) -> Callable[..., tuple[Any, ...] | None]:
    """The lock row as the database sees it: (instance_id, heartbeat age s, held for s) or None."""

    def read(name: str | None = None, table: str = "mutex_lock") -> tuple[Any, ...] | None:
        return admin.execute(
            f"SELECT instance_id, EXTRACT(EPOCH FROM now() - last_heartbeat)::float8, "  # noqa: S608
            f"EXTRACT(EPOCH FROM now() - acquired_at)::float8 FROM {table} WHERE lock_name = %s",
            (name or lock_name,),
        ).fetchone()

    return read


@pytest.fixture
def holder_id(row: Callable[..., tuple[Any, ...] | None]) -> Callable[..., str | None]:
    """The instance_id holding the lock per the table, or None."""

    def read(name: str | None = None, table: str = "mutex_lock") -> str | None:
        found = row(name, table)
        return None if found is None else str(found[0])

    return read


@pytest.fixture(scope="session")
def _spent_proxies() -> Iterator[list[FaultProxy]]:
    spent: list[FaultProxy] = []
    yield spent
    for fault_proxy in spent:
        fault_proxy.close()


@pytest.fixture
def proxy(pg: PostgresServer, _spent_proxies: list[FaultProxy]) -> Iterator[FaultProxy]:
    fault_proxy = FaultProxy(pg.host, pg.port)
    yield fault_proxy
    # Healed and kept open to the end of the session: Mutexes closed after this
    # test still reach the server through it and delete what they left.
    fault_proxy.heal()
    _spent_proxies.append(fault_proxy)


@pytest.fixture
def proxy_dsn(pg: PostgresServer, proxy: FaultProxy) -> str:
    # No TLS and no GSS negotiation: the proxy reads the protocol in clear.
    return pg.dsn(host="127.0.0.1", port=proxy.port, sslmode="disable", gssencmode="disable")


class RecordingMetrics:
    """A metrics hook recording every call as (method, lock_name, kwargs)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict[str, Any]]] = []

    def __getattr__(self, method: str) -> Callable[..., None]:
        if method.startswith("_"):
            raise AttributeError(method)

        def record(*args: Any, **kwargs: Any) -> None:
            # Lock calls pass the lock name first; a watcher's "observed" passes its observations.
            first = args[0] if args else ""
            if isinstance(first, str):
                self.calls.append((method, first, kwargs))
            else:
                self.calls.append((method, "", {"observations": first, **kwargs}))

        return record

    def named(self, method: str) -> list[dict[str, Any]]:
        return [kwargs for name, _, kwargs in self.calls if name == method]


@pytest.fixture
def metrics() -> RecordingMetrics:
    return RecordingMetrics()


ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def row_locked(dsn: str, lock_name: str) -> Iterator[None]:
    """Another session holds the lock row (SELECT ... FOR UPDATE): its holder's heartbeats cannot land."""
    with psycopg.connect(dsn) as blocker:
        blocker.execute("SELECT 1 FROM mutex_lock WHERE lock_name = %s FOR UPDATE", (lock_name,))
        yield
        blocker.rollback()


def start_worker(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Run ``python -m tests.workers ARGS`` (see tests/workers.py) as a separate process."""
    return subprocess.Popen(
        [sys.executable, "-m", "tests.workers", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=None if env is None else {**os.environ, **env},
    )


def read_held(proc: subprocess.Popen[str]) -> str:
    """Wait for a worker's first line, "held <instance_id>" (or "ready"), and return its second word."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith(("held ", "ready")), (
        f"worker did not start: {line!r} {proc.stderr.read() if proc.stderr else ''}"
    )
    return [*line.split(), ""][1]


@pytest.fixture
def workers() -> Iterator[list[subprocess.Popen[str]]]:
    """Worker processes started by a test; killed at its end if still running."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture(autouse=True)
def _library_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="postgres_mutex")
