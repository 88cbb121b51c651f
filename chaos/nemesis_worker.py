"""One worker process of the nemesis run: contend for a few locks, work under them, and log everything that happened.

    python -m chaos.nemesis_worker NAME LOCKS LOG SEED STOP_FILE
        (the DSN, through this worker's proxy, in $POSTGRES_MUTEX_DSN; LOCKS comma-separated)

Again and again, until STOP_FILE exists: pick a lock, wait for it (blocking,
with a timeout), then work under it for a while (a thread samples ``held``
every few milliseconds; the section ends as soon as it turns false), and increment
that lock's row of the ledger (``nemesis_ledger``) once or twice, each time in
a transaction that first calls ``mutex.fence(conn)``, then reads the counter
and writes it back plus one (a read-modify-write: two holders at once would
lose an update).

Everything goes to LOG, one JSON object a line, flushed at once, timed on
CLOCK_MONOTONIC (which every process of the machine shares): ``enter`` as a
section begins (a killed worker leaves its section open), ``believed`` every
tenth of a second while it still sees ``held`` true, ``section`` as it
ends (with ``held`` at its end and the last moment ``held`` was seen true),
``inc-start`` before a ledger transaction commits and ``inc`` with its
outcome (committed, fenced, aborted, unknown), ``lost`` from ``on_lost``,
``reclaimed`` when an acquire took a stale (or disconnected) holder's row over,
``doubt`` and ``confirmed`` when a hold turned in doubt and when a heartbeat
confirmed it (``reclaim_disconnected_after``, set for half the workers by
$NEMESIS_RECLAIM_DISCONNECTED_AFTER), ``error`` for a failed acquire or
release. chaos/nemesis.py reads it back.

$NEMESIS_PERMITS=N makes each lock a `Semaphore` of N permits: a section, its
log lines and its ledger row are then those of the permit it holds, named
``LOCK/K`` (each permit is held by one holder at a time, as a mutex is), and the
checker also counts how many of the semaphore's holders believed at once.

$NEMESIS_BROKEN=lease makes this process deliberately unsafe, for the test
that shows the nemesis catches it: see `break_the_lease`.
"""

from __future__ import annotations

import json
import os
import random
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, TextIO

import psycopg

from chaos.harness import TIMING
from postgres_mutex import LockNotHeldError, Mutex, MutexError, Semaphore

LEDGER = "nemesis_ledger"
RECLAIM_ENV = "NEMESIS_RECLAIM_DISCONNECTED_AFTER"
"""Seconds: the workers of odd slots run with ``reclaim_disconnected_after`` (the others without)."""
PERMITS_ENV = "NEMESIS_PERMITS"
"""A number of permits: every lock of the run is a semaphore of that many (unset: mutexes)."""
SAMPLE = 0.005
"""How often a section looks at ``held``."""
BELIEF_EVERY = 0.1
"""How often a section logs that it still believes it holds the lock."""
TRANSACTION_DEADLINE = 1.0
"""A ledger transaction that takes longer (a silent network) has its socket shut down."""
LEDGER_OPTIONS = "-c idle_in_transaction_session_timeout=2000 -c statement_timeout=1000 -c lock_timeout=1000"
"""A transaction of a frozen or cut-off worker must not keep its fence's row lock (which holds up
the lock's reclaim) for longer than a holder's lease would have lasted: the server ends it."""


def break_the_lease() -> None:
    """Make this process trust its lock one heartbeat interval past the stale threshold.

    The library has no such switch, and must not have one: this monkeypatches the
    private ``Timing.lease`` (normally ``stale_threshold - heartbeat_interval``) in
    this worker process only, so that the nemesis can show it catches a holder that
    trusts its lease too long. Past the stale threshold another instance may reclaim
    the lock while this one still believes it holds it.

    Exactly ``stale_threshold`` would not do for that demonstration: the lease runs
    from the moment a heartbeat is *sent* and the server stamps it no earlier, so on
    one machine's clocks such a holder stops believing at the first instant a reclaim
    is allowed, and no overlap can be observed (it is unsafe only with clocks that
    drift, or with work that outlasts the last look at ``held``).
    """
    from postgres_mutex._state import settings as _settings

    _settings.Timing.lease = property(  # type: ignore[method-assign, assignment]
        lambda self: self.stale_threshold + self.heartbeat_interval
    )


class Log:
    """The worker's history: JSON lines, flushed one by one (a SIGKILL loses at most the line being written)."""

    def __init__(self, out: TextIO, who: str) -> None:
        self._out = out
        self._who = who
        self._lock = threading.Lock()

    def write(self, event: str, **fields: Any) -> None:
        line = json.dumps({"ev": event, "who": self._who, **fields})
        with self._lock:
            self._out.write(line + "\n")
            self._out.flush()


class Hook:
    """The metrics hook: logs the reclaims this worker made (a stale or disconnected holder's row taken over),
    and when a hold of its turned in doubt or was confirmed (``reclaim_disconnected_after``)."""

    def __init__(self, log: Log, unit: Callable[[str], str]) -> None:
        self._log = log
        self._unit = unit

    def stale_reclaimed(
        self, lock_name: str, *, instance_id: str, previous_holder: str, token: int | None, reason: str
    ) -> None:
        self._log.write(
            "reclaimed",
            lock=self._unit(lock_name),
            at=time.monotonic(),
            previous=previous_holder,
            token=token,
            reason=reason,
        )

    def hold_in_doubt(self, lock_name: str, *, instance_id: str) -> None:
        self._log.write("doubt", lock=self._unit(lock_name), at=time.monotonic())

    def hold_confirmed(self, lock_name: str, *, instance_id: str, seconds_in_doubt: float) -> None:
        self._log.write("confirmed", lock=self._unit(lock_name), at=time.monotonic())


@contextmanager
def deadline(conn: psycopg.Connection[Any], seconds: float) -> Iterator[None]:
    """Shut the connection's socket down if the block outlasts ``seconds`` (a silent network blocks forever)."""
    cut = socket.socket(fileno=os.dup(conn.fileno()))

    def shut() -> None:
        with suppress(OSError):
            cut.shutdown(socket.SHUT_RDWR)

    timer = threading.Timer(seconds, shut)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        cut.close()


class Ledger:
    """This worker's connection to the ledger, through its proxy; replaced after any failure."""

    def __init__(self, dsn: str, log: Log, *, fenced: bool = True) -> None:
        self._dsn = dsn
        self._log = log
        self._fenced = fenced
        self._conn: psycopg.Connection[Any] | None = None
        self._count = 0

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(
                self._dsn, connect_timeout=2, options=LEDGER_OPTIONS, application_name="nemesis ledger"
            )
        return self._conn

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with suppress(psycopg.Error, OSError):  # a broken connection is dropped whatever it says
                conn.close()

    def increment(self, mutex: Mutex | Semaphore, lock: str) -> None:
        """One fenced read-modify-write of the counter of ``lock`` (the mutex's, or the permit's); its outcome
        goes to the log."""
        self._count += 1
        inc = f"{mutex.instance_id}.{self._count}"
        phase = "before commit"
        try:
            conn = self._connection()
            with deadline(conn, TRANSACTION_DEADLINE):
                token = mutex.fence(conn) if self._fenced else mutex.token
                found = conn.execute(f"SELECT counter FROM {LEDGER} WHERE id = %s", (lock,)).fetchone()  # noqa: S608
                assert found is not None, f"no ledger row for {lock}"
                wrote = int(found[0]) + 1
                conn.execute(
                    f"UPDATE {LEDGER} SET counter = %s, token = %s WHERE id = %s",  # noqa: S608
                    (wrote, token, lock),
                )
                # From here a failure leaves the outcome unknown: the commit may have landed.
                self._log.write(
                    "inc-start", inc=inc, lock=lock, read=wrote - 1, wrote=wrote, token=token, at=time.monotonic()
                )
                phase = "commit"
                conn.commit()
            self._log.write("inc", inc=inc, lock=lock, outcome="committed", at=time.monotonic())
        except LockNotHeldError:
            # Fenced out (or the lease ran out just now): nothing was written.
            self._rollback()
            self._log.write("inc", inc=inc, lock=lock, outcome="fenced", at=time.monotonic())
        except (psycopg.Error, OSError) as exc:
            self._drop()
            outcome = "unknown" if phase == "commit" else "aborted"
            self._log.write("inc", inc=inc, lock=lock, outcome=outcome, error=type(exc).__name__, at=time.monotonic())

    def _rollback(self) -> None:
        try:
            if self._conn is not None:
                with deadline(self._conn, TRANSACTION_DEADLINE):
                    self._conn.rollback()
        except (psycopg.Error, OSError):
            self._drop()

    def close(self) -> None:
        self._drop()


class Belief:
    """Watches ``held`` every `SAMPLE` seconds on a thread of its own, whatever the section is doing.

    ``until`` is the last moment ``held`` was seen true (read after the timestamp is taken, so it
    is never later than the truth); ``ended`` is set the moment it is seen false.
    """

    def __init__(self, mutex: Mutex | Semaphore, log: Log, enter: float, lock: str) -> None:
        self.until = enter
        self._lock = lock
        self.ended = threading.Event()
        self._stop = threading.Event()
        self._mutex = mutex
        self._log = log
        self._enter = enter
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        told = self._enter
        while not self._stop.is_set():
            seen = time.monotonic()
            if not self._mutex.held:
                self.ended.set()
                return
            self.until = seen
            if seen - told >= BELIEF_EVERY:
                # For a section a SIGKILL leaves open: until when it was seen believing.
                self._log.write("believed", lock=self._lock, enter=self._enter, at=seen)
                told = seen
            self._stop.wait(SAMPLE)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def unit_of(mutex: Mutex | Semaphore) -> str:
    """What a section holds: the mutex's lock, or the semaphore's permit (``LOCK/K``), exclusive either way."""
    if isinstance(mutex, Semaphore):
        return f"{mutex.lock_name}/{mutex.permit}"
    return mutex.lock_name


def work(mutex: Mutex | Semaphore, ledger: Ledger, log: Log, rng: random.Random) -> None:
    """One critical section: work for a while, incrementing the ledger on the way; over when ``held`` turns false.

    Half the sections are long (seconds): a holder frozen or cut off in the middle of one is
    still in it when its lease, and the stale threshold, run out.
    """
    enter = time.monotonic()
    lock = unit_of(mutex)
    log.write("enter", lock=lock, token=mutex.token, at=enter)
    belief = Belief(mutex, log, enter, lock)
    seconds = rng.uniform(0.05, 1.0) if rng.random() < 0.5 else rng.uniform(1.0, 6.0)
    increments = sorted(rng.uniform(0.0, seconds) for _ in range(rng.choice((1, 1, 2, 3))))
    for due in increments:
        if belief.ended.wait(max(0.0, enter + due - time.monotonic())):
            break
        ledger.increment(mutex, lock)
    else:
        belief.ended.wait(max(0.0, enter + seconds - time.monotonic()))
    leave = time.monotonic()
    held = mutex.held
    belief.close()
    log.write(
        "section",
        lock=lock,
        token=mutex.token,
        enter=enter,
        exit=leave,
        held=held,
        believed_until=leave if held else belief.until,
    )


def main(name: str, locks: list[str], log_path: str, seed: int, stop_file: str) -> None:
    if os.environ.get("NEMESIS_BROKEN") == "lease":
        break_the_lease()
    timing: dict[str, Any] = {**TIMING, **json.loads(os.environ.get("CHAOS_TIMING") or "{}")}
    reclaim = os.environ.get(RECLAIM_ENV)
    if reclaim and int(name[1:].split("g")[0]) % 2:
        # Half the fleet (the odd slots) names its sessions: a mixed fleet, as a rollout makes.
        timing["reclaim_disconnected_after"] = float(reclaim)
    dsn = os.environ["POSTGRES_MUTEX_DSN"]
    stop = Path(stop_file)
    rng = random.Random(f"{seed}-{name}")
    with open(log_path, "a") as out:
        log = Log(out, name)
        # A semaphore's events name it; the checker wants the permit its holder held last.
        units: dict[str, str] = {}

        def unit(lock: str) -> str:
            # The permit held now, else (the hold is gone: a loss) the one held last.
            mutex = mutexes.get(lock)
            if isinstance(mutex, Semaphore) and mutex.permit is not None:
                return unit_of(mutex)
            return units.get(lock, lock)

        hook = Hook(log, unit)

        def lost(error: LockNotHeldError) -> None:
            log.write("lost", lock=unit(error.lock_name or ""), at=time.monotonic(), reason=error.reason)

        permits = int(os.environ.get(PERMITS_ENV) or 0)
        mutexes: dict[str, Mutex | Semaphore] = {
            lock: Semaphore(dsn, lock, permits=permits, instance_id=name, on_lost=lost, metrics=hook, **timing)
            if permits
            else Mutex(dsn, lock, instance_id=name, on_lost=lost, metrics=hook, **timing)
            for lock in locks
        }
        ledger = Ledger(dsn, log)
        log.write("start", pid=os.getpid(), at=time.monotonic(), broken=os.environ.get("NEMESIS_BROKEN", ""))
        while not stop.exists():
            mutex = mutexes[rng.choice(locks)]
            try:
                with mutex.acquire(blocking=True, timeout=rng.uniform(0.5, 3.0)):
                    units[mutex.lock_name] = unit_of(mutex)
                    work(mutex, ledger, log, rng)
            except MutexError as exc:
                # Timed out, lost (leaving the block says so), or the database was unreachable.
                log.write("error", lock=mutex.lock_name, at=time.monotonic(), error=type(exc).__name__)
            threading.Event().wait(rng.uniform(0.0, 0.05))
        ledger.close()
        for mutex in mutexes.values():
            try:
                mutex.close()
            except MutexError as exc:
                log.write("error", lock=mutex.lock_name, at=time.monotonic(), error=type(exc).__name__)
        log.write("stop", at=time.monotonic())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","), sys.argv[3], int(sys.argv[4]), sys.argv[5])
