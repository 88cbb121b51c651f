"""One process of the soak: take the lock again and again until a deadline, logging every critical section.

    python -m chaos.soak_worker NAME SECONDS LOG    (the DSN comes in $POSTGRES_MUTEX_DSN)

$CHAOS_TIMING (JSON) overrides the chaos timing, for scenarios whose faults
last longer than its lease (a failover); the worker also stops early once
the file named by $CHAOS_STOP_FILE exists.

A section is logged as "NAME enter exit" on CLOCK_MONOTONIC, shared by every
process on the machine. It ends when the work is done or the moment the
worker sees ``held`` turn false, whichever comes first: that is all a job
can know, and it must never overlap another worker's section.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

from chaos.harness import TIMING
from postgres_mutex import Mutex, MutexError


def main(name: str, seconds: float, log_path: str) -> None:
    timing = {**TIMING, **json.loads(os.environ.get("CHAOS_TIMING") or "{}")}
    stop = Path(os.environ["CHAOS_STOP_FILE"]) if os.environ.get("CHAOS_STOP_FILE") else None
    mutex = Mutex(os.environ["POSTGRES_MUTEX_DSN"], os.environ["CHAOS_LOCK"], instance_id=name, **timing)
    rng = random.Random(name)
    deadline = time.monotonic() + seconds
    with open(log_path, "w") as log:
        while time.monotonic() < deadline and not (stop is not None and stop.exists()):
            try:
                wait = max(0.1, deadline - time.monotonic())
                # With a stop file, look at it now and then, however long the wait may be.
                with mutex.acquire(blocking=True, timeout=wait if stop is None else min(wait, 5.0)):
                    enter = time.monotonic()
                    work_until = enter + rng.uniform(0.05, 0.3)
                    while mutex.held and time.monotonic() < work_until:
                        time.sleep(0.005)
                    log.write(f"{name} {enter!r} {time.monotonic()!r}\n")
                    log.flush()
            except MutexError:
                pass  # a fault got in the way: lost, timed out, or the database was unreachable
            time.sleep(rng.uniform(0.0, 0.05))
    mutex.close()


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), sys.argv[3])
