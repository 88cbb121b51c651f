"""How a fair lock's hand-off notification is read (`_sql.fair.handed`)."""

from __future__ import annotations

from postgres_mutex._sql import WAKE_EACH_PROCESS, WAKE_FAIR, handed
from postgres_mutex._sql.fair import at_slot, waiter_of


def test_a_hand_off_names_the_acquire_the_token_and_the_stamp() -> None:
    assert handed(f"{WAKE_FAIR}host 1/7 42 1800000000123456") == ("host 1/7", 42, 1800000000123456)


def test_other_payloads_hand_nothing() -> None:
    assert handed(WAKE_EACH_PROCESS) is None
    assert handed("*") is None
    assert handed(f"{WAKE_FAIR}garbled") is None


def test_a_waiter_named_with_its_slot_is_the_same_acquire() -> None:
    assert waiter_of(at_slot("host 1/7", 3)) == "host 1/7"
    assert waiter_of("host 1/7") == "host 1/7"
    # An instance id of the user's own may hold the separator: only a slot's number after it is one.
    assert waiter_of("worker@host/7") == "worker@host/7"
    assert waiter_of(at_slot("worker@12/7", 5)) == "worker@12/7"
    assert handed(f"{WAKE_FAIR}{at_slot('host 1/7', 3)} 42 1800000000123456") == ("host 1/7", 42, 1800000000123456)
