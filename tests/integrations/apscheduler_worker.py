"""One scheduler of the fleet: ``python -m tests.integrations.apscheduler_worker JOB POLICY COUNT``.

Prints ``ready`` once imported, then reads the epoch time START from stdin (the test sends
it to every scheduler at once), and runs an APScheduler BackgroundScheduler whose job fires
every second from START, COUNT times, on a `FleetExecutor` with the contention policy
POLICY. Each run records its fire time and process in ``aps_runs``; each fire time that
ended in an error here is recorded in ``aps_errors``. Exits once the last fire time's run
is over.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import psycopg
from apscheduler.events import EVENT_JOB_ERROR
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.interval import IntervalTrigger

from postgres_mutex.integrations.apscheduler import FleetExecutor, Policy, fire_time

DSN = os.environ["POSTGRES_MUTEX_DSN"]
RUN_SECONDS = 0.4  # long enough that the other schedulers' attempts meet a held lock


def record(job: str) -> None:
    with psycopg.connect(DSN, autocommit=True) as conn:
        conn.execute("INSERT INTO aps_runs (job, fire_time, pid) VALUES (%s, %s, %s)", (job, fire_time(), os.getpid()))
    time.sleep(RUN_SECONDS)


def main() -> None:
    job, policy, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    print("ready", flush=True)
    first = datetime.fromtimestamp(float(sys.stdin.readline()), UTC)
    last = first + timedelta(seconds=count - 1)

    def on_error(event: Any) -> None:
        with psycopg.connect(DSN, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO aps_errors (job, fire_time, error) VALUES (%s, %s, %s)",
                (job, event.scheduled_run_time, type(event.exception).__name__),
            )

    executor = FleetExecutor(DSN, on_contention=cast(Policy, policy), wait_timeout=10, heartbeat_interval=0.5)
    scheduler = BackgroundScheduler(executors={"default": executor}, timezone=UTC)
    scheduler.add_listener(on_error, EVENT_JOB_ERROR)
    trigger = IntervalTrigger(seconds=1, start_date=first, end_date=last, timezone=UTC)
    scheduler.add_job(record, trigger, args=[job], id=job, misfire_grace_time=30, max_instances=3)
    scheduler.start()
    # This process's lifetime: past the last fire time, then shutdown waits for the runs in flight.
    time.sleep(max(0.0, last.timestamp() - time.time()) + 0.5)
    scheduler.shutdown(wait=True)


if __name__ == "__main__":
    main()
