"""An exception raised into an acquire, wherever it lands, leaves either a hold the block owns or nothing.

A job runner's time limit (Celery's soft time limit, RQ, a ``signal.alarm`` wrapper) or Ctrl-C
raises from a signal handler between any two lines of the library. The caller then either got
the hold (its ``with`` block's exit releases it) or nothing is left: no hold in memory, no row
heartbeated, the object usable at once, and the row, if any, deleted by the background.

Two ways in, for every kind of holder: an exception raised in turn at points of an acquire where
CPython could run a signal handler (a trace function raises it there, deterministically: at a
sample of those points on every run, at each of them under ``pytest -m slow``), and a real
signal handler raising at random moments, hundreds of times, as a job runner does. Either way,
no exception is left being handled afterwards, which the caller's next one would carry.
"""

from __future__ import annotations

import functools
import itertools
import logging
import random
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import psycopg
import pytest

import postgres_mutex
from postgres_mutex import Mutex, RWLock, Semaphore
from postgres_mutex._io.acquisition import Acquisition
from tests.support.signal_points import RaiseAtCheck
from tests.support.timing import FAST

LIBRARY = str(Path(postgres_mutex.__file__).parent)

# Short statement deadlines: a row an unanswered attempt may leave is deleted within a second.
OPTIONS: dict[str, Any] = {**FAST, "operation_timeout": 0.5}


class JobTimeout(Exception):
    """What a job runner raises from its signal handler: a plain exception, which code may catch by mistake."""


@dataclass
class Subject:
    """One kind of holder, and how to ask it for the lock."""

    kind: str
    holder: Any
    acquire: Callable[[], Acquisition]
    rows_like: str

    @property
    def held(self) -> bool:
        return bool(self.holder.held)

    def stray_row_possible(self) -> bool:
        """Whether a statement of an interrupted acquire may still write a row the background must delete."""
        holders = [self.holder._reader, self.holder._writer] if isinstance(self.holder, RWLock) else [self.holder]
        return any(holder._lock.stray_row_possible for holder in holders)


@pytest.fixture(params=["mutex", "semaphore", "read", "write"])
def subject(request: pytest.FixtureRequest, dsn: str, lock_name: str, schema: None) -> Iterator[Subject]:
    kind: str = request.param
    made: Any
    if kind == "mutex":
        made = Mutex(dsn=dsn, lock_name=lock_name, **OPTIONS)
        yield Subject(kind, made, lambda: made.acquire(blocking=True, timeout=5), lock_name)
    elif kind == "semaphore":
        made = Semaphore(dsn, lock_name, permits=2, **OPTIONS)
        yield Subject(kind, made, lambda: made.acquire(blocking=True, timeout=5), lock_name + "%")
    else:
        made = RWLock(dsn, lock_name, **OPTIONS)
        pick = made.read if kind == "read" else made.write
        yield Subject(kind, made, lambda: pick(blocking=True, timeout=5), lock_name + "%")
    made.close()


def _rows(admin: psycopg.Connection[Any], subject: Subject) -> int:
    found = admin.execute(
        "SELECT count(*) FROM mutex_lock WHERE lock_name LIKE %s AND instance_id = %s",
        (subject.rows_like, subject.holder.instance_id),
    ).fetchone()
    assert found is not None
    return int(found[0])


@dataclass
class Tally:
    """What the tries saw, reported whatever the outcome."""

    kind: str
    tries: int = 0
    interrupted: int = 0
    entered: int = 0
    offsets: list[float] = field(default_factory=list)
    took: float = 0.008
    """How long the last acquire that entered its block took."""

    def __str__(self) -> str:
        spread = f", offsets {min(self.offsets) * 1000:.2f}-{max(self.offsets) * 1000:.2f} ms" if self.offsets else ""
        return (
            f"{self.kind}: {self.tries} tries, {self.interrupted} interrupted before the block, "
            f"{self.entered} entered the block{spread}"
        )


def _one_try(
    subject: Subject,
    admin: psycopg.Connection[Any],
    tally: Tally,
    said: Callable[[], str] | str,
    arm: Callable[[], object] = lambda: None,
) -> None:
    """Acquire with an exception on its way; check the caller got the hold, or that nothing is left.

    ``said`` tells where the exception was raised (a function: once it was); ``arm`` sets it on
    its way, where the exception is caught (a signal can come before the acquire is called).
    """
    tally.tries += 1
    where = "before the block"
    began = time.monotonic()
    try:
        arm()
        with subject.acquire() as acquired:
            _stop_raising()
            tally.took = time.monotonic() - began
            where = said if isinstance(said, str) else said()
            tally.entered += 1
            assert acquired, f"{where}: the block runs holding the lock"
            assert subject.held, f"{where}: the block runs holding the lock"
    except (JobTimeout, KeyboardInterrupt):
        _stop_raising()
        tally.interrupted += 1
    _stop_raising()
    where = said if isinstance(said, str) else said()
    # No exception of the library's is left being handled: the caller's next exception would
    # carry it as its __context__ (with whatever it holds, into a log or an error report).
    assert sys.exc_info() == (None, None, None), f"{where}: nothing is left being handled ({tally})"
    assert not subject.held, f"{where}: no hold is left in memory ({tally})"
    # Nothing stays heartbeated: the row, if the acquire wrote one, is deleted by the background
    # (within seconds even where the exception skipped giving the connection back: see `Gate`).
    # (A statement the server reads late may write a row after this saw none: the background
    # deletes that one too, or the next acquire takes it back; `_nothing_left` checks the end.)
    deadline = time.monotonic() + 10.0
    rows = _rows(admin, subject)
    while rows and time.monotonic() < deadline:
        time.sleep(0.005)
        rows = _rows(admin, subject)
    assert not rows, f"{where}: the background deleted the row ({tally})"
    # And the object is usable at once: no "already holds or is acquiring".
    with subject.acquire() as acquired:
        assert acquired, f"{where}: the lock is free again"


def _nothing_left(subject: Subject, admin: psycopg.Connection[Any]) -> None:
    """Once the background has done its work, no row of the holder is left in the table."""
    deadline = time.monotonic() + 10.0
    while (subject.stray_row_possible() or _rows(admin, subject)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not subject.stray_row_possible(), "the background's clean-up ended"
    assert not _rows(admin, subject), "no row is left once no late statement can land"


_ALARM = {"armed": False}
"""Whether the signal handler raises: a signal delivered just after the acquire ended must not."""


def _arm(seconds: float) -> None:
    _ALARM["armed"] = True
    signal.setitimer(signal.ITIMER_REAL, seconds)


def _stop_raising() -> None:
    _ALARM["armed"] = False
    sys.settrace(None)
    signal.setitimer(signal.ITIMER_REAL, 0)


@pytest.fixture(autouse=True)
def _library_logs_reach_no_locking_handler() -> Iterator[None]:
    """While exceptions fly, the library's log records reach no handler, which would take a lock.

    A handler takes its lock in Python code (`logging.Handler.handle`: ``acquire()``, then
    ``try``): a signal's exception landing between the two, as the library logs during an
    acquire, leaves that lock held by the main thread for good, and every other thread that
    logs through the handler (pytest's own) then waits on it: the library's heartbeat thread
    as it logs a row it removed, whose next clean-ups then never run. That is the logging
    module's hazard, which a job runner's signal meets in any code that logs, not the library's.
    The records are made (the library's logging paths run as they would) and dropped by a
    filter on the library's logger, before any handler: a logger that does not propagate
    would not do, since pytest attaches its capturing handlers to such loggers too.
    """
    logger = logging.getLogger("postgres_mutex")

    def dropped(record: logging.LogRecord) -> bool:
        return False

    logger.addFilter(dropped)
    try:
        yield
    finally:
        logger.removeFilter(dropped)


@pytest.fixture(autouse=True)
def _lost_in_finalizers(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """An exception a signal handler raises while a finalizer runs is lost there ("Exception ignored"):
    Python's doing, not the library's. Only such losses are tolerated; anything else still fails."""
    lost: list[str] = []
    others: list[str] = []

    def hook(unraisable: Any) -> None:
        where = f"{unraisable.exc_type.__name__} in {unraisable.object!r}"
        (lost if unraisable.exc_type in (JobTimeout, KeyboardInterrupt) else others).append(where)

    monkeypatch.setattr(sys, "unraisablehook", hook)
    yield lost
    assert others == [], "nothing but the signal's own exception may be lost in a finalizer"


def _told(raiser: RaiseAtCheck, point: str) -> str:
    return f"{point}: {raiser.where or 'not reached'}"


def _raise_at_check(at: int, error: type[BaseException]) -> RaiseAtCheck:
    """Raises at the ``at``-th point where a signal handler could run in the library's code."""
    return RaiseAtCheck(at, error, lambda filename: filename.startswith(LIBRARY))


def _points(subject: Subject) -> int:
    """How many points where a signal handler could run an uncontended acquire passes, its connection already open."""
    with subject.acquire():
        pass
    counter = _raise_at_check(at=0, error=JobTimeout)
    sys.settrace(counter)
    try:
        acquisition = subject.acquire()
        acquisition.__enter__()
    finally:
        sys.settrace(None)
    acquisition.__exit__(None, None, None)
    # A few dozen at least, whichever Python counts them (3.12 sees fewer than 3.11 on the same path).
    assert counter.seen > 20, "the count saw the library run"
    return counter.seen


def _raise_at_each(
    subject: Subject,
    admin: psycopg.Connection[Any],
    capsys: pytest.CaptureFixture[str],
    points: int,
    at: list[int],
    said: str,
) -> None:
    """An acquire with an exception raised at each of the points ``at`` in turn; ``said`` tells which were picked."""
    tally = Tally(subject.kind)
    for each in at:
        # A KeyboardInterrupt at every third point, as Ctrl-C raises it.
        error: type[BaseException] = KeyboardInterrupt if each % 3 == 0 else JobTimeout
        raiser = _raise_at_check(each, error)
        sys.settrace(raiser)
        _one_try(
            subject, admin, tally, functools.partial(_told, raiser, f"raised at point {each} of {points} ({said})")
        )
    _nothing_left(subject, admin)
    with capsys.disabled():
        print(f"\n{tally} (an exception at {said})")
    assert tally.interrupted >= len(at) // 2, f"the exceptions reached the acquire: {tally}"


SAMPLED_POINTS = 24
"""At how many of the points each run raises: one drawn in each of so many stretches of the acquire,
from its start to its end (most tries take milliseconds; one that wrote a row waits for its clean-up)."""


def test_an_exception_raised_at_a_sample_of_the_points_where_a_signal_handler_could_run_leaves_a_hold_or_nothing(
    subject: Subject, admin: psycopg.Connection[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    points = _points(subject)
    seed = random.randrange(2**32)
    draw = random.Random(seed)
    bounds = [1 + points * band // SAMPLED_POINTS for band in range(SAMPLED_POINTS + 1)]
    at = sorted({draw.randrange(low, high) for low, high in itertools.pairwise(bounds) if low < high})
    _raise_at_each(subject, admin, capsys, points, at, f"{len(at)} of {points} points, seed {seed}")


# The long variant, at every point: a minute and a half. Run it with `pytest -m slow`.
@pytest.mark.slow
def test_an_exception_raised_wherever_a_signal_handler_could_run_leaves_a_hold_or_nothing(
    subject: Subject, admin: psycopg.Connection[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    points = _points(subject)
    _raise_at_each(subject, admin, capsys, points, list(range(1, points + 1)), f"each of {points} points")


def test_a_signal_handlers_exception_at_random_moments_leaves_a_hold_or_nothing(
    subject: Subject, admin: psycopg.Connection[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    # As a job runner's time limit does it: SIGALRM, its handler raising at a random moment of the
    # acquire (from 0.05 ms to a little past how long the last acquire took: a fresh connection's
    # takes milliseconds, a warm one's a fraction of one), hundreds of times.
    tries = 300
    seed = random.randrange(2**32)
    draw = random.Random(seed)
    tally = Tally(subject.kind)

    def job_timeout(signum: int, frame: FrameType | None) -> None:
        if _ALARM["armed"]:
            raise JobTimeout("the job ran too long") if draw.random() < 0.7 else KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, job_timeout)
    started = time.monotonic()
    try:
        for attempt in range(tries):
            offset = draw.uniform(0.00005, 1.2 * tally.took)
            tally.offsets.append(offset)
            said = f"try {attempt + 1}, seed {seed}, signal at {offset * 1000:.2f} ms"
            _one_try(subject, admin, tally, said, functools.partial(_arm, offset))
    finally:
        _stop_raising()
        signal.signal(signal.SIGALRM, previous)
    _nothing_left(subject, admin)
    with capsys.disabled():
        print(f"\n{tally}, seed {seed}, {time.monotonic() - started:.1f}s")
    assert tally.interrupted >= tries // 4, f"the signals reached the acquires: {tally}"
