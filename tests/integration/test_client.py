"""One client per process: many locks on two connections, one heartbeat round, no thread per lock."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import logging
import math
import re
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from postgres_mutex import LockTable, Mutex, MutexClient, MutexError, OperationTimeout, RWLock, Semaphore
from postgres_mutex._io.sources import OwnConnection
from postgres_mutex._state.heartbeat_flows import BATCH
from postgres_mutex._state.settings import Timing
from postgres_mutex.client import core_of
from tests.support.faultproxy import FaultProxy
from tests.support.fixtures import FAST, LISTENER_LOST, ROOT, RecordingMetrics, row_locked, wait_until
from tests.support.postgres_server import PostgresServer


def _connections(admin: psycopg.Connection[Any], application_name: str) -> int:
    found = admin.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (application_name,)
    ).fetchone()
    assert found is not None
    return int(found[0])


def test_many_locks_share_two_connections_one_heartbeat_round_and_a_few_threads(
    pg: PostgresServer, admin: psycopg.Connection[Any], schema: None
) -> None:
    name = f"many-{uuid.uuid4().hex[:6]}"
    earlier = set(threading.enumerate())  # other tests' clients may linger a few seconds
    proxy = FaultProxy(pg.host, pg.port)
    dsn = pg.dsn(host="127.0.0.1", port=proxy.port, sslmode="disable", gssencmode="disable", application_name=name)
    interval = 0.5
    thresholds = {"heartbeat_interval": interval, "alert_threshold": 5.0, "stale_threshold": 20.0}
    holders = [Mutex(dsn, f"{name}-{n}", **thresholds) for n in range(300)]  # type: ignore[arg-type]
    waiters = [Mutex(dsn, f"{name}-{n}", poll_interval=30.0, **thresholds) for n in range(20)]  # type: ignore[arg-type]
    held = [holder.acquire() for holder in holders]
    try:
        assert all(entered.__enter__() for entered in held)
        waiting = [threading.Thread(target=_wait_briefly, args=(waiter,)) for waiter in waiters]
        for thread in waiting:
            thread.start()
        wait_until(lambda: _connections(admin, name) == 2, timeout=10)  # statements, and the listener

        # Nothing else happens now: every round trip through the proxy is a heartbeat.
        time.sleep(interval)  # line the window up with whole intervals
        before = proxy.ready_for_query
        window = 4 * interval
        time.sleep(window)
        statements = proxy.ready_for_query - before
        # One round per interval, of one statement per batch of holds at most: a lease renews them in one.
        per_round = math.ceil(len(holders) / BATCH)
        assert 3 <= statements <= 5 * per_round, (
            f"{statements} round trips in {window:g}s: a heartbeat round of at most {per_round} statements per interval"
        )
        assert all(holder.held for holder in holders)
        # As docs/concepts/client.md says: per client heartbeats, the listener and the event
        # thread; per process the watchdog, whichever client started it.
        per_client, per_process = _documented_threads()
        ours = [
            thread.name
            for thread in threading.enumerate()
            if thread.name.startswith("postgres-mutex") and thread not in earlier and "watchdog" not in thread.name
        ]
        assert {"postgres-mutex-heartbeat", "postgres-mutex-listener"} <= set(ours), ours
        assert len(ours) <= per_client, ours
        watchdogs = [thread.name for thread in threading.enumerate() if "watchdog" in thread.name]
        assert len(watchdogs) == per_process, watchdogs
        assert _connections(admin, name) == 2, "300 held locks and 20 waiters, two connections"
        for thread in waiting:
            thread.join(timeout=60)
    finally:
        for entered in held:
            entered.__exit__(None, None, None)
        for mutex in holders + waiters:
            mutex.close()
        proxy.close()
    wait_until(lambda: _connections(admin, name) <= 1, timeout=15)  # the listener lingers a little


def test_a_heartbeat_of_many_locks_goes_in_statements_of_a_bounded_size(
    dsn: str, schema: None, admin: psycopg.Connection[Any]
) -> None:
    # Each heartbeat statement takes its turn on the connection the process's other lock
    # operations share: none may carry so many holds that it keeps them waiting long.
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    name = f"batched-{uuid.uuid4().hex[:6]}"
    count = 2 * BATCH + 1
    with MutexClient(dsn) as client:
        holders = [client.mutex(f"{name}-{n}", heartbeat_interval=0.2, tracer_provider=provider) for n in range(count)]
        with contextlib.ExitStack() as stack:
            assert all(stack.enter_context(holder.acquire()) for holder in holders)
            taken = admin.execute("SELECT clock_timestamp()").fetchone()
            assert taken is not None

            def renewed_since_taken() -> bool:
                # Renewed by itself, or by the lease it follows (concepts/the-table.md#leases), after it was
                # renewed by itself once: every hold goes in a statement of rows once, whatever renews it then.
                found = admin.execute(
                    "SELECT count(*) FROM mutex_lock AS held LEFT JOIN mutex_lock_leases AS lease USING (lease_key)"
                    " WHERE held.lock_name LIKE %s AND GREATEST(held.last_heartbeat, lease.last_heartbeat) > %s",
                    (f"{name}-%", taken[0]),
                ).fetchone()
                return found is not None and found[0] == count

            wait_until(renewed_since_taken, timeout=15)
            assert all(holder.held for holder in holders)
    provider.shutdown()
    carried = [
        int(str(span.attributes["postgres_mutex.locks"]))
        for span in exporter.get_finished_spans()
        if span.name == "postgres_mutex.heartbeat" and span.attributes is not None
    ]
    assert sum(carried) >= count, f"every hold was renewed, by statements of {carried} holds"
    assert max(carried) <= BATCH, f"heartbeat statements of {carried} holds: at most {BATCH} each"


def _documented_threads() -> tuple[int, int]:
    """The threads docs/concepts/client.md promises: at most so many per client, plus so many per process."""
    text = (ROOT / "docs" / "concepts" / "client.md").read_text(encoding="utf-8")
    found = re.search(
        r"^\| threads \| at most (\d+) \(.*?\), whatever the number of locks, plus (\d+) per process", text, re.M
    )
    assert found is not None, "docs/concepts/client.md has a threads row: at most N per client, plus M per process"
    return int(found[1]), int(found[2])


def _wait_briefly(waiter: Mutex) -> None:
    with pytest.raises(MutexError), waiter.acquire(blocking=True, timeout=4.0):
        pass


def _sleeps(thread: threading.Thread) -> int:
    """How many times ``thread`` has gone to sleep (Linux counts its voluntary context switches)."""
    with open(f"/proc/self/task/{thread.native_id}/status") as status:
        for line in status:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches in /proc")


def test_statements_that_end_in_time_never_wake_the_deadline_watchdog(make_mutex: Callable[..., Mutex]) -> None:
    timeout = 0.5
    mutex = make_mutex(operation_timeout=timeout)
    with mutex.acquire():
        pass
    watchdog = next(thread for thread in threading.enumerate() if thread.name == "postgres-mutex-watchdog")
    before = _sleeps(watchdog)
    for _ in range(300):
        with mutex.acquire():
            pass
    time.sleep(2 * timeout)  # every deadline the 600 statements armed comes due meanwhile
    woke = _sleeps(watchdog) - before
    assert woke < 60, f"the watchdog woke {woke} times for 600 statements that each ended long before their deadline"


def test_a_release_wakes_only_that_locks_waiters(make_mutex: Callable[..., Mutex], lock_name: str) -> None:
    slow_poll = {"poll_interval": 30.0}
    first, second = make_mutex(lock_name=f"{lock_name}-a"), make_mutex(lock_name=f"{lock_name}-b")
    attempts: dict[str, RecordingMetrics] = {"a": RecordingMetrics(), "b": RecordingMetrics()}
    waiter_a = make_mutex(lock_name=f"{lock_name}-a", metrics=attempts["a"], **slow_poll)
    waiter_b = make_mutex(lock_name=f"{lock_name}-b", metrics=attempts["b"], **slow_poll)
    holding_a, holding_b = first.acquire(), second.acquire()
    assert holding_a.__enter__()
    assert holding_b.__enter__()
    acquired_a: list[float] = []

    def wait(waiter: Mutex, out: list[float]) -> None:
        with waiter.acquire(blocking=True, timeout=20):
            out.append(time.monotonic())

    thread_a = threading.Thread(target=wait, args=(waiter_a, acquired_a))
    thread_b = threading.Thread(target=wait, args=(waiter_b, []))
    thread_a.start()
    thread_b.start()
    listener = core_of(first.client).engine().listener
    assert listener is not None
    wait_until(lambda: len(listener.listening) == 2)  # both wait on their own channel
    wait_until(lambda: len(attempts["a"].named("contended")) == 2 and len(attempts["b"].named("contended")) == 2)
    released_at = time.monotonic()
    holding_a.__exit__(None, None, None)
    thread_a.join(timeout=10)
    assert acquired_a, "A's waiter got the lock"
    assert acquired_a[0] - released_at < 1.0, "woken by the release, not by its 30 s poll"
    time.sleep(0.3)
    assert len(attempts["b"].named("contended")) == 2, "B's waiter was not woken by A's release"
    holding_b.__exit__(None, None, None)
    thread_b.join(timeout=10)


def test_a_listener_that_keeps_failing_is_reported_at_warning_and_its_waiter_still_gets_the_lock(
    pg: PostgresServer, admin: psycopg.Connection[Any], lock_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A database that takes no new connection: the waiter's statement connection, open
    # before, goes on working, and the listener's connection fails each time it is made.
    database = f"pm_listener_{uuid.uuid4().hex[:8]}"
    admin.execute(f'CREATE DATABASE "{database}"')
    made: list[Mutex] = []
    try:
        holder = Mutex(pg.dsn(dbname=database), lock_name, **FAST)  # type: ignore[arg-type]
        waiter = Mutex(pg.dsn(dbname=database, application_name="waiter"), lock_name, **FAST)  # type: ignore[arg-type]
        made += [holder, waiter]
        holder.create_schema()
        got: list[bool] = []
        with caplog.at_level(logging.DEBUG, logger="postgres_mutex"), holder.acquire():
            with waiter.acquire(blocking=False) as acquired:
                assert not acquired
            admin.execute(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS false')

            def wait() -> None:
                with waiter.acquire(blocking=True, timeout=30) as acquired:
                    got.append(bool(acquired))

            thread = threading.Thread(target=wait)
            thread.start()

            def warned() -> list[logging.LogRecord]:
                return [r for r in caplog.records if LISTENER_LOST in r.getMessage() and r.levelno == logging.WARNING]

            wait_until(lambda: len(warned()) > 0, timeout=20)
            assert "times in a row" in warned()[0].getMessage()
            assert "not currently accepting connections" in warned()[0].getMessage(), "the reason is said"
        thread.join(timeout=30)
        assert got == [True], "the waiter got the lock by polling"
        assert len(warned()) == 1, "said once, not at every attempt"
    finally:
        for mutex in made:
            mutex.close()
        admin.execute(f'DROP DATABASE "{database}" WITH (FORCE)')


def test_a_client_you_own_shares_its_connections_and_closes_them(
    pg: PostgresServer, admin: psycopg.Connection[Any], schema: None, lock_name: str
) -> None:
    name = f"owned-{uuid.uuid4().hex[:6]}"
    client = MutexClient(pg.dsn(application_name=name))
    nightly, hourly = client.mutex(f"{lock_name}-n", **FAST), client.mutex(f"{lock_name}-h", **FAST)
    assert isinstance(client.table(), LockTable)
    with nightly.acquire(), hourly.acquire():
        assert _connections(admin, name) == 1
        assert {seen.lock_name for seen in client.table().holders()} >= {nightly.lock_name, hourly.lock_name}
        holding = nightly.acquire
    still = hourly.acquire()
    assert still.__enter__()
    client.close()
    assert not hourly.held, "close() releases what the client's Mutexes hold"
    found = admin.execute("SELECT count(*) FROM mutex_lock WHERE lock_name = %s", (hourly.lock_name,)).fetchone()
    assert found == (0,)
    wait_until(lambda: _connections(admin, name) == 0)
    with pytest.raises(MutexError, match="closed"), holding():
        pass


@pytest.mark.parametrize(
    "one_block",
    [
        lambda dsn, name: Mutex(dsn, name, **FAST).acquire(),  # type: ignore[arg-type]
        lambda dsn, name: Semaphore(dsn, name, permits=2, **FAST).acquire(),  # type: ignore[arg-type]
        lambda dsn, name: RWLock(dsn, name, **FAST).write(),  # type: ignore[arg-type]
    ],
    ids=["Mutex", "Semaphore", "RWLock"],
)
def test_a_lock_made_for_one_block_and_never_closed_lets_the_shared_client_idle(
    pg: PostgresServer, admin: psycopg.Connection[Any], schema: None, lock_name: str, one_block: Callable[..., Any]
) -> None:
    # As with a closed one: once nothing refers to it, the shared client closes its connection. Without
    # the cyclic collector's help: the lock is let go of as the block ends, not at some later collection.
    name = f"one-block-{uuid.uuid4().hex[:6]}"
    dsn = pg.dsn(application_name=name)  # a shared client of this test's own
    collecting = gc.isenabled()
    gc.disable()
    try:
        with one_block(dsn, lock_name) as acquired:
            assert acquired
            assert _connections(admin, name) == 1
        wait_until(lambda: _connections(admin, name) == 0, timeout=5)
        with one_block(dsn, lock_name) as acquired:  # and opens one again on next use
            assert acquired
            assert _connections(admin, name) == 1
    finally:
        if collecting:
            gc.enable()


def test_a_shared_client_going_idle_never_closes_its_connection_under_a_statement(
    pg: PostgresServer, schema: None, lock_name: str
) -> None:
    # The last Mutex lets go of the client (here, closed) just as another starts a statement on its
    # connection: the client is not idle then, and the connection is not closed under the statement.
    last = Mutex(pg.dsn(application_name=f"busy-{uuid.uuid4().hex[:6]}"), lock_name, **FAST)  # type: ignore[arg-type]
    with last.acquire() as acquired:
        assert acquired
    engine = core_of(last.client).engine()
    source = engine._source
    assert isinstance(source, OwnConnection)
    engine._gate.enter(False, 1.0)  # a statement has the connection
    try:
        last.close()
        assert source._conn is not None, "closed under the statement"
    finally:
        engine._gate.leave()
    last = Mutex(last.dsn, lock_name, **FAST)  # type: ignore[arg-type]
    last.close()  # nothing uses the connection now: the client idles
    assert source._conn is None


def test_a_client_is_a_context_manager(dsn: str, schema: None, lock_name: str) -> None:
    with MutexClient(dsn) as client, client.mutex(lock_name).acquire() as acquired:
        assert acquired
    with pytest.raises(TypeError, match="no dsn="):
        client.mutex(lock_name, dsn=dsn)


async def test_an_event_loop_gets_its_own_two_connections(
    pg: PostgresServer, admin: psycopg.Connection[Any], schema: None, lock_name: str
) -> None:
    name = f"loop-{uuid.uuid4().hex[:6]}"
    dsn = pg.dsn(application_name=name)
    mutexes = [Mutex(dsn, f"{lock_name}-{n}", **FAST) for n in range(50)]  # type: ignore[arg-type]
    try:
        async with asyncio.timeout(30):
            entered = [mutex.acquire_async() for mutex in mutexes]
            for each in entered:
                assert await each.__aenter__()
            assert _connections(admin, name) == 1
            waiter = Mutex(dsn, f"{lock_name}-0", **FAST)  # type: ignore[arg-type]
            waiting = asyncio.ensure_future(_acquire_and_leave(waiter))
            await _until(lambda: _connections(admin, name) == 2)  # the loop's listener
            await entered[0].__aexit__(None, None, None)
            await waiting
            for each in entered[1:]:
                await each.__aexit__(None, None, None)
            await waiter.aclose()
    finally:
        for mutex in mutexes:
            await mutex.aclose()


async def _acquire_and_leave(mutex: Mutex) -> None:
    async with mutex.acquire_async(timeout=20):
        pass


async def _until(predicate: Callable[[], object], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"condition not met within {timeout}s"
        await asyncio.sleep(0.02)


def test_a_slow_callback_never_delays_a_heartbeat(make_mutex: Callable[..., Mutex]) -> None:
    released = threading.Event()

    class Slow:
        def heartbeat_latency(self, lock_name: str, *, instance_id: str, seconds: float) -> None:
            released.wait(3.0)  # longer than the whole lease (1.4 s)

    lost: list[object] = []
    slow = make_mutex(metrics=Slow(), on_lost=lost.append)
    with slow.acquire():
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:
            assert slow.held, "its heartbeats carried on while the hook was stuck"
            time.sleep(0.05)
        released.set()
    assert lost == []


@pytest.mark.parametrize("clean_up", [False, True], ids=["alone", "beside-a-clean-up"])
def test_a_stuck_acquire_never_delays_a_heartbeat_past_the_lease(
    make_mutex: Callable[..., Mutex], dsn: str, lock_name: str, clean_up: bool
) -> None:
    # A lease (stale_threshold less an interval: 3 s) that one stuck statement's second leaves room in,
    # on a busy machine, and that six of them, one after another, would run out.
    holder = make_mutex(heartbeat_interval=0.2, alert_threshold=1.5, stale_threshold=3.2)
    rival_name = f"{lock_name}-stuck"
    with holder.acquire(), psycopg.connect(dsn) as blocker, psycopg.connect(dsn) as row_locker:
        if clean_up:
            # A release the database did not answer in time: the heartbeat worker deletes the row
            # later, and must not wait behind the stuck acquires for its turn (renewing nothing).
            # Each of its tries waits a quarter of a second for the row, locked until the end.
            other = make_mutex(lock_name=f"{lock_name}-other", operation_timeout=0.25)
            with pytest.raises(OperationTimeout, match="deleted in the background"), other.acquire():
                row_locker.execute("SELECT 1 FROM mutex_lock WHERE lock_name = %s FOR UPDATE", (f"{lock_name}-other",))
        # Another session's uncommitted insert: an acquire of that lock waits on the server.
        blocker.execute(
            "INSERT INTO mutex_lock (lock_name, instance_id, last_heartbeat, acquired_at) "
            "VALUES (%s, 'blocker', now(), now())",
            (rival_name,),
        )
        stuck = [make_mutex(lock_name=rival_name, operation_timeout=1.0) for _ in range(6)]
        threads = [threading.Thread(target=_try_once, args=(mutex,)) for mutex in stuck]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 6.5
        while time.monotonic() < deadline:
            assert holder.held, "heartbeats go before the stuck acquires on the shared connection"
            time.sleep(0.05)
        for thread in threads:
            thread.join(timeout=20)
        blocker.rollback()
        row_locker.rollback()


def test_clean_ups_waiting_on_locked_rows_never_hold_the_heartbeats_past_the_lease(
    make_mutex: Callable[..., Mutex], dsn: str, lock_name: str
) -> None:
    # Releases the database did not answer in time: the heartbeat worker deletes their rows later,
    # and each try waits out an operation_timeout while the rows stay locked. One such try between
    # two heartbeats fits in the lease; six in a row would not.
    holder = make_mutex(heartbeat_interval=0.2, alert_threshold=1.5, stale_threshold=3.2)
    slow = {"heartbeat_interval": 1.0, "alert_threshold": 5.0, "stale_threshold": 10.0, "operation_timeout": 0.8}
    others = [make_mutex(lock_name=f"{lock_name}-other-{n}", **slow) for n in range(6)]
    with holder.acquire(), psycopg.connect(dsn) as row_locker:
        for other in others:
            with pytest.raises(OperationTimeout, match="deleted in the background"), other.acquire():
                row_locker.execute("SELECT 1 FROM mutex_lock WHERE lock_name = %s FOR UPDATE", (other.lock_name,))
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            assert holder.held, "a heartbeat goes between the clean-ups"
            time.sleep(0.05)
        row_locker.rollback()


def _try_once(mutex: Mutex) -> None:
    with mutex.acquire() as acquired:
        assert not acquired, "busy: another session is writing that row"


@pytest.mark.parametrize(
    ("heartbeat", "stale", "expected"),
    [(10.0, 600.0, 5.0), (0.2, 3.0, (3.0 - 0.4 - 0.4) / 3), (1.0, 3.0, (3.0 - 2.0) / 4)],
)
def test_the_default_operation_timeout_leaves_the_lease_room_for_two_retries(
    heartbeat: float, stale: float, expected: float
) -> None:
    timing = Timing.validate(
        heartbeat_interval=heartbeat,
        alert_threshold=(heartbeat + stale) / 2,
        stale_threshold=stale,
        poll_interval=0.5,
        operation_timeout=None,
    )
    assert timing.operation_timeout == pytest.approx(expected)
    assert timing.operation_timeout <= 5.0
    window = timing.stale_threshold - 2 * timing.heartbeat_interval
    assert 3 * timing.operation_timeout <= window + 1e-9, "the heartbeat and two retries fit before the lease ends"


def test_pool_mode_borrows_at_most_one_connection_per_operation(dsn: str, schema: None, lock_name: str) -> None:
    from psycopg_pool import ConnectionPool

    with ConnectionPool(dsn, min_size=1, max_size=1, open=True, timeout=10) as pool:
        client = MutexClient(pool=pool)
        holders = [client.mutex(f"{lock_name}-{n}", **FAST) for n in range(20)]
        entered = [holder.acquire() for holder in holders]
        assert all(each.__enter__() for each in entered)
        waiter = client.mutex(f"{lock_name}-0", **FAST)
        with pytest.raises(MutexError), waiter.acquire(blocking=True, timeout=0.5):
            pass
        time.sleep(3 * FAST["heartbeat_interval"])
        assert all(holder.held for holder in holders), "heartbeats and waiters take turns on one connection"
        for each in entered:
            each.__exit__(None, None, None)
        client.close()


@pytest.mark.parametrize("owner", ["Mutex", "LockTable", "MutexClient", "RWLock"])
def test_every_sync_method_has_an_async_twin_with_the_same_parameters(owner: str) -> None:
    import postgres_mutex

    cls = getattr(postgres_mutex, owner)
    twins = {"close": "aclose", "__enter__": "__aenter__", "__exit__": "__aexit__"}
    checked = 0
    # Its own methods and those it inherits (a Mutex's are its base's, shared with the other holders).
    members = {name: member for klass in reversed(cls.__mro__) for name, member in vars(klass).items()}
    for name, member in members.items():
        if (name.startswith("_") and name not in twins) or not inspect.isfunction(member):
            continue
        if name.endswith("_async") or name in twins.values() or name in ("mutex", "table", "close_async"):
            continue
        twin = getattr(cls, twins.get(name, f"{name}_async"), None)
        if twin is None:
            continue
        checked += 1
        # Context managers and decorators: their async twins return an async one, or decorate coroutines.
        context_managers = ("acquire", "singleton", "fenced", "read", "write", "read_singleton", "write_singleton")
        assert inspect.iscoroutinefunction(twin) or name in context_managers, f"{owner}.{name}"
        ours, theirs = inspect.signature(member).parameters, inspect.signature(twin).parameters
        assert list(ours) == list(theirs), f"{owner}.{name} and its twin take the same parameters"
        for parameter in ours:
            if parameter != "blocking":  # documented: sync acquires try once, async ones wait
                assert ours[parameter].default == theirs[parameter].default, f"{owner}.{name}({parameter}=)"
    assert checked >= 2


def test_the_generated_sync_engine_is_up_to_date() -> None:
    import subprocess
    import sys

    from tests.support.fixtures import ROOT

    result = subprocess.run(
        [sys.executable, "tools/async_to_sync.py", "--check"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr


def _failed_on_close(caplog: pytest.LogCaptureFixture, lock_name: str) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.levelno == logging.WARNING
        and "on close failed" in record.getMessage()
        and repr(lock_name) in record.getMessage()
    ]


def test_a_release_that_fails_as_the_client_closes_is_logged_naming_the_lock(
    dsn: str, schema: None, lock_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    client = MutexClient(dsn)
    mutex = client.mutex(lock_name, **{**FAST, "operation_timeout": 0.5})
    assert mutex.acquire().__enter__()
    with row_locked(dsn, lock_name):  # the release's DELETE waits past its deadline
        client.close()
    assert len(_failed_on_close(caplog, lock_name)) == 1, "close() said nothing of the release it could not make"


async def test_a_release_that_fails_as_the_client_closes_is_logged_naming_the_lock_async(
    dsn: str, schema: None, lock_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    client = MutexClient(dsn)
    mutex = client.mutex(lock_name, **{**FAST, "operation_timeout": 0.5})
    assert await mutex.acquire_async().__aenter__()
    with row_locked(dsn, lock_name):
        await client.aclose()
    assert len(_failed_on_close(caplog, lock_name)) == 1, "aclose() said nothing of the release it could not make"
