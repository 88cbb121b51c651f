"""`FleetExecutor`: three APScheduler processes, one job every second, each fire time run exactly once."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from tests.support.fixtures import read_line

ROOT = Path(__file__).resolve().parents[2]
SCHEDULERS = 3
FIRE_TIMES = 3


@pytest.fixture
def tables(dsn: str, schema: None) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS aps_runs (job text, fire_time timestamptz, pid int)")
        conn.execute("CREATE TABLE IF NOT EXISTS aps_errors (job text, fire_time timestamptz, error text)")
        yield conn


def run_fleet(dsn: str, job: str, policy: str) -> None:
    """Three schedulers started together; returns once all have exited."""
    env = {**os.environ, "POSTGRES_MUTEX_DSN": dsn, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "tests.integrations.apscheduler_worker", job, policy, str(FIRE_TIMES)]
    procs = [
        subprocess.Popen(command, env=env, cwd=ROOT, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        for _ in range(SCHEDULERS)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None
            assert read_line(proc.stdout, timeout=30).strip() == "ready"
        start = f"{int(time.time()) + 2}\n"  # a whole second, far enough ahead for every scheduler to start
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write(start)
            proc.stdin.flush()
        assert [proc.wait(timeout=60) for proc in procs] == [0] * SCHEDULERS
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return None


@pytest.mark.parametrize("policy", ["skip", "wait", "raise"])
def test_each_fire_time_runs_exactly_once_across_three_schedulers(
    policy: str, dsn: str, tables: psycopg.Connection[Any]
) -> None:
    job = f"aps-{policy}-{uuid.uuid4().hex[:8]}"
    run_fleet(dsn, job, policy)

    runs = tables.execute("SELECT fire_time, count(*) FROM aps_runs WHERE job = %s GROUP BY 1 ORDER BY 1", (job,))
    counts = runs.fetchall()
    first = counts[0][0]
    assert counts == [(first + timedelta(seconds=n), 1) for n in range(FIRE_TIMES)]
    assert isinstance(first, datetime)
    assert first.astimezone(UTC).microsecond == 0, "every scheduler ran the same fire times"

    errors = tables.execute("SELECT error, count(*) FROM aps_errors WHERE job = %s GROUP BY 1", (job,)).fetchall()
    if policy == "raise":
        # The schedulers fire together and a run holds the lock for 0.4 s: the others met it held.
        assert [name for name, _ in errors] == ["JobRunningElsewhere"]
    else:
        assert errors == [], "skip and wait end contention without an error"


def test_a_scheduler_needs_only_the_documented_grants_and_one_lacking_a_grant_does_not_start(
    dml_role: str, admin: psycopg.Connection[Any]
) -> None:
    from apscheduler.schedulers.background import BackgroundScheduler

    from postgres_mutex import SchemaError
    from postgres_mutex.integrations.apscheduler import FleetExecutor

    # dml_role: the README's grants exactly, on tables the owner made with 'postgres-mutex init
    # --apscheduler'; no CREATE on the schema.
    job = f"aps-grants-{uuid.uuid4().hex[:8]}"
    ran = threading.Event()
    scheduler = BackgroundScheduler(
        executors={"default": FleetExecutor(dml_role, heartbeat_interval=0.5)}, timezone=UTC
    )
    scheduler.add_job(ran.set, "date", run_date=datetime.now(UTC) + timedelta(seconds=0.5), id=job)
    scheduler.start()
    try:
        assert ran.wait(15), "the job ran"
    finally:
        scheduler.shutdown()
    assert admin.execute("SELECT count(*) FROM mutex_apscheduler_runs WHERE job_id = %s", (job,)).fetchone() == (1,)

    role = conninfo_to_dict(dml_role)["user"]
    admin.execute(f"REVOKE UPDATE ON mutex_apscheduler_runs FROM {role}")
    lacking = BackgroundScheduler(executors={"default": FleetExecutor(dml_role)}, timezone=UTC)
    with pytest.raises(SchemaError) as caught:
        lacking.start()
    assert f"GRANT SELECT, INSERT, UPDATE ON mutex_apscheduler_runs TO {role}" in str(caught.value)
    assert "postgres-mutex init --apscheduler" in str(caught.value)
    assert not lacking.running
