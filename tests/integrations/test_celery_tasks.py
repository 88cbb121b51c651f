"""Singleton tasks in a real ``celery worker``, prefork and threads pools, on the test PostgreSQL.

Each run of a test task says when it started and waits for the test's
go-ahead, so a test holds a run as long as it needs, with no fixed sleep.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.fixtures import required_module

required_module("celery", "the Celery integration's tests run real Celery workers: pip install -e '.[celery]'")

from celery import Celery  # noqa: E402
from celery.result import AsyncResult  # noqa: E402

from postgres_mutex.integrations.celery import SKIPPED, TaskAlreadyRunning  # noqa: E402
from tests.integrations.celery_app import TASK_OPTIONS, configure  # noqa: E402
from tests.integrations.celery_support import running, start_celery, wait_for  # noqa: E402

TASKS = "tests.integrations.celery_app"


class Worker:
    """The test's side of one worker: sends tasks, starts and releases their runs."""

    def __init__(self, folder: Path, dsn: str) -> None:
        self.folder = folder
        self.app = Celery("celery_test_client")
        configure(self.app, folder, dsn)

    def send(self, task: str, key: str, marker: str, limit: float = 30.0) -> AsyncResult:
        return self.app.send_task(f"{TASKS}.{task}", args=(key, marker, limit))

    def started(self, marker: str, timeout: float = 30.0) -> int:
        """The pid of the process running ``marker``'s run, once it has started."""
        path = self.folder / f"started-{marker}"
        wait_for(path.exists, timeout=timeout, what=f"run {marker} started")
        return int(wait_for(path.read_text, timeout=5, what=f"run {marker} wrote its pid"))

    def release(self, marker: str) -> None:
        (self.folder / f"release-{marker}").touch()


@pytest.fixture(scope="module", params=["prefork", "threads"])
def worker(
    request: pytest.FixtureRequest, dsn: str, schema: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Worker]:

    folder = tmp_path_factory.mktemp(f"celery-{request.param}")
    log = folder / "worker.log"
    proc = start_celery(
        folder,
        dsn,
        "worker",
        "--pool",
        request.param,
        "--concurrency",
        "3",
        "-O",
        "fair",
        "--loglevel",
        "INFO",
        log=log,
    )
    with running([proc], [log]):
        client = Worker(folder, dsn)
        assert client.app.send_task(f"{TASKS}.ping").get(timeout=60) == "pong"
        yield client


def key() -> str:
    return uuid.uuid4().hex[:8]


def test_a_singleton_task_sent_twice_runs_once_and_the_other_is_skipped(worker: Worker) -> None:
    k, first, second, third = key(), key(), key(), key()
    running_one = worker.send("hold", k, first)
    worker.started(first)

    assert worker.send("hold", k, second).get(timeout=30) == SKIPPED
    assert not (worker.folder / f"started-{second}").exists()

    worker.release(first)
    assert running_one.get(timeout=30)["marker"] == first
    worker.release(third)  # the lock was released with the run: the next one runs
    assert worker.send("hold", k, third).get(timeout=30)["marker"] == third


def test_other_arguments_are_another_lock(worker: Worker) -> None:
    one, other = key(), key()
    worker.send("hold", "first-key", one)
    worker.started(one)
    worker.release(other)
    assert worker.send("hold", "second-key", other).get(timeout=30)["marker"] == other
    worker.release(one)


def test_raise_policy_fails_the_second_run(worker: Worker) -> None:
    k, first, second = key(), key(), key()
    worker.send("hold_or_raise", k, first)
    worker.started(first)
    with pytest.raises(TaskAlreadyRunning, match="already running"):
        worker.send("hold_or_raise", k, second).get(timeout=30)
    worker.release(first)


def test_wait_policy_runs_the_second_once_the_first_ends(worker: Worker) -> None:
    k, first, second = key(), key(), key()
    one = worker.send("hold_or_wait", k, first)
    worker.started(first)
    worker.release(second)
    two = worker.send("hold_or_wait", k, second)
    wait_for(lambda: two.state == "STARTED", timeout=30, what="the second run was taken up by the worker")
    assert not (worker.folder / f"started-{second}").exists(), "the second run did not wait for the first"
    worker.release(first)
    ran_one: dict[str, Any] = one.get(timeout=30)
    ran_two: dict[str, Any] = two.get(timeout=30)
    assert ran_two["start"] >= ran_one["end"], "the second run began before the first ended"


@pytest.mark.parametrize("worker", ["prefork"], indirect=True)  # a thread cannot be killed alone
def test_a_killed_prefork_child_frees_the_lock_for_the_next_run(worker: Worker) -> None:
    k, doomed = key(), key()
    doomed_run = worker.send("hold", k, doomed, 120.0)
    pid = worker.started(doomed)
    assert pid != os.getpid()
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    # The worker reports the run lost (and replaces the child) before it is given another one.
    doomed_run.get(timeout=30, propagate=False)
    assert doomed_run.state == "FAILURE"

    bound = TASK_OPTIONS["reclaim_disconnected_after"] + 20.0  # far below the 30 s stale threshold
    attempts = 0
    while True:
        attempts += 1
        marker = key()
        worker.release(marker)
        outcome = worker.send("hold", k, marker).get(timeout=30)
        if outcome != SKIPPED:
            break
        assert time.monotonic() - killed < bound, f"the killed run's lock was not reclaimed within {bound:g}s"
        assert attempts < 200
    assert outcome["marker"] == marker
