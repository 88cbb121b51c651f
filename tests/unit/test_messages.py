"""Messages built from psycopg's failures: what they name, in words a user can act on."""

from __future__ import annotations

import psycopg
import pytest

from postgres_mutex._state.failures import classify_failure


def test_a_host_from_pghost_that_does_not_resolve_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    # psycopg's words when the host came from PGHOST rather than the DSN.
    failure = psycopg.OperationalError("failed to resolve host None: [Errno -2] Name or service not known")
    monkeypatch.setenv("PGHOST", "db.example.invalid")
    error = classify_failure(
        failure,
        action="lookup of table mutex_lock",
        table="mutex_lock",
        sent=False,
        timed_out=False,
        connection_lost=True,
        connect_retryable=False,
        redact=lambda text: text,
    )
    assert str(error) == (
        "lookup of table mutex_lock failed: could not connect to PostgreSQL (failed to resolve host "
        "'db.example.invalid' (from PGHOST): [Errno -2] Name or service not known)"
    )
