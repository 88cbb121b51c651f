"""What an exception raised into the library's thread primitives leaves behind: nothing held.

A signal handler's exception (a job runner's time limit, Ctrl-C) lands wherever CPython checks
for pending work: as a function starts, after a call returns, at a loop's back edge. Raised
there inside a ``with`` block's entry written in Python, it leaves the block's lock held, and
every later user of that primitive waits for good. These tests raise at each such point.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from pathlib import Path

import postgres_mutex
from postgres_mutex._base.acompat import Event
from postgres_mutex._election.term import Flag
from tests.support.signal_points import RaiseAtCheck

LIBRARY = str(Path(postgres_mutex.__file__).parent)
THREADING = threading.__file__


class Interrupt(Exception):
    """What the signal handler raises."""


def _raise_at(at: int) -> RaiseAtCheck:
    """Raises at the ``at``-th point where a signal handler could run (0: counts only), in the library's
    frames and the threading module's (whose Python code a `threading.Event` runs)."""
    return RaiseAtCheck(at, Interrupt, lambda name: name.startswith(LIBRARY) or name == THREADING)


def _wait_with(tracer: RaiseAtCheck, waiting: Event | Flag) -> None:
    sys.settrace(tracer)
    try:
        waiting.wait(0.001)
    except Interrupt:
        pass
    finally:
        sys.settrace(None)


def _sweep(failures: list[str], waited_on: Callable[[Event], Event | Flag]) -> None:
    """Raise at each point of a wait on ``waited_on(event)``, then check ``event`` still works."""
    counter = _raise_at(0)
    _wait_with(counter, waited_on(Event()))
    points = counter.seen
    if points < 3:
        failures.append(f"the count saw the wait run ({points} points)")
    for at in range(1, points + 1):
        event = Event()
        raiser = _raise_at(at)
        _wait_with(raiser, waited_on(event))
        setter = threading.Thread(target=event.set, daemon=True)
        setter.start()
        setter.join(2.0)
        if setter.is_alive():
            failures.append(f"set() from another thread waits for good after an exception at {raiser.where}")
            return
        if not event.wait(2.0):
            failures.append(f"wait() misses a set() after an exception at {raiser.where}")
        event.clear()
        if event.wait(0.001):
            failures.append(f"a cleared event reads as set after an exception at {raiser.where}")


def _swept(waited_on: Callable[[Event], Event | Flag]) -> list[str]:
    # Run in a thread of its own: what a trace function's exception leaves in the thread's
    # exception state stays there.
    failures: list[str] = []
    sweeper = threading.Thread(target=_sweep, args=(failures, waited_on), daemon=True)
    sweeper.start()
    sweeper.join(60.0)
    assert not sweeper.is_alive(), "the sweep ended"
    return failures


def test_an_exception_raised_anywhere_in_an_events_wait_leaves_it_working() -> None:
    # A waiting acquire waits on such an event, which the listener thread sets on a release's
    # notification: a wedged one would stop the listener, and every waiter of the process.
    assert _swept(lambda event: event) == []


def test_an_exception_raised_anywhere_in_leaderships_wait_leaves_the_election_working() -> None:
    # ``lead`` waits on `Leadership.ended` in the caller's thread, where Ctrl-C or a job runner's
    # time limit lands; the election then ends the term from its own thread, and must not wait
    # for good on what the interrupted wait left behind.
    assert _swept(lambda event: Flag(event)) == []


def test_an_event_wakes_every_waiter_and_stays_set_until_cleared() -> None:
    event = Event()
    woken: list[bool] = []
    waiters = [threading.Thread(target=lambda: woken.append(event.wait(5.0))) for _ in range(3)]
    for waiter in waiters:
        waiter.start()
    event.set()
    for waiter in waiters:
        waiter.join(5.0)
    assert woken == [True, True, True]
    assert event.is_set()
    assert event.wait(0)
    event.clear()
    assert not event.is_set()
    assert not event.wait(0.01)
