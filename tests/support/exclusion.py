"""The one mutual-exclusion checker of both suites: critical sections on one clock, and their overlaps.

A critical section runs from the moment a holder's acquire returned to the
moment it stopped working under the lock: it released, or it saw its lock lost
(``held`` false, ``on_lost``). Every process on the machine reads the same
``CLOCK_MONOTONIC`` (``time.monotonic()``), so sections logged by separate
processes can be compared directly. Worker processes log theirs one a line, as
"WHO ENTER EXIT" (`read_log`).

Two sections of one lock *overlap* when the later one began before the earlier
one had ended; sections that merely touch (one begins exactly when the other
ends) do not. With ``believed=True`` an earlier section counts only up to the
last moment its holder still believed it held the lock: a holder that ran on
after it learned of the loss (a frozen process resuming, say) is no second
holder. `tests/unit/test_exclusion.py` feeds the checker known intervals.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from postgres_mutex import LockNotHeldError
from postgres_mutex._kinds.holder import Holder  # what Mutex, Semaphore and RWLock holders share


@dataclass
class Section:
    """One critical section of one holder, on the machine-wide monotonic clock."""

    who: str
    enter: float
    exit: float | None = None
    """None while it is open: it then lasts until the moment of the check."""
    lock: str = ""
    """Sections of different locks never overlap."""
    held_at_exit: bool = True
    """Whether the holder still believed it held the lock (``held`` true) when the section ended."""
    believed_until: float | None = None
    """When not ``held_at_exit``: the last moment the holder was seen believing it held the lock (None: never)."""

    def end(self, now: float) -> float:
        return now if self.exit is None else self.exit

    def belief_end(self, now: float) -> float:
        """Until when its holder believed it held the lock."""
        if self.held_at_exit:
            return self.end(now)
        return self.enter if self.believed_until is None else min(self.believed_until, self.end(now))


def overlaps(
    sections: Iterable[Section], *, now: float | None = None, believed: bool = False
) -> list[tuple[Section, Section]]:
    """Every section that began while another of its lock was still running, paired with that other one.

    ``believed``: the earlier section runs only until its holder stopped believing it held the lock,
    and a section whose holder never believed it held the lock (it learned of the loss before the
    section began: an acquire that returned, then a freeze past the lease) overlaps nothing.
    """
    moment = time.monotonic() if now is None else now
    found: list[tuple[Section, Section]] = []
    by_lock: dict[str, list[Section]] = {}
    for section in sections:
        by_lock.setdefault(section.lock, []).append(section)

    def until(section: Section) -> float:
        return section.belief_end(moment) if believed else section.end(moment)

    for lock_sections in by_lock.values():
        latest: Section | None = None  # the section seen so far that runs longest
        for section in sorted(lock_sections, key=lambda s: (s.enter, s.end(moment))):
            if believed and until(section) <= section.enter:
                continue
            if latest is not None and section.enter < until(latest):
                found.append((latest, section))
            if latest is None or until(section) > until(latest):
                latest = section
    return found


def read_log(path: Path, lock: str = "") -> list[Section]:
    """Sections a worker process logged, one a line: "WHO ENTER EXIT"."""
    found = []
    for line in path.read_text().splitlines():
        who, enter, leave = line.split()
        found.append(Section(who, float(enter), float(leave), lock=lock))
    return found


class Sections:
    """A thread-safe log of critical sections, filled as they happen or from worker logs."""

    def __init__(self) -> None:
        self._sections: list[Section] = []
        self._lock = threading.Lock()

    def enter(self, who: str, at: float | None = None) -> Section:
        section = Section(who, time.monotonic() if at is None else at)
        with self._lock:
            self._sections.append(section)
        return section

    def add(self, section: Section) -> None:
        with self._lock:
            self._sections.append(section)

    def leave(self, section: Section) -> None:
        if section.exit is None:
            section.exit = time.monotonic()

    @contextmanager
    def holding(self, mutex: Holder, who: str, **acquire: Any) -> Iterator[bool]:
        """``with mutex.acquire(...)`` recording the section; a lost lock ends it when it is lost."""
        with mutex.acquire(**acquire) as acquired:
            if not acquired:
                yield False
                return
            section = self.enter(who)
            try:
                yield True
            finally:
                self.leave(section)

    def on_lost(self, who: str) -> Any:
        """An ``on_lost`` callback that ends ``who``'s open section at the moment of the loss."""

        def lost(error: LockNotHeldError) -> None:
            with self._lock:
                for section in self._sections:
                    if section.who == who and section.exit is None:
                        section.exit = time.monotonic()

        return lost

    def add_log(self, path: Path) -> None:
        found = read_log(path)
        with self._lock:
            self._sections.extend(found)

    def all(self) -> list[Section]:
        with self._lock:
            return list(self._sections)

    def overlaps(self) -> list[tuple[Section, Section]]:
        """Sections that began before an earlier one had ended; an open section lasts until now."""
        return overlaps(self.all())


def most_at_once(sections: Iterable[Section], *, now: float | None = None) -> int:
    """The most sections of one lock open at one moment (sections that merely touch are not counted together):
    what a semaphore of N must keep at N or fewer."""
    moment = time.monotonic() if now is None else now
    # At one moment, exits come before entries: a section that ends as another begins is not concurrent with it.
    events = sorted(
        [(section.enter, 1) for section in sections] + [(section.end(moment), -1) for section in sections],
        key=lambda event: (event[0], event[1]),
    )
    most = current = 0
    for _, change in events:
        current += change
        most = max(most, current)
    return most
