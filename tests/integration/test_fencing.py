"""Fencing: a token per acquisition, and a fence that keeps a holder who lost the lock from writing."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from postgres_mutex import LockNotHeldError, LockTable, Mutex, OperationTimeout, SchemaError
from tests.support.faultproxy import FaultProxy
from tests.support.fixtures import FAST, ROOT, RecordingMetrics, freeze, wait_until
from tests.support.postgres_server import PASSWORD, PostgresServer

Holder = Callable[..., str | None]


def token_of(admin: psycopg.Connection[Any], lock_name: str, table: str = "mutex_lock") -> int | None:
    found = admin.execute(f"SELECT token FROM {table} WHERE lock_name = %s", (lock_name,)).fetchone()  # noqa: S608
    return None if found is None else found[0]


@pytest.fixture
def ledger(admin: psycopg.Connection[Any]) -> Iterator[str]:
    """A table of the user's own, in the lock table's database: what the lock protects."""
    name = f"ledger_{uuid.uuid4().hex[:8]}"
    admin.execute(f"CREATE TABLE {name} (id int PRIMARY KEY, counter int NOT NULL)")
    admin.execute(f"INSERT INTO {name} VALUES (1, 0)")  # noqa: S608
    yield name
    admin.execute(f"DROP TABLE {name}")


def counter(admin: psycopg.Connection[Any], ledger: str) -> int:
    found = admin.execute(f"SELECT counter FROM {ledger} WHERE id = 1").fetchone()  # noqa: S608
    assert found is not None
    return int(found[0])


# -- tokens ------------------------------------------------------------------------------


def test_every_acquisition_gets_a_greater_token(
    make_mutex: Callable[..., Mutex], admin: psycopg.Connection[Any], lock_name: str
) -> None:
    first, second = make_mutex(instance_id="first"), make_mutex(instance_id="second")
    seen: list[int] = []

    def record(mutex: Mutex) -> None:
        assert mutex.token is not None
        assert mutex.token == token_of(admin, lock_name), "the token is the row's"
        seen.append(mutex.token)

    with first.acquire():  # a fresh insert
        record(first)
    assert first.token is None, "no token while not held"
    with second.acquire():  # another instance, after a release
        record(second)
    with first.acquire():  # the same instance again
        record(first)
    with pytest.raises(LockNotHeldError), first.acquire():
        record(first)
        assert LockTable(first.dsn).force_release(lock_name) is not None  # an operator's override
        with second.acquire() as acquired:
            assert acquired
            record(second)
            wait_until(lambda: not first.held)  # its next heartbeat finds the row taken over
    assert seen == sorted(seen)
    assert len(set(seen)) == len(seen), f"strictly increasing: {seen}"


def test_tokens_increase_across_reclaims_own_row_takeovers_and_a_server_restart(
    own_pg: PostgresServer, lock_name: str
) -> None:
    dsn = own_pg.dsn()
    LockTable(dsn).create()
    seen: list[int] = []
    dead = Mutex(dsn, lock_name, instance_id="dead", **FAST)  # type: ignore[arg-type]
    rival = Mutex(dsn, lock_name, instance_id="rival", **FAST)  # type: ignore[arg-type]
    with pytest.raises(LockNotHeldError), dead.acquire():
        assert dead.token is not None
        seen.append(dead.token)
        freeze(dead)
        with rival.acquire(blocking=True, timeout=10):  # a reclaim of the silent row
            assert rival.token is not None
            seen.append(rival.token)
    # The same instance_id takes its own row back (a restarted process reusing its id).
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO mutex_lock (lock_name, instance_id, last_heartbeat, acquired_at) "
            "VALUES (%s, 'rival', now(), now() - interval '1 second')",
            (lock_name,),
        )
    with rival.acquire() as taken_back:
        assert taken_back
        assert rival.token is not None
        seen.append(rival.token)
    own_pg.restart()
    with rival.acquire(blocking=True, timeout=15):
        assert rival.token is not None
        seen.append(rival.token)
    assert seen == sorted(seen)
    assert len(set(seen)) == len(seen), f"strictly increasing: {seen}"
    dead.close()
    rival.close()


# -- the fence -------------------------------------------------------------------------------


def test_a_fenced_write_lands_while_the_lock_is_held(
    make_mutex: Callable[..., Mutex], dsn: str, admin: psycopg.Connection[Any], ledger: str
) -> None:
    mutex = make_mutex()
    with mutex.acquire(), psycopg.connect(dsn) as conn:
        with mutex.fenced(conn) as token:
            assert token == mutex.token
            conn.execute(f"UPDATE {ledger} SET counter = counter + 1 WHERE id = 1")  # noqa: S608
        with conn.transaction():
            assert mutex.fence(conn) == token
            conn.execute(f"UPDATE {ledger} SET counter = counter + 1 WHERE id = 1")  # noqa: S608
    assert counter(admin, ledger) == 2


def test_a_fence_after_the_lock_changed_hands_raises_and_the_write_rolls_back(
    make_mutex: Callable[..., Mutex], dsn: str, admin: psycopg.Connection[Any], ledger: str, lock_name: str
) -> None:
    paused, rival = make_mutex(instance_id="paused"), make_mutex(instance_id="rival")
    with pytest.raises(LockNotHeldError), paused.acquire():
        freeze(paused)
        # What the holder's own lease cannot see: its row went stale on the server (a failover that
        # lost its heartbeats, say) and another instance reclaimed it.
        admin.execute(
            "UPDATE mutex_lock SET last_heartbeat = now() - interval '1 hour' WHERE lock_name = %s", (lock_name,)
        )
        with rival.acquire() as reclaimed:
            assert reclaimed
            assert paused.held, "its lease still says it holds the lock"
            with (
                psycopg.connect(dsn) as conn,
                pytest.raises(LockNotHeldError) as fenced_out,
                paused.fenced(conn),
            ):
                conn.execute(f"UPDATE {ledger} SET counter = counter + 100 WHERE id = 1")  # noqa: S608
            assert fenced_out.value.reason.startswith("fenced out")
            assert "now held by rival" in str(fenced_out.value)
    assert counter(admin, ledger) == 0, "its write rolled back"


def test_a_hold_whose_lease_ran_out_is_refused_a_fence_even_before_anyone_reclaims(
    make_mutex: Callable[..., Mutex], dsn: str
) -> None:
    mutex = make_mutex()
    with pytest.raises(LockNotHeldError), mutex.acquire():
        freeze(mutex)
        wait_until(lambda: not mutex.held, timeout=5)
        with psycopg.connect(dsn) as conn, pytest.raises(LockNotHeldError, match="lease"):
            mutex.fence(conn)


def test_a_fence_after_a_forced_release_names_the_change(
    make_mutex: Callable[..., Mutex], dsn: str, lock_name: str
) -> None:
    holder, other = make_mutex(instance_id="holder"), make_mutex(instance_id="other")
    with pytest.raises(LockNotHeldError), holder.acquire():
        # No heartbeat of the holder's may find the row gone first: then the hold is lost before
        # the fence asks, and the error says so instead (a loaded machine delays the steps below).
        freeze(holder)
        LockTable(dsn).force_release(lock_name)
        with other.acquire() as acquired:
            assert acquired
            with psycopg.connect(dsn) as conn, pytest.raises(LockNotHeldError) as caught, holder.fenced(conn):
                pytest.fail("must not run")
            assert caught.value.reason.startswith("fenced out")
            assert "now held by other" in str(caught.value)


def test_a_forced_release_waiting_behind_a_fenced_transaction_does_not_starve_the_holder(
    make_mutex: Callable[..., Mutex], dsn: str, lock_name: str
) -> None:
    # The operator's forced release runs in the holder's own process (one client, one
    # connection) and waits longer than the holder's lease: the holder must go on renewing.
    seen = RecordingMetrics()
    holder = make_mutex(metrics=seen)
    lease = FAST["stale_threshold"] - FAST["heartbeat_interval"]
    table = LockTable(dsn, operation_timeout=2 * lease)
    outcome: list[BaseException | object] = []

    def force() -> None:
        try:
            outcome.append(table.force_release(lock_name))
        except BaseException as exc:
            outcome.append(exc)

    with holder.acquire(), psycopg.connect(dsn) as conn, conn.transaction():
        holder.fence(conn)  # the holder's fenced transaction stays open through the forced release
        thread = threading.Thread(target=force)
        beats_before = len(seen.named("heartbeat_latency"))
        thread.start()
        thread.join(timeout=4 * lease)
        assert not thread.is_alive()
        assert holder.held, "its heartbeats went on while the forced release waited, past its lease"
        renewed = len(seen.named("heartbeat_latency")) - beats_before
        # Each try of the forced release waits for the row a quarter of a second, the heartbeat between.
        assert renewed >= 4, f"{renewed} heartbeats in {2 * lease:g}s"
        assert seen.named("heartbeat_failed") == []
    (error,) = outcome
    assert isinstance(error, OperationTimeout), error
    assert "kept the lock's row locked" in str(error)
    assert "nothing was deleted" in str(error)


@pytest.mark.parametrize("operation_timeout", [0.05, 0.26, 0.7])
def test_a_forced_release_behind_a_locked_row_ends_at_its_deadline_saying_why(
    make_mutex: Callable[..., Mutex], dsn: str, lock_name: str, operation_timeout: float
) -> None:
    # Whatever the budget, the row's lock, not the statement's own deadline, ends
    # each try: the operator reads why nothing was deleted, on time.
    holder = make_mutex()
    table = LockTable(dsn, operation_timeout=operation_timeout)
    with holder.acquire(), psycopg.connect(dsn) as conn, conn.transaction():
        holder.fence(conn)
        started = time.monotonic()
        with pytest.raises(OperationTimeout) as caught:
            table.force_release(lock_name)
        took = time.monotonic() - started
        assert holder.held
    assert "kept the lock's row locked" in str(caught.value)
    assert f"operation_timeout ({operation_timeout:g}s)" in str(caught.value)
    assert took < operation_timeout + 1.0


def test_a_fenced_transaction_makes_a_reclaim_wait_until_it_ends(
    make_mutex: Callable[..., Mutex], dsn: str, admin: psycopg.Connection[Any], ledger: str, lock_name: str
) -> None:
    holder = make_mutex(instance_id="holder")
    rival = make_mutex(instance_id="rival", operation_timeout=5.0)
    with pytest.raises(LockNotHeldError), holder.acquire(), psycopg.connect(dsn) as conn:
        with conn.transaction():
            holder.fence(conn)
            freeze(holder)  # it goes silent, its transaction still open
            reclaimed_at: list[float] = []

            def reclaim() -> None:
                with rival.acquire(blocking=True, timeout=20):
                    reclaimed_at.append(time.monotonic())

            thread = threading.Thread(target=reclaim)
            thread.start()
            # Past the stale threshold, the rival's reclaim waits on the fenced row.
            wait_until(
                lambda: (
                    admin.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                        "AND (query LIKE %s OR query LIKE %s)",
                        # The acquire's opening (pg_stat_activity keeps a statement's first 1024 bytes
                        # only), or its call of the table's acquire function.
                        ("%WITH current AS%", '%\\_acquire"(%'),
                    ).fetchone()
                    == (1,)
                ),
                timeout=10,
            )
            assert reclaimed_at == [], "no takeover while the fenced transaction is open"
            conn.execute(f"UPDATE {ledger} SET counter = counter + 1 WHERE id = 1")  # noqa: S608
            committed_at = time.monotonic()
        thread.join(timeout=20)
        assert reclaimed_at, "the reclaim went through once the transaction ended"
        assert reclaimed_at[0] >= committed_at
    assert counter(admin, ledger) == 1, "the fenced write landed: it committed before the reclaim"


def test_a_contender_is_answered_at_once_while_the_holder_has_a_fenced_transaction_open(
    make_mutex: Callable[..., Mutex], dsn: str
) -> None:
    holder, contender = make_mutex(), make_mutex(operation_timeout=5.0)
    with holder.acquire(), psycopg.connect(dsn) as conn, holder.fenced(conn):
        started = time.monotonic()
        with contender.acquire() as acquired:
            assert not acquired
        assert time.monotonic() - started < 1.0, "a fresh row is never locked by a contender's acquire"


def test_heartbeats_carry_on_during_a_long_fenced_transaction(
    make_mutex: Callable[..., Mutex], dsn: str, lock_name: str
) -> None:
    from tests.support.fixtures import RecordingMetrics

    metrics = RecordingMetrics()
    holder = make_mutex(metrics=metrics)
    with holder.acquire(), psycopg.connect(dsn) as conn, holder.fenced(conn):
        beats = len(metrics.named("heartbeat_latency"))
        # Many heartbeat intervals, and past the whole lease (1.4 s): a blocked heartbeat would lose it.
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            assert holder.held
            time.sleep(0.05)
        assert len(metrics.named("heartbeat_latency")) >= beats + 8
        assert metrics.named("heartbeat_failed") == []
        holder.ensure_held()


async def test_fence_async_on_an_async_connection(
    amake_mutex: Callable[..., Mutex], dsn: str, admin: psycopg.Connection[Any], ledger: str
) -> None:
    mutex = amake_mutex()
    async with (
        mutex.acquire_async(),
        await psycopg.AsyncConnection.connect(dsn) as conn,
        mutex.fenced_async(conn) as token,
    ):
        assert token == mutex.token
        await conn.execute(f"UPDATE {ledger} SET counter = counter + 1 WHERE id = 1")  # noqa: S608
    assert counter(admin, ledger) == 1


def test_a_fence_on_a_silent_network_ends_within_operation_timeout_and_nothing_commits(
    make_mutex: Callable[..., Mutex], proxy: FaultProxy, proxy_dsn: str, admin: psycopg.Connection[Any], ledger: str
) -> None:
    mutex = make_mutex(operation_timeout=0.7)  # its own connection is direct: the holder stays healthy
    slack = 1.0  # how late a thread may run on a busy two-core machine
    with mutex.acquire(), psycopg.connect(proxy_dsn) as conn:
        conn.execute(f"UPDATE {ledger} SET counter = counter + 1 WHERE id = 1")  # noqa: S608
        proxy.silence()
        started = time.monotonic()
        with pytest.raises(OperationTimeout, match=r"fencing lock .* within operation_timeout \(0.7s\)"):
            mutex.fence(conn)
        assert time.monotonic() - started < 0.7 + slack
        assert conn.broken or conn.closed, "the transaction can go no further"
    proxy.heal()
    wait_until(lambda: counter(admin, ledger) == 0 and not _writing(admin, ledger), timeout=10)


def _writing(admin: psycopg.Connection[Any], ledger: str) -> bool:
    """Whether a session still holds the ledger's row (its transaction not yet rolled back)."""
    try:
        with admin.transaction():
            admin.execute("SET LOCAL lock_timeout = '50ms'")
            admin.execute(f"SELECT 1 FROM {ledger} WHERE id = 1 FOR UPDATE")  # noqa: S608
    except psycopg.errors.LockNotAvailable:
        return True
    return False


async def test_fence_async_on_a_silent_network_ends_within_operation_timeout(
    amake_mutex: Callable[..., Mutex], proxy: FaultProxy, proxy_dsn: str
) -> None:
    mutex = amake_mutex(operation_timeout=0.7)
    async with mutex.acquire_async(), await psycopg.AsyncConnection.connect(proxy_dsn) as conn:
        await conn.execute("SELECT 1")
        proxy.silence()
        started = time.monotonic()
        with pytest.raises(OperationTimeout, match="fencing lock"):
            await mutex.fence_async(conn)
        assert time.monotonic() - started < 0.7 + 1.0
    proxy.heal()


def test_fence_needs_an_open_transaction(make_mutex: Callable[..., Mutex], dsn: str) -> None:
    mutex = make_mutex()
    with mutex.acquire(), psycopg.connect(dsn, autocommit=True) as conn, pytest.raises(ValueError, match="transaction"):
        mutex.fence(conn)


# -- tables without tokens, and the migration ---------------------------------------------------


README_DDL = """CREATE TABLE {table} (
  lock_name      VARCHAR(64) NOT NULL,
  locked         INT NOT NULL DEFAULT 1,
  instance_id    VARCHAR(64) NOT NULL,
  last_heartbeat TIMESTAMPTZ NOT NULL,
  acquired_at    TIMESTAMPTZ NOT NULL,
  CONSTRAINT uq_{table} UNIQUE (locked, lock_name),
  CONSTRAINT chk_locked CHECK (locked = 1)
)"""


@pytest.fixture
def readme_table(admin: psycopg.Connection[Any]) -> Iterator[str]:
    """A table made with the README's DDL alone (or by an earlier release): no token column."""
    table = f"readme_{uuid.uuid4().hex[:8]}"
    admin.execute(README_DDL.format(table=table))
    yield table
    admin.execute(f"DROP TABLE IF EXISTS {table}")


def test_a_table_without_tokens_keeps_working_and_fencing_names_the_migration(
    make_mutex: Callable[..., Mutex], dsn: str, readme_table: str
) -> None:
    mutex = make_mutex(table=readme_table)
    assert not LockTable(dsn, table=readme_table).has_tokens()
    with mutex.acquire() as acquired:
        assert acquired
        assert mutex.token is None
        with (
            psycopg.connect(dsn) as conn,
            pytest.raises(SchemaError, match=r"no token column.*migrate"),
            mutex.fenced(conn),
        ):
            pytest.fail("must not run")


def test_migrating_in_place_is_online_idempotent_and_safe_to_race(
    make_mutex: Callable[..., Mutex], dsn: str, admin: psycopg.Connection[Any], readme_table: str
) -> None:
    from tests.support.fixtures import RecordingMetrics

    metrics = RecordingMetrics()
    holder = make_mutex(table=readme_table, metrics=metrics)
    with holder.acquire():
        beats = len(metrics.named("heartbeat_latency"))
        errors: list[BaseException] = []
        results: list[bool] = []
        barrier = threading.Barrier(4)

        def migrate() -> None:
            from postgres_mutex import MutexClient

            client = MutexClient(dsn)  # a separate process would have its own
            try:
                barrier.wait(timeout=10)
                results.append(client.table(readme_table).migrate())
            except BaseException as exc:
                errors.append(exc)
            finally:
                client.close()

        threads = [threading.Thread(target=migrate) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert errors == []
        assert True in results, "one of them changed the table"
        assert LockTable(dsn, table=readme_table).migrate() is False, "idempotent: nothing left to do"
        wait_until(lambda: len(metrics.named("heartbeat_latency")) >= beats + 5)
        assert holder.held, "the holder kept heartbeating through the migration"
        assert metrics.named("heartbeat_failed") == []
        assert holder.token is None, "a hold acquired before the migration has no token"
    rewritten = admin.execute("SELECT relfilenode FROM pg_class WHERE relname = %s", (readme_table,)).fetchone()
    assert rewritten is not None
    with make_mutex(table=readme_table).acquire():
        pass
    new_holder = make_mutex(table=readme_table)
    with new_holder.acquire():
        assert new_holder.token is not None, "acquired after the migration: a token"
    assert (
        admin.execute("SELECT relfilenode FROM pg_class WHERE relname = %s", (readme_table,)).fetchone() == rewritten
    ), "no table rewrite"


def test_the_cli_migrates_a_table(dsn: str, readme_table: str) -> None:
    command = [sys.executable, "-m", "postgres_mutex", "migrate", "--dsn", dsn, "--table", readme_table]
    first = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert first.returncode == 0, first.stderr
    assert "now has fencing tokens" in first.stdout
    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert "already had fencing tokens" in again.stdout


@pytest.fixture
def limited_role(pg: PostgresServer, admin: psycopg.Connection[Any], needs_superuser: None) -> Iterator[str]:
    role = f"mutex_fence_{uuid.uuid4().hex[:8]}"
    admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{PASSWORD}'")
    yield role
    admin.execute(f"DROP OWNED BY {role}")
    admin.execute(f"DROP ROLE {role}")


def test_a_limited_role_can_lock_and_fence_after_the_documented_grants(
    pg: PostgresServer, admin: psycopg.Connection[Any], limited_role: str, lock_name: str, ledger: str
) -> None:
    role_dsn = pg.dsn(user=limited_role, password=PASSWORD)
    mutex = Mutex(role_dsn, lock_name, **FAST)  # type: ignore[arg-type]
    try:
        with pytest.raises(SchemaError, match="USAGE on its token sequence"), mutex.acquire():
            pass
        # The documented grants: DML on the table, USAGE on its sequence.
        admin.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON mutex_lock TO {limited_role}")
        admin.execute(f"GRANT USAGE ON SEQUENCE mutex_lock_token_seq TO {limited_role}")
        admin.execute(f"GRANT SELECT, UPDATE ON {ledger} TO {limited_role}")
        with mutex.acquire() as acquired, psycopg.connect(role_dsn) as conn:
            assert acquired
            with mutex.fenced(conn):
                conn.execute(f"UPDATE {ledger} SET counter = counter + 1 WHERE id = 1")  # noqa: S608
    finally:
        mutex.close()
    assert counter(admin, ledger) == 1


# -- the token outside the database -----------------------------------------------------------


def test_run_hands_the_command_its_token_and_a_forced_release_reports_it(
    dsn: str, lock_name: str, admin: psycopg.Connection[Any]
) -> None:
    code = "import os, time; print(os.environ['POSTGRES_MUTEX_TOKEN'], flush=True); time.sleep(30)"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "postgres_mutex",
            "run",
            "--dsn",
            dsn,
            "--lock",
            lock_name,
            "--",
            sys.executable,
            "-c",
            code,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "POSTGRES_MUTEX_TOKEN"},
    )
    try:
        assert proc.stdout is not None
        token = int(proc.stdout.readline())
        assert token == token_of(admin, lock_name)
        released = subprocess.run(
            [sys.executable, "-m", "postgres_mutex", "release", lock_name, "--force", "--dsn", dsn],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert released.returncode == 0, released.stderr
        assert f"token {token}" in released.stdout
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# -- the row-lock modes the fence relies on (PostgreSQL 15 and 18 alike) --------------------------


@pytest.mark.parametrize(
    ("held_lock", "heartbeat_passes", "reclaim_passes", "delete_passes"),
    [
        ("FOR KEY SHARE", True, False, False),  # what fence() takes
        ("FOR SHARE", False, False, False),  # would starve the holder's heartbeats
    ],
)
def test_which_statements_wait_for_a_transaction_holding_the_lock_row(
    dsn: str,
    admin: psycopg.Connection[Any],
    lock_name: str,
    held_lock: str,
    heartbeat_passes: bool,
    reclaim_passes: bool,
    delete_passes: bool,
) -> None:
    from postgres_mutex._sql import CURRENT, Names, Statements

    statements = Statements(Names("mutex_lock"), CURRENT)
    admin.execute(
        "INSERT INTO mutex_lock (lock_name, instance_id, last_heartbeat, acquired_at) "
        "VALUES (%s, 'holder', now() - interval '1 hour', now() - interval '1 hour')",
        (lock_name,),
    )
    row = admin.execute("SELECT acquired_at, token FROM mutex_lock WHERE lock_name = %s", (lock_name,)).fetchone()
    assert row is not None

    def passes(text: str, params: dict[str, Any]) -> bool:
        with psycopg.connect(dsn, autocommit=True) as other:
            cursor = psycopg.ClientCursor(other)
            try:
                cursor.execute("SET lock_timeout = '500ms'")
                # What the engine binds for its own connection: here, one that names no session, and no minimum hold.
                unnamed = {"reclaim_seconds": None, "_session_key": None, "_backend_pid": 0, "hold_seconds": None}
                cursor.execute(text, {**unnamed, **params, "_server_timeout_ms": 5000})
            except psycopg.errors.LockNotAvailable:
                return False
            return True

    with psycopg.connect(dsn) as fencer:
        fencer.execute(f"SELECT 1 FROM mutex_lock WHERE lock_name = %s {held_lock}", (lock_name,))  # noqa: S608
        # The row is stale: a reclaim would take it over, if the row lock let it.
        reclaim = {"lock_name": lock_name, "instance_id": "rival", "stale_seconds": 3.0}
        assert passes(statements.acquire.text, reclaim) is reclaim_passes
        assert statements.acquire_plain is not None  # what a prompt acquire sends: its take-over waits alike
        assert passes(statements.acquire_plain.text, reclaim) is reclaim_passes
        assert passes("DELETE FROM mutex_lock WHERE lock_name = %(lock_name)s", {"lock_name": lock_name}) is (
            delete_passes
        )
        heartbeat = {"tokens": [row[1]], "lock_timeout_ms": 100}
        assert statements.heartbeat_by_token is not None
        assert passes(statements.heartbeat_by_token[1].text, heartbeat) is heartbeat_passes
        fencer.rollback()
    admin.execute("DELETE FROM mutex_lock WHERE lock_name = %s", (lock_name,))


async def test_the_async_admin_calls_read_and_change_the_table_as_the_sync_ones_do(
    make_mutex: Callable[..., Mutex], dsn: str, admin: psycopg.Connection[Any], readme_table: str
) -> None:
    table = LockTable(dsn, table=readme_table)
    assert await table.has_tokens_async() is False
    assert await table.migrate_async() is True
    assert await table.has_tokens_async() is True
    assert table.has_tokens(), "the sync side sees the migration"
    assert await table.migrate_async() is False, "idempotent: nothing left to do"
    holder = make_mutex(table=readme_table)
    with holder.acquire():
        (found,) = await table.holders_async()
        assert found.lock_name == holder.lock_name
        assert found.holder == holder.instance_id
        assert found.token == holder.token
        assert [o.holder for o in table.holders()] == [found.holder]
    assert await table.holders_async() == []
    fresh = f"fresh_{uuid.uuid4().hex[:8]}"
    try:
        await LockTable(dsn, table=fresh).create_async()
        assert await LockTable(dsn, table=fresh).has_tokens_async() is True
        assert admin.execute("SELECT to_regclass(%s) IS NOT NULL", (fresh,)).fetchone() == (True,)
    finally:
        admin.execute(f"DROP TABLE IF EXISTS {fresh}")
