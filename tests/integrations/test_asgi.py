"""`LeaderOnly` under uvicorn: replicas as real processes, killed and stopped the way Kubernetes does it.

The app is tests/integrations/asgi_app.py (heartbeat 0.5 s, reclaim_disconnected_after 2 s,
poll_interval 0.5 s): the how-to page promises that a killed leader's successor leads within
reclaim_disconnected_after + poll_interval + one statement, and at once after a SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from postgres_mutex import LockTable
from postgres_mutex.integrations.asgi import LeaderOnly
from tests.support.fixtures import FAST, await_until, wait_until
from tests.support.postgres_server import free_port

ROOT = Path(__file__).resolve().parents[2]
RECLAIM_DISCONNECTED_AFTER = 2.0
POLL_INTERVAL = 0.5
TAKEOVER_BOUND = RECLAIM_DISCONNECTED_AFTER + POLL_INTERVAL + 1.0  # the documented bound (one statement: 1 s)
MARGIN = 5.0  # the machine is shared and slow: the bound is checked with room to spare


def probe(port: int, path: str) -> tuple[int, dict[str, Any]] | None:
    """The endpoint's status and JSON body, or None while the server does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as reply:
            return int(reply.status), json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return int(error.code), json.loads(error.read())
    except OSError:
        return None


def status(port: int) -> int | None:
    answer = probe(port, "/ready")
    return None if answer is None else answer[0]


class Replicas:
    """uvicorn processes, each in a session of its own so that a signal reaches its workers too."""

    def __init__(self, dsn: str, election: str) -> None:
        self.dsn, self.election = dsn, election
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.ports: dict[str, int] = {}

    def start(self, replica: str, workers: int = 1) -> int:
        port = free_port()
        env = {
            **os.environ,
            "POSTGRES_MUTEX_DSN": self.dsn,
            "ELECTION": self.election,
            "REPLICA": replica,
            "PYTHONPATH": str(ROOT),
        }
        command = [sys.executable, "-m", "uvicorn", "tests.integrations.asgi_app:app", "--host", "127.0.0.1"]
        command += ["--port", str(port), "--workers", str(workers), "--log-level", "warning"]
        self.procs[replica] = subprocess.Popen(command, env=env, cwd=ROOT, text=True, start_new_session=True)
        self.ports[replica] = port
        wait_until(lambda: probe(port, "/health") is not None, timeout=30, interval=0.1)
        return port

    def signal(self, replica: str, signum: signal.Signals) -> None:
        os.killpg(self.procs[replica].pid, signum)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@pytest.fixture
def replicas(dsn: str, schema: None) -> Iterator[Replicas]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE IF NOT EXISTS asgi_ticks (election text, replica text, pid int, token bigint,"
            " at timestamptz NOT NULL DEFAULT clock_timestamp())"
        )
    started = Replicas(dsn, f"asgi-{uuid.uuid4().hex[:8]}")
    yield started
    started.stop_all()


def took(predicate: Any, timeout: float) -> float:
    start = time.monotonic()
    wait_until(predicate, timeout=timeout, interval=0.05)
    return time.monotonic() - start


def test_one_replica_leads_and_a_killed_or_stopped_leader_is_replaced(replicas: Replicas, dsn: str) -> None:
    a = replicas.start("a", workers=2)
    wait_until(lambda: status(a) == 200, timeout=20, interval=0.1)
    b = replicas.start("b")
    # Every worker of the leading replica answers for it, whichever one leads.
    assert [status(a) for _ in range(8)] == [200] * 8
    assert probe(b, "/ready") == (503, {"election": replicas.election, "replica": "b", "leader": False})
    assert probe(b, "/health") == (200, {"election": replicas.election, "replica": "b", "leader": False})

    replicas.signal("a", signal.SIGKILL)
    takeover = took(lambda: status(b) == 200, TAKEOVER_BOUND + MARGIN)
    print(f"a killed leader was replaced after {takeover:.2f}s (bound {TAKEOVER_BOUND:g}s)")

    c = replicas.start("c")
    assert status(c) == 503
    replicas.signal("b", signal.SIGTERM)
    handover = took(lambda: status(c) == 200, 3.0 + MARGIN)
    print(f"a stopped leader handed over after {handover:.2f}s")
    # uvicorn ends its graceful shutdown by raising the signal again: a clean exit, as a shell sees it.
    assert replicas.procs["b"].wait(timeout=20) in (0, -signal.SIGTERM)
    assert handover < POLL_INTERVAL + 3.0, "the release woke c: it did not wait for a poll or a reclaim"

    with psycopg.connect(dsn, autocommit=True) as conn:

        def ticks() -> list[tuple[Any, ...]]:
            return conn.execute(
                "SELECT replica, count(DISTINCT pid), count(DISTINCT token), min(at), max(at) FROM asgi_ticks"
                " WHERE election = %s GROUP BY replica ORDER BY min(at)",
                (replicas.election,),
            ).fetchall()

        # c answers ready as it begins to lead, a moment before its work has connected and ticked.
        wait_until(lambda: len(ticks()) == 3, timeout=10, interval=0.05)
        rows = ticks()
    # The work ran on one process at a time, one term per replica, in the order leadership passed.
    assert [(replica, pids, terms) for replica, pids, terms, _, _ in rows] == [("a", 1, 1), ("b", 1, 1), ("c", 1, 1)]
    assert rows[0][4] < rows[1][3]
    assert rows[1][4] < rows[2][3]


async def test_the_work_is_cancelled_at_once_when_leadership_is_lost(dsn: str, schema: None) -> None:
    name = f"asgi-{uuid.uuid4().hex[:8]}"
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def work(leadership: object) -> None:
        started.set()
        try:
            await asyncio.sleep(3600)
        finally:
            cancelled.set()

    leader = LeaderOnly(
        dsn,
        name,
        work,
        heartbeat_interval=FAST["heartbeat_interval"],
        alert_threshold=FAST["alert_threshold"],
        stale_threshold=FAST["stale_threshold"],
        poll_interval=FAST["poll_interval"],
    )
    async with leader.lifespan():
        await asyncio.wait_for(started.wait(), 20)
        assert await leader.replica_leads()
        await LockTable(dsn).force_release_async(name)
        # The next heartbeat finds the row gone: the term ends and the work is cancelled.
        await asyncio.wait_for(cancelled.wait(), FAST["heartbeat_interval"] + MARGIN)
    assert leader.election is None


async def test_a_replica_that_cannot_campaign_says_so_once_and_serves_as_a_follower(
    dsn: str, schema: None, caplog: pytest.LogCaptureFixture
) -> None:
    leader = LeaderOnly(dsn, f"asgi-{uuid.uuid4().hex[:8]}", table="mutex_lock_never_made", poll_interval=0.1)
    async with leader.lifespan():
        await await_until(lambda: any(record.levelname == "ERROR" for record in caplog.records))
        for _ in range(3):
            assert not await leader.replica_leads()
    said = [record for record in caplog.records if record.name == "postgres_mutex.integrations.asgi"]
    assert [record.levelname for record in said] == ["ERROR"], [record.getMessage() for record in said]
    assert "run 'postgres-mutex init'" in said[0].getMessage()
    assert "serves on as a follower" in said[0].getMessage()
