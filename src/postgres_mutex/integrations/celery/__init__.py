"""Celery: a highly available beat (one of several sends the schedule) and singleton tasks.

Install with ``pip install "postgres-mutex[celery]"``. Use
``celery beat -S postgres_mutex.integrations.celery:LeaderScheduler`` on
every node, and ``@app.task(base=SingletonTask)`` for tasks that must not
run twice at once. ``LeaderDatabaseScheduler`` is django-celery-beat's
``DatabaseScheduler`` sending only while it leads (needs django-celery-beat).
See docs/how-to/celery.md.
"""

from __future__ import annotations

from typing import Any

from .beat import BEAT_DEFAULTS, RUN_HEADERS, LeaderScheduler, LeaderSchedulerMixin, database_scheduler
from .tasks import SKIPPED, TASK_DEFAULTS, SingletonTask, TaskAlreadyRunning, close_clients, current_mutex

__all__ = [
    "BEAT_DEFAULTS",
    "RUN_HEADERS",
    "SKIPPED",
    "TASK_DEFAULTS",
    "LeaderScheduler",
    "LeaderSchedulerMixin",
    "SingletonTask",
    "TaskAlreadyRunning",
    "close_clients",
    "current_mutex",
]


def __getattr__(name: str) -> Any:
    # Built on first use: importing django-celery-beat needs Django configured.
    if name == "LeaderDatabaseScheduler":
        return database_scheduler()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
