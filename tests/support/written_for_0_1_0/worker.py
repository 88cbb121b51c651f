"""A fleet worker written against postgres-mutex 0.1.0's API: the same program, before and after the upgrade.

    python -I worker.py create-schema               0.1.0's create_schema() (or this version's)
    python -I worker.py contend NAME SECONDS LOG    take the lock again and again until SECONDS pass, logging sections
    python -I worker.py hold NAME                   take the lock, say so, and hold it until killed
    python -I worker.py reclaim NAME                wait for the lock (alerting on a silent holder), hold it briefly

The DSN comes in $POSTGRES_MUTEX_DSN and the lock's name in $CHAOS_LOCK, as
for chaos/soak_worker.py (this version's worker); the thresholds are the chaos
suite's (heartbeat 0.2 s, alert 1 s, stale 3 s). Critical sections are logged
as "NAME enter exit" on CLOCK_MONOTONIC, which every process on the machine
shares, in the form tests.support.exclusion.Sections reads. Everything else is printed
as one JSON object a line: {"event": ..., "at": <monotonic>, ...}.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from typing import Any

import postgres_mutex
from postgres_mutex import Mutex, PgMutexError

# chaos.harness.TIMING without operation_timeout, which 0.1.0 does not take.
TIMING: dict[str, Any] = {
    "heartbeat_interval": 0.2,
    "alert_threshold": 1.0,
    "stale_threshold": 3.0,
    "poll_interval": 0.1,
}
HOLD_LIMIT = 60.0
"""A holder waiting to be killed gives up after this long, so that no worker outlives its test."""


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "at": time.monotonic(), **fields}), flush=True)


class Hook:
    """0.1.0's metrics hook (its six methods): the contender's view of a silent holder, as events."""

    def acquired(self, lock_name: str, *, instance_id: str) -> None: ...
    def released(self, lock_name: str, *, instance_id: str) -> None: ...
    def contended(self, lock_name: str, *, instance_id: str) -> None: ...
    def heartbeat_latency(self, lock_name: str, *, instance_id: str, seconds: float) -> None: ...

    def stale_reclaimed(self, lock_name: str, *, instance_id: str, previous_holder: str) -> None:
        emit("stale_reclaimed", previous_holder=previous_holder)

    def alert(self, lock_name: str, *, holder: str, seconds_since_heartbeat: float) -> None:
        # float(): 0.1.0 passes a decimal.Decimal here.
        emit("alert", holder=holder, seconds_since_heartbeat=float(seconds_since_heartbeat))


def contend(mutex: Mutex, name: str, seconds: float, log_path: str) -> None:
    rng = random.Random(name)
    deadline = time.monotonic() + seconds
    with open(log_path, "w") as log:
        while time.monotonic() < deadline:
            try:
                with mutex.acquire(blocking=True, timeout=max(0.1, deadline - time.monotonic())):
                    enter = time.monotonic()
                    work_until = enter + rng.uniform(0.02, 0.1)
                    while mutex.held and time.monotonic() < work_until:
                        time.sleep(0.005)
                    log.write(f"{name} {enter!r} {time.monotonic()!r}\n")
                    log.flush()
            except PgMutexError:
                pass  # timed out at the end of the run
            # A pause between jobs: 0.1.0's waiters poll (every poll_interval) while this version's are woken
            # at a release, so without it this version's workers would pass the lock among themselves.
            time.sleep(rng.uniform(0.05, 0.25))


def hold(mutex: Mutex) -> None:
    with mutex.acquire(blocking=True, timeout=30) as acquired:
        emit("held", acquired=acquired, instance_id=mutex.instance_id)
        give_up = time.monotonic() + HOLD_LIMIT
        while time.monotonic() < give_up:
            time.sleep(0.05)


def reclaim(mutex: Mutex) -> None:
    with mutex.acquire(blocking=True, timeout=30) as acquired:
        emit("held", acquired=acquired, instance_id=mutex.instance_id)
        time.sleep(0.2)  # the job
        emit("left")
    emit("released")


def main(argv: list[str]) -> None:
    command, *rest = argv
    dsn = os.environ["POSTGRES_MUTEX_DSN"]
    emit("start", version=postgres_mutex.__version__, file=postgres_mutex.__file__)
    if command == "create-schema":
        Mutex(dsn, "create-schema").create_schema()
        emit("created")
        return
    name = rest[0]
    mutex = Mutex(dsn, os.environ["CHAOS_LOCK"], instance_id=name, metrics=Hook(), **TIMING)
    if command == "contend":
        contend(mutex, name, float(rest[1]), rest[2])
    elif command == "hold":
        hold(mutex)
    elif command == "reclaim":
        reclaim(mutex)
    else:
        raise SystemExit(f"unknown command {command!r}")
    mutex.close()


if __name__ == "__main__":
    main(sys.argv[1:])
