"""A program the tests run as a process with more than 1,024 descriptors open, as a busy server has.

Run from the repository root as ``python -m tests.support.many_descriptors MODE FLAVOUR DSN LOCK [SECONDS]``:

    hold sync|async DSN LOCK SECONDS   hold LOCK for SECONDS (heartbeat_interval=0.6): print "held",
                                       then "done <held>" once the SECONDS are over
    wait sync|async DSN LOCK           print "waiting", acquire (blocking, poll_interval=5), then print
                                       "held <t>", t on CLOCK_MONOTONIC, which every process shares

Before the library connects, it opens `EXTRA` descriptors (raising RLIMIT_NOFILE's soft limit
within the hard one), so that every socket and pipe the library opens is numbered above 1,024,
where ``select()`` fails. The test checks the hard limit first (`needed_limit`).
"""

from __future__ import annotations

import asyncio
import os
import resource
import sys
import time

from postgres_mutex import Mutex

EXTRA = 1100
"""Descriptors opened before the library's: every one of its own is numbered above them."""

# Long enough (over half a second) that the connection idles between two heartbeats,
# and is checked before each one, as a real holder's is.
HOLDER = {"heartbeat_interval": 0.6, "alert_threshold": 2.4, "stale_threshold": 6.0, "operation_timeout": 2.0}
# A waiter that polls rarely: only the release's notification hands the lock over fast.
WAITER = {"heartbeat_interval": 0.6, "alert_threshold": 2.4, "stale_threshold": 6.0, "poll_interval": 5.0}


def needed_limit() -> int:
    """The RLIMIT_NOFILE this program needs: its descriptors, the interpreter's and the library's."""
    return EXTRA + 100


def open_many() -> list[int]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed_limit():
        wanted = needed_limit() if hard == resource.RLIM_INFINITY else min(hard, needed_limit())
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    opened = [os.open(os.devnull, os.O_RDONLY) for _ in range(EXTRA)]
    if opened[-1] < 1024:
        raise SystemExit(f"the last descriptor opened is {opened[-1]}, not above 1,024")
    return opened


def hold(flavour: str, dsn: str, lock: str, seconds: float) -> None:
    mutex = Mutex(dsn, lock, **HOLDER)  # type: ignore[arg-type]
    if flavour == "async":

        async def main() -> bool:
            async with mutex.acquire_async(blocking=True, timeout=10) as got:
                if not got:
                    raise SystemExit("not acquired")
                print("held", flush=True)
                await asyncio.sleep(seconds)
                held = mutex.held
            await mutex.aclose()
            return held

        held = asyncio.run(main())
    else:
        with mutex.acquire(blocking=True, timeout=10) as got:
            if not got:
                raise SystemExit("not acquired")
            print("held", flush=True)
            time.sleep(seconds)
            held = mutex.held
        mutex.close()
    print(f"done {held}", flush=True)


def wait(flavour: str, dsn: str, lock: str) -> None:
    mutex = Mutex(dsn, lock, **WAITER)  # type: ignore[arg-type]
    print("waiting", flush=True)
    if flavour == "async":

        async def main() -> float:
            async with mutex.acquire_async(blocking=True, timeout=30) as got:
                if not got:
                    raise SystemExit("not acquired within 30 s")
                at = time.monotonic()
            await mutex.aclose()
            return at

        at = asyncio.run(main())
    else:
        with mutex.acquire(blocking=True, timeout=30) as got:
            if not got:
                raise SystemExit("not acquired within 30 s")
            at = time.monotonic()
        mutex.close()
    print(f"held {at!r}", flush=True)


def main(argv: list[str]) -> None:
    command, flavour, dsn, lock, *rest = argv
    opened = open_many()
    if command == "hold":
        hold(flavour, dsn, lock, float(rest[0]))
    elif command == "wait":
        wait(flavour, dsn, lock)
    else:
        raise SystemExit(f"unknown command {command!r}")
    for fd in opened:
        os.close(fd)


if __name__ == "__main__":
    main(sys.argv[1:])
