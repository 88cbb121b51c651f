"""The lock's decisions, without a database: what results mean, when to alert, what errors mean."""

from __future__ import annotations

from datetime import UTC, datetime

import psycopg
import pytest

from postgres_mutex import DatabaseError, OperationTimeout, SchemaError
from postgres_mutex._base.secrets import Redactor
from postgres_mutex._kinds.semaphore import FairPermits, Permits
from postgres_mutex._state.admin_flows import observe
from postgres_mutex._state.alerts import AlertGate
from postgres_mutex._state.failures import classify_failure
from postgres_mutex._state.outcome import Outcome, interpret_acquire, read_acquire
from postgres_mutex._state.settings import Timing

ME = "host-me"


NOW = datetime(2026, 12, 2, tzinfo=UTC)


@pytest.mark.parametrize(
    ("row", "outcome", "holder"),
    [
        ((True, None, None, NOW, 7), Outcome.ACQUIRED, None),
        ((True, "host-gone", 0.5, NOW, 7), Outcome.ACQUIRED, None),  # the holder released meanwhile
        ((False, "host-dead", 700.0, NOW, 7), Outcome.RECLAIMED, "host-dead"),
        ((False, ME, 0.2, NOW, 7), Outcome.REACQUIRED, ME),
        ((None, "host-other", 3.0, None, None), Outcome.CONTENDED, "host-other"),
        ((None, None, None, None, None), Outcome.CONTENDED, None),  # inserted after our snapshot
    ],
)
def test_interpret_acquire(row: tuple[object, ...], outcome: Outcome, holder: str | None) -> None:
    result = interpret_acquire(row, ME)
    assert result.outcome is outcome
    assert result.holder == holder
    assert outcome.acquired is (outcome is not Outcome.CONTENDED)
    assert result.acquired_at == (NOW if outcome.acquired else None)
    assert result.token == (7 if outcome.acquired else None)


@pytest.mark.parametrize(
    ("row", "outcome", "permit_row", "retry_at_once"),
    [
        ((True, None, None, NOW, 7, "api\x1f2", 3, 1), Outcome.ACQUIRED, "api\x1f2", False),
        ((False, "host-dead", 700.0, NOW, 7, "api\x1f0", 3, 3), Outcome.RECLAIMED, "api\x1f0", False),
        # Nothing won with two permits free: another contender won the one chosen; the others are worth a try.
        ((None, "host-other", 0.1, None, None, None, 3, 1), Outcome.CONTENDED, None, True),
        # The last free permit went to another contender: wait for a release.
        ((None, "host-other", 0.1, None, None, None, 3, 2), Outcome.CONTENDED, None, False),
        ((None, "host-other", 0.1, None, None, None, 3, 3), Outcome.CONTENDED, None, False),
        # Another session was declaring the semaphore at that moment: its N is known at the next try.
        ((None, None, None, None, None, None, None, 0), Outcome.CONTENDED, None, True),
    ],
)
def test_read_a_permit_acquire(
    row: tuple[object, ...], outcome: Outcome, permit_row: str | None, retry_at_once: bool
) -> None:
    reply = read_acquire(row, ME, 3)
    assert reply.result.outcome is outcome
    assert reply.row_name == permit_row
    assert reply.retry_at_once(3) is retry_at_once


def test_a_mutexs_acquire_is_read_as_before() -> None:
    reply = read_acquire((True, None, None, NOW, 7), ME, None)
    assert (reply.result.outcome, reply.row_name, reply.stored_permits) == (Outcome.ACQUIRED, None, None)
    assert reply.retry_at_once(None) is False


def test_a_table_without_tokens_acquires_without_one() -> None:
    result = interpret_acquire((True, None, None, NOW, None), ME)
    assert result.outcome is Outcome.ACQUIRED
    assert result.token is None


@pytest.mark.parametrize(
    "row", [None, (True, None, None, NOW), (True, None, None, None, None), (True, None, None, NOW, "7")]
)
def test_interpret_acquire_refuses_a_malformed_row(row: tuple[object, ...] | None) -> None:
    with pytest.raises(ValueError, match="unexpected"):
        interpret_acquire(row, ME)


def test_alert_gate_fires_once_per_stale_episode() -> None:
    gate = AlertGate(30.0)
    assert not gate.should_alert("a", 29.9)
    assert gate.should_alert("a", 30.0)
    assert not gate.should_alert("a", 45.0), "same episode: once"
    assert gate.should_alert("b", 31.0), "another holder: a new episode"
    assert not gate.should_alert("b", 1.0), "heartbeat resumed: episode over"
    assert gate.should_alert("b", 30.5), "silent again: a new episode"
    assert not gate.should_alert(None, None)


def test_a_lease_too_short_to_retry_a_heartbeat_is_refused() -> None:
    with pytest.raises(ValueError, match="stale_threshold"):
        Timing.validate(
            heartbeat_interval=1, alert_threshold=1.5, stale_threshold=1.8, poll_interval=1, operation_timeout=1
        )


def test_a_busy_pool_is_transient_even_before_the_first_connection() -> None:
    from psycopg_pool import PoolTimeout

    error = _classify(PoolTimeout("couldn't get a connection after 1.0 sec"), sent=False, connect_retryable=False)
    assert error.transient
    assert "no pooled connection" in str(error)


def test_a_read_only_server_is_transient() -> None:
    error = _classify(psycopg.errors.ReadOnlySqlTransaction("cannot execute INSERT in a read-only transaction"))
    assert error.transient


def test_the_lease_ends_one_heartbeat_before_the_stale_threshold() -> None:
    timing = Timing.validate(
        heartbeat_interval=10, alert_threshold=30, stale_threshold=600, poll_interval=0.5, operation_timeout=5
    )
    assert timing.lease == 590
    assert timing.alert_threshold < timing.lease < timing.stale_threshold


def _classify(exc: BaseException, **overrides: bool) -> DatabaseError:
    options = {"sent": True, "timed_out": False, "connection_lost": False, "connect_retryable": True}
    options.update(overrides)
    return classify_failure(exc, action="acquire of lock 'x'", table="mutex_lock", redact=str, **options)


def test_a_deadline_is_an_operation_timeout_with_an_unknown_outcome() -> None:
    error = _classify(psycopg.OperationalError("consuming input failed"), timed_out=True, connection_lost=True)
    assert isinstance(error, OperationTimeout)
    assert isinstance(error, TimeoutError)
    assert error.transient
    assert error.outcome_unknown


def test_a_server_error_has_a_known_outcome() -> None:
    error = _classify(psycopg.errors.SerializationFailure("could not serialize"))
    assert error.transient
    assert not error.outcome_unknown


def test_a_failure_before_sending_has_a_known_outcome() -> None:
    error = _classify(psycopg.OperationalError("connection refused"), sent=False, connect_retryable=False)
    assert "could not connect" in str(error)
    assert not error.outcome_unknown
    assert not error.transient, "never connected: the DSN itself may be wrong"
    assert _classify(psycopg.OperationalError("refused"), sent=False).transient, "connected before: a blip"


@pytest.mark.parametrize(
    ("exc", "message"),
    [
        (psycopg.errors.UndefinedTable("relation does not exist"), "does not exist"),
        (psycopg.errors.InsufficientPrivilege("permission denied"), "may not use"),
    ],
)
def test_schema_problems_are_schema_errors(exc: psycopg.Error, message: str) -> None:
    error = _classify(exc)
    assert isinstance(error, SchemaError)
    assert message in str(error)
    assert not error.transient


def test_an_admin_shutdown_is_transient() -> None:
    error = _classify(psycopg.errors.AdminShutdown("terminating connection"), connection_lost=True)
    assert error.transient
    assert error.outcome_unknown


def test_redactor_masks_passwords_in_any_shape() -> None:
    redact = Redactor("postgresql://u:pa55@h/db").redact
    assert redact('invalid token: "pa55"') == 'invalid token: "***"'
    assert redact("postgres://x:other@h/db") == "postgres://x:***@h/db"
    assert redact("host=h password='a b' user=u") == "host=h password=*** user=u"
    assert Redactor(None).redact("nothing secret") == "nothing secret"


def test_a_holders_row_says_what_it_holds_by_its_name() -> None:
    rows = [
        (name, "holder", 1.0, 2.0, None, 7, None, None, None)
        for name in ("job", "partner-api\x1f2", "catalogue\x1fr0123456789ab", "catalogue\x1fw")
    ]
    seen = observe(rows, alert_threshold=30.0, stale_threshold=600.0)
    assert [(s.lock_name, s.semaphore, s.permit, s.rwlock, s.mode) for s in seen] == [
        ("job", None, None, None, None),
        ("partner-api\x1f2", "partner-api", 2, None, None),
        ("catalogue\x1fr0123456789ab", None, None, "catalogue", "read"),
        ("catalogue\x1fw", None, None, "catalogue", "write"),
    ]


def test_a_fair_semaphore_waits_for_free_permits_left_to_waiters_ahead() -> None:
    # Two permits free and none won: in fair mode, waiters ahead of this one are owed them.
    left_to_others = read_acquire((None, "host-other", 0.1, None, None, None, 3, 1), ME, 3)
    assert Permits(3).again_at_once(left_to_others) is True
    assert FairPermits(3).again_at_once(left_to_others) is False
    # The semaphore's N was being declared: known at the next try, fair or not.
    declaring = read_acquire((None, None, None, None, None, None, None, 0), ME, 3)
    assert FairPermits(3).again_at_once(declaring) is True
