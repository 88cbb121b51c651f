"""The pytest fixtures every suite shares (a pytest plugin, see the root conftest.py), and the helpers tests call."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import IO, Any, NoReturn, TypeVar

import psycopg
import pytest

from postgres_mutex import LockNotHeldError, Mutex, MutexClient
from postgres_mutex._kinds.holder import Holder  # what Mutex, Semaphore and RWLock holders share
from postgres_mutex._sql import Names
from postgres_mutex._sql.wake import SLOTS, slot_channel
from postgres_mutex.client import core_of
from tests.support.faultproxy import FaultProxy
from tests.support.postgres_server import PASSWORD, PostgresServer, configured_server, local_server
from tests.support.timing import FAST as FAST  # the suite's one table of short thresholds, re-exported


def wait_until(predicate: Callable[[], object], *, timeout: float = 10.0, interval: float = 0.02) -> None:
    """Poll ``predicate`` until it is truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s: {predicate}")
        time.sleep(interval)


def read_line(stream: IO[str], *, timeout: float = 10.0) -> str:
    """The next line of a child's output, or fail after ``timeout`` seconds (a readline alone could block forever).

    The reading thread is left blocked on a child that stays silent; the child's end unblocks it.
    """
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not line:
        raise AssertionError(f"no line within {timeout}s")
    return line[0]


async def await_until(predicate: Callable[[], object], *, timeout: float = 10.0, interval: float = 0.02) -> None:
    """`wait_until` for async tests: polls without blocking the event loop."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s: {predicate}")
        await asyncio.sleep(interval)


async def held_in_a_task(mutex: Holder) -> asyncio.Task[None]:
    """A task that holds ``mutex`` in an ``async with`` block until cancelled; returned once it holds it."""
    entered = asyncio.Event()

    async def job() -> None:
        async with mutex.acquire_async():
            entered.set()
            await asyncio.sleep(3600)

    task = asyncio.create_task(job())
    await asyncio.wait_for(entered.wait(), 10)
    return task


def skip_or_fail_in_ci(reason: str, *, module: bool = False) -> NoReturn:
    """Skip a test that needs what this machine lacks; in CI (CI=true) such a gap fails instead.

    ``module``: called at import time, to skip (or fail) a whole test module.
    """
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}: CI must run this test, not skip it", pytrace=False)
    pytest.skip(reason=reason, allow_module_level=module)


def required_module(name: str, reason: str) -> ModuleType:
    """Import ``name``, or skip the calling test module (fail it in CI) saying why it is needed."""
    try:
        return importlib.import_module(name)
    except ImportError:
        skip_or_fail_in_ci(f"{name} cannot be imported: {reason}", module=True)


def required_tool(name: str, package: str) -> str:
    """Path of a command-line tool, or skip (fail in CI) naming the Debian package that has it."""
    found = shutil.which(name)
    if found is None:
        skip_or_fail_in_ci(f"{name} not found: install Debian's {package} package")
    return found


@contextlib.contextmanager
def frozen_holder(mutex: Holder) -> Iterator[None]:
    """Hold the lock, then stop heartbeating as a frozen process would.

    The row goes stale and the holder's lease runs out, so leaving the block
    raises LockNotHeldError: that is asserted here.
    """
    with pytest.raises(LockNotHeldError), mutex.acquire() as acquired:
        assert acquired
        freeze(mutex)
        yield


def thaw(mutex: Holder) -> None:
    """Let a holder `freeze` stopped heartbeat again, as a process resumed after SIGCONT would."""
    hold = mutex._lock.hold
    assert hold is not None
    hold.paused = False


def freeze(mutex: Holder) -> None:
    """Stop a holder's heartbeats, as if its process froze (its lease still runs out, and is noticed)."""
    hold = mutex._lock.hold
    assert hold is not None
    hold.paused = True


# -- what a waiter is doing, observed rather than slept on ------------------------------------

LISTENER_LOST = "the release listener lost its connection"
"""The library's DEBUG line when its listener's connection broke: every waiter is then woken to retry."""


def channel_of(lock_name: str, table: str = "mutex_lock", kind: str = "lock") -> str:
    """The NOTIFY channel a release of ``lock_name`` is announced on (``kind``: "semaphore",
    "read/write lock" for those)."""
    return Names(table).channel(lock_name, kind)


def release_channels(lock_name: str, table: str = "mutex_lock", kind: str = "lock") -> list[str]:
    """Every NOTIFY channel a release of ``lock_name`` may be announced on: the lock's own (nobody
    registered), and the channel of each slot a waiting process registers in (the one it wakes)."""
    channel = channel_of(lock_name, table, kind)
    return [channel, *(slot_channel(channel, slot) for slot in range(1, SLOTS + 1))]


def listens(mutex: Holder, *, engine: Any = None) -> bool:
    """In-process: the client of ``mutex`` LISTENs on its lock's channel (``engine``: an async engine, else sync).

    A waiter asks its client's listener to LISTEN, then tries the lock once
    more, then waits: with `contended` counting two attempts as well, it is
    waiting for the release and will be woken by its notification.
    """
    listener = (engine or core_of(mutex.client).engine()).listener
    return listener is not None and mutex._lock.channel in listener.listening


def process_listens(
    admin: psycopg.Connection[Any], lock_name: str, table: str = "mutex_lock", kind: str = "lock"
) -> bool:
    """Another process's release listener has LISTENed on ``lock_name``'s channel, as pg_stat_activity shows.

    The listener connection's last statement stays visible there while it idles: the LISTEN, alone or
    the process's registration on the channel (which LISTENs there).
    """
    query = (
        "SELECT 1 FROM pg_stat_activity WHERE application_name LIKE 'postgres-mutex listener%%' "
        "AND (query = %(listen)s OR position(%(listen)s || ';' IN query) > 0 OR position(%(registers)s IN query) > 0)"
    )
    channel = channel_of(lock_name, table, kind)
    listen, registers = f'LISTEN "{channel}"', f"format('LISTEN %I', '{channel}')"
    return admin.execute(query, {"listen": listen, "registers": registers}).fetchone() is not None


def listener_reconnected(caplog: pytest.LogCaptureFixture) -> bool:
    """The library logged that a release listener lost its connection (which wakes waiters without a release)."""
    return any(LISTENER_LOST in record.getMessage() for record in caplog.records)


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


Made = TypeVar("Made")


@contextlib.contextmanager
def closing_maker(kind: Callable[..., Made], **defaults: Any) -> Iterator[Callable[..., Made]]:
    """Makes ``kind(**kwargs)`` over ``defaults`` over the fast thresholds; closes all it made on leaving."""
    made: list[Any] = []

    def make(**kwargs: Any) -> Made:
        thing = kind(**{**FAST, **defaults, **kwargs})
        made.append(thing)
        return thing

    try:
        yield make
    finally:
        for thing in made:
            with contextlib.suppress(Exception):
                thing.close()


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


ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def row_locked(dsn: str, lock_name: str) -> Iterator[None]:
    """Another session holds the lock row (SELECT ... FOR UPDATE): its holder's heartbeats cannot land."""
    with psycopg.connect(dsn) as blocker:
        blocker.execute("SELECT 1 FROM mutex_lock WHERE lock_name = %s FOR UPDATE", (lock_name,))
        yield
        blocker.rollback()


@pytest.fixture
def uncommitted_insert(dsn: str, lock_name: str, schema: None) -> Iterator[psycopg.Connection[Any]]:
    """Another session inserts the lock's row and does not commit: an acquire of it waits on the server."""
    with psycopg.connect(dsn) as blocker:
        blocker.execute(
            "INSERT INTO mutex_lock (lock_name, instance_id, last_heartbeat, acquired_at) "
            "VALUES (%s, 'blocker', now(), now())",
            (lock_name,),
        )
        yield blocker
        blocker.rollback()


@pytest.fixture
def dml_role(pg: PostgresServer, admin: psycopg.Connection[Any], needs_superuser: None) -> Iterator[str]:
    """The DSN of a login role granted only what the README's Permissions section grants, as it says it.

    The tables it grants on are made first, as the section says, by the suite's
    owner role (``postgres-mutex init --celery-beat --apscheduler``); the role
    may not create anything in the schema.
    """
    from tests.support.doc_examples import ROOT, expand  # the README's own text, as the docs site includes it

    role = f"mutex_app_{uuid.uuid4().hex[:8]}"
    problems: list[str] = []
    section = [line for line, _ in expand("README.md:permissions", ROOT, problems)]
    grants = [line.replace("app_role", role) for line in section if line.startswith("GRANT ")]
    assert problems == []
    assert grants, "the README's Permissions section shows its GRANTs"
    with MutexClient(pg.dsn()) as owner:
        owner.table().create(celery_beat=True, apscheduler=True)
    admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{PASSWORD}'")
    # PostgreSQL 14 and older let everyone create tables in public: not here.
    admin.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")
    for grant in grants:
        admin.execute(grant)
    yield pg.dsn(user=role, password=PASSWORD)
    admin.execute(f"DROP OWNED BY {role}")
    admin.execute(f"DROP ROLE {role}")


def role_with_setting(pg: PostgresServer, admin: psycopg.Connection[Any], setting: str) -> Iterator[str]:
    """The DSN of a new login role with DML on the lock table whose sessions default to ``setting``; dropped after."""
    role = f"mutex_setting_{uuid.uuid4().hex[:8]}"
    admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{PASSWORD}'")
    admin.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON mutex_lock TO {role}")
    admin.execute(f"GRANT USAGE ON SEQUENCE mutex_lock_token_seq TO {role}")
    admin.execute(f"ALTER ROLE {role} SET {setting}")
    try:
        yield pg.dsn(user=role, password=PASSWORD)
    finally:
        admin.execute(f"DROP OWNED BY {role}")
        admin.execute(f"DROP ROLE {role}")


def start_worker(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Run ``python -m tests.support.workers ARGS`` (see tests/support/workers.py) as a separate process."""
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.workers", *args],
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
