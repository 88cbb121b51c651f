"""Mutex, Semaphore and a read/write lock's holders are siblings: none of them stands in for another."""

from __future__ import annotations

from postgres_mutex import Mutex, Semaphore

DSN = "host=127.0.0.1 dbname=app"


def test_a_semaphore_is_not_a_mutex_yet_offers_what_a_mutex_does() -> None:
    # Code that checks for a Mutex (one holder at a time) must not take a Semaphore (N at once) for one.
    semaphore = Semaphore(DSN, "partner-api", permits=3)
    mutex = Mutex(DSN, "job")
    try:
        assert Mutex not in type(semaphore).__mro__
        assert Semaphore not in type(mutex).__mro__
        for name in ("acquire", "acquire_async", "held", "token", "fence", "fenced", "release", "singleton"):
            assert hasattr(semaphore, name), name
    finally:
        semaphore.close()
        mutex.close()
