"""django-celery-beat's DatabaseScheduler, leader-elected: two real beats, a hand-over, no run sent twice.

The beats share Django's database (an SQLite file here), as they would in
production; each keeps the schedule it read at start in memory, which is
why the runs recorded in PostgreSQL are what keeps the new leader from
sending again what the old one sent.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path

from tests.support.fixtures import required_module

required_module("celery", "the Celery integration's tests run real celery beat processes: pip install -e '.[celery]'")
required_module("django_celery_beat", "django-celery-beat's scheduler is tested with it: pip install -e '.[dev]'")

from postgres_mutex import Election  # noqa: E402
from tests.integrations.celery_app import BEAT_OPTIONS  # noqa: E402
from tests.integrations.celery_support import ROOT, celery_env, running, sent_messages, start_celery, wait_for  # noqa: E402

SETTINGS = "tests.integrations.celery_django_settings"


def test_a_stopped_database_scheduler_hands_over_at_once_and_sends_no_run_twice(
    dsn: str, schema: None, tmp_path: Path
) -> None:
    lock = f"django-beat-{uuid.uuid4().hex[:8]}"
    env = {"CELERY_TEST_BEAT_LOCK": lock, "DJANGO_SETTINGS_MODULE": SETTINGS}
    subprocess.run(
        [sys.executable, "-m", "django", "migrate", "-v0"],
        cwd=ROOT,
        env=celery_env(tmp_path, dsn, **env),
        check=True,
        timeout=120,
    )
    observer = Election(dsn, lock, instance_id="observer", **BEAT_OPTIONS)
    broker = tmp_path / "broker"
    names = ("django-beat-1", "django-beat-2")
    logs = [tmp_path / f"{name}.log" for name in names]
    beats: dict[str, subprocess.Popen[bytes]] = {}
    started: list[subprocess.Popen[bytes]] = []  # stopped at the end by running(), however many started
    with running(started, logs), observer:
        for name, log in zip(names, logs, strict=True):
            beat = start_celery(
                tmp_path,
                dsn,
                "beat",
                "-S",
                "postgres_mutex.integrations.celery:LeaderDatabaseScheduler",
                "--loglevel",
                "INFO",
                log=log,
                CELERY_TEST_BEAT_ID=name,
                **env,
            )
            beats[name] = beat
            started.append(beat)
            leader = wait_for(observer.leader, timeout=60, what=f"a beat leads once {name} started")
        first = leader.instance_id
        first_token = leader.token
        wait_for(
            lambda: sum(m["postgres_mutex_token"] == first_token for m in sent_messages(broker)) >= 4,
            timeout=30,
            what="the leader sent both entries twice",
        )

        beats[first].send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        second = wait_for(
            lambda: (found := observer.leader()) is not None and found.instance_id != first and found,
            timeout=30,
            what="the standby took over",
        )
        assert time.monotonic() - stopped < BEAT_OPTIONS["reclaim_disconnected_after"] - 2
        wait_for(
            lambda: sum(m["postgres_mutex_token"] == second.token for m in sent_messages(broker)) >= 4,
            timeout=30,
            what="the new leader sent both entries twice",
        )

    runs: dict[str, list[int]] = defaultdict(list)
    for message in sent_messages(broker):
        runs[message["postgres_mutex_entry"]].append(message["postgres_mutex_run"])
        assert message["seen_before_publish"] == message["postgres_mutex_run"], "a publish handler missed the run"
    assert {"tick-a", "tick-b"} <= set(runs)
    for entry, numbers in runs.items():
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), f"{entry}: {numbers}"
