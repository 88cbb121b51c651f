"""An election's relay carries stop() and resign() out of a signal handler; a run's end waits for it within a bound."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from postgres_mutex._election.relay import Relay


def test_the_end_of_a_run_waits_for_what_the_relay_carries() -> None:
    stopped = threading.Event()
    relay = Relay(stopped.set, lambda: None, name="nightly")
    assert relay.send(Relay.STOP)
    assert relay.close(5.0)
    assert stopped.is_set(), "a stop() sent before close() was acted on"
    assert not relay.send(Relay.RESIGN), "a relay closed takes nothing more: its caller acts itself"


def test_a_stop_that_hangs_in_the_relay_delays_the_end_of_a_run_only_within_its_bound(
    caplog: pytest.LogCaptureFixture,
) -> None:
    acting, let_go = threading.Event(), threading.Event()

    def stop() -> None:
        acting.set()
        let_go.wait(30)

    relay = Relay(stop, lambda: None, name="nightly")
    try:
        assert relay.send(Relay.STOP)
        assert acting.wait(5)
        started = time.monotonic()
        assert not relay.close(0.2)
        assert time.monotonic() - started < 2.0
        said = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
        assert any("'nightly'" in message and "0.2s" in message for message in said), said
    finally:
        let_go.set()
