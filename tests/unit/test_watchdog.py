"""The deadline watchdog, on a socket pair: a deadline cuts the socket in time, however it was armed."""

from __future__ import annotations

import socket
import time

from postgres_mutex._base.clock import now
from postgres_mutex._base.watchdog import STORE_ARMS, Cutter


def test_a_deadline_armed_by_its_store_alone_cuts_the_socket_in_time() -> None:
    # The common statement arms its deadline with a store, waking no thread: the watchdog, asleep
    # with nothing armed, must still look before that deadline and cut a reply that never comes.
    ours, peer = socket.socketpair()
    cutter = Cutter(ours.fileno())
    try:
        cutter.disarm(cutter.arm(60.0))  # the first deadline: the watchdog watches this connection
        assert cutter.stores_arm
        time.sleep(0.2)  # it looked, found nothing armed, and sleeps
        ours.settimeout(STORE_ARMS + 10)
        started = now()
        cutter.until = started + STORE_ARMS  # as a statement of STORE_ARMS seconds arms it
        assert ours.recv(1) == b"", "the socket was not shut down"  # no reply ever comes
        waited = now() - started
        assert cutter.fired
        assert STORE_ARMS <= waited < STORE_ARMS + 1.0, f"cut after {waited:.2f}s, for a {STORE_ARMS}s deadline"
    finally:
        cutter.close()
        ours.close()
        peer.close()


def test_a_deadline_disarmed_in_time_never_cuts() -> None:
    ours, peer = socket.socketpair()
    cutter = Cutter(ours.fileno())
    try:
        cutter.disarm(cutter.arm(60.0))
        cutter.until = now() + STORE_ARMS
        with cutter.lock:  # as the statement's end disarms it
            cutter.until = float("inf")
        time.sleep(STORE_ARMS + 0.3)  # past the deadline it had: the watchdog looked meanwhile
        assert not cutter.fired
        peer.sendall(b"x")
        assert ours.recv(1) == b"x"
    finally:
        cutter.close()
        ours.close()
        peer.close()
