"""A client's locks follow one lease: one row renewed for many locks, judged as each lock's own heartbeat was."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Generator, Iterator
from contextlib import ExitStack
from typing import Any

import psycopg
import psycopg.conninfo
import pytest
from psycopg import sql
from psycopg_pool import ConnectionPool

from postgres_mutex import LockNotHeldError, LockTable, Mutex
from tests.support.fixtures import ROOT, RecordingMetrics, await_until, freeze, wait_until
from tests.support.postgres_server import PASSWORD, PostgresServer

# Thresholds that leave the lease room beside the statement's deadline (`heartbeat_flows.lease_within`): FAST's
# do not, and their locks renew their rows one by one, as without a lease.
LEASED: dict[str, float] = {
    "heartbeat_interval": 0.2,
    "alert_threshold": 1.0,
    "stale_threshold": 4.0,
    "poll_interval": 0.05,
    "operation_timeout": 1.0,
}
LOCKS = 30
"""More than a client's heartbeat renews one by one (`heartbeat_flows.LEASE_FROM`): a lease renews them."""


def _names(lock_name: str) -> list[str]:
    return [f"{lock_name}-{index}" for index in range(LOCKS)]


@pytest.fixture
def holding(make_mutex: Callable[..., Mutex], lock_name: str) -> Iterator[list[Mutex]]:
    """``LOCKS`` mutexes of one client, held."""
    yield from _held(make_mutex, lock_name, LEASED)


def _held(
    make_mutex: Callable[..., Mutex], lock_name: str, thresholds: dict[str, Any]
) -> Generator[list[Mutex], None, None]:
    mutexes = [make_mutex(lock_name=name, **thresholds) for name in _names(lock_name)]
    with ExitStack() as stack:
        for mutex in mutexes:
            stack.enter_context(contextlib.suppress(LockNotHeldError))  # a test may have frozen it: lost
            assert stack.enter_context(mutex.acquire())
        yield mutexes


def _rows(admin: psycopg.Connection[Any], lock_name: str) -> dict[str, tuple[Any, ...]]:
    """Each row's version (xmin), its own heartbeat's age (what a 0.1.0 process judges) and its lease."""
    found = admin.execute(
        "SELECT lock_name, xmin::text, EXTRACT(EPOCH FROM now() - last_heartbeat)::float8, lease_key"
        " FROM mutex_lock WHERE lock_name = ANY(%s)",
        (_names(lock_name),),
    ).fetchall()
    return {row[0]: row[1:] for row in found}


def _following(admin: psycopg.Connection[Any], lock_name: str) -> bool:
    rows = _rows(admin, lock_name)
    return len(rows) == LOCKS and all(row[2] is not None for row in rows.values())


def test_one_row_renews_many_locks_and_each_rows_own_heartbeat_stays_fresh_for_0_1_0(
    make_mutex: Callable[..., Mutex], admin: psycopg.Connection[Any], lock_name: str
) -> None:
    # Each row's own heartbeat is renewed every third of the lease (stale_threshold less an interval): 2.6 s.
    thresholds = {**LEASED, "stale_threshold": 8.0}
    held = _held(make_mutex, lock_name, thresholds)
    holding = next(held)
    wait_until(lambda: _following(admin, lock_name), timeout=5)
    time.sleep(3 * LEASED["heartbeat_interval"])  # the lease is renewed alone from the third heartbeat on
    before = _rows(admin, lock_name)
    window = 3 * LEASED["heartbeat_interval"]
    time.sleep(window)
    after = _rows(admin, lock_name)
    touched = sum(after[name][0] != before[name][0] for name in before)
    # Spread over the period from their first: a few of the rows in a window of 3 heartbeats, where a heartbeat
    # of each row would have touched each 3 times.
    assert touched < LOCKS / 2, f"{touched} of {LOCKS} rows were updated in {window:.1f} s"
    assert all(mutex.held for mutex in holding)

    # A 0.1.0 process judges each row by its own heartbeat: never stale while its holder lives.
    period = (thresholds["stale_threshold"] - thresholds["heartbeat_interval"]) / 3
    deadline = time.monotonic() + period * 1.2
    oldest = 0.0
    while time.monotonic() < deadline:
        oldest = max(oldest, *(row[1] for row in _rows(admin, lock_name).values()))
        time.sleep(0.1)
    assert oldest < thresholds["stale_threshold"] / 2, f"a live holder's row was {oldest:.2f} s old"
    assert all(mutex.held for mutex in holding)
    held.close()


def test_each_renewal_of_the_lease_is_a_heartbeat_of_every_lock_it_covers_for_the_hook(
    make_mutex: Callable[..., Mutex], admin: psycopg.Connection[Any], lock_name: str
) -> None:
    # Each row's own heartbeat every 5.2 s (a third of the lease): a window of 2 s sees the lease's renewals alone.
    metrics = RecordingMetrics()
    thresholds = {**LEASED, "stale_threshold": 16.0, "metrics": metrics}
    held = _held(make_mutex, lock_name, thresholds)
    holding = next(held)
    wait_until(lambda: _following(admin, lock_name), timeout=5)
    time.sleep(3 * LEASED["heartbeat_interval"])  # the lease is renewed alone from the third heartbeat on
    before = {name: row[0] for name, row in _rows(admin, lock_name).items()}
    counted = len(metrics.calls)
    window = 10 * LEASED["heartbeat_interval"]
    time.sleep(window)
    beats = [lock for method, lock, _ in metrics.calls[counted:] if method == "heartbeat_latency"]
    after = _rows(admin, lock_name)
    assert sum(after[name][0] != before[name] for name in before) < LOCKS / 2, "the rows were left to the lease"
    # One heartbeat of each lock per interval, whatever renewed it: the metrics see each lock renewed every interval.
    assert all(beats.count(mutex.lock_name) >= window / LEASED["heartbeat_interval"] / 2 for mutex in holding), beats
    held.close()


def test_a_row_is_judged_by_its_lease_by_contenders_and_watchers(
    holding: list[Mutex],
    make_mutex: Callable[..., Mutex],
    admin: psycopg.Connection[Any],
    lock_name: str,
    dsn: str,
    metrics: RecordingMetrics,
) -> None:
    wait_until(lambda: _following(admin, lock_name), timeout=5)
    name = _names(lock_name)[0]
    # Its own heartbeat long past the stale threshold, as a row's may be between its renewals: its lease is fresh.
    admin.execute("UPDATE mutex_lock SET last_heartbeat = now() - interval '1 hour' WHERE lock_name = %s", (name,))
    contender = make_mutex(lock_name=name, metrics=metrics, **LEASED)
    with contender.acquire() as acquired:
        assert not acquired, "a live holder was robbed"
    assert metrics.named("alert") == [], "a live holder was alerted on"
    (seen,) = LockTable(dsn).holders([name])
    assert seen.seconds_since_heartbeat < LEASED["alert_threshold"]
    assert holding[0].held


def test_a_forced_release_reaches_the_holder_at_its_next_heartbeat(
    make_mutex: Callable[..., Mutex], admin: psycopg.Connection[Any], lock_name: str, dsn: str
) -> None:
    # A long stale threshold: each row's own heartbeat is renewed seconds apart, and only the lease tells.
    slow = {**LEASED, "stale_threshold": 30.0}
    mutexes = [make_mutex(lock_name=name, **slow) for name in _names(lock_name)]
    with ExitStack() as stack:
        for mutex in mutexes[1:]:
            assert stack.enter_context(mutex.acquire())
        with pytest.raises(LockNotHeldError, match="deleted or taken over"), mutexes[0].acquire() as acquired:
            assert acquired
            wait_until(lambda: all(row[2] is not None for row in _rows(admin, lock_name).values()), timeout=5)
            time.sleep(3 * LEASED["heartbeat_interval"])
            assert LockTable(dsn).force_release(mutexes[0].lock_name) is not None
            forced_at = time.monotonic()
            wait_until(lambda: not mutexes[0].held, timeout=3)
            assert time.monotonic() - forced_at < 1.5
        assert all(mutex.held for mutex in mutexes[1:])


def _poll_for_update(dsn: str, name: str, stop: threading.Event) -> None:
    """What a 0.1.0 contender's acquire does at every poll: lock the row (SELECT ... FOR UPDATE) for an instant."""
    with psycopg.connect(dsn) as conn:
        while not stop.is_set():
            with conn.transaction():
                conn.execute("SELECT 1 FROM mutex_lock WHERE lock_name = %s FOR UPDATE", (name,))
                time.sleep(0.03)
            time.sleep(0.002)


def test_a_row_a_contender_keeps_locking_an_instant_at_a_time_stays_its_holders(
    make_mutex: Callable[..., Mutex], admin: psycopg.Connection[Any], lock_name: str, dsn: str
) -> None:
    stop = threading.Event()
    poller = threading.Thread(target=_poll_for_update, args=(dsn, _names(lock_name)[0], stop), daemon=True)
    poller.start()
    try:
        # Acquired while the contender polls: the heartbeats that point the rows at the lease meet its row locks.
        held = _held(make_mutex, lock_name, LEASED)
        holding = next(held)
        wait_until(lambda: _following(admin, lock_name), timeout=5)
        time.sleep(1.0)
        assert all(mutex.held for mutex in holding), "a lock was declared lost while its row was still its own"
    finally:
        stop.set()
        poller.join(timeout=5)
    held.close()


def test_a_row_locked_by_another_session_holds_up_no_other_locks_renewal(
    holding: list[Mutex], admin: psycopg.Connection[Any], lock_name: str, dsn: str
) -> None:
    wait_until(lambda: _following(admin, lock_name), timeout=5)
    with psycopg.connect(dsn) as other:
        # An operator's transaction left open on one row, whose holder stops renewing it meanwhile: the lease's
        # renewal is to detach that row from the lease.
        other.execute("SELECT 1 FROM mutex_lock WHERE lock_name = %s FOR UPDATE", (_names(lock_name)[0],))
        freeze(holding[0])
        time.sleep(LEASED["stale_threshold"])
        assert all(mutex.held for mutex in holding[1:]), "the other locks' heartbeats waited for that one row"
        other.rollback()
    # Detached once the row is free again: it turns stale by its own heartbeat.
    wait_until(lambda: _rows(admin, lock_name)[_names(lock_name)[0]][2] is None, timeout=5)


def test_locks_whose_lease_may_no_longer_be_renewed_are_renewed_row_by_row(
    make_mutex: Callable[..., Mutex], admin: psycopg.Connection[Any], lock_name: str, dml_role: str
) -> None:
    mutexes = [make_mutex(dsn=dml_role, lock_name=name, **LEASED) for name in _names(lock_name)]
    with ExitStack() as stack:
        for mutex in mutexes:
            assert stack.enter_context(mutex.acquire())
        wait_until(lambda: _following(admin, lock_name), timeout=5)
        role = psycopg.conninfo.conninfo_to_dict(dml_role)["user"]
        admin.execute(sql.SQL("REVOKE ALL ON mutex_lock_leases FROM {}").format(sql.Identifier(str(role))))
        time.sleep(LEASED["stale_threshold"])
        assert all(mutex.held for mutex in mutexes), "locks were lost with the lease's grant"
        ages = [row[1] for row in _rows(admin, lock_name).values()]
        assert max(ages) < LEASED["alert_threshold"], "each row renewed by itself"


def test_locks_held_through_an_applications_pool_renew_their_rows_one_by_one(
    make_mutex: Callable[..., Mutex], admin: psycopg.Connection[Any], lock_name: str, dsn: str
) -> None:
    # The pool's connections may go through a pooler the client cannot see, whose queue may hold the lease's
    # renewal past the deadline it must land within.
    with ConnectionPool(dsn, min_size=1, max_size=2, open=True, timeout=10) as pool:
        mutexes = [make_mutex(pool=pool, lock_name=name, **LEASED) for name in _names(lock_name)]
        with ExitStack() as stack:
            for mutex in mutexes:
                assert stack.enter_context(mutex.acquire())
            time.sleep(5 * LEASED["heartbeat_interval"])
            rows = _rows(admin, lock_name)
            assert len(rows) == LOCKS
            assert all(row[2] is None for row in rows.values()), "rows follow a lease through a pool"
            assert max(row[1] for row in rows.values()) < LEASED["alert_threshold"]


@contextlib.contextmanager
def _role(pg: PostgresServer, admin: psycopg.Connection[Any], *grants: str) -> Iterator[str]:
    """The DSN of a new login role granted ``grants`` (each ``PRIVILEGES ON object``); dropped after."""
    role = f"mutex_lease_{uuid.uuid4().hex[:8]}"
    admin.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(sql.Identifier(role), sql.Literal(PASSWORD)))
    try:
        for grant in grants:
            admin.execute(f"GRANT {grant} TO {role}")
        yield pg.dsn(user=role, password=PASSWORD)
    finally:
        admin.execute(f"DROP OWNED BY {role}")
        admin.execute(f"DROP ROLE {role}")


def test_a_role_that_may_only_read_judges_a_row_by_its_lease(
    holding: list[Mutex], pg: PostgresServer, admin: psycopg.Connection[Any], lock_name: str, needs_superuser: None
) -> None:
    wait_until(lambda: _following(admin, lock_name), timeout=5)
    name = _names(lock_name)[0]
    admin.execute("UPDATE mutex_lock SET last_heartbeat = now() - interval '1 hour' WHERE lock_name = %s", (name,))
    with _role(pg, admin, "SELECT ON mutex_lock", "SELECT ON mutex_lock_leases") as reader:
        (seen,) = LockTable(reader).holders([name])
    assert seen.seconds_since_heartbeat < LEASED["alert_threshold"], "a live holder shown as silent"


def test_a_take_over_by_a_role_not_granted_the_leases_leaves_the_row_on_no_lease(
    holding: list[Mutex],
    make_mutex: Callable[..., Mutex],
    pg: PostgresServer,
    admin: psycopg.Connection[Any],
    lock_name: str,
    needs_superuser: None,
) -> None:
    wait_until(lambda: _following(admin, lock_name), timeout=5)
    name = _names(lock_name)[0]
    # Its own heartbeat stale, as a role that may not read the leases judges it.
    admin.execute("UPDATE mutex_lock SET last_heartbeat = now() - interval '1 hour' WHERE lock_name = %s", (name,))
    grants = ("SELECT, INSERT, UPDATE, DELETE ON mutex_lock", "USAGE ON SEQUENCE mutex_lock_token_seq")
    with _role(pg, admin, *grants) as dml:
        contender = make_mutex(dsn=dml, lock_name=name, instance_id="contender", **LEASED)
        with contender.acquire() as acquired:
            assert acquired
            row = admin.execute("SELECT lease_key FROM mutex_lock WHERE lock_name = %s", (name,)).fetchone()
            assert row == (None,), "the new holder's row follows the former holder's lease"
        contender.close()


def test_a_lapsed_lease_is_never_revived_and_its_rows_follow_a_new_one(
    holding: list[Mutex], admin: psycopg.Connection[Any], lock_name: str
) -> None:
    wait_until(lambda: _following(admin, lock_name), timeout=5)
    (lapsed,) = {row[2] for row in _rows(admin, lock_name).values()}
    # Lapsed, as after a partition longer than the locks' stale threshold: a contender may have judged it stale.
    admin.execute(
        "UPDATE mutex_lock_leases SET last_heartbeat = now() - interval '1 hour' WHERE lease_key = %s", (lapsed,)
    )
    wait_until(
        lambda: _following(admin, lock_name) and lapsed not in {row[2] for row in _rows(admin, lock_name).values()},
        timeout=5,
    )
    age = admin.execute(
        "SELECT EXTRACT(EPOCH FROM now() - last_heartbeat)::float8 FROM mutex_lock_leases WHERE lease_key = %s",
        (lapsed,),
    ).fetchone()
    assert age is not None
    assert age[0] > 3000, "the lapsed lease was renewed again"
    assert all(mutex.held for mutex in holding)


_HOLDER = """
import sys, time
from contextlib import ExitStack
from postgres_mutex import Mutex
dsn, prefix, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
thresholds = dict(heartbeat_interval=0.2, alert_threshold=1.0, stale_threshold=4.0, operation_timeout=1.0)
with ExitStack() as stack:
    mutexes = [Mutex(dsn, f"{prefix}-{index}", **thresholds) for index in range(count)]
    for mutex in mutexes:
        assert stack.enter_context(mutex.acquire())
    print("held", flush=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # which locks it trusts, and when (CLOCK_MONOTONIC: the machine's)
        print(time.monotonic(), "".join("1" if mutex.held else "0" for mutex in mutexes), flush=True)
        time.sleep(0.02)
"""


@pytest.fixture
def holder_process(dsn: str, lock_name: str) -> Iterator[subprocess.Popen[str]]:
    """A process holding ``LOCKS`` locks with `LEASED` thresholds, printing which it trusts every 20 ms."""
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_HOLDER), dsn, lock_name, str(LOCKS)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def test_a_frozen_holder_stops_trusting_its_lock_before_a_0_1_0_reader_may_take_it(
    holder_process: subprocess.Popen[str], admin: psycopg.Connection[Any], lock_name: str
) -> None:
    wait_until(lambda: _following(admin, lock_name), timeout=5)
    time.sleep(5 * LEASED["heartbeat_interval"])
    # The row whose own heartbeat is the oldest: the first a 0.1.0 contender would find stale.
    oldest = max(_rows(admin, lock_name).items(), key=lambda item: item[1][1])[0]
    index = _names(lock_name).index(oldest)
    os.kill(holder_process.pid, signal.SIGSTOP)  # frozen: neither its lease nor its rows are renewed
    try:
        wait_until(
            lambda: (
                admin.execute(
                    "SELECT last_heartbeat <= now() - make_interval(secs => %s) FROM mutex_lock WHERE lock_name = %s",
                    (LEASED["stale_threshold"], oldest),
                ).fetchone()
                == (True,)
            ),
            timeout=LEASED["stale_threshold"] + 2,
        )
        takeable_at = time.monotonic()  # a 0.1.0 contender may reclaim it from now on
    finally:
        os.kill(holder_process.pid, signal.SIGCONT)
    assert holder_process.stdout is not None
    while True:
        at, trusted = holder_process.stdout.readline().split()
        if float(at) >= takeable_at:
            break
    assert trusted[index] == "0", "the holder, woken, still trusted a lock a 0.1.0 reader could take"


def test_a_killed_holders_locks_come_back_when_its_lease_runs_out(
    holder_process: subprocess.Popen[str],
    admin: psycopg.Connection[Any],
    lock_name: str,
    make_mutex: Callable[..., Mutex],
) -> None:
    wait_until(lambda: _following(admin, lock_name), timeout=5)
    time.sleep(3 * LEASED["heartbeat_interval"])
    os.kill(holder_process.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    holder_process.wait(timeout=10)
    contenders = [make_mutex(lock_name=name, **LEASED) for name in (_names(lock_name)[0], _names(lock_name)[-1])]
    for contender in contenders:
        with contender.acquire(blocking=True, timeout=15) as acquired:
            assert acquired
    back_after = time.monotonic() - killed_at
    earliest = LEASED["stale_threshold"] - LEASED["heartbeat_interval"] - 0.3
    assert back_after >= earliest, "reclaimed before the holder could be presumed dead"
    assert back_after < LEASED["stale_threshold"] + 2.0, "reclaimed when its lease ran out"


def _lease_keys(admin: psycopg.Connection[Any]) -> set[int]:
    return {row[0] for row in admin.execute("SELECT lease_key FROM mutex_lock_leases").fetchall()}


def test_a_lease_goes_with_the_last_lock_that_followed_it_and_takes_forgotten_ones_along(
    make_mutex: Callable[..., Mutex], admin: psycopg.Connection[Any], lock_name: str
) -> None:
    # Two leases of processes that ended without deleting theirs: one long ago, one minutes ago.
    admin.execute(
        "INSERT INTO mutex_lock_leases (lease_key, last_heartbeat)"
        " VALUES (-1, now() - interval '2 hours'), (-2, now() - interval '10 minutes')"
    )
    try:
        held = _held(make_mutex, lock_name, LEASED)
        next(held)
        wait_until(lambda: _following(admin, lock_name), timeout=5)
        (key,) = {row[2] for row in _rows(admin, lock_name).values()}
        assert key in _lease_keys(admin)
        held.close()  # every lock released: the client holds nothing on this table
        wait_until(lambda: key not in _lease_keys(admin), timeout=10)
        left = _lease_keys(admin)
        assert -1 not in left, "a lease nobody renewed for hours stays for good"
        assert -2 in left, "a lease renewed minutes ago was deleted"
    finally:
        admin.execute("DELETE FROM mutex_lock_leases WHERE lease_key IN (-1, -2)")


def test_a_migrated_0_1_0_table_gains_the_leases(
    make_mutex: Callable[..., Mutex], admin: psycopg.Connection[Any], dsn: str, lock_name: str
) -> None:
    from tests.integration.test_fencing import README_DDL

    table = f"leased_{uuid.uuid4().hex[:8]}"
    admin.execute(README_DDL.format(table=table))
    try:
        assert LockTable(dsn, table=table).migrate() is True
        names = _names(lock_name)
        mutexes = [make_mutex(lock_name=name, table=table, **LEASED) for name in names]
        with ExitStack() as stack:
            for mutex in mutexes:
                assert stack.enter_context(mutex.acquire())
            wait_until(
                lambda: (
                    admin.execute(
                        f"SELECT count(DISTINCT lease_key), count(lease_key) FROM {table}"  # noqa: S608
                    ).fetchone()
                    == (1, len(names))
                ),
                timeout=5,
            )
            assert admin.execute(f"SELECT count(*) FROM {table}_leases").fetchone() == (1,)  # noqa: S608
    finally:
        admin.execute(f"DROP TABLE IF EXISTS {table}, {table}_leases, {table}_semaphores, {table}_rwlocks CASCADE")


async def test_async_holders_follow_the_lease_too(
    amake_mutex: Callable[..., Mutex], admin: psycopg.Connection[Any], lock_name: str
) -> None:
    mutexes = [amake_mutex(lock_name=name, **{**LEASED, "stale_threshold": 8.0}) for name in _names(lock_name)]
    async with contextlib.AsyncExitStack() as stack:
        for mutex in mutexes:
            assert await stack.enter_async_context(mutex.acquire_async())
        await await_until(lambda: _following(admin, lock_name), timeout=5)
        await asyncio.sleep(3 * LEASED["heartbeat_interval"])
        before = _rows(admin, lock_name)
        await asyncio.sleep(3 * LEASED["heartbeat_interval"])
        after = _rows(admin, lock_name)
        assert sum(after[name][0] != before[name][0] for name in before) < LOCKS / 2
        assert all(mutex.held for mutex in mutexes)
