"""dsn mode: the DSN goes to libpq untouched, so every libpq convention works."""

from __future__ import annotations

import os
import re
import socket
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from postgres_mutex import LockTable, Mutex
from tests.support.fixtures import wait_until
from tests.support.postgres_server import PASSWORD, PASSWORD_ROLE, PostgresServer


@pytest.fixture
def clean_pg_env(monkeypatch: pytest.MonkeyPatch, admin: psycopg.Connection[Any]) -> None:
    """No PG* variable leaks in from the developer's shell (and the table exists)."""
    for name in ("PGHOST", "PGPORT", "PGUSER", "PGDATABASE", "PGPASSWORD", "PGPASSFILE", "PGAPPNAME", "PGSERVICE"):
        monkeypatch.delenv(name, raising=False)


def _works(mutex: Mutex) -> None:
    with mutex.acquire() as acquired:
        assert acquired
        assert mutex.held
    mutex.close()


def test_uri_and_keyword_dsns(pg: PostgresServer, lock_name: str, clean_pg_env: None) -> None:
    credentials = pg.user + (f":{pg.password}" if pg.password else "")
    _works(Mutex(f"postgresql://{credentials}@{pg.host}:{pg.port}/{pg.dbname}?sslmode=disable", lock_name))
    _works(Mutex(pg.dsn(), lock_name))


def test_a_partial_dsn_is_completed_from_pg_environment_variables(
    pg: PostgresServer, lock_name: str, clean_pg_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PGHOST", pg.host)
    monkeypatch.setenv("PGPORT", str(pg.port))
    monkeypatch.setenv("PGUSER", pg.user)
    monkeypatch.setenv("PGDATABASE", pg.dbname)
    if pg.password:
        monkeypatch.setenv("PGPASSWORD", pg.password)
    _works(Mutex("", lock_name))
    _works(Mutex("sslmode=disable", lock_name))


def test_no_dsn_and_no_pool_connects_as_the_pg_environment_says(
    pg: PostgresServer, lock_name: str, clean_pg_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PGHOST", pg.host)
    monkeypatch.setenv("PGPORT", str(pg.port))
    monkeypatch.setenv("PGUSER", pg.user)
    monkeypatch.setenv("PGDATABASE", pg.dbname)
    if pg.password:
        monkeypatch.setenv("PGPASSWORD", pg.password)
    _works(Mutex(lock_name=lock_name))
    assert isinstance(LockTable().holders(), list), "a LockTable reads the same environment"


@pytest.fixture
def password_role(admin: psycopg.Connection[Any], needs_superuser: None) -> Iterator[str]:
    admin.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON mutex_lock TO {PASSWORD_ROLE}")
    admin.execute(f"GRANT USAGE ON SEQUENCE mutex_lock_token_seq TO {PASSWORD_ROLE}")
    yield PASSWORD_ROLE
    admin.execute(f"REVOKE ALL ON mutex_lock FROM {PASSWORD_ROLE}")


def test_a_password_from_pgpass(
    pg: PostgresServer,
    lock_name: str,
    password_role: str,
    tmp_path: Path,
    clean_pg_env: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pgpass = tmp_path / "pgpass"
    pgpass.write_text(f"{pg.host}:{pg.port}:*:{password_role}:{PASSWORD}\n")
    pgpass.chmod(0o600)
    monkeypatch.setenv("PGPASSFILE", str(pgpass))
    _works(Mutex(f"host={pg.host} port={pg.port} user={password_role} dbname={pg.dbname}", lock_name))


def test_the_clients_connections_are_named_after_the_process_in_pg_stat_activity(
    make_mutex: Callable[..., Mutex], admin: psycopg.Connection[Any]
) -> None:
    mutex = make_mutex()
    name = f"postgres-mutex {socket.gethostname()}:{os.getpid()}"
    with mutex.acquire():
        found = admin.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (name,)).fetchone()
        assert found is not None
        assert found[0] >= 1, "a DBA finds the library's sessions and whose they are"


def test_the_dsn_application_name_wins(pg: PostgresServer, admin: psycopg.Connection[Any], lock_name: str) -> None:
    name = f"my-app-{uuid.uuid4().hex[:6]}"
    mutex = Mutex(pg.dsn(application_name=name), lock_name)
    with mutex.acquire():
        found = admin.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (name,)).fetchone()
        assert found == (1,)
    mutex.close()


def test_the_connection_is_opened_lazily_and_closed_by_the_last_close(
    pg: PostgresServer, admin: psycopg.Connection[Any], lock_name: str
) -> None:
    name = f"lazy-{uuid.uuid4().hex[:6]}"
    dsn = pg.dsn(application_name=name)

    def connections() -> int:
        found = admin.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (name,)).fetchone()
        assert found is not None
        return int(found[0])

    first, second = Mutex(dsn, lock_name), Mutex(dsn, lock_name + "-2")
    assert connections() == 0
    with first.acquire(), second.acquire():
        assert connections() == 1, "two Mutexes of one process share one connection"
    first.close()
    assert connections() == 1, "still used by the other Mutex"
    second.close()
    wait_until(lambda: connections() == 0)  # the server ends the session a moment after Terminate


def test_an_unreachable_server_is_a_clear_error_and_not_retried_forever(lock_name: str) -> None:
    from postgres_mutex import DatabaseError
    from tests.support.postgres_server import free_port

    mutex = Mutex(f"host=127.0.0.1 port={free_port()} user=x dbname=y connect_timeout=2", lock_name)
    with pytest.raises(DatabaseError, match="could not connect") as caught, mutex.acquire(blocking=True):
        pytest.fail("must not run")
    assert not caught.value.transient, "a Mutex that never connected does not wait for a server that may not exist"


def test_the_runbooks_query_finds_the_holders_connections(
    make_mutex: Callable[..., Mutex], admin: psycopg.Connection[Any]
) -> None:
    """On-call follows exporters/README.md's runbook from the alert's holder to its sessions."""
    runbook = (Path(__file__).resolve().parents[2] / "exporters" / "README.md").read_text(encoding="utf-8")
    found = re.search(r"`(SELECT [^`]*FROM pg_stat_activity[^`]*)`", runbook.replace("\n", " "))
    assert found, "the runbook shows how to find a holder's sessions in pg_stat_activity"
    mutex = make_mutex()
    host = socket.gethostname()
    with mutex.acquire():
        rows = admin.execute(found[1].replace("<hostname>", host)).fetchall()
    names = [row[1] for row in rows]
    assert f"postgres-mutex {host}:{os.getpid()}" in names, f"the holder's own process is among {names}"
