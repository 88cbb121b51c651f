"""A fair Mutex's waiter, as a process of its own: ``python -m tests.support.fair_worker DSN LOCK LABEL LOG POLL``.

With a sixth argument, ``PERMITS``, a fair Semaphore's of that many permits instead.
Prints "ready" once made, waits for a line on its standard input, then
acquires (blocking, within 30 s), prints "held LABEL TOKEN", holds for 20 ms,
logs its critical section to LOG ("LABEL ENTER EXIT", `tests.support.exclusion`)
and releases.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from postgres_mutex import Mutex, Semaphore

from .timing import FAST


def main(dsn: str, lock: str, label: str, log: str, poll: float, permits: int | None = None) -> None:
    options: dict[str, Any] = {
        "heartbeat_interval": FAST["heartbeat_interval"],
        "alert_threshold": FAST["alert_threshold"],
        "stale_threshold": 30.0,
        "poll_interval": poll,
        "operation_timeout": FAST["operation_timeout"],
    }
    mutex: Mutex | Semaphore
    if permits is None:
        mutex = Mutex(dsn, lock, fair=True, **options)
    else:
        mutex = Semaphore(dsn, lock, permits=permits, fair=True, **options)
    print("ready", flush=True)
    sys.stdin.readline()
    with mutex.acquire(timeout=30):
        enter = time.monotonic()
        print(f"held {label} {mutex.token}", flush=True)
        time.sleep(0.02)
        exit_ = time.monotonic()
    with open(log, "a") as out:
        out.write(f"{label} {enter!r} {exit_!r}\n")
    mutex.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5]), *map(int, sys.argv[6:7]))
