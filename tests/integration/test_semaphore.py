"""Semaphores: at most N holders at once, enforced by the table, with every guarantee of a Mutex.

Each test uses its own semaphore name on the suite's table, and short
thresholds (`FAST`) where a reclaim or a loss must happen within the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from postgres_mutex import (
    LockAcquisitionTimeout,
    LockNotHeldError,
    LockTable,
    MutexClient,
    OperationTimeout,
    PermitsMismatchError,
    SchemaError,
    Semaphore,
)
from tests.support.exclusion import Sections, most_at_once
from tests.support.faultproxy import FaultProxy
from tests.support.fixtures import FAST, ROOT, RecordingMetrics, closing_maker, freeze, listens, read_line, wait_until

MakeSemaphore = Callable[..., Semaphore]


@pytest.fixture
def name() -> str:
    return f"sem-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def make_semaphore(dsn: str, name: str, schema: None) -> Iterator[MakeSemaphore]:
    """Semaphores of ``name`` (3 permits) with fast thresholds, each closed after the test."""
    with closing_maker(Semaphore, dsn=dsn, name=name, permits=3) as make:
        yield make


def permit_rows(admin: psycopg.Connection[Any], name: str) -> list[tuple[Any, ...]]:
    """The semaphore's permit rows as the table holds them: (permit, instance_id, permits), by permit."""
    return admin.execute(
        "SELECT permit, instance_id, permits FROM mutex_lock WHERE semaphore = %s ORDER BY permit", (name,)
    ).fetchall()


def test_n_holders_at_once_and_the_next_one_is_refused(
    make_semaphore: MakeSemaphore, admin: psycopg.Connection[Any], name: str
) -> None:
    holders = [make_semaphore() for _ in range(4)]
    with contextlib.ExitStack() as stack:
        got = [stack.enter_context(semaphore.acquire()) for semaphore in holders[:3]]
        assert got == [True, True, True]
        assert sorted(semaphore.permit for semaphore in holders[:3]) == [0, 1, 2]  # type: ignore[type-var]
        assert all(semaphore.held and semaphore.token is not None for semaphore in holders[:3])
        with holders[3].acquire() as fourth:
            assert fourth is False
            assert not holders[3].held
        busy = r"semaphore '.*' has no permit free: 3 of 3 held"
        with pytest.raises(LockAcquisitionTimeout, match=busy), holders[3].acquire(blocking=True, timeout=0.3):
            pass
        with pytest.raises(LockAcquisitionTimeout, match=busy), holders[3].acquire(timeout=0.3):
            pass  # a timeout alone waits, as blocking=True does
        rows = permit_rows(admin, name)
        assert [(permit, permits) for permit, _, permits in rows] == [(0, 3), (1, 3), (2, 3)]
        assert {holder for _, holder, _ in rows} == {semaphore.instance_id for semaphore in holders[:3]}
    assert permit_rows(admin, name) == [], "leaving the blocks releases every permit"
    with holders[3].acquire() as fourth:
        assert fourth is True


def test_the_table_refuses_a_permit_too_many_whatever_a_client_sends(
    make_semaphore: MakeSemaphore, admin: psycopg.Connection[Any], name: str
) -> None:
    holders = [make_semaphore() for _ in range(3)]
    with contextlib.ExitStack() as stack:
        assert all(stack.enter_context(semaphore.acquire()) for semaphore in holders)
        insert = (
            "INSERT INTO mutex_lock (lock_name, instance_id, last_heartbeat, acquired_at, semaphore, permit, permits) "
            "VALUES (%s, 'intruder', now(), now(), %s, %s, %s)"
        )
        # A fourth permit of a semaphore of 3; the same with N claimed to be 4; a permit already held.
        for lock_name, permit, permits, refused in [
            (f"{name}\x1f3", 3, 3, psycopg.errors.CheckViolation),
            (f"{name}\x1f3", 3, 4, psycopg.errors.ForeignKeyViolation),
            (f"{name}-other-name", 0, 3, psycopg.errors.UniqueViolation),
        ]:
            with pytest.raises(refused):
                admin.execute(insert, (lock_name, name, permit, permits))
        with pytest.raises(psycopg.errors.CheckViolation):
            admin.execute("UPDATE mutex_lock SET semaphore = NULL WHERE semaphore = %s", (name,))
        assert len(permit_rows(admin, name)) == 3


def test_a_semaphore_that_disagrees_on_its_permits_is_refused_naming_both(make_semaphore: MakeSemaphore) -> None:
    first, other = make_semaphore(permits=3), make_semaphore(permits=5)
    with first.acquire() as got:
        assert got
    both = r"has 3 permits.*says permits=5.*set_permits"
    with pytest.raises(PermitsMismatchError, match=both) as caught, other.acquire():
        pass
    assert (caught.value.permits, caught.value.stored_permits) == (5, 3)
    assert not other.held


def test_lowering_the_permits_releases_the_extra_holders_who_learn_it(
    make_semaphore: MakeSemaphore, admin: psycopg.Connection[Any], dsn: str, name: str
) -> None:
    lost: list[LockNotHeldError] = []
    holders = [make_semaphore(on_lost=lost.append) for _ in range(3)]
    for semaphore in holders:
        assert semaphore.acquire().__enter__()
    changed = LockTable(dsn).set_permits(name, 1)
    assert (changed.previous, changed.released, changed.permits) == (3, 2, 1)
    assert [(permit, permits) for permit, _, permits in permit_rows(admin, name)] == [(0, 1)]
    wait_until(lambda: len(lost) == 2, timeout=10)
    assert sorted(semaphore.held for semaphore in holders) == [False, False, True]
    with pytest.raises(PermitsMismatchError):
        make_semaphore(permits=3).acquire().__enter__()
    assert make_semaphore(permits=1).acquire().__enter__() is False
    for semaphore in holders:
        with contextlib.suppress(LockNotHeldError):
            semaphore.release()


def test_never_more_than_n_among_contending_holders_each_on_its_own_client(dsn: str, name: str, schema: None) -> None:
    sections = Sections()
    stop = time.monotonic() + 4.0
    errors: list[BaseException] = []

    def contend(who: str) -> None:
        with MutexClient(dsn) as client:
            semaphore = client.semaphore(name, permits=3, **FAST)
            try:
                while time.monotonic() < stop:
                    with sections.holding(semaphore, who, blocking=True, timeout=30) as got:
                        assert got
                        time.sleep(0.05)
            except BaseException as exc:  # reported by the test, not lost in a thread
                errors.append(exc)

    threads = [threading.Thread(target=contend, args=(f"holder-{i}",)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []
    logged = sections.all()
    assert len(logged) > 20, "every holder went in and out many times"
    assert most_at_once(logged) == 3, "three at once at most, and three were reached"


def test_a_waiter_is_woken_by_a_release_not_by_polling(make_semaphore: MakeSemaphore) -> None:
    holders = [make_semaphore(permits=2) for _ in range(2)]
    for semaphore in holders:
        assert semaphore.acquire().__enter__()
    waiter = make_semaphore(permits=2, poll_interval=30.0)
    took: list[float] = []

    def wait() -> None:
        with waiter.acquire(blocking=True, timeout=60) as got:
            assert got
            took.append(time.monotonic())

    thread = threading.Thread(target=wait)
    thread.start()
    # Listening on the semaphore's channel: it tried once more since, and now waits to be woken.
    wait_until(lambda: listens(waiter), timeout=10)
    released = time.monotonic()
    holders[1].release()
    thread.join(timeout=20)
    assert took, "the waiter acquired"
    assert took[0] - released < 5.0, "woken by the release, long before its 30 s poll"


async def test_an_async_acquire_waits_for_a_permit_and_holds_it(make_semaphore: MakeSemaphore) -> None:
    holder, waiter = make_semaphore(permits=1), make_semaphore(permits=1)
    try:
        async with holder.acquire_async() as got:
            assert got
            assert holder.permit == 0

            async def wait() -> bool:
                async with waiter.acquire_async(timeout=20) as acquired:
                    return acquired and waiter.held

            task = asyncio.ensure_future(wait())
            await asyncio.sleep(0.3)
            assert not task.done()
        assert await asyncio.wait_for(task, 20)
    finally:
        await holder.aclose()
        await waiter.aclose()


def test_a_fence_refuses_once_the_permit_changed_hands(make_semaphore: MakeSemaphore, dsn: str, name: str) -> None:
    holder, other = make_semaphore(permits=1), make_semaphore(permits=1)
    with pytest.raises(LockNotHeldError), holder.acquire() as got:
        assert got
        with psycopg.connect(dsn) as conn, holder.fenced(conn) as token:
            assert token == holder.token
        # An operator frees the permit's row while its holder still trusts its lease; another takes it.
        assert LockTable(dsn).force_release(f"{name}\x1f0") is not None
        with other.acquire(blocking=True, timeout=20) as taken:
            assert taken
            with psycopg.connect(dsn) as conn, pytest.raises(LockNotHeldError, match="changed hands"):
                holder.fence(conn)


def test_one_heartbeat_statement_renews_a_clients_mutex_and_permit_holds(
    dsn: str, name: str, admin: psycopg.Connection[Any], schema: None
) -> None:
    with MutexClient(dsn) as client:
        mutex = client.mutex(f"{name}-mutex", **FAST)
        semaphore = client.semaphore(name, permits=2, **FAST)
        with mutex.acquire() as m, semaphore.acquire() as s:
            assert m
            assert s

            def beats() -> list[Any]:
                return [
                    row[0]
                    for row in admin.execute(
                        "SELECT last_heartbeat FROM mutex_lock WHERE (lock_name = %s OR semaphore = %s) "
                        "AND last_heartbeat > acquired_at ORDER BY lock_name",
                        (f"{name}-mutex", name),
                    ).fetchall()
                ]

            wait_until(lambda: len(beats()) == 2, timeout=10)
            # now() is the statement's start: one stamp for both rows means one statement renewed both.
            wait_until(lambda: len(set(beats())) == 1, timeout=10)


def test_a_table_without_semaphores_keeps_its_mutexes_and_says_to_migrate(
    dsn: str, name: str, admin: psycopg.Connection[Any]
) -> None:
    table = f"sem_{name.replace('-', '_')}"
    admin.execute(
        f"CREATE TABLE {table} (lock_name VARCHAR(64) NOT NULL, locked INT NOT NULL DEFAULT 1, "
        "instance_id VARCHAR(64) NOT NULL, last_heartbeat TIMESTAMPTZ NOT NULL, acquired_at TIMESTAMPTZ NOT NULL, "
        f"CONSTRAINT uq_{table} UNIQUE (locked, lock_name), CHECK (locked = 1))"
    )
    try:
        with MutexClient(dsn) as client:
            with client.mutex("job", table=table, **FAST).acquire() as held:
                assert held
            semaphore = client.semaphore(name, permits=2, table=table, **FAST)
            with pytest.raises(SchemaError, match="migrate"), semaphore.acquire():
                pass
            assert LockTable(dsn, table=table).migrate() is True
            assert LockTable(dsn, table=table).migrate() is False, "idempotent"
            with semaphore.acquire() as got:
                assert got
                assert semaphore.permit is not None
    finally:
        admin.execute(f"DROP TABLE IF EXISTS {table}, {table}_semaphores")
        admin.execute(f"DROP SEQUENCE IF EXISTS {table}_token_seq")


def test_names_that_leave_no_room_for_the_permit_number_are_refused(dsn: str) -> None:
    with pytest.raises(ValueError, match="at most 62 characters"):
        Semaphore(dsn, "x" * 63, permits=10)
    with pytest.raises(ValueError, match="permits"):
        Semaphore(dsn, "ok", permits=0)
    with pytest.raises(ValueError, match="separator"):
        Semaphore(dsn, "a\x1fb", permits=2)
    with pytest.raises(TypeError, match="needs a name"):
        Semaphore(dsn, permits=2)


HOLDER = """
import json, sys, time
from postgres_mutex import Semaphore
dsn, name, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
semaphore = Semaphore(dsn, name, **options)
with semaphore.acquire(blocking=True, timeout=60) as held:
    print(json.dumps({"held": held, "id": semaphore.instance_id}), flush=True)
    while True:
        time.sleep(0.1)
"""
"""A process holding one permit until it is killed or frozen."""

EARLY: dict[str, Any] = {
    "heartbeat_interval": 0.3,
    "alert_threshold": 0.9,
    "stale_threshold": 600.0,
    "reclaim_disconnected_after": 2.0,
    "poll_interval": 0.1,
}
"""A holder that opted in to ``reclaim_disconnected_after``: reclaimed in seconds if its process dies, never while
it lives (its stale threshold is ten minutes)."""

HAND_OFF = 2.0
"""A generous bound on what a reclaim takes beyond its threshold: a poll, a statement, a loaded machine."""


@pytest.fixture
def holder_process(dsn: str, schema: None) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []

    def start(name: str, **options: Any) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, dsn, name, json.dumps(options)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        started.append(proc)
        assert proc.stdout is not None
        assert json.loads(read_line(proc.stdout, timeout=30))["held"] is True
        return proc

    yield start
    for proc in started:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


@pytest.mark.parametrize(
    ("options", "threshold", "reason"),
    [(FAST, FAST["stale_threshold"], "stale"), (EARLY, EARLY["reclaim_disconnected_after"], "disconnected")],
    ids=["after the stale threshold", "early, having opted in to reclaim_disconnected_after"],
)
def test_a_killed_holders_permit_is_reclaimed(
    dsn: str,
    name: str,
    holder_process: Callable[..., subprocess.Popen[str]],
    metrics: RecordingMetrics,
    options: dict[str, Any],
    threshold: float,
    reason: str,
) -> None:
    holder = holder_process(name, permits=1, **options)
    contender = Semaphore(dsn, name, permits=1, metrics=metrics, **options)
    try:
        holder.kill()
        died = time.monotonic()
        holder.wait(10)
        with contender.acquire(blocking=True, timeout=threshold + HAND_OFF + 10) as acquired:
            took = time.monotonic() - died
            assert acquired
            assert contender.permit == 0
        assert took <= threshold + HAND_OFF, f"reclaimed {took:.2f}s after the holder died"
        assert [reclaim["reason"] for reclaim in metrics.named("stale_reclaimed")] == [reason]
    finally:
        contender.close()


def test_a_frozen_holder_is_alerted_on_and_keeps_its_permit(
    dsn: str,
    name: str,
    admin: psycopg.Connection[Any],
    holder_process: Callable[..., subprocess.Popen[str]],
    metrics: RecordingMetrics,
) -> None:
    holder = holder_process(name, permits=1, **EARLY)
    contender = Semaphore(dsn, name, permits=1, metrics=metrics, **EARLY)
    try:
        os.kill(holder.pid, signal.SIGSTOP)
        # Frozen past the option: its session is alive, so the contender waits, told the holder is silent.
        wait_for = EARLY["reclaim_disconnected_after"] + 1.5
        with pytest.raises(LockAcquisitionTimeout), contender.acquire(blocking=True, timeout=wait_for):
            pytest.fail("a frozen holder's permit was taken")
        assert metrics.named("alert") != [], "the contender alerted on the silent holder"
        (row,) = permit_rows(admin, name)
        assert row[1] != contender.instance_id, "the frozen holder keeps its permit"
    finally:
        os.kill(holder.pid, signal.SIGCONT)
        contender.close()


async def test_the_permits_can_be_changed_from_async_code(make_semaphore: MakeSemaphore, dsn: str, name: str) -> None:
    first = make_semaphore(permits=2)
    with first.acquire() as got:
        assert got
    changed = await LockTable(dsn).set_permits_async(name, 4)
    assert (changed.previous, changed.permits, changed.released) == (2, 4, 0)
    assert make_semaphore(permits=4).acquire().__enter__() is True


def test_holders_and_status_show_each_permit_with_its_semaphore(
    make_semaphore: MakeSemaphore, dsn: str, name: str
) -> None:
    holders = [make_semaphore(permits=2) for _ in range(2)]
    with holders[0].acquire() as first, holders[1].acquire() as second:
        assert first
        assert second
        seen = LockTable(dsn).holders([f"{name}\x1f0", f"{name}\x1f1"])
        assert sorted((one.semaphore, one.permit, one.holder) for one in seen) == sorted(
            (name, semaphore.permit, semaphore.instance_id) for semaphore in holders
        )
        status = [sys.executable, "-m", "postgres_mutex", "status", "--dsn", dsn]
        text = subprocess.run(status, capture_output=True, text=True, timeout=60, check=True).stdout
        for semaphore in holders:
            # The columns are as wide as the longest lock name in the table: other tests' locks too.
            line = rf"^{re.escape(name)} \(permit {semaphore.permit}\) +{re.escape(semaphore.instance_id)} "
            assert re.search(line, text, re.MULTILINE), text
        data = subprocess.run([*status, "--json"], capture_output=True, text=True, timeout=60, check=True).stdout
        shown = [(lock["semaphore"], lock["permit"]) for lock in json.loads(data)["locks"] if lock["semaphore"] == name]
        assert sorted(shown) == [(name, 0), (name, 1)]


def test_the_history_records_each_permits_holds(dsn: str, name: str, admin: psycopg.Connection[Any]) -> None:
    table = f"hist_{name.replace('-', '_')}"
    LockTable(dsn, table=table).create(history=True)
    try:
        with MutexClient(dsn) as client:
            first = client.semaphore(name, permits=2, table=table, **FAST)
            second = client.semaphore(name, permits=2, table=table, **FAST)
            with first.acquire() as got, second.acquire() as too:
                assert got
                assert too
                permits = {first.instance_id: first.permit, second.instance_id: second.permit}
            records = client.table(table).history()
        assert sorted((record.lock_name, record.holder, record.ended_how) for record in records) == sorted(
            (f"{name}\x1f{permit}", holder, "released") for holder, permit in permits.items()
        )
    finally:
        admin.execute(f"DROP TABLE IF EXISTS {table}, {table}_history, {table}_semaphores")


def test_a_decorated_function_runs_while_holding_a_permit(make_semaphore: MakeSemaphore) -> None:
    semaphore = make_semaphore(permits=1)
    seen: list[int | None] = []

    @semaphore.singleton
    def job() -> str:
        seen.append(semaphore.permit)
        return "ran"

    assert job() == "ran"
    assert seen == [0]
    with make_semaphore(permits=1).acquire() as other:
        assert other
        assert job() is None, "no permit free: the function does not run"


def test_an_acquire_whose_reply_is_lost_leaves_no_permit_behind(
    make_semaphore: MakeSemaphore, proxy: FaultProxy, proxy_dsn: str, admin: psycopg.Connection[Any], name: str
) -> None:
    semaphore, other = make_semaphore(dsn=proxy_dsn, permits=1, operation_timeout=0.5), make_semaphore(permits=1)
    for _ in range(2):  # connected, the acquire prepared: the next one is a single message
        with semaphore.acquire():
            pass
    proxy.drop_replies()  # the INSERT reaches the server; its answer never comes back
    with pytest.raises(OperationTimeout) as caught, semaphore.acquire():
        pytest.fail("must not run")
    assert caught.value.outcome_unknown
    proxy.heal()
    # The Semaphore removed the permit row its unanswered acquire left, in the background.
    wait_until(lambda: permit_rows(admin, name) == [], timeout=10)
    with other.acquire() as acquired:
        assert acquired, "nobody waits out the stale threshold"


def test_a_blocking_acquire_takes_back_its_own_permit_after_a_lost_reply(
    make_semaphore: MakeSemaphore, proxy: FaultProxy, proxy_dsn: str, admin: psycopg.Connection[Any], name: str
) -> None:
    semaphore = make_semaphore(dsn=proxy_dsn, permits=2, operation_timeout=0.5)
    for _ in range(2):
        with semaphore.acquire():
            pass
    proxy.drop_replies()
    with semaphore.acquire(blocking=True, timeout=15) as acquired:
        assert acquired
        rows = permit_rows(admin, name)
        assert [(permit, holder) for permit, holder, _ in rows] == [(semaphore.permit, semaphore.instance_id)], (
            "one permit, taken back: not a second one"
        )


def test_after_lowering_the_permits_under_contention_never_more_hold_than_the_new_number(
    dsn: str, name: str, admin: psycopg.Connection[Any], schema: None
) -> None:
    stop = time.monotonic() + 20.0
    refused: list[PermitsMismatchError] = []
    errors: list[BaseException] = []

    def contend() -> None:
        with MutexClient(dsn) as client:
            semaphore = client.semaphore(name, permits=4, **FAST)
            try:
                while time.monotonic() < stop:
                    with semaphore.acquire(blocking=True, timeout=10):
                        time.sleep(0.01)
            except PermitsMismatchError as exc:
                refused.append(exc)  # the number changed under it: what it must be told
            except LockNotHeldError:
                pass  # its permit was released by the change: learned at its heartbeat
            except BaseException as exc:
                errors.append(exc)

    threads = [threading.Thread(target=contend) for _ in range(6)]
    for thread in threads:
        thread.start()
    wait_until(lambda: len(permit_rows(admin, name)) >= 2, timeout=10)
    result = LockTable(dsn).set_permits(name, 2)
    assert result.previous == 4
    # Sampled from outside for a second (or 500 reads): never more than 2 rows from now on.
    samples = []
    deadline = time.monotonic() + 1.0
    for _ in range(500):
        samples.append(len(permit_rows(admin, name)))
        if time.monotonic() > deadline:
            break
    assert max(samples) <= 2
    for thread in threads:
        thread.join(timeout=60)
    assert errors == []
    assert refused, "a Semaphore still saying 4 was refused once the number was 2"
    assert all((exc.permits, exc.stored_permits) == (4, 2) for exc in refused)


def test_a_fence_refuses_once_a_frozen_holders_permit_was_reclaimed(make_semaphore: MakeSemaphore, dsn: str) -> None:
    holder, other = make_semaphore(permits=1), make_semaphore(permits=1)
    with pytest.raises(LockNotHeldError), holder.acquire() as got:
        assert got
        freeze(holder)  # its heartbeats stop, as a frozen process's do: its permit goes stale
        with other.acquire(blocking=True, timeout=20) as taken:
            assert taken
            assert other.permit == 0
            with psycopg.connect(dsn) as conn, pytest.raises(LockNotHeldError):
                holder.fence(conn)  # its lease ran out before the reclaim: it refuses without asking
