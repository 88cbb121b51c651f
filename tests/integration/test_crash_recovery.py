"""A crashed holder's lock comes back on time, and never while it could still be alive."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from postgres_mutex import Mutex
from tests.support.exclusion import overlaps, read_log
from tests.support.fixtures import FAST, ROOT, RecordingMetrics, read_held, start_worker, wait_until

Holder = Callable[..., str | None]


def test_a_killed_holder_is_alerted_on_then_reclaimed_no_sooner_than_the_stale_threshold(
    dsn: str,
    lock_name: str,
    make_mutex: Callable[..., Mutex],
    metrics: RecordingMetrics,
    workers: list[subprocess.Popen[str]],
    holder_id: Holder,
    row: Callable[..., tuple[Any, ...] | None],
) -> None:
    proc = start_worker("hold", dsn, lock_name)
    workers.append(proc)
    dead_id = read_held(proc)
    # A live holder first: the server saw it heartbeat since it acquired.
    wait_until(lambda: (found := row()) is not None and found[2] > found[1])
    os.kill(proc.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    proc.wait(timeout=10)

    contender = make_mutex(metrics=metrics)
    with contender.acquire(blocking=True, timeout=20) as acquired:
        acquired_at = time.monotonic()
        assert acquired
        assert holder_id() == contender.instance_id
        token = contender.token

    # The last heartbeat came at most one interval before the kill.
    earliest = FAST["stale_threshold"] - FAST["heartbeat_interval"] - 0.3  # a heartbeat may be late on a busy machine
    assert acquired_at - killed_at >= earliest, "reclaimed before the holder could be presumed dead"
    assert acquired_at - killed_at < FAST["stale_threshold"] + 3.0, "reclaimed on time"
    assert metrics.named("stale_reclaimed") == [
        {"instance_id": contender.instance_id, "previous_holder": dead_id, "token": token, "reason": "stale"}
    ]
    assert isinstance(token, int)
    alerts = metrics.named("alert")
    assert len(alerts) == 1, "one alert per stale episode, however often the contender polls"
    assert alerts[0]["holder"] == dead_id
    assert FAST["alert_threshold"] <= alerts[0]["seconds_since_heartbeat"] < FAST["stale_threshold"]
    names = [name for name, _, _ in metrics.calls if name in ("alert", "stale_reclaimed")]
    assert names == ["alert", "stale_reclaimed"], "on-call hears before the reclaim"


@pytest.mark.parametrize("how", ["exit-holding", "exit-in-thread", "exit-in-task"])
def test_a_normal_interpreter_exit_releases_a_lock_still_held(
    dsn: str, lock_name: str, workers: list[subprocess.Popen[str]], holder_id: Holder, how: str
) -> None:
    # On every Python .ci/run tests: 3.12 refuses to start threads in atexit callbacks.
    proc = start_worker(how, dsn, lock_name)
    workers.append(proc)
    read_held(proc)
    assert proc.wait(timeout=20) == 0
    assert holder_id() is None, "the exiting process deleted its row"
    assert proc.stderr is not None
    stderr = proc.stderr.read()
    assert "Traceback" not in stderr, stderr
    assert "Exception ignored" not in stderr, stderr


def test_contending_processes_never_overlap(
    dsn: str, lock_name: str, tmp_path: Path, workers: list[subprocess.Popen[str]], holder_id: Holder
) -> None:
    iterations = 15
    logs = [tmp_path / f"worker-{i}.log" for i in range(4)]
    for i, log in enumerate(logs):
        workers.append(start_worker("contend", dsn, lock_name, str(iterations), str(log), ("sync", "async")[i % 2]))
    for proc in workers:
        assert proc.wait(timeout=120) == 0, proc.stderr.read() if proc.stderr else ""

    sections = [section for log in logs for section in read_log(log)]
    assert len(sections) == iterations * len(logs), "every process finished every iteration"
    assert overlaps(sections) == []  # the checker's own tests: tests/unit/test_exclusion.py
    assert len({section.who for section in sections}) == len(logs)
    assert holder_id() is None, "no row is left that nobody holds"


def _fork_report(dsn: str, lock_name: str, instance_id: str = "") -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.workers", "fork", dsn, lock_name, instance_id],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    report: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return report


def test_a_forked_child_is_another_instance_and_its_exit_leaves_the_parent_holding(
    dsn: str, lock_name: str, holder_id: Holder
) -> None:
    report = _fork_report(dsn, lock_name)
    assert report["parent_acquired"] is True
    assert report["child_id"] != report["parent_id"], "the child chose its own instance_id"
    assert report["child_held"] is False, "the child does not inherit the hold"
    assert report["child_acquired"] is False, "the child contends like any other instance"
    assert report["parent_held_after_child_exit"] is True, "the child's exit did not release the parent's lock"
    assert report["stranger_acquired"] is False
    assert holder_id() is None, "the parent released at the end"


def test_a_forked_child_refuses_an_explicit_instance_id_it_would_share(dsn: str, lock_name: str) -> None:
    report = _fork_report(dsn, lock_name, "worker-1")
    assert report["child_id"] == "worker-1"
    assert "MutexError" in report["child_error"]
    assert "forked child would share" in report["child_error"]
    assert report["parent_held_after_child_exit"] is True


def test_a_stale_row_in_the_way_of_a_prompt_acquire_is_reclaimed_told_and_tokens_still_grow(
    make_mutex: Callable[..., Mutex],
    admin: Any,
    lock_name: str,
    metrics: RecordingMetrics,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A row left by a holder that vanished long ago (its heartbeat past stale_threshold), as a crashed
    # process leaves it: an uncontended-looking acquire finds it in the way of its INSERT.
    admin.execute(
        "INSERT INTO mutex_lock (lock_name, instance_id, last_heartbeat, acquired_at) "
        "VALUES (%s, 'vanished', now() - interval '1 hour', now() - interval '1 hour')",
        (lock_name,),
    )
    found = admin.execute("SELECT token FROM mutex_lock WHERE lock_name = %s", (lock_name,)).fetchone()
    assert found is not None
    left_token = found[0]
    contender = make_mutex(metrics=metrics)
    with contender.acquire() as acquired:
        assert acquired, "a stale row is reclaimed by a non-blocking acquire too"
        reclaimed_token = contender.token
    assert [call["previous_holder"] for call in metrics.named("stale_reclaimed")] == ["vanished"]
    told = [r.getMessage() for r in caplog.records if r.name == "postgres_mutex" and r.levelname == "WARNING"]
    assert any("reclaimed lock" in message and "'vanished'" in message for message in told), told
    assert admin.execute("SELECT count(*) FROM mutex_lock WHERE lock_name = %s", (lock_name,)).fetchone() == (0,)
    with contender.acquire() as again:  # nothing in the way now: a fresh row
        assert again
        fresh_token = contender.token
    assert isinstance(reclaimed_token, int)
    assert isinstance(fresh_token, int)
    assert left_token < reclaimed_token < fresh_token, "fencing tokens grow across the reclaim and after it"
