"""The Celery app the Celery tests run in real ``celery worker`` and ``celery beat`` processes.

Configured from the environment (the tests set it): ``CELERY_TEST_FOLDER``
holds the broker's messages (kombu's filesystem transport) and the results
(Celery's file backend), so the tests need no server but the test
PostgreSQL, named by ``CELERY_TEST_DSN``. The tasks wait for a file the test
creates rather than sleep, so a test decides when a run ends.
"""

from __future__ import annotations

import importlib
import os
import time
from pathlib import Path
from typing import Any

from celery import Celery

from postgres_mutex.integrations.celery import SingletonTask

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


def configure(app: Celery, folder: Path, dsn: str) -> None:
    """Point ``app`` at the broker and results in ``folder`` and at the lock table in ``dsn``."""
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
        postgres_mutex_beat_options={**BEAT_OPTIONS, "instance_id": os.environ.get("CELERY_TEST_BEAT_ID") or None},
    )


if os.environ.get("DJANGO_SETTINGS_MODULE"):  # the django-celery-beat test: its models need Django set up
    importlib.import_module("django").setup()

app = Celery("celery_app")
if "CELERY_TEST_FOLDER" in os.environ:
    configure(app, Path(os.environ["CELERY_TEST_FOLDER"]), os.environ["CELERY_TEST_DSN"])


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
