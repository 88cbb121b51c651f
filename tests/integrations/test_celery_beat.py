"""Three real ``celery beat`` processes on one election: one sends, hand-overs send no run twice.

The hand-overs: the leader's lock force-released under it (it is alive, and
learns of the loss at its next heartbeat), the leader SIGKILLed (a standby
takes over within the bound), the leader SIGTERMed (a standby at once).

What beat sent is read from the filesystem broker's folder (no worker
consumes it): each message carries its entry, its run number and the
sending term's token, so a run sent twice, or a run sent by a beat that was
not leading, shows in the files.
"""

from __future__ import annotations

import re
import signal
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

from tests.support.fixtures import required_module

required_module("celery", "the Celery integration's tests run real celery beat processes: pip install -e '.[celery]'")

import psycopg  # noqa: E402
from psycopg.conninfo import conninfo_to_dict  # noqa: E402

from postgres_mutex import Election, MutexClient  # noqa: E402
from tests.integrations.celery_app import BEAT_OPTIONS  # noqa: E402
from tests.integrations.celery_support import running, sent_messages, start_celery, wait_for  # noqa: E402

RECLAIM = BEAT_OPTIONS["reclaim_disconnected_after"]


def test_three_beats_one_sends_and_no_run_is_sent_twice_across_hand_overs(
    dsn: str, schema: None, tmp_path: Path
) -> None:
    lock = f"beat-{uuid.uuid4().hex[:8]}"
    names = ("beat-1", "beat-2", "beat-3")
    logs = [tmp_path / f"{name}.log" for name in names]
    beats = {
        name: start_celery(
            tmp_path,
            dsn,
            "beat",
            "-S",
            "postgres_mutex.integrations.celery:LeaderScheduler",
            "-s",
            str(tmp_path / f"{name}-schedule"),  # each node has its own file, as on separate machines
            "--loglevel",
            "INFO",
            log=log,
            CELERY_TEST_BEAT_LOCK=lock,
            CELERY_TEST_BEAT_ID=name,
        )
        for name, log in zip(names, logs, strict=True)
    }
    broker = tmp_path / "broker"
    observer = Election(dsn, lock, instance_id="observer", **BEAT_OPTIONS)

    def leader_other_than(*former: str) -> str | None:
        leader = observer.leader()
        return leader.instance_id if leader is not None and leader.instance_id not in former else None

    def sent_by(token: int, count: int) -> list[dict[str, Any]]:
        found = [message for message in sent_messages(broker) if message["postgres_mutex_token"] == token]
        return found if len(found) >= count else []

    def term_token(instance_id: str) -> int:
        leader = observer.leader()
        assert leader is not None
        assert leader.instance_id == instance_id
        assert leader.token is not None
        return leader.token

    with running(list(beats.values()), logs), observer:
        first = wait_for(leader_other_than, timeout=60, what="a beat leads")
        first_token = term_token(first)
        wait_for(lambda: sent_by(first_token, 4), timeout=30, what="the first leader sent both entries twice")

        # The leader loses its lock while alive (an operator's forced release): a standby may lead
        # before the old leader hears of it, and the old one's runs are fenced out meanwhile.
        with MutexClient(dsn) as admin:
            assert admin.table().force_release(lock) is not None
        relieved = wait_for(
            lambda: (found := observer.leader()) is not None and (found.token or 0) > first_token and found,
            timeout=30,
            what="a new term began after the forced release",
        )
        second, second_token = relieved.instance_id, relieved.token
        wait_for(lambda: sent_by(second_token, 4), timeout=30, what="the second term sent")

        beats[second].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        third = wait_for(lambda: leader_other_than(second), timeout=RECLAIM + 30, what="a standby took over")
        third_token = term_token(third)
        resumed = wait_for(lambda: sent_by(third_token, 4), timeout=30, what="the third term sent")
        assert resumed[0]["sent"] - killed < RECLAIM + 10, "a killed beat was not replaced within its bound"

        beats[third].send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        fourth = wait_for(lambda: leader_other_than(second, third), timeout=30, what="the last standby took over")
        assert time.monotonic() - stopped < RECLAIM - 2, "a stopped beat did not hand over at once"
        assert beats[third].wait(15) == 0
        fourth_token = term_token(fourth)
        wait_for(lambda: sent_by(fourth_token, 4), timeout=30, what="the fourth term sent")

    messages = sent_messages(broker)
    terms = {first_token, second_token, third_token, fourth_token}
    assert {message["postgres_mutex_token"] for message in messages} == terms, "a beat sent while it did not lead"
    runs: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for message in messages:
        assert message["args"] == [message["postgres_mutex_entry"][-1]]
        # The app's own before_task_publish handler runs before the integration's code is imported.
        assert message["seen_before_publish"] == message["postgres_mutex_run"], "a publish handler missed the run"
        runs[message["postgres_mutex_entry"]].append((message["postgres_mutex_run"], message["postgres_mutex_token"]))
    assert set(runs) == {"tick-a", "tick-b"}
    for entry, sent in runs.items():
        numbers = sorted(number for number, _ in sent)
        assert len(numbers) == len(set(numbers)), f"{entry}: a run was sent twice: {sorted(sent)}"
        tokens = [token for _, token in sorted(sent)]
        assert tokens == sorted(tokens), f"{entry}: a beat sent a run after its successor had begun: {sorted(sent)}"
        # A beat killed between recording a run and sending it loses that one run, never more.
        missing = set(range(numbers[0], numbers[-1] + 1)) - set(numbers)
        assert len(missing) <= 1, f"{entry}: runs {sorted(missing)} were never sent"


def test_a_beat_that_cannot_campaign_says_so_once_at_error_level_and_stops(
    dsn: str, schema: None, tmp_path: Path
) -> None:
    log = tmp_path / "beat.log"
    beat = start_celery(
        tmp_path,
        dsn,
        "beat",
        "-S",
        "postgres_mutex.integrations.celery:LeaderScheduler",
        "-s",
        str(tmp_path / "schedule"),
        "--loglevel",
        "INFO",
        log=log,
        CELERY_TEST_BEAT_LOCK=f"beat-{uuid.uuid4().hex[:8]}",
        CELERY_TEST_BEAT_TABLE="no_such_lock_table",
    )
    with running([beat], [log]):
        assert beat.wait(60) == 1
    logged = log.read_text()
    errors = [line for line in logged.splitlines() if "ERROR/" in line]
    assert len(errors) == 1, logged
    assert "beat cannot campaign" in errors[0], logged
    assert "no_such_lock_table does not exist" in errors[0], logged
    for noise in ("Traceback", "CRITICAL/", "WARNING/"):
        assert noise not in logged, logged


def start_beat(tmp_path: Path, dsn: str, lock: str, name: str) -> tuple[Any, Path]:
    log = tmp_path / f"{name}.log"
    beat = start_celery(
        tmp_path,
        dsn,
        "beat",
        "-S",
        "postgres_mutex.integrations.celery:LeaderScheduler",
        "-s",
        str(tmp_path / f"{name}-schedule"),
        "--loglevel",
        "INFO",
        log=log,
        CELERY_TEST_BEAT_LOCK=lock,
        CELERY_TEST_BEAT_ID=name,
    )
    return beat, log


def stops_saying_once(beat: Any, log: Path, observer: Election, *phrases: str) -> None:
    """The beat exits non-zero, resigned (nobody leads), having said why in one ERROR naming ``phrases``."""
    assert beat.wait(30) != 0, "a beat that may not use its table stops"
    assert observer.leader() is None, "it resigned as it stopped: a standby may lead at once"
    said = re.findall(r"ERROR.*beat cannot lead.*", log.read_text())
    assert len(said) == 1, log.read_text()
    for phrase in phrases:
        assert phrase in said[0]


def test_a_beat_needs_only_the_documented_grants_and_one_lacking_a_grant_says_so_and_hands_over(
    dml_role: str, dsn: str, admin: psycopg.Connection[Any], tmp_path: Path
) -> None:
    # dml_role: the README's grants exactly, on tables the owner made with 'postgres-mutex init
    # --celery-beat'; no CREATE on the schema.
    role = conninfo_to_dict(dml_role)["user"]
    lock = f"beat-{uuid.uuid4().hex[:8]}"
    broker = tmp_path / "broker"
    observer = Election(dml_role, lock, instance_id="observer", **BEAT_OPTIONS)
    grant = f"GRANT SELECT, INSERT, UPDATE, DELETE ON celery_beat_state TO {role}"

    with observer:
        admin.execute("DROP TABLE celery_beat_state")  # not made yet, and this role may not make it
        missing, missing_log = start_beat(tmp_path, dml_role, lock, "missing")
        with running([missing], [missing_log]):
            stops_saying_once(
                missing, missing_log, observer, "may not create it", "'postgres-mutex init --celery-beat'"
            )

        with MutexClient(dsn) as owner:
            owner.table().create(celery_beat=True)  # made, but nothing granted on it
        lacking, lacking_log = start_beat(tmp_path, dml_role, lock, "lacking")
        with running([lacking], [lacking_log]):
            stops_saying_once(lacking, lacking_log, observer, grant, "postgres-mutex init --celery-beat")
    assert sent_messages(broker) == []

    admin.execute(grant)
    granted, granted_log = start_beat(tmp_path, dml_role, lock, "granted")
    with running([granted], [granted_log]):
        wait_for(lambda: len(sent_messages(broker)) >= 2, timeout=30, what="the beat with the grants sent")
        assert "ERROR" not in granted_log.read_text()
