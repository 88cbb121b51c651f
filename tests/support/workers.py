"""Programs the tests run as separate processes: real holders that can crash or exit.

Run from the repository root as ``python -m tests.support.workers MODE ARGS``:

    hold DSN LOCK               acquire, print "held <id>", sleep until killed
    exit-holding DSN LOCK       acquire, print "held <id>", exit without releasing
    exit-in-thread DSN LOCK     the same, inside `with` in a daemon thread
    exit-in-task DSN LOCK       the same, asyncio.run returning with an entered acquisition
    wait DSN LOCK               print "waiting", acquire (blocking), print "held <id> <t>", hold
    contend DSN LOCK N OUT MODE acquire N times (MODE sync|async), log intervals to OUT
    fork DSN LOCK ID            hold, fork a child that tries the same Mutex, report JSON
    fleet DSN PREFIX PORT       contend, wait to reclaim, stall; /metrics on PORT
    watcher DSN - PORT          a stale-holder watcher; /metrics on PORT

Thresholds come from the FAST settings the tests use (tests/support/timing.py). Critical sections are
logged as "pid enter exit" on CLOCK_MONOTONIC, which every process on the
machine shares, so the parent can check that no two ever overlap.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import threading
import time

from postgres_mutex import Mutex
from tests.support.timing import FAST


def hold(dsn: str, lock: str, *, exit_at_once: bool, announce_wait: bool = False) -> None:
    mutex = Mutex(dsn, lock, **FAST)  # type: ignore[arg-type]
    held = mutex.acquire(blocking=True, timeout=60)
    if announce_wait:
        print("waiting", flush=True)
    if not held.__enter__():
        sys.exit(3)
    # The moment of the acquisition on CLOCK_MONOTONIC, which every process shares.
    print(f"held {mutex.instance_id} {time.monotonic()!r} {time.time()!r}", flush=True)
    if exit_at_once:
        return  # a normal interpreter exit, lock still held
    while True:
        time.sleep(60)


def exit_in_thread(dsn: str, lock: str) -> None:
    """The main thread returns while a daemon thread is inside ``with``: the exit releases its lock."""
    mutex = Mutex(dsn, lock, **FAST)  # type: ignore[arg-type]
    entered = threading.Event()

    def job() -> None:
        with mutex.acquire(blocking=True, timeout=60):
            entered.set()
            while True:
                time.sleep(60)

    threading.Thread(target=job, daemon=True).start()
    if not entered.wait(60):
        sys.exit(3)
    print(f"held {mutex.instance_id}", flush=True)


def exit_in_task(dsn: str, lock: str) -> None:
    """asyncio.run returns with an acquisition entered and never left: the exit releases it."""
    mutex = Mutex(dsn, lock, **FAST)  # type: ignore[arg-type]

    async def main() -> None:
        await mutex.acquire_async(blocking=True, timeout=60).__aenter__()
        print(f"held {mutex.instance_id}", flush=True)

    asyncio.run(main())


def contend(dsn: str, lock: str, iterations: int, out: str, mode: str) -> None:
    mutex = Mutex(dsn, lock, **FAST)  # type: ignore[arg-type]
    rng = random.Random(os.getpid())
    with open(out, "w") as log:
        if mode == "async":
            asyncio.run(_contend_async(mutex, iterations, log, rng))
        else:
            for _ in range(iterations):
                with mutex.acquire(blocking=True, timeout=60):
                    entered = time.monotonic()
                    time.sleep(rng.uniform(0.0, 0.02))
                    left = time.monotonic()
                log.write(f"{os.getpid()} {entered!r} {left!r}\n")
                time.sleep(rng.uniform(0.0, 0.01))
    mutex.close()


async def _contend_async(mutex: Mutex, iterations: int, log: object, rng: random.Random) -> None:
    for _ in range(iterations):
        async with mutex.acquire_async(timeout=60):
            entered = time.monotonic()
            await asyncio.sleep(rng.uniform(0.0, 0.02))
            left = time.monotonic()
        log.write(f"{os.getpid()} {entered!r} {left!r}\n")  # type: ignore[attr-defined]
        await asyncio.sleep(rng.uniform(0.0, 0.01))
    await mutex.aclose()


def fork_check(dsn: str, lock: str, instance_id: str) -> None:
    """A Mutex created before fork(): the child is a different instance, and its exit is not the parent's."""
    mutex = Mutex(dsn, lock, instance_id=instance_id or None, **FAST)  # type: ignore[arg-type]
    report: dict[str, object] = {"parent_id": mutex.instance_id}
    with mutex.acquire() as acquired:
        report["parent_acquired"] = acquired
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: try the inherited Mutex, then exit normally (atexit runs)
            os.close(read)
            child: dict[str, object] = {"child_id": mutex.instance_id, "child_held": mutex.held}
            try:
                with mutex.acquire() as child_acquired:
                    child["child_acquired"] = child_acquired
            except Exception as exc:
                child["child_error"] = f"{type(exc).__name__}: {exc}"
            os.write(write, json.dumps(child).encode())
            os.close(write)
            sys.exit(0)
        os.close(write)
        with os.fdopen(read) as pipe:
            report.update(json.loads(pipe.read()))
        os.waitpid(pid, 0)
        time.sleep(FAST["heartbeat_interval"] * 3)  # let the parent heartbeat after the child's exit
        report["parent_held_after_child_exit"] = mutex.held
        with Mutex(dsn, lock, **FAST).acquire() as stranger:  # type: ignore[arg-type]
            report["stranger_acquired"] = stranger
    print(json.dumps(report), flush=True)


def fleet(dsn: str, prefix: str, port: int) -> None:
    """A process using the library the ways a dashboard must show, exporting its metrics.

    Three instances contend for PREFIX-contended; one waits to reclaim
    PREFIX-reclaimed from a holder the test kills; one holds PREFIX-stalled,
    whose heartbeats the test blocks until the lock is lost; one holds
    PREFIX-flaky, whose heartbeats the test keeps failing now and then; one holds
    PREFIX-doubted with reclaim_disconnected_after, in doubt now and then. One
    candidate campaigns in election PREFIX-elected, another in
    PREFIX-leaderless, whose lock a plain Mutex holds. Three instances take
    turns on PREFIX-shared, a semaphore of 2. Two readers and a writer take
    turns on read/write lock PREFIX-catalogue (the writer waiting, and readers
    behind it); on PREFIX-rw-stale a writer goes silent, and another writer
    waiting for it alerts, then takes it over.
    """
    from prometheus_client import CollectorRegistry, start_http_server

    from postgres_mutex import MutexError
    from postgres_mutex.prometheus import PrometheusMetrics

    registry = CollectorRegistry()
    hook = PrometheusMetrics(registry)
    start_http_server(port, addr="127.0.0.1", registry=registry)

    def contend() -> None:
        mutex = Mutex(dsn, f"{prefix}-contended", metrics=hook, **FAST)  # type: ignore[arg-type]
        while True:
            with mutex.acquire(blocking=True, timeout=60):
                time.sleep(0.1)
            time.sleep(0.05)

    def reclaim() -> None:
        mutex = Mutex(dsn, f"{prefix}-reclaimed", metrics=hook, **FAST)  # type: ignore[arg-type]
        with mutex.acquire(blocking=True, timeout=120):
            while True:
                time.sleep(1)

    def stall(name: str) -> None:
        options = {**FAST, "operation_timeout": 0.3}
        mutex = Mutex(dsn, f"{prefix}-{name}", metrics=hook, **options)  # type: ignore[arg-type]
        try:
            with mutex.acquire(blocking=True, timeout=60):
                while True:
                    mutex.ensure_held()
                    time.sleep(0.05)
        except MutexError:
            pass  # the loss is what the test is after; keep serving metrics
        while True:
            time.sleep(1)

    def elect() -> None:
        # Every election series: a failing lead, a grace overrun after a resign, terms that return.
        from postgres_mutex import Election, Leadership

        election = Election(dsn, f"{prefix}-elected", metrics=hook, grace_period=0.05, failure_backoff=0.05, **FAST)  # type: ignore[arg-type]
        terms: list[int | None] = []

        def lead(leadership: Leadership) -> None:
            terms.append(leadership.token)
            if len(terms) == 1:
                raise RuntimeError("the first term fails")
            if len(terms) == 2:
                election.resign()
                time.sleep(0.3)  # past grace_period
                return
            leadership.ended.wait(1.0)

        election.run(lead)

    def doubted() -> None:
        # A holder that names its session (the watcher shows it alive), in doubt now and then: its
        # heartbeats pause past reclaim_disconnected_after - heartbeat_interval, then resume.
        options = {**FAST, "operation_timeout": 0.3, "reclaim_disconnected_after": 0.8}
        mutex = Mutex(dsn, f"{prefix}-doubted", metrics=hook, **options)  # type: ignore[arg-type]
        with mutex.acquire(blocking=True, timeout=60):
            while True:
                hold = mutex._lock.hold
                assert hold is not None
                hold.paused = True
                time.sleep(1.0)
                hold.paused = False
                time.sleep(2.0)

    def share() -> None:
        # Three holders take turns on a semaphore of 2: permits in use, and a waiter now and then.
        from postgres_mutex import Semaphore

        semaphore = Semaphore(dsn, f"{prefix}-shared", permits=2, metrics=hook, **FAST)  # type: ignore[arg-type]
        while True:
            with semaphore.acquire(blocking=True, timeout=60):
                time.sleep(0.3)
            time.sleep(0.05)

    def read() -> None:
        # Readers overlap; a writer waits for them, and new readers wait behind it.
        from postgres_mutex import RWLock

        rwlock = RWLock(dsn, f"{prefix}-catalogue", metrics=hook, **FAST)  # type: ignore[arg-type]
        while True:
            with rwlock.read(blocking=True, timeout=60):
                time.sleep(0.4)
            time.sleep(0.05)

    def write() -> None:
        from postgres_mutex import RWLock

        rwlock = RWLock(dsn, f"{prefix}-catalogue", metrics=hook, **FAST)  # type: ignore[arg-type]
        while True:
            with rwlock.write(blocking=True, timeout=60):
                time.sleep(0.1)
            time.sleep(0.3)

    def rw_stale() -> None:
        # A writer goes silent; another, waiting for it, alerts and then takes its row over.
        from postgres_mutex import RWLock

        silent = RWLock(dsn, f"{prefix}-rw-stale", metrics=hook, **FAST)  # type: ignore[arg-type]
        taker = RWLock(dsn, f"{prefix}-rw-stale", metrics=hook, **FAST)  # type: ignore[arg-type]
        while True:
            try:
                with silent.write(blocking=True, timeout=60):
                    hold = silent._writer._lock.hold
                    assert hold is not None
                    hold.paused = True
                    with taker.write(blocking=True, timeout=60):
                        time.sleep(0.2)
            except MutexError:
                pass  # the silent writer lost its hold: what this is for
            time.sleep(1.0)

    def leaderless() -> None:
        # Candidates and no leader: something that is not a candidate holds the election's lock.
        from postgres_mutex import Election

        Mutex(dsn, f"{prefix}-leaderless", **FAST).acquire().__enter__()  # type: ignore[arg-type]
        Election(dsn, f"{prefix}-leaderless", metrics=hook, **FAST).run(lambda leadership: None)  # type: ignore[arg-type]

    for target, args in (
        (elect, ()),
        (leaderless, ()),
        (contend, ()),
        (contend, ()),
        (contend, ()),
        (reclaim, ()),
        (stall, ("stalled",)),
        (stall, ("flaky",)),
        (doubted, ()),
        (share, ()),
        (share, ()),
        (share, ()),
        (read, ()),
        (read, ()),
        (write, ()),
        (rw_stale, ()),
    ):
        threading.Thread(target=target, args=args, daemon=True).start()
    print("ready", flush=True)
    while True:
        time.sleep(1)


def watcher(dsn: str, port: int) -> None:
    from prometheus_client import CollectorRegistry, start_http_server

    from postgres_mutex.prometheus import PrometheusMetrics
    from postgres_mutex.watcher import StaleWatcher

    registry = CollectorRegistry()
    stale = StaleWatcher(
        dsn,
        alert_threshold=FAST["alert_threshold"],
        stale_threshold=FAST["stale_threshold"],
        interval=0.5,
        metrics=PrometheusMetrics(registry),
    )
    start_http_server(port, addr="127.0.0.1", registry=registry)
    stale.start()
    print("ready", flush=True)
    while True:
        time.sleep(1)


def skew_wall_clock(offset: float) -> None:
    """Make this process's wall clock wrong by ``offset`` seconds, as Python's ``time`` module reads it.

    Skewed: ``time.time``, ``time.time_ns`` and ``time.clock_gettime`` /
    ``time.clock_gettime_ns`` of ``CLOCK_REALTIME`` (what ``datetime.now`` and
    logging read is C code, left alone). The monotonic and boot-time clocks are
    not skewed (a time namespace could offset them, but only with privileges CI
    runners lack), nor is the kernel's or libpq's view. This is enough because
    the library reads no wall clock at all: leases run on the boot-time clock
    and every staleness decision on the server's, and tests/integration/test_wall_clock.py
    fails if any of the library's code reads a wall clock. (libfaketime would
    skew the clock below Python too, but it breaks Python 3.11's sleeps.)
    """
    real_time, real_time_ns = time.time, time.time_ns
    real_clock, real_clock_ns = time.clock_gettime, time.clock_gettime_ns
    offset_ns = int(offset * 1e9)

    def clock_gettime(clock: int) -> float:
        return real_clock(clock) + (offset if clock == time.CLOCK_REALTIME else 0.0)

    def clock_gettime_ns(clock: int) -> int:
        return real_clock_ns(clock) + (offset_ns if clock == time.CLOCK_REALTIME else 0)

    time.time = lambda: real_time() + offset
    time.time_ns = lambda: real_time_ns() + offset_ns
    time.clock_gettime = clock_gettime
    time.clock_gettime_ns = clock_gettime_ns


def main(argv: list[str]) -> None:
    if offset := os.environ.get("WORKER_WALL_CLOCK_OFFSET"):
        skew_wall_clock(float(offset))
    command, dsn, lock, *rest = argv
    if command == "hold":
        hold(dsn, lock, exit_at_once=False)
    elif command == "exit-holding":
        hold(dsn, lock, exit_at_once=True)
    elif command == "exit-in-thread":
        exit_in_thread(dsn, lock)
    elif command == "exit-in-task":
        exit_in_task(dsn, lock)
    elif command == "wait":
        hold(dsn, lock, exit_at_once=False, announce_wait=True)
    elif command == "fleet":
        fleet(dsn, lock, int(rest[0]))
    elif command == "watcher":
        watcher(dsn, int(rest[0]))
    elif command == "fork":
        fork_check(dsn, lock, rest[0] if rest else "")
    elif command == "contend":
        iterations, out, mode = rest
        contend(dsn, lock, int(iterations), out, mode)
    else:
        raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
