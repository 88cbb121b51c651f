"""A process with more than 1,024 descriptors open: a holder keeps one session, a waiter is woken by the release.

A web server or a worker with many sockets hands the library descriptors
numbered above 1,024, where ``select()`` fails. Each test runs the library in
a process of its own (`tests/support/many_descriptors.py`) that opens 1,100
descriptors before the library connects: this process's are left alone.
"""

from __future__ import annotations

import resource
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from postgres_mutex import Mutex
from tests.support.fixtures import ROOT, process_listens, read_line, skip_or_fail_in_ci, wait_until
from tests.support.many_descriptors import HOLDER, WAITER, needed_limit
from tests.support.postgres_server import PostgresServer


@pytest.fixture(autouse=True)
def _enough_descriptors() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < needed_limit():
        skip_or_fail_in_ci(f"RLIMIT_NOFILE's hard limit is {hard}: these tests open {needed_limit()} descriptors")


def _start(procs: list[subprocess.Popen[str]], *args: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.many_descriptors", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    procs.append(proc)
    return proc


def _line(proc: subprocess.Popen[str], *, timeout: float) -> str:
    try:
        return read_line(proc.stdout, timeout=timeout).strip()  # type: ignore[arg-type]
    except AssertionError:
        proc.kill()
        _, err = proc.communicate(timeout=10)
        raise AssertionError(f"the process said nothing within {timeout}s: {err[-3000:]}") from None


def _sessions(admin: psycopg.Connection[Any], application_name: str) -> set[tuple[int, Any]]:
    return {
        (pid, started)
        for pid, started in admin.execute(
            "SELECT pid, backend_start FROM pg_stat_activity WHERE application_name = %s", (application_name,)
        ).fetchall()
    }


def test_a_holder_keeps_one_server_session_over_its_heartbeats(
    pg: PostgresServer, admin: psycopg.Connection[Any], schema: None, workers: list[subprocess.Popen[str]]
) -> None:
    """Idle between two heartbeats, the holder's connection is checked before each: it stays the same one.

    A sync holder and an async one, at once: each in a process of its own, with a name of its own.
    """
    beats = 4
    holders = {}
    for flavour in ("sync", "async"):
        name = f"fds-{flavour}-{uuid.uuid4().hex[:10]}"
        seconds = str(beats * HOLDER["heartbeat_interval"])
        holders[name] = _start(workers, "hold", flavour, pg.dsn(application_name=name), name, seconds)
    for proc in holders.values():
        assert _line(proc, timeout=30) == "held"
    seen: dict[str, set[tuple[int, Any]]] = {name: set() for name in holders}
    deadline = time.monotonic() + beats * HOLDER["heartbeat_interval"] + 20
    # Every session each holder has, sampled far more often than it heartbeats.
    while any(proc.poll() is None for proc in holders.values()) and time.monotonic() < deadline:
        for name in holders:
            seen[name] |= _sessions(admin, name)
        time.sleep(0.05)
    for proc in holders.values():
        out, err = proc.communicate(timeout=10)
        assert proc.returncode == 0, err[-3000:]
        assert out.split() == ["done", "True"], (out, err[-3000:])
    sessions = {name: len(found) for name, found in seen.items()}
    assert set(sessions.values()) == {1}, f"server sessions over {beats} heartbeats: {sessions}"


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_waiter_is_woken_by_the_release_not_its_poll(
    pg: PostgresServer,
    admin: psycopg.Connection[Any],
    make_mutex: Callable[..., Mutex],
    lock_name: str,
    workers: list[subprocess.Popen[str]],
    flavour: str,
) -> None:
    """The waiter's listener hears the release: the lock is handed over long before its poll_interval."""
    holder = make_mutex()
    with holder.acquire() as got:
        assert got
        proc = _start(workers, "wait", flavour, pg.dsn(), lock_name)
        assert _line(proc, timeout=30) == "waiting"
        try:
            wait_until(lambda: process_listens(admin, lock_name), timeout=10)
        except AssertionError:
            raise AssertionError("the waiter's release listener never LISTENed within 10s") from None
        released_at = time.monotonic()
    held = _line(proc, timeout=30).split()
    assert held[0] == "held", held
    hand_off = float(held[1]) - released_at
    assert hand_off < 2.0, f"handed over after {hand_off:.2f}s (poll_interval={WAITER['poll_interval']:g}s)"
    assert proc.wait(timeout=10) == 0
