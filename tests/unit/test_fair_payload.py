"""How a fair lock's hand-off notification is read (`_sql.fair.handed`)."""

from __future__ import annotations

from postgres_mutex._sql import WAKE_EACH_PROCESS, WAKE_FAIR, handed


def test_a_hand_off_names_the_acquire_the_token_and_the_stamp() -> None:
    assert handed(f"{WAKE_FAIR}host 1/7 42 1800000000123456") == ("host 1/7", 42, 1800000000123456)


def test_other_payloads_hand_nothing() -> None:
    assert handed(WAKE_EACH_PROCESS) is None
    assert handed("*") is None
    assert handed(f"{WAKE_FAIR}garbled") is None
