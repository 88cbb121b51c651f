"""The lock through a real PgBouncer (Debian's 1.18), in transaction mode and in session mode.

Every combination a user can pick — PgBouncer's transaction or session
pooling, and the Mutex's dsn mode (a connection of its own, through
PgBouncer) or pool mode (a psycopg_pool in front of PgBouncer) — is driven
through contention, hand-off, heartbeats, lock loss and release, and a
restart of PgBouncer under a held lock. Critical sections go through the
chaos suite's overlap checker; the figures go to
``chaos/report/pgbouncer-report.{json,md}``, which docs/how-to/pgbouncer.md
quotes.

What PgBouncer changes, and what these tests pin down:

- transaction mode hands each transaction to any server connection, so a
  LISTEN lands on a connection the waiter no longer has: waiters get the lock
  by polling (within ``poll_interval``), and a notification PgBouncer passes
  to another client only makes that client re-check its own lock early;
- session mode pins one server connection per client connection: a dsn-mode
  Mutex holds one for its lifetime, so clients beyond ``default_pool_size``
  wait inside PgBouncer, and their statements pass ``operation_timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Literal

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from chaos.harness import Events
from postgres_mutex import (
    LockAcquisitionTimeout,
    LockNotHeldError,
    LockTable,
    Mutex,
    MutexClient,
    MutexError,
    OperationTimeout,
)
from tests.integration.test_cli import cli
from tests.support.exclusion import Sections
from tests.support.figures import Figures, ran_whole
from tests.support.fixtures import channel_of, wait_until
from tests.support.pgbouncer import PgBouncer
from tests.support.postgres_server import PostgresServer

pytestmark = pytest.mark.pgbouncer

HEARTBEAT, ALERT, STALE = 0.2, 1.0, 3.0
LEASE = STALE - HEARTBEAT
POLL = 0.1
OPERATION_TIMEOUT = 1.0
# Any: unpacked into Mutex(...) next to other keyword arguments.
TIMING: dict[str, Any] = {
    "heartbeat_interval": HEARTBEAT,
    "alert_threshold": ALERT,
    "stale_threshold": STALE,
    "poll_interval": POLL,
    "operation_timeout": OPERATION_TIMEOUT,
}
# How late a thread may run on a busy two-core machine: bounds "within" checks.
SLACK = 0.5

Holder = Callable[..., str | None]


@pytest.fixture(scope="module")
def figures(request: pytest.FixtureRequest) -> Iterator[Figures]:
    collected = Figures(
        "pgbouncer-report",
        "postgres-mutex through PgBouncer (measured by tests/integration/test_pgbouncer.py)",
        {**TIMING, "pgbouncer": "1.18 (Debian 12)"},
    )
    yield collected
    if collected.scenarios:
        collected.write(docs_copy=ran_whole(request.path))


@pytest.fixture(scope="module", params=["transaction", "session"])
def bouncer(request: pytest.FixtureRequest, pg: PostgresServer) -> Iterator[PgBouncer]:
    """One PgBouncer per pool mode for the module, with room for every test's clients."""
    with PgBouncer(pg, pool_mode=request.param, default_pool_size=20) as started:
        yield started


class Through:
    """Mutexes reaching PostgreSQL through a PgBouncer in one of the library's two connection modes."""

    def __init__(self, bouncer: PgBouncer, via: str, lock_name: str) -> None:
        self.bouncer = bouncer
        self.via = via
        self.lock_name = lock_name
        self.events = Events()
        self.sections = Sections()
        self.pool: ConnectionPool[Any] | None = None
        self._mutexes: list[Mutex] = []
        if via == "pool":
            self.pool = ConnectionPool(bouncer.dsn(), min_size=1, max_size=4, open=True)
            self.pool.wait(timeout=10)

    @property
    def label(self) -> str:
        return f"{self.bouncer.pool_mode} mode, {self.via} mode"

    def mutex(self, who: str, lock_name: str | None = None, **options: Any) -> Mutex:
        """A Mutex named ``who`` whose loss ends its critical section, reporting to `events`."""
        settings: dict[str, Any] = {**TIMING, "instance_id": who, "metrics": self.events}
        settings["on_lost"] = self.sections.on_lost(who)
        settings.update(options)
        connect: dict[str, Any] = {"pool": self.pool} if self.pool is not None else {"dsn": self.bouncer.dsn()}
        mutex = Mutex(lock_name=lock_name or self.lock_name, **connect, **settings)
        self._mutexes.append(mutex)
        return mutex

    def count(self, event: str, who: str, since: float = 0.0) -> int:
        return sum(1 for e in self.events.named(event) if e.fields.get("instance_id") == who and e.at > since)

    def close(self) -> None:
        # Closed before the next test: in session mode each open connection pins a server connection.
        for mutex in self._mutexes:
            with contextlib.suppress(Exception):
                mutex.close()
        if self.pool is not None:
            self.pool.close()


@pytest.fixture(params=["dsn", "pool"])
def through(request: pytest.FixtureRequest, bouncer: PgBouncer, lock_name: str, schema: None) -> Iterator[Through]:
    world = Through(bouncer, request.param, lock_name)
    try:
        yield world
    finally:
        world.close()
    assert world.sections.overlaps() == [], "two holders at once"


def beats(through: Through, who: str, since: float = 0.0) -> list[float]:
    return [e.at for e in through.events.named("heartbeat_latency") if e.fields["instance_id"] == who and e.at > since]


# -- contention, hand-off, heartbeats, loss, release: every mode ------------------------------------


def test_contention_and_hand_off(through: Through, holder_id: Holder, figures: Figures) -> None:
    """A second instance is refused while the lock is held; a waiter gets it once the holder releases."""
    holder, other = through.mutex("holder"), through.mutex("other")
    # A long poll interval tells a wake-up by notification (milliseconds) from one by polling.
    waiter_poll = 0.5
    waiter = through.mutex("waiter", poll_interval=waiter_poll)
    hand_offs: list[float] = []
    for _ in range(3):
        got: list[float] = []

        def wait() -> None:
            with through.sections.holding(waiter, "waiter", blocking=True, timeout=10) as acquired:
                got.append(time.monotonic())  # noqa: B023
                assert acquired

        with through.sections.holding(holder, "holder") as acquired:
            assert acquired
            assert holder_id() == "holder"
            with other.acquire() as second:
                assert not second, "refused while held"
            thread = threading.Thread(target=wait)
            contended = through.count("contended", "waiter")
            thread.start()
            # Waiting, and past its first re-check (where a dsn-mode waiter starts to LISTEN).
            wait_until(lambda: through.count("contended", "waiter") >= contended + 2)  # noqa: B023
        released = time.monotonic()
        thread.join(10)
        assert got, "the waiter got the lock"
        hand_offs.append(got[0] - released)
        assert holder_id() is None, "the waiter released in turn"
    assert max(hand_offs) < waiter_poll + SLACK, "the waiter polled at worst"
    if through.bouncer.pool_mode == "session" and through.via == "dsn":
        # Session mode keeps the waiter's LISTEN on its own server connection.
        assert max(hand_offs) < waiter_poll / 2, f"woken by the release's notification: {hand_offs}"
    assert through.count("released", "holder") == 3
    woken_by = "notification" if max(hand_offs) < waiter_poll / 2 else "polling"
    figures.record(
        f"{through.label}: hand-off",
        waiter_poll_interval_s=waiter_poll,
        hand_off_s=[round(h, 3) for h in hand_offs],
        woken_by=woken_by,
    )


def test_heartbeats_keep_the_row_fresh(
    through: Through, row: Callable[..., tuple[Any, ...] | None], figures: Figures
) -> None:
    holder = through.mutex("holder")
    ages: list[float] = []
    with through.sections.holding(holder, "holder"):
        start = time.monotonic()
        while time.monotonic() - start < HEARTBEAT * 8:
            found = row()
            assert found is not None
            ages.append(found[1])
            time.sleep(0.05)
        assert holder.held
    latencies = [e.fields["seconds"] for e in through.events.named("heartbeat_latency")]
    assert len(latencies) >= 5, "heartbeats went through"
    assert max(ages) < HEARTBEAT * 3, f"the row's heartbeat never went stale: worst age {max(ages):.3f}s"
    assert through.events.named("heartbeat_failed") == []
    figures.record(
        f"{through.label}: heartbeats",
        median_heartbeat_s=statistics.median(latencies),
        worst_row_age_s=max(ages),
    )


def test_a_deleted_row_is_a_lost_lock_at_the_next_heartbeat(
    through: Through, admin: psycopg.Connection[Any], holder_id: Holder, figures: Figures
) -> None:
    holder, successor = through.mutex("holder"), through.mutex("successor")
    with pytest.raises(LockNotHeldError), through.sections.holding(holder, "holder"):
        wait_until(lambda: len(beats(through, "holder")) >= 1)
        # An operator's `postgres-mutex release --force`, straight on the server.
        admin.execute("DELETE FROM mutex_lock WHERE lock_name = %s", (through.lock_name,))
        deleted = time.monotonic()
        wait_until(lambda: through.events.first("lost") is not None, timeout=HEARTBEAT + OPERATION_TIMEOUT + SLACK)
        assert not holder.held
        with pytest.raises(LockNotHeldError):
            holder.ensure_held()
    lost = through.events.first("lost")
    assert lost is not None
    assert "deleted" in lost.fields["reason"]
    with through.sections.holding(successor, "successor") as acquired:
        assert acquired, "the lock is free for the next instance"
        assert holder_id() == "successor"
    figures.record(f"{through.label}: row deleted under the holder", holder_told_after_s=lost.at - deleted)


def test_release_deletes_the_row(through: Through, holder_id: Holder) -> None:
    holder = through.mutex("holder")
    with holder.acquire() as acquired:
        assert acquired
        assert holder_id() == "holder"
    assert holder_id() is None
    assert through.count("released", "holder") == 1
    with pytest.raises(LockNotHeldError):
        holder.release()  # nothing held: refused, as threading.Lock.release refuses
    assert through.count("released", "holder") == 1


def test_behind_pgbouncer_a_holder_that_would_name_its_session_falls_back_to_the_thresholds(
    bouncer: PgBouncer, lock_name: str, schema: None, admin: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A pooler's server session is not the client's: the row names none, the hold falls back, and it is said."""
    options = {**TIMING, "operation_timeout": 0.3, "reclaim_disconnected_after": 1.2}
    mutex = Mutex(bouncer.dsn(), lock_name, **options)
    try:
        with caplog.at_level(logging.WARNING, logger="postgres_mutex"), mutex.acquire() as acquired:
            assert acquired
            mutex.heartbeat()
            row = admin.execute(
                "SELECT session_key, reclaim_after FROM mutex_lock WHERE lock_name = %s", (lock_name,)
            ).fetchone()
            assert row == (None, 1.2), "no session named: never reclaimed early"
            (seen,) = LockTable(bouncer.dsn()).holders([lock_name])
            assert (seen.session_alive, seen.reclaim_disconnected_after) == (None, 1.2)
        warnings = [r.getMessage() for r in caplog.records if "reclaim_disconnected_after" in r.getMessage()]
        assert len(warnings) == 1, warnings
        assert "not reclaimed early" in warnings[0]
    finally:
        mutex.close()


async def test_async_contention_and_hand_off(bouncer: PgBouncer, lock_name: str, schema: None) -> None:
    """acquire_async through PgBouncer, on a dedicated connection and on an AsyncConnectionPool."""
    sections = Sections()
    async with AsyncConnectionPool(bouncer.dsn(), min_size=1, max_size=4, open=False) as pool:
        await pool.wait(timeout=10)
        connects: list[dict[str, Any]] = [{"dsn": bouncer.dsn()}, {"async_pool": pool}]
        for connect in connects:
            holder = Mutex(lock_name=lock_name, instance_id="holder", **connect, **TIMING)
            waiter = Mutex(lock_name=lock_name, instance_id="waiter", **connect, **TIMING)
            done = asyncio.Event()

            async def wait(waiter: Mutex = waiter, done: asyncio.Event = done) -> None:
                async with waiter.acquire_async(timeout=10) as acquired:
                    section = sections.enter("waiter")
                    assert acquired
                    assert done.is_set(), "the holder had finished"
                    sections.leave(section)

            async with holder.acquire_async(blocking=False) as acquired:
                section = sections.enter("holder")
                assert acquired
                task = asyncio.create_task(wait())
                await asyncio.sleep(HEARTBEAT * 3)
                assert not task.done()
                done.set()
                sections.leave(section)
            await asyncio.wait_for(task, 10)
            await holder.aclose()
            await waiter.aclose()
    assert sections.overlaps() == []


# -- transaction mode: LISTEN does not survive, waiters poll --------------------------------------


@pytest.fixture
def one_server_connection(pg: PostgresServer) -> Iterator[PgBouncer]:
    """Transaction mode with a single server connection: every client shares it, LISTENs included."""
    with PgBouncer(pg, pool_mode="transaction", default_pool_size=1) as started:
        yield started


def test_transaction_mode_the_library_prepares_and_sets_nothing_on_the_server_connection_it_shares(
    one_server_connection: PgBouncer, admin: psycopg.Connection[Any], lock_name: str, schema: None
) -> None:
    """Through a pooler the library finds it is not alone on the server session, and leaves it as it was.

    A prepared statement or a session setting would stay on PgBouncer's one
    server connection and reach the next client it serves; on a direct
    connection the library makes both (see test_network_faults).
    """
    queries = (
        "SELECT (SELECT count(*) FROM pg_prepared_statements), current_setting('statement_timeout'),"
        " current_setting('default_transaction_isolation')"
    )
    as_the_server_makes_it = admin.execute(queries).fetchone()
    with MutexClient(one_server_connection.dsn()) as client:
        mutex = client.mutex(lock_name, **TIMING)
        for _ in range(8):  # past psycopg's own threshold of five
            with mutex.acquire() as acquired:
                assert acquired
                mutex.heartbeat()
        with psycopg.connect(one_server_connection.dsn(), autocommit=True, prepare_threshold=None) as other:
            assert other.execute(queries, prepare=False).fetchone() == as_the_server_makes_it


def test_transaction_mode_the_release_listener_prepares_nothing_on_the_server_connection_either(
    one_server_connection: PgBouncer, pg: PostgresServer, admin: psycopg.Connection[Any], lock_name: str, schema: None
) -> None:
    """LISTEN and UNLISTEN, sent again and again, stay unprepared: a prepared one would collide with another's."""
    unlisten = f'UNLISTEN "{channel_of(lock_name)}"'

    def unlistened() -> bool:
        return admin.execute("SELECT 1 FROM pg_stat_activity WHERE query = %s", (unlisten,)).fetchone() is not None

    with Mutex(pg.dsn(), lock_name, **TIMING).acquire(), MutexClient(one_server_connection.dsn()) as client:
        waiter = client.mutex(lock_name, **TIMING)
        for _ in range(8):  # past psycopg's own threshold of five
            with pytest.raises(LockAcquisitionTimeout), waiter.acquire(blocking=True, timeout=0.5):
                pass
            # The listener's last statement on the one server connection: this round's UNLISTEN
            # (the waiter's attempts came through it since the last round's).
            wait_until(unlistened, timeout=10)
        with psycopg.connect(one_server_connection.dsn(), autocommit=True, prepare_threshold=None) as other:
            found = other.execute("SELECT name, statement FROM pg_prepared_statements", prepare=False).fetchall()
    assert found == []


def test_transaction_mode_waiters_poll_and_a_notification_for_another_client_does_no_harm(
    one_server_connection: PgBouncer, pg: PostgresServer, lock_name: str, schema: None, figures: Figures
) -> None:
    """Two waiters share PgBouncer's one server connection; each lock's release is announced on that connection.

    Waiter 1 LISTENs through PgBouncer, but its LISTEN stays on the server
    connection, which PgBouncer hands to whichever client runs a transaction.
    Lock 1's release notification therefore reaches waiter 2 (busy on that
    connection at the time) instead: waiter 2 must not take lock 2, still
    held, and waiter 1 must get lock 1 by polling.

    Lock 1 lives in a table of its own, so that waiter 2 can be kept busy on
    the server connection (its acquire waits behind a lock on lock 2's table)
    while lock 1 is released.
    """
    events = Events()
    lock1, lock2 = lock_name, f"{lock_name}-2"
    sections = {lock1: Sections(), lock2: Sections()}  # one overlap check per lock
    waiter_poll = 0.5
    made: list[Mutex] = []

    table1 = f"pgb_notify_{uuid.uuid4().hex[:8]}"
    LockTable(pg.dsn(), table=table1).create()

    def mutex(who: str, name: str, dsn: str, **options: Any) -> Mutex:
        # A client each, as separate processes would have: a notification meant for one
        # must reach the other's connection to be "meant for another client".
        settings: dict[str, Any] = {**TIMING, "instance_id": who, "metrics": events, **options}
        made.append(MutexClient(dsn).mutex(name, on_lost=sections[name].on_lost(who), **settings))
        return made[-1]

    direct = pg.dsn()
    holder1, holder2 = mutex("holder-1", lock1, direct, table=table1), mutex("holder-2", lock2, direct)
    through = one_server_connection.dsn()
    waiter1 = mutex("waiter-1", lock1, through, poll_interval=waiter_poll, table=table1)
    waiter2 = mutex("waiter-2", lock2, through, poll_interval=waiter_poll)
    got: dict[str, float] = {}

    def wait(waiter: Mutex, who: str) -> None:
        with sections[waiter.lock_name].holding(waiter, who, blocking=True, timeout=20) as acquired:
            got[who] = time.monotonic()
            assert acquired

    def contended(who: str) -> int:
        return sum(1 for e in events.named("contended") if e.fields["instance_id"] == who)

    threads = [
        threading.Thread(target=wait, args=(waiter1, "waiter-1")),
        threading.Thread(target=wait, args=(waiter2, "waiter-2")),
    ]
    try:
        with sections[lock2].holding(holder2, "holder-2"), contextlib.ExitStack() as stack:
            # Entered by hand, released by hand below: its release is the moment under test.
            assert stack.enter_context(holder1.acquire())
            section1 = sections[lock1].enter("holder-1")
            for thread in threads:
                thread.start()
            # Both past their first re-check: both have sent LISTEN through PgBouncer.
            wait_until(lambda: contended("waiter-1") >= 2 and contended("waiter-2") >= 2)
            with psycopg.connect(direct, autocommit=True) as watch:
                with table_locked(direct, "mutex_lock"):
                    # Waiter 2's next attempt waits behind the table lock, holding the one server connection.
                    wait_until(lambda: _waiting_on_a_lock(watch), timeout=waiter_poll + 2)
                    before = contended("waiter-2")
                    # Lock 1's release: its notification goes to the busy server connection, so to waiter 2.
                    sections[lock1].leave(section1)
                    stack.close()
                    released = time.monotonic()
                    time.sleep(0.2)
                # Waiter 2's statement finishes (contended: lock 2 is still held) and it re-checks.
                wait_until(lambda: "waiter-1" in got, timeout=waiter_poll + OPERATION_TIMEOUT + SLACK)
            woken = [e.at for e in events.named("contended") if e.fields["instance_id"] == "waiter-2"]
            assert "waiter-2" not in got, "a stray notification did not hand waiter 2 a held lock"
            time.sleep(waiter_poll * 2)
            assert "waiter-2" not in got
            assert holder2.held
        for thread in threads:
            thread.join(20)
        assert set(got) == {"waiter-1", "waiter-2"}, "both waiters got their lock; nothing hung"
    finally:
        for each in made:
            with contextlib.suppress(Exception):
                each.client.close()
        with psycopg.connect(direct, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {table1}")
            conn.execute(f"DROP SEQUENCE IF EXISTS {table1}_token_seq")
    assert sections[lock1].overlaps() == []
    assert sections[lock2].overlaps() == []
    # The blocked attempt ended, contended: lock 1's notification, delivered to the server
    # connection waiter 2 was using, reached no listener of its, and handed it nothing.
    after = [at for at in woken[before:] if at > released]
    assert len(after) >= 1
    figures.record(
        "transaction mode, dsn mode: release notification landed on another client",
        waiter_poll_interval_s=waiter_poll,
        waiter_1_got_its_lock_after_s=got["waiter-1"] - released,
        waiter_2_wrongly_acquired=False,
    )


@contextlib.contextmanager
def table_locked(dsn: str, table: str) -> Iterator[None]:
    """Another session holds a lock on ``table`` that every write to it waits behind."""
    with psycopg.connect(dsn) as blocker:
        blocker.execute(f"LOCK TABLE {table} IN SHARE MODE")
        yield
        blocker.rollback()


def _waiting_on_a_lock(conn: psycopg.Connection[Any]) -> bool:
    # An acquire's statement, or its call of the table's acquire function (whose INSERT waits).
    found = conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND (query LIKE %s OR query LIKE %s)",
        ("%INSERT INTO%", '%\\_acquire"(%'),
    ).fetchone()
    return bool(found and found[0])


@pytest.mark.parametrize("via", ["dsn", "pool"])
def test_transaction_mode_a_waiter_with_a_timeout_never_hangs(
    pg: PostgresServer, via: str, lock_name: str, schema: None, figures: Figures
) -> None:
    with PgBouncer(pg, pool_mode="transaction", default_pool_size=2) as bouncer:
        world = Through(bouncer, via, lock_name)
        try:
            holder, waiter = world.mutex("holder"), world.mutex("waiter")
            with holder.acquire():
                started = time.monotonic()
                with pytest.raises(LockAcquisitionTimeout) as caught, waiter.acquire(blocking=True, timeout=1.0):
                    pytest.fail("must not run")
                waited = time.monotonic() - started
            assert caught.value.holder == "holder"
            assert 1.0 <= waited < 1.0 + OPERATION_TIMEOUT + SLACK
        finally:
            world.close()
    figures.record(f"transaction mode, {via} mode: blocking acquire, timeout 1 s, lock held", gave_up_after_s=waited)


# -- session mode: one server connection per client connection -----------------------------------


def test_session_mode_a_client_beyond_the_pool_size_times_out_instead_of_hanging(
    pg: PostgresServer, lock_name: str, schema: None, figures: Figures
) -> None:
    """Each client (a process, in real life) pins a server connection; the next one waits inside PgBouncer.

    The Mutexes of one client share its connection, however many there are:
    two clients fill a pool of two, a third waits, within its deadlines.
    """
    with PgBouncer(pg, pool_mode="session", default_pool_size=2) as bouncer:
        clients = [MutexClient(bouncer.dsn()) for _ in range(3)]
        try:
            first, second = (client.mutex(f"{lock_name}-{n}", **TIMING) for n, client in enumerate(clients[:2]))
            siblings = [clients[0].mutex(f"{lock_name}-sibling-{n}", **TIMING) for n in range(5)]
            third = clients[2].mutex(f"{lock_name}-c", **TIMING)
            with first.acquire() as a, second.acquire() as b, contextlib.ExitStack() as stack:
                assert a
                assert b
                for sibling in siblings:
                    assert stack.enter_context(sibling.acquire()), "on the first client's server connection"
                started = time.monotonic()
                with pytest.raises(OperationTimeout) as caught, third.acquire():
                    pytest.fail("must not run")
                refused_after = time.monotonic() - started
                assert caught.value.transient
                assert refused_after < OPERATION_TIMEOUT * 2 + SLACK, "the statement's deadline held"
                started = time.monotonic()
                with pytest.raises(MutexError), third.acquire(blocking=True, timeout=1.5):
                    pytest.fail("must not run")
                gave_up_after = time.monotonic() - started
                assert gave_up_after < 1.5 + OPERATION_TIMEOUT * 2 + SLACK, "a blocking acquire gives up on time"
                assert first.held
                assert second.held
                assert all(sibling.held for sibling in siblings)
            clients[0].close()  # its server connection goes back to PgBouncer's pool
            with third.acquire(blocking=True, timeout=10) as acquired:
                assert acquired
        finally:
            for client in clients:
                client.close()
    figures.record(
        "session mode, dsn mode: a third client with default_pool_size 2",
        statement_gave_up_after_s=refused_after,
        blocking_acquire_timeout_1_5s_gave_up_after_s=gave_up_after,
    )


@pytest.mark.parametrize("pool_mode", ["transaction", "session"])
def test_one_client_holds_hundreds_of_locks_through_a_pool_of_two_server_connections(
    pg: PostgresServer,
    lock_name: str,
    schema: None,
    admin: psycopg.Connection[Any],
    pool_mode: Literal["transaction", "session"],
    figures: Figures,
) -> None:
    """The many-locks client behind a small ``default_pool_size``: its heartbeat rounds renew them all."""
    count = 300
    events = Events()
    with PgBouncer(pg, pool_mode=pool_mode, default_pool_size=2) as bouncer, MutexClient(bouncer.dsn()) as client:
        mutexes = [client.mutex(f"{lock_name}-{n}", metrics=events, **TIMING) for n in range(count)]
        with contextlib.ExitStack() as stack:
            for mutex in mutexes:
                assert stack.enter_context(mutex.acquire())
            started = time.monotonic()

            def renewals() -> int:
                first = mutexes[0].instance_id
                return sum(
                    1 for e in events.named("heartbeat_latency") if e.fields["instance_id"] == first and e.at > started
                )

            wait_until(lambda: renewals() >= 10, timeout=30)
            oldest = admin.execute(
                "SELECT count(*), max(EXTRACT(EPOCH FROM now() - last_heartbeat))::float8 "
                "FROM mutex_lock WHERE lock_name LIKE %s",
                (f"{lock_name}-%",),
            ).fetchone()
            assert oldest is not None
            assert oldest[0] == count
            assert oldest[1] < 3 * HEARTBEAT, "every row renewed within a few heartbeat intervals"
            assert all(mutex.held for mutex in mutexes)
            assert events.named("lost") == []
        assert all(not mutex.held for mutex in mutexes), "all released"
    figures.record(
        f"{pool_mode} mode: {count} locks on one client, default_pool_size 2",
        oldest_heartbeat_s=round(oldest[1], 3),
        heartbeats_of_one_lock=renewals(),
    )


# -- PgBouncer restarted, or gone, under a held lock ------------------------------------------------


def test_a_pgbouncer_restart_under_a_held_lock(through: Through, holder_id: Holder, figures: Figures) -> None:
    holder, waiter = through.mutex("holder"), through.mutex("waiter")
    got: list[float] = []

    def wait() -> None:
        with through.sections.holding(waiter, "waiter", blocking=True, timeout=20) as acquired:
            got.append(time.monotonic())
            assert acquired

    thread = threading.Thread(target=wait)
    with through.sections.holding(holder, "holder"):
        wait_until(lambda: len(beats(through, "holder")) >= 2)
        thread.start()
        wait_until(lambda: through.count("contended", "waiter") >= 2)
        before = max(beats(through, "holder"))
        restart_took = through.bouncer.restart()
        restarted = time.monotonic()
        wait_until(lambda: len(beats(through, "holder", since=restarted)) >= 2, timeout=LEASE)
        after = min(beats(through, "holder", since=restarted))
        assert holder.held, "the holder kept its lock"
        assert holder_id() == "holder"
        assert not got, "the waiter still waits"
    released = time.monotonic()
    thread.join(20)
    assert got, "the waiter got the lock after the restart"
    assert through.events.named("lost") == []
    assert through.events.named("stale_reclaimed") == []
    failed = sum(1 for e in through.events.named("heartbeat_failed") if e.at > before)
    figures.record(
        f"{through.label}: PgBouncer restarted under a held lock",
        restart_s=restart_took,
        heartbeat_gap_s=after - before,
        heartbeats_failed=failed,
        lock_kept=True,
        waiter_acquired_after_release_s=got[0] - released,
    )


@pytest.mark.parametrize("via", ["dsn", "pool"])
def test_pgbouncer_down_past_the_lease_the_holder_knows_before_anyone_reclaims(
    pg: PostgresServer, via: str, lock_name: str, schema: None, holder_id: Holder, figures: Figures
) -> None:
    with PgBouncer(pg, pool_mode="transaction", default_pool_size=4) as bouncer:
        world = Through(bouncer, via, lock_name)
        try:
            holder = world.mutex("holder")
            # The reclaimer reaches PostgreSQL directly: only the holder's path is down.
            reclaimer = Mutex(pg.dsn(), lock_name, instance_id="reclaimer", metrics=world.events, **TIMING)
            with pytest.raises(LockNotHeldError), world.sections.holding(holder, "holder"):
                wait_until(lambda: len(beats(world, "holder")) >= 2)
                bouncer.stop()
                silent_from = max(beats(world, "holder"))
                with world.sections.holding(reclaimer, "reclaimer", blocking=True, timeout=STALE * 3) as acquired:
                    assert acquired
                    assert not holder.held
                    bouncer.start()
                    with pytest.raises(LockNotHeldError):
                        holder.heartbeat()
                    assert holder_id() == "reclaimer"
            assert holder_id() is None, "the old holder's release did not delete the reclaimer's row"
            reclaimer.close()
        finally:
            world.close()
    lost, reclaimed = world.events.first("lost"), world.events.first("stale_reclaimed")
    assert lost is not None
    assert reclaimed is not None
    assert lost.at < reclaimed.at, "the holder knew before the reclaim"
    assert world.sections.overlaps() == []
    figures.record(
        f"transaction mode, {via} mode: PgBouncer down past the lease",
        last_heartbeat_to_loss_s=lost.at - silent_from,
        last_heartbeat_to_reclaim_s=reclaimed.at - silent_from,
        knew_before_reclaim_s=reclaimed.at - lost.at,
    )


# -- the command line ---------------------------------------------------------------------------


def test_the_command_line_through_transaction_mode(pg: PostgresServer, lock_name: str, schema: None) -> None:
    with PgBouncer(pg, pool_mode="transaction", default_pool_size=2) as bouncer:
        holder = Mutex(bouncer.dsn(), lock_name, **TIMING)
        with holder.acquire():
            status = cli("status", "--dsn", bouncer.dsn(), "--json", "--lock", lock_name)
            assert status.returncode == 0, status.stderr
            [lock] = json.loads(status.stdout)["locks"]
            assert lock["holder"] == holder.instance_id
            busy = cli("run", "--dsn", bouncer.dsn(), "--lock", lock_name, "--", "true")
            assert busy.returncode == 75, busy.stderr
        holder.close()
        ran = cli("run", "--dsn", bouncer.dsn(), "--lock", lock_name, "--", "true")
        assert ran.returncode == 0, ran.stderr
        bouncer.stop()
        down = cli("status", "--dsn", bouncer.dsn())
        assert down.returncode == 69, "PgBouncer gone: PostgreSQL could not be used"
