"""A minimum hold (``hold_at_least``, ``run --hold-at-least``): the lock stays taken that long after its acquire.

What cron on several hosts needs: hosts fire the same schedule a few seconds
apart, and the job must run once per tick, however short it is. Released
sooner, the lock's row stays, marked released, until the minimum has passed;
a holder that dies keeps it too. Then it is free at once: no alert, no
reclaim.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from postgres_mutex import Mutex, MutexClient, SchemaError
from tests.support.fixtures import ROOT, RecordingMetrics, wait_until
from tests.support.timing import FAST

MINIMUM = 2.5
"""The minimum hold of these tests: long enough to tell from a prompt release, short enough for a quick test."""
LATE = 0.5
"""Slack for a busy machine: a poll interval, a process start, a statement."""
STALE = 3.0
"""The stale threshold of these tests' holders: a minimum hold is at most that."""
FLAGS = ["--heartbeat-interval", "0.1", "--alert-threshold", "0.6", "--stale-threshold", f"{STALE:g}"]


def drop(admin: psycopg.Connection[Any], table: str) -> None:
    """A table of a test's own, with what its creation made beside it."""
    admin.execute(f"DROP TABLE IF EXISTS {table}, {table}_history, {table}_semaphores, {table}_rwlocks")


def run_cli(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "postgres_mutex", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finished(proc: subprocess.Popen[str], timeout: float = 30) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def test_runs_fired_seconds_apart_run_the_job_once(dsn: str, lock_name: str, schema: None, tmp_path: Path) -> None:
    """Three hosts' cron fire a one-instant job about a second apart: it runs once; the next tick's run runs."""
    ran = tmp_path / "ran"
    job = ["sh", "-c", f"echo ran >> {ran}"]
    common = ["run", "--dsn", dsn, "--lock", lock_name, *FLAGS, "--hold-at-least", f"{STALE:g}"]
    started = time.monotonic()
    first = run_cli(*common, "--instance-id", "host-0", "--", *job)
    assert finished(first)[0] == 0, "the first host's run ran the job and released"
    done = time.monotonic()
    runs = [first]
    for host in (1, 2):
        # The others fire after the job is done: half a second, then a second after (a process start more).
        wait_until(lambda host=host: time.monotonic() - done >= host / 2, timeout=5)  # type: ignore[misc]
        runs.append(run_cli(*common, "--instance-id", f"host-{host}", "--", *job))
    codes = [(0, "", ""), *(finished(proc) for proc in runs[1:])]
    assert [code for code, _, _ in codes] == [0, 75, 75], codes
    assert "host-0" in codes[1][2], "a later run names the host whose run holds the lock"
    assert ran.read_text() == "ran\n", "the job ran once"
    # The next tick: a run that waits runs once the minimum has passed, with no alert and no reclaim.
    waiting = run_cli(*common, "--instance-id", "host-next", "--wait", "--timeout", "10", "-v", "--", *job)
    code, _, err = finished(waiting)
    assert code == 0, err
    assert time.monotonic() - started >= STALE
    assert ran.read_text() == "ran\nran\n"
    assert "reclaim" not in err, err
    assert "alert" not in err, err


def test_a_job_that_ends_early_keeps_the_lock_until_the_minimum(
    make_mutex: Callable[..., Mutex], admin: psycopg.Connection[Any], lock_name: str, metrics: RecordingMetrics
) -> None:
    first = make_mutex(instance_id="first", stale_threshold=STALE)
    other = make_mutex(instance_id="other", metrics=metrics)
    with first.acquire(hold_at_least=MINIMUM) as acquired:
        assert acquired
        acquired_at = time.monotonic()
    assert not first.held
    with other.acquire() as got:
        assert not got, "released, but within its minimum hold"
    assert other.last_holder == "first"
    with first.acquire() as again:
        assert not again, "its own instance too waits out the minimum (as ShedLock's lockAtLeastFor)"
    (hold_until, in_future) = admin.execute(
        "SELECT hold_until, hold_until > now() FROM mutex_lock WHERE lock_name = %s", (lock_name,)
    ).fetchone() or (None, None)
    assert hold_until is not None
    assert in_future
    tried = len(metrics.named("contended"))
    with other.acquire(timeout=MINIMUM + 10) as got:
        assert got
        waited = time.monotonic() - acquired_at
    assert MINIMUM - LATE <= waited < MINIMUM + 1, f"taken {waited:.2f}s after the first acquire"
    # Polling every 0.05 s, it would have tried some 40 times: it waits for the minimum's end instead.
    assert len(metrics.named("contended")) - tried <= 3, "a waiter does not poll a lock kept for its minimum"
    assert metrics.named("stale_reclaimed") == [], "a released row: no reclaim"
    assert metrics.named("alert") == [], "a released row: no alert"
    assert admin.execute("SELECT count(*) FROM mutex_lock WHERE lock_name = %s", (lock_name,)).fetchone() == (0,)


def test_a_hold_longer_than_its_minimum_is_released_at_once(
    make_mutex: Callable[..., Mutex], admin: psycopg.Connection[Any], lock_name: str
) -> None:
    mutex = make_mutex(hold_at_least=0.2)  # the constructor's keyword: each acquire's default
    with mutex.acquire() as acquired:
        assert acquired
        time.sleep(0.4)  # the job outlasts the minimum
    assert admin.execute("SELECT count(*) FROM mutex_lock WHERE lock_name = %s", (lock_name,)).fetchone() == (0,)
    with make_mutex().acquire() as got:
        assert got


def test_a_minimum_asked_by_one_acquire_is_kept_whatever_the_same_mutex_held_before(
    make_mutex: Callable[..., Mutex], admin: psycopg.Connection[Any], lock_name: str
) -> None:
    mutex = make_mutex(stale_threshold=STALE)
    with mutex.acquire() as acquired:  # no minimum: the row goes with the release
        assert acquired
    assert admin.execute("SELECT count(*) FROM mutex_lock WHERE lock_name = %s", (lock_name,)).fetchone() == (0,)
    with mutex.acquire(hold_at_least=MINIMUM) as acquired:
        assert acquired
    with make_mutex().acquire() as got:
        assert not got, "released, but within the minimum its acquire asked for"
    assert admin.execute("SELECT hold_until > now() FROM mutex_lock WHERE lock_name = %s", (lock_name,)).fetchone() == (
        True,
    )


async def test_the_async_acquire_takes_a_minimum_too(amake_mutex: Callable[..., Mutex]) -> None:
    first, other = amake_mutex(stale_threshold=STALE), amake_mutex()
    async with first.acquire_async(hold_at_least=MINIMUM) as acquired:
        assert acquired
    async with other.acquire_async(blocking=False) as got:
        assert not got


def test_a_killed_holder_keeps_the_lock_until_the_minimum(
    dsn: str, lock_name: str, schema: None, make_mutex: Callable[..., Mutex]
) -> None:
    """SIGKILL right after the acquire: not even a contender with a shorter stale threshold takes it sooner."""
    holder = run_cli(
        *("run", "--dsn", dsn, "--lock", lock_name, *FLAGS, "--hold-at-least", f"{STALE:g}", "--"),
        *("sh", "-c", "echo $$; exec sleep 30 > /dev/null"),
    )
    job = None
    try:
        assert holder.stdout is not None
        job = int(holder.stdout.readline())
        started = time.monotonic()
        os.kill(holder.pid, signal.SIGKILL)
        contender = make_mutex()  # stale_threshold 1.5 s
        with contender.acquire(timeout=15) as got:
            assert got
            waited = time.monotonic() - started
        assert waited >= STALE - LATE, f"taken {waited:.2f}s after the killed holder's acquire"
    finally:
        holder.kill()
        if job is not None:
            os.kill(job, signal.SIGKILL)  # the runner's command, orphaned by its SIGKILL
        finished(holder)


def test_a_table_without_the_column_works_and_names_the_migration(
    dsn: str, admin: psycopg.Connection[Any], lock_name: str
) -> None:
    table = f"old_{lock_name.replace('-', '_')}"
    with MutexClient(dsn) as client:
        client.table(table).create()
        admin.execute(f"ALTER TABLE {table} DROP COLUMN hold_until")
        try:
            mutex = client.mutex(lock_name, table=table, **FAST)
            with mutex.acquire() as acquired:
                assert acquired, "a table of an older shape keeps working without the feature"
            with pytest.raises(SchemaError, match=r"hold_at_least.*postgres-mutex migrate"):
                mutex.acquire(hold_at_least=1).__enter__()
            assert not mutex.held
            refused = finished(
                run_cli(
                    "run", "--dsn", dsn, "--table", table, "--lock", lock_name, "--hold-at-least", "1", "--", "true"
                )
            )
            assert refused[0] == 69, refused
            assert "--hold-at-least needs the lock table" in refused[2]
            assert "run 'postgres-mutex migrate' once" in refused[2]
            migrated = subprocess.run(
                [sys.executable, "-m", "postgres_mutex", "migrate", "--dsn", dsn, "--table", table],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert migrated.returncode == 0, migrated.stderr
            with mutex.acquire(hold_at_least=1) as acquired:
                assert acquired
            with client.mutex(lock_name, table=table, **FAST).acquire() as got:
                assert not got, "the minimum holds once migrated"
        finally:
            drop(admin, table)


def test_status_and_the_history_show_a_released_lock_held_until_its_minimum(
    dsn: str, admin: psycopg.Connection[Any], lock_name: str
) -> None:
    table = f"kept_{lock_name.replace('-', '_')}"
    with MutexClient(dsn) as client:
        client.table(table).create(history=True)
        try:
            first = client.mutex(lock_name, table=table, instance_id="first", **{**FAST, "stale_threshold": STALE})
            with first.acquire(hold_at_least=MINIMUM) as acquired:
                assert acquired
            (seen,) = client.table(table).holders([lock_name])
            assert seen.holder == "first"
            assert seen.held_until is not None
            assert (seen.alerting, seen.reclaimable) == (False, False)
            status = subprocess.run(
                [sys.executable, "-m", "postgres_mutex", "status", "--dsn", dsn, "--table", table, "--lock", lock_name],
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            )
            assert "released, held until " in status.stdout, status.stdout
            (record,) = client.table(table).history(lock_name)
            assert (record.holder, record.ended_how) == ("first", "released"), "released now, kept for its minimum"
            other = client.mutex(lock_name, table=table, instance_id="other", **FAST)
            with other.acquire(timeout=MINIMUM + 10) as got:
                assert got
                newest, released = client.table(table).history(lock_name)
                assert (newest.holder, newest.ended_how) == ("other", None)
                assert (released.holder, released.ended_how) == ("first", "released"), "no reclaim recorded"
            assert client.table(table).holders([lock_name]) == []
        finally:
            drop(admin, table)
