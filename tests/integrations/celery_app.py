"""The Celery app the Celery tests run in real ``celery worker`` and ``celery beat`` processes.

Configured from the environment (the tests set it): ``CELERY_TEST_FOLDER``
holds the broker's messages (kombu's filesystem transport) and the results
(Celery's file backend), so the tests need no server but the test
PostgreSQL, named by ``CELERY_TEST_DSN``; with ``CELERY_TEST_REDIS_URL``,
a Redis server is the broker and the result backend instead. The tasks wait
for a file the test creates rather than sleep, so a test decides when a run
ends.
"""

from __future__ import annotations

import importlib
import json
import os
import time
from pathlib import Path
from typing import Any

from celery import Celery, signals


def _seen_before_publish(headers: dict[str, Any] | None = None, **_: Any) -> None:
    """A user's ``before_task_publish`` handler, connected before the integration is imported: it runs first.

    It copies the run number it sees into a header of its own, so a test
    tells from the message what such a handler could read.
    """
    if headers is not None:
        headers["seen_before_publish"] = headers.get("postgres_mutex_run")


signals.before_task_publish.connect(_seen_before_publish, weak=False)

from postgres_mutex.integrations.celery import SingletonTask  # noqa: E402

BEAT_OPTIONS: dict[str, Any] = {
    "heartbeat_interval": 0.5,
    "operation_timeout": 1.0,
    "alert_threshold": 5.0,
    "stale_threshold": 30.0,
    "reclaim_disconnected_after": 6.0,
    "poll_interval": 0.25,
}
"""The beats' election: a killed beat is replaced 6 s after its last heartbeat, far sooner than 30 s."""

TASK_OPTIONS: dict[str, Any] = {
    "heartbeat_interval": 0.5,
    "operation_timeout": 1.0,
    "alert_threshold": 5.0,
    "stale_threshold": 30.0,
    "reclaim_disconnected_after": 2.0,
}
"""The singleton tasks' locks: a killed worker's lock is back 2 s after its last heartbeat."""


def configure(app: Celery, folder: Path, dsn: str, redis_url: str | None = None) -> None:
    """Point ``app`` at the broker and results in ``folder`` (or on ``redis_url``) and at the lock table in ``dsn``."""
    broker = folder / "broker"
    broker.mkdir(parents=True, exist_ok=True)
    (folder / "results").mkdir(exist_ok=True)
    app.conf.update(
        broker_url="filesystem://",
        broker_transport_options={
            "data_folder_in": str(broker),
            "data_folder_out": str(broker),
            "control_folder": str(folder / "control"),
            "polling_interval": 0.1,
        },
        result_backend=f"file://{folder / 'results'}",
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        worker_prefetch_multiplier=1,
        task_track_started=True,
        worker_lost_wait=1.0,  # a killed child is reported lost 1 s later, not 10
        broker_connection_retry_on_startup=True,
        beat_schedule={
            "tick-a": {"task": "tests.integrations.celery_app.tick", "schedule": 1.0, "args": ("a",)},
            "tick-b": {"task": "tests.integrations.celery_app.tick", "schedule": 1.0, "args": ("b",)},
        },
        postgres_mutex_dsn=dsn,
        postgres_mutex_task_options=TASK_OPTIONS,
        postgres_mutex_beat_dsn=dsn,
        postgres_mutex_beat_lock=os.environ.get("CELERY_TEST_BEAT_LOCK", "celery-beat"),
        postgres_mutex_beat_options={
            **BEAT_OPTIONS,
            "instance_id": os.environ.get("CELERY_TEST_BEAT_ID") or None,
            **({"table": os.environ["CELERY_TEST_BEAT_TABLE"]} if "CELERY_TEST_BEAT_TABLE" in os.environ else {}),
        },
    )
    if redis_url:
        # A busy worker (one slot each) holds no message it cannot run: an idle worker takes each one at once.
        app.conf.update(broker_url=redis_url, result_backend=redis_url, task_acks_late=True)


if os.environ.get("DJANGO_SETTINGS_MODULE"):  # the django-celery-beat test: its models need Django set up
    importlib.import_module("django").setup()

app = Celery("celery_app")
if "CELERY_TEST_FOLDER" in os.environ:
    configure(
        app,
        Path(os.environ["CELERY_TEST_FOLDER"]),
        os.environ["CELERY_TEST_DSN"],
        os.environ.get("CELERY_TEST_REDIS_URL"),
    )


def _hold(marker: str, limit: float) -> dict[str, Any]:
    """Say the run started (with this process's id), then wait for the test's go-ahead (at most ``limit`` s)."""
    folder = Path(os.environ["CELERY_TEST_FOLDER"])
    start = time.monotonic()
    (folder / f"started-{marker}").write_text(str(os.getpid()))
    release = folder / f"release-{marker}"
    while not release.exists() and time.monotonic() - start < limit:
        time.sleep(0.02)
    return {"marker": marker, "pid": os.getpid(), "start": start, "end": time.monotonic()}


@app.task(base=SingletonTask, singleton_key=["key"])  # type: ignore[untyped-decorator]
def hold(key: str, marker: str, limit: float = 30.0) -> dict[str, Any]:
    return _hold(marker, limit)


@app.task(base=SingletonTask, singleton_key=["key"], singleton_on_contention="wait", singleton_timeout=30.0)  # type: ignore[untyped-decorator]
def hold_or_wait(key: str, marker: str, limit: float = 30.0) -> dict[str, Any]:
    return _hold(marker, limit)


@app.task(base=SingletonTask, singleton_key=["key"], singleton_on_contention="raise")  # type: ignore[untyped-decorator]
def hold_or_raise(key: str, marker: str, limit: float = 30.0) -> dict[str, Any]:
    return _hold(marker, limit)


@app.task  # type: ignore[untyped-decorator]
def tick(entry: str) -> str:
    return entry


@app.task  # type: ignore[untyped-decorator]
def ping() -> str:
    return "pong"


RETRY_OPTIONS: dict[str, Any] = {"base": SingletonTask, "bind": True, "singleton_key": ["marker"], "max_retries": 5}
FAILURES = 2
"""How many times a flaky task's body fails before it succeeds."""


def _attempt(task: Any, marker: str, *, retry_then_clean_up: bool = False) -> dict[str, Any]:
    """Record this body's run (its attempt, process, start and end); fail the first `FAILURES` attempts.

    ``retry_then_clean_up``: a failing attempt asks for its retry first
    (``self.retry(throw=False)``), and goes on a moment before it ends.
    """
    folder = Path(os.environ["CELERY_TEST_FOLDER"])
    attempt = task.request.retries
    (folder / f"begun-{task.request.id}-{attempt}").touch()
    record = {"attempt": attempt, "pid": os.getpid(), "start": time.time()}
    failure = ValueError(f"attempt {attempt} of {marker} fails") if attempt < FAILURES else None
    retry = task.retry(exc=failure, countdown=0, throw=False) if failure and retry_then_clean_up else None
    time.sleep(0.05)  # the body's work, or its clean-up: two bodies at once would overlap in time
    record["end"] = time.time()
    (folder / f"body-{marker}-{attempt}").write_text(json.dumps(record))
    if retry is not None:
        raise retry
    if failure is not None:
        raise failure
    return {"marker": marker, "attempt": attempt}


@app.task(**RETRY_OPTIONS, autoretry_for=(ValueError,), retry_kwargs={"countdown": 0})  # type: ignore[untyped-decorator]
def flaky(self: Any, marker: str) -> dict[str, Any]:
    return _attempt(self, marker)


@app.task(  # type: ignore[untyped-decorator]
    **RETRY_OPTIONS, autoretry_for=(ValueError,), retry_kwargs={"countdown": 0}, singleton_on_contention="raise"
)
def flaky_or_raise(self: Any, marker: str) -> dict[str, Any]:
    return _attempt(self, marker)


@app.task(**RETRY_OPTIONS)  # type: ignore[untyped-decorator]
def flaky_retrying(self: Any, marker: str) -> dict[str, Any]:
    try:
        return _attempt(self, marker)
    except ValueError as exc:
        raise self.retry(exc=exc, countdown=0) from exc


@app.task(**RETRY_OPTIONS, singleton_on_contention="wait", singleton_timeout=30.0)  # type: ignore[untyped-decorator]
def flaky_retrying_or_wait(self: Any, marker: str) -> dict[str, Any]:
    try:
        return _attempt(self, marker)
    except ValueError as exc:
        raise self.retry(exc=exc, countdown=0) from exc


@app.task(**RETRY_OPTIONS)  # type: ignore[untyped-decorator]
def flaky_retrying_then_cleaning_up(self: Any, marker: str) -> dict[str, Any]:
    return _attempt(self, marker, retry_then_clean_up=True)


FLAKY = {
    f"{__name__}.{task.__name__}"
    for task in (flaky, flaky_or_raise, flaky_retrying, flaky_retrying_or_wait, flaky_retrying_then_cleaning_up)
}


@signals.task_postrun.connect(weak=False)  # type: ignore[untyped-decorator]
def _ended(task: Any = None, task_id: str = "", **_: Any) -> None:
    """Say that this attempt of a flaky task ended, whether its body ran or not."""
    if task is not None and task.name in FLAKY:
        (Path(os.environ["CELERY_TEST_FOLDER"]) / f"ended-{task_id}-{task.request.retries}").touch()


@signals.after_task_publish.connect(weak=False)  # type: ignore[untyped-decorator]
def _retry_published(sender: str = "", headers: dict[str, Any] | None = None, **_: Any) -> None:
    """Once a worker has sent a flaky task's retry, wait (at most 5 s) until the retry's body began or it ended.

    The other, idle worker takes the retry up at once, so what the sending
    worker does next (its attempt's end, the release of its lock) happens
    after the retry tried the lock: as when an idle worker is quicker than
    the release, but every time.
    """
    if sender not in FLAKY or not headers or not headers.get("retries") or "CELERY_TEST_FOLDER" not in os.environ:
        return
    folder, attempt = Path(os.environ["CELERY_TEST_FOLDER"]), f"{headers['id']}-{headers['retries']}"
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        if (folder / f"begun-{attempt}").exists() or (folder / f"ended-{attempt}").exists():
            return
        time.sleep(0.01)
