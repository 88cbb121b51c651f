"""A fair Mutex's waiter, as a process of its own: ``python -m tests.support.fair_worker DSN LOCK LABEL LOG POLL``.

With a sixth argument, a fair Semaphore's waiter instead (a number: its
permits), or a fair RWLock's writer (``write``).
Prints "ready" once made, waits for a line on its standard input, then
acquires (blocking, within 30 s), prints "held LABEL TOKEN", holds for 20 ms,
logs its critical section to LOG ("LABEL ENTER EXIT", `tests.support.exclusion`)
and releases.
"""

from __future__ import annotations

import sys
import time
from contextlib import AbstractContextManager
from typing import Any

from postgres_mutex import Mutex, RWLock, Semaphore

from .timing import FAST


def main(dsn: str, lock: str, label: str, log: str, poll: float, kind: str = "mutex") -> None:
    options: dict[str, Any] = {
        "heartbeat_interval": FAST["heartbeat_interval"],
        "alert_threshold": FAST["alert_threshold"],
        "stale_threshold": 30.0,
        "poll_interval": poll,
        "operation_timeout": FAST["operation_timeout"],
    }
    holder: Mutex | Semaphore | RWLock
    if kind == "mutex":
        holder = Mutex(dsn, lock, fair=True, **options)
    elif kind == "write":
        holder = RWLock(dsn, lock, fair=True, **options)
    else:
        holder = Semaphore(dsn, lock, permits=int(kind), fair=True, **options)
    print("ready", flush=True)
    sys.stdin.readline()
    held: AbstractContextManager[bool] = (
        holder.write(timeout=30) if isinstance(holder, RWLock) else holder.acquire(timeout=30)
    )
    with held:
        enter = time.monotonic()
        print(f"held {label} {holder.token}", flush=True)
        time.sleep(0.02)
        exit_ = time.monotonic()
    with open(log, "a") as out:
        out.write(f"{label} {enter!r} {exit_!r}\n")
    holder.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5]), *sys.argv[6:7])
