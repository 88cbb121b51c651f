"""The waiters of one process take turns reading their listener's socket (`Reader`): a release's
notification wakes the very thread that waits for it, whoever read it.

A turn ends at its waiter's deadline; the waiter leaves a moment later. A waiter that comes in
between takes the socket, and the one leaving must not end that new turn: a reader whose turn
was ended is no longer told when a release wakes it, and sleeps on till its own deadline.
"""

from __future__ import annotations

import os
import select
import threading
import time

from postgres_mutex._base.acompat import Event, Reader, Waker
from tests.support.fixtures import wait_until


def test_a_reader_leaving_after_its_deadline_leaves_the_next_readers_turn_alone() -> None:
    reader, waker = Reader(Waker()), Waker()
    socket_read, socket_write = os.pipe()
    first_drains, first_may_return = threading.Event(), threading.Event()
    first_released, second_released = Event(), Event()
    second_returned: list[float] = []

    def first_drain() -> bool:
        first_drains.set()
        first_may_return.wait(10.0)
        os.read(socket_read, 1)  # what a notification's read consumes
        return True

    def second() -> None:
        reader.wait(second_released, socket_read, lambda: True, 10.0)
        second_returned.append(time.monotonic())

    try:
        first = threading.Thread(target=reader.wait, args=(first_released, socket_read, first_drain, 0.2), daemon=True)
        first.start()
        os.write(socket_write, b"!")  # a notification arrives: the first reader drains it, slowly
        assert first_drains.wait(10.0)
        wait_until(lambda: reader.busy_until() < time.monotonic(), timeout=10)  # its turn is over
        waiting = threading.Thread(target=second, daemon=True)
        waiting.start()
        wait_until(lambda: reader.busy_until() > time.monotonic(), timeout=10)  # the second's turn began
        first_may_return.set()
        first.join(10.0)
        assert not first.is_alive()
        assert reader.busy_until() > time.monotonic(), "the first reader, leaving, ended the second's turn"

        # A release that wakes the second reader (as `Listener.wake` does) ends its wait at once.
        woken = time.monotonic()
        second_released.set()
        reader.poke()
        waiting.join(10.0)
        assert second_returned, "the second reader's wait did not end"
        assert second_returned[0] - woken < 0.5, "the second reader slept on after it was woken"
    finally:
        first_may_return.set()
        second_released.set()
        reader.poke()
        for fd in (socket_read, socket_write):
            os.close(fd)
        reader.close()
        waker.close()


def test_a_reader_woken_by_what_it_drains_writes_nothing_to_wake_itself() -> None:
    """The reader's own wake-up, set as it drains the socket, ends its wait with no write to its pipe: a
    system call on the hand-off's path, and a byte its next wait would go round its loop to read. Another
    thread's wake-up still writes, and ends the wait at once."""
    reader = Reader(Waker())
    socket_read, socket_write = os.pipe()
    released = Event()

    def drain() -> bool:
        os.read(socket_read, 1)  # a release's notification, for this very waiter
        released.set()
        reader.poke()  # as `Listener.wake` does
        return True

    try:
        os.write(socket_write, b"!")
        assert reader.wait(released, socket_read, drain, 10.0)
        assert released.is_set()
        assert not select.select([reader._read], [], [], 0)[0], "the reader wrote to its own pipe to wake itself"

        # Another thread's wake-up (a stop, or the listener's thread) reaches the reader through the pipe.
        other = Event()
        returned: list[float] = []
        waiting = threading.Thread(
            target=lambda: returned.append(reader.wait(other, socket_read, lambda: True, 10.0)), daemon=True
        )
        waiting.start()
        wait_until(lambda: reader.busy_until() > time.monotonic(), timeout=10)
        woken = time.monotonic()
        other.set()
        reader.poke()
        waiting.join(10.0)
        assert returned, "the reader's wait did not end"
        assert time.monotonic() - woken < 0.5, "the reader slept on after another thread woke it"
    finally:
        released.set()
        for fd in (socket_read, socket_write):
            os.close(fd)
        reader.close()
