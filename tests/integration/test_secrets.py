"""A DSN's password never appears in a repr, a message, a log record or a traceback."""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from postgres_mutex import DatabaseError, Election, LockTable, Mutex, MutexClient
from postgres_mutex._base.secrets import Redactor
from tests.support.fixtures import FAST, RecordingMetrics
from tests.support.postgres_server import PASSWORD, PASSWORD_ROLE, PostgresServer, free_port

SECRET = "Hunter2-is-not-a-password"


def everything_said(exc: BaseException) -> str:
    """What the error shows, and what code can reach from it: every error it chains, shown or not."""
    said, seen = [], set()
    todo: list[BaseException | None] = [exc]
    while todo:
        each = todo.pop()
        if each is None or id(each) in seen:
            continue
        seen.add(id(each))
        said += ["".join(traceback.format_exception(each)), repr(each), str(each), repr(vars(each))]
        todo += [each.__cause__, each.__context__]
    return "".join(said)


@pytest.mark.parametrize(
    "dsn",
    [
        f"postgresql://app:{SECRET}@127.0.0.1:1/db",
        f"host=127.0.0.1 port=1 user=app password={SECRET} dbname=db",
        f"host=127.0.0.1 port=1 user=app password='{SECRET}' dbname=db",
    ],
)
def test_repr_and_str_never_show_the_dsn(dsn: str) -> None:
    mutex = Mutex(dsn, "job")
    assert SECRET not in repr(mutex)
    assert SECRET not in str(mutex)
    assert SECRET not in repr(vars(mutex))


@pytest.mark.parametrize(
    "dsn",
    [
        f"postgresql://app:{SECRET}%zz@127.0.0.1/db",  # invalid percent-encoding: libpq quotes the token
        f"host=127.0.0.1 password={SECRET} garbage",  # libpq quotes what follows
        f"postgresql://app:{SECRET}@127.0.0.1/db?nonsense=1",
        f"host=127.0.0.1 password=Hunter2 {SECRET}",  # an unquoted space: libpq quotes the tail
    ],
)
def test_a_malformed_dsn_error_does_not_quote_the_password(dsn: str) -> None:
    with pytest.raises(ValueError, match="dsn is not a valid connection string") as caught:
        Mutex(dsn, "job")
    assert SECRET not in everything_said(caught.value)


@pytest.mark.parametrize(
    "dsn",
    [
        f"postgresql://app:{SECRET}@[::1/db",  # an unclosed IPv6 bracket: libpq quotes the host part
        f"postgresql://app:{SECRET}%zz@127.0.0.1/db",
    ],
)
@pytest.mark.parametrize("entry", ["Mutex", "MutexClient", "LockTable", "Election"])
def test_nothing_reachable_from_a_malformed_dsn_error_holds_the_password(dsn: str, entry: str) -> None:
    make: dict[str, Callable[[], object]] = {
        "Mutex": lambda: Mutex(dsn, "job"),
        "MutexClient": lambda: MutexClient(dsn),
        "LockTable": lambda: LockTable(dsn),
        "Election": lambda: Election(dsn, "leader"),
    }
    with pytest.raises(ValueError, match="dsn is not a valid connection string") as caught:
        make[entry]()
    assert caught.value.__context__ is None
    assert SECRET not in everything_said(caught.value)


@pytest.mark.parametrize("password", ["e", "ab", "nnec"])
def test_a_short_password_is_masked_where_it_appears_and_nowhere_else(password: str) -> None:
    redact = Redactor(f"host=h user=u password={password} dbname=d").redact
    assert redact("connection failed: server closed the connection") == (
        "connection failed: server closed the connection"
    ), "ordinary words are not garbled, and their letters give nothing away"
    assert redact(f"host=h user=u password={password} dbname=d") == "host=h user=u password=*** dbname=d"
    assert redact(f"postgresql://u:{password}@h/d") == "postgresql://u:***@h/d"
    assert redact(f'invalid value: "{password}"') == 'invalid value: "***"'


def test_connection_failures_never_show_the_password(
    lock_name: str, caplog: pytest.LogCaptureFixture, metrics: RecordingMetrics
) -> None:
    dsn = f"postgresql://app:{SECRET}@127.0.0.1:{free_port()}/db?connect_timeout=2"
    mutex = Mutex(dsn, lock_name, metrics=metrics, **FAST)  # type: ignore[arg-type]
    with caplog.at_level(logging.DEBUG), pytest.raises(DatabaseError) as caught, mutex.acquire():
        pytest.fail("must not run")
    with pytest.raises(DatabaseError) as on_schema:
        mutex.create_schema()
    for error in (caught.value, on_schema.value):
        assert SECRET not in everything_said(error)
    assert SECRET not in caplog.text
    assert SECRET not in repr(metrics.calls)


@pytest.fixture
def password_server(pg: PostgresServer, admin: psycopg.Connection[Any], needs_superuser: None) -> Iterator[str]:
    admin.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON mutex_lock TO {PASSWORD_ROLE}")
    admin.execute(f"GRANT USAGE ON SEQUENCE mutex_lock_token_seq TO {PASSWORD_ROLE}")
    yield f"postgresql://{PASSWORD_ROLE}:{PASSWORD}@{pg.host}:{pg.port}/{pg.dbname}"
    admin.execute(f"REVOKE ALL ON mutex_lock FROM {PASSWORD_ROLE}")


def test_a_wrong_password_is_reported_without_either_password(password_server: str, lock_name: str) -> None:
    wrong = password_server.replace(PASSWORD, SECRET)
    mutex = Mutex(wrong, lock_name)
    with pytest.raises(DatabaseError, match="password authentication failed") as caught, mutex.acquire():
        pytest.fail("must not run")
    said = everything_said(caught.value)
    assert SECRET not in said
    assert PASSWORD not in said


def test_everything_a_holder_logs_and_raises_is_free_of_its_password(
    password_server: str, lock_name: str, admin: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    from postgres_mutex import LockNotHeldError

    mutex = Mutex(password_server, lock_name, **FAST)  # type: ignore[arg-type]
    with caplog.at_level(logging.DEBUG), pytest.raises(LockNotHeldError) as caught, mutex.acquire():
        assert mutex.held
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
            (f"postgres-mutex {mutex.instance_id}",),
        )
        admin.execute("DELETE FROM mutex_lock WHERE lock_name = %s", (lock_name,))
        deadline = __import__("time").monotonic() + 10
        while mutex.held and __import__("time").monotonic() < deadline:
            __import__("time").sleep(0.02)
    assert "lost lock" in caplog.text
    assert PASSWORD not in caplog.text
    assert PASSWORD not in everything_said(caught.value)
    assert PASSWORD not in repr(mutex)
    mutex.close()
