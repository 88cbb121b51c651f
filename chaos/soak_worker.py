"""One process of the soak: take the lock again and again until a deadline, logging every critical section.

    python -m chaos.soak_worker NAME SECONDS LOG    (the DSN comes in $POSTGRES_MUTEX_DSN)

A section is logged as "NAME enter exit" on CLOCK_MONOTONIC, shared by every
process on the machine. It ends when the work is done or the moment the
worker sees ``held`` turn false, whichever comes first: that is all a job
can know, and it must never overlap another worker's section.
"""

from __future__ import annotations

import os
import random
import sys
import time

from chaos.harness import TIMING
from postgres_mutex import Mutex, MutexError


def main(name: str, seconds: float, log_path: str) -> None:
    mutex = Mutex(os.environ["POSTGRES_MUTEX_DSN"], os.environ["CHAOS_LOCK"], instance_id=name, **TIMING)  # type: ignore[arg-type]
    rng = random.Random(name)
    deadline = time.monotonic() + seconds
    with open(log_path, "w") as log:
        while time.monotonic() < deadline:
            try:
                with mutex.acquire(blocking=True, timeout=max(0.1, deadline - time.monotonic())):
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
