"""The table is exactly the README's; creating it is idempotent and safe to race; roles need only DML."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from postgres_mutex import LockTable, Mutex, MutexClient, RWLock, SchemaError, Semaphore
from tests.support.fixtures import FAST, frozen_holder
from tests.support.postgres_server import PASSWORD, PostgresServer


def fresh_table() -> str:
    return f"locks_{uuid.uuid4().hex[:10]}"


def test_the_default_table_matches_the_readme(admin: psycopg.Connection[Any]) -> None:
    columns = admin.execute(
        """SELECT column_name, data_type, character_maximum_length, is_nullable, column_default
             FROM information_schema.columns WHERE table_name = 'mutex_lock' ORDER BY ordinal_position"""
    ).fetchall()
    assert columns == [
        ("lock_name", "character varying", 64, "NO", None),
        ("locked", "integer", None, "NO", "1"),
        ("instance_id", "character varying", 64, "NO", None),
        ("last_heartbeat", "timestamp with time zone", None, "NO", None),
        ("acquired_at", "timestamp with time zone", None, "NO", None),
        ("token", "bigint", None, "YES", "nextval('mutex_lock_token_seq'::regclass)"),
        # A holder's session, for reclaim_disconnected_after: NULL for every other holder.
        ("session_key", "bigint", None, "YES", None),
        ("session_hold", "timestamp with time zone", None, "YES", None),
        ("reclaim_after", "double precision", None, "YES", None),
        # A semaphore's permit: NULL in a mutex's row.
        ("semaphore", "character varying", 64, "YES", None),
        ("permit", "integer", None, "YES", None),
        ("permits", "integer", None, "YES", None),
        # A read/write lock's row: its lock and mode, NULL in a mutex's or a permit's row.
        ("rwlock", "character varying", 64, "YES", None),
        ("rw_mode", "text", None, "YES", None),
        # A minimum hold's end (hold_at_least): NULL for every other hold.
        ("hold_until", "timestamp with time zone", None, "YES", None),
        # The lease a mutex's row follows (its holder's heartbeat group's): NULL for every other row.
        ("lease_key", "bigint", None, "YES", None),
    ]
    constraints = admin.execute(
        """SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint
            WHERE conrelid = 'mutex_lock'::regclass AND contype IN ('u', 'c') ORDER BY conname"""
    ).fetchall()
    assert constraints == [
        ("chk_locked", "CHECK ((locked = 1))"),
        (
            "mutex_lock_permit_in_range",
            "CHECK ((((semaphore IS NULL) = (permit IS NULL)) AND ((semaphore IS NULL) = (permits IS NULL)) "
            "AND (permit >= 0) AND (permit < permits)))",
        ),
        (
            "mutex_lock_rw_paired",
            "CHECK ((((rwlock IS NULL) = (rw_mode IS NULL)) AND ((rwlock IS NULL) OR (semaphore IS NULL))))",
        ),
        ("uq_mutex_lock", "UNIQUE (locked, lock_name)"),
    ]
    # The token column is uniquely indexed (what lets a fence block a reclaim but not a heartbeat),
    # and its sequence hands out tokens in the order sessions draw them.
    (index,) = admin.execute(
        "SELECT indexdef FROM pg_indexes WHERE tablename = 'mutex_lock' AND indexname = 'mutex_lock_token_key'"
    ).fetchone() or (None,)
    assert index is not None
    assert "UNIQUE INDEX" in index
    assert "(token)" in index
    assert admin.execute(
        "SELECT seqcache, seqcycle FROM pg_sequence WHERE seqrelid = 'mutex_lock_token_seq'::regclass"
    ).fetchone() == (1, False)


def test_the_table_allows_one_row_per_lock(admin: psycopg.Connection[Any], lock_name: str) -> None:
    insert = (
        "INSERT INTO mutex_lock (lock_name, locked, instance_id, last_heartbeat, acquired_at) "
        "VALUES (%s, %s, 'x', now(), now())"
    )
    admin.execute(insert, (lock_name, 1))
    with pytest.raises(psycopg.errors.UniqueViolation):
        admin.execute(insert, (lock_name, 1))
    with pytest.raises(psycopg.errors.CheckViolation):
        admin.execute(insert, (lock_name, 2))
    admin.execute("DELETE FROM mutex_lock WHERE lock_name = %s", (lock_name,))


def test_create_schema_is_safe_when_many_instances_start_at_once(dsn: str, admin: psycopg.Connection[Any]) -> None:
    table = fresh_table()
    # A client each, as separate processes would have, each connected before the race.
    clients = [MutexClient(dsn) for _ in range(8)]
    tables = [client.table(table) for client in clients]
    for each in tables:
        assert not each.has_tokens()  # so the threads race on CREATE, not on connecting
    barrier = threading.Barrier(len(tables))
    errors: list[BaseException] = []

    def create(each: LockTable) -> None:
        barrier.wait(timeout=10)
        try:
            each.create()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=create, args=(each,)) for each in tables]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert errors == []
    with clients[0].mutex("job", table=table).acquire() as acquired:
        assert acquired
    for client in clients:
        client.close()
    admin.execute(f'DROP TABLE "{table}"')


def test_create_schema_is_idempotent(make_mutex: Callable[..., Mutex]) -> None:
    mutex = make_mutex()
    mutex.create_schema()
    mutex.create_schema()
    with mutex.acquire() as acquired:
        assert acquired


async def test_create_schema_async(amake_mutex: Callable[..., Mutex], admin: psycopg.Connection[Any]) -> None:
    table = fresh_table()
    mutex = amake_mutex(table=table)
    await mutex.create_schema_async()
    await mutex.create_schema_async()
    async with mutex.acquire_async() as acquired:
        assert acquired
    await mutex.aclose()
    admin.execute(f'DROP TABLE "{table}"')


def test_a_schema_qualified_table(
    make_mutex: Callable[..., Mutex], admin: psycopg.Connection[Any], lock_name: str
) -> None:
    schema = f"ops_{uuid.uuid4().hex[:8]}"
    admin.execute(f'CREATE SCHEMA "{schema}"')
    mutex = make_mutex(table=f"{schema}.mutex_lock")
    mutex.create_schema()
    with mutex.acquire():
        found = admin.execute(
            sql.SQL("SELECT instance_id FROM {} WHERE lock_name = %s").format(sql.Identifier(schema, "mutex_lock")),
            (lock_name,),
        ).fetchone()
        assert found == (mutex.instance_id,)
    admin.execute(f'DROP SCHEMA "{schema}" CASCADE')


def test_two_lock_tables_can_share_a_schema(make_mutex: Callable[..., Mutex], admin: psycopg.Connection[Any]) -> None:
    table = fresh_table()
    mutex, default = make_mutex(table=table), make_mutex()
    mutex.create_schema()
    with mutex.acquire() as first, default.acquire() as second:
        assert (first, second) == (True, True), "same lock name, different tables: two different locks"
    admin.execute(f'DROP TABLE "{table}"')


@pytest.mark.parametrize("length", [61, 62, 63])
def test_a_table_name_of_up_to_63_bytes_works_with_tokens_and_history(
    make_mutex: Callable[..., Mutex], admin: psycopg.Connection[Any], dsn: str, length: int
) -> None:
    # PostgreSQL's limit; the names derived from the table (sequence, history, indexes) must fit too.
    table = fresh_table().ljust(length, "x")
    try:
        with MutexClient(dsn) as client:
            client.table(table).create(history=True)
            mutex = make_mutex(table=table)
            with mutex.acquire() as acquired:
                assert acquired
                first = mutex.token
                mutex.heartbeat()
            with mutex.acquire():
                assert mutex.token is not None
                assert first is not None
                assert mutex.token > first
            assert len(client.table(table).history()) == 2
    finally:
        _drop_everything_named(admin, table[:16])


def test_two_long_table_names_sharing_a_prefix_get_names_of_their_own(dsn: str, admin: psycopg.Connection[Any]) -> None:
    prefix = fresh_table().ljust(60, "x")
    tables = [f"{prefix}_a", f"{prefix}_b"]
    try:
        with MutexClient(dsn) as client:
            for table in tables:
                client.table(table).create(history=True)
            for table in tables:
                assert client.table(table).has_tokens()
    finally:
        _drop_everything_named(admin, prefix[:16])


def _drop_everything_named(admin: psycopg.Connection[Any], prefix: str) -> None:
    """Drop the tables and sequences whose names start with ``prefix`` (a test's own)."""
    for kind, what in (("r", "TABLE"), ("S", "SEQUENCE")):
        for (name,) in admin.execute(
            "SELECT relname FROM pg_class WHERE relname LIKE %s AND relkind = %s", (f"{prefix}%", kind)
        ).fetchall():
            admin.execute(sql.SQL(f"DROP {what} IF EXISTS {{}} CASCADE").format(sql.Identifier(name)))


def test_a_missing_table_is_a_clear_error(make_mutex: Callable[..., Mutex]) -> None:
    mutex = make_mutex(table="no_such_table")
    with pytest.raises(SchemaError, match=r"no_such_table does not exist.*create_schema"), mutex.acquire():
        pass
    assert not mutex.held


def test_create_schema_in_a_missing_schema_is_a_clear_error(make_mutex: Callable[..., Mutex]) -> None:
    mutex = make_mutex(table="no_such_schema.mutex_lock")
    with pytest.raises(SchemaError, match="schema does not exist"):
        mutex.create_schema()


def test_a_role_with_only_dml_privileges_can_do_everything_but_create(
    dml_role: str, lock_name: str, admin: psycopg.Connection[Any]
) -> None:
    holder = Mutex(dml_role, lock_name, **FAST)  # type: ignore[arg-type]
    rival = Mutex(dml_role, lock_name, **FAST)  # type: ignore[arg-type]
    with holder.acquire() as acquired:
        assert acquired
        holder.heartbeat()
        with rival.acquire() as second:
            assert not second
    with frozen_holder(holder), rival.acquire(blocking=True, timeout=10) as reclaimed:
        assert reclaimed
    holder.create_schema()  # the table exists: nothing to create, nothing refused
    with pytest.raises(SchemaError, match="may not create it") as caught:
        Mutex(dml_role, lock_name, table=fresh_table()).create_schema()
    assert caught.value.sqlstate == "42501"
    holder.close()
    rival.close()


def test_migrate_on_a_migrated_table_is_nothing_to_do_even_for_a_role_that_may_not_change_it(dml_role: str) -> None:
    assert LockTable(dml_role).migrate() is False, "nothing changed, nothing refused"
    result = subprocess.run(
        [sys.executable, "-m", "postgres_mutex", "migrate", "--dsn", dml_role],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, "table mutex_lock already had fencing tokens\n", "")


FAST_OPTIONS: dict[str, Any] = dict(FAST)


@pytest.mark.parametrize(
    ("revoke", "make", "said"),
    [
        (
            "REVOKE ALL ON mutex_lock_semaphores FROM {role}",
            lambda dsn, name: Semaphore(dsn, name, permits=2, **FAST_OPTIONS),
            "the role may not use table mutex_lock_semaphores (permission denied for table mutex_lock_semaphores); "
            "grant SELECT, INSERT (and UPDATE, to change a semaphore's permits) on it, as the README shows",
        ),
        (
            "REVOKE ALL ON SEQUENCE mutex_lock_token_seq FROM {role}",
            lambda dsn, name: Mutex(dsn, name, **FAST_OPTIONS),
            "the role may not use sequence mutex_lock_token_seq (permission denied for sequence mutex_lock_token_seq); "
            "grant USAGE on it, as the README shows",
        ),
    ],
    ids=["semaphores", "sequence"],
)
def test_a_missing_grant_names_the_object_the_server_refused_and_the_grant_it_needs(
    dml_role: str,
    admin: psycopg.Connection[Any],
    lock_name: str,
    revoke: str,
    make: Callable[[str, str], Mutex | Semaphore],
    said: str,
) -> None:
    admin.execute(revoke.format(role=conninfo_to_dict(dml_role)["user"]))
    primitive = make(dml_role, lock_name)
    try:
        with pytest.raises(SchemaError) as caught, primitive.acquire():
            pass
    finally:
        primitive.close()
    assert str(caught.value).endswith(said)


def test_a_role_with_only_dml_privileges_can_use_a_read_write_lock(dml_role: str, lock_name: str) -> None:
    # The README's grants cover the read/write locks' gates, which every acquire may insert or update.
    options: dict[str, Any] = dict(FAST)
    writer = RWLock(dml_role, lock_name, **options)
    reader = RWLock(dml_role, lock_name, **options)
    try:
        with writer.write() as wrote:
            assert wrote
        with reader.read() as read:
            assert read
    finally:
        writer.close()
        reader.close()


def test_a_role_without_privileges_gets_a_clear_error(
    pg: PostgresServer, admin: psycopg.Connection[Any], needs_superuser: None, lock_name: str
) -> None:
    role = f"mutex_nobody_{uuid.uuid4().hex[:8]}"
    admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{PASSWORD}'")
    try:
        mutex = Mutex(pg.dsn(user=role, password=PASSWORD), lock_name)
        with (
            pytest.raises(
                SchemaError, match=r"may not use the lock table mutex_lock.*grant SELECT, INSERT, UPDATE, DELETE"
            ),
            mutex.acquire(),
        ):
            pass
        mutex.close()
    finally:
        admin.execute(f"DROP ROLE {role}")


# -- the functions of the common acquire and release (`_sql.functions`) ---------------------------------


def _functions(admin: psycopg.Connection[Any], table: str) -> list[str]:
    """The functions made with ``table``: its common acquire's and its release's choice of whom to wake."""
    rows = admin.execute(
        "SELECT proname FROM pg_proc WHERE proname = ANY(%s) ORDER BY proname", ([f"{table}_acquire", f"{table}_wake"],)
    ).fetchall()
    return [name for (name,) in rows]


@pytest.fixture
def own_table(admin: psycopg.Connection[Any]) -> Iterator[str]:
    """A lock table's name of the test's own; after it, the table and the functions made with it are dropped."""
    table = fresh_table()
    yield table
    admin.execute(f'DROP TABLE IF EXISTS "{table}" CASCADE')
    admin.execute(f'DROP FUNCTION IF EXISTS "{table}_acquire", "{table}_wake"')


def _contend_and_reclaim(monkeypatch: pytest.MonkeyPatch, dsn: str, lock_name: str, table: str = "mutex_lock") -> None:
    """What a lock does on the table, whichever way its statements reach it: held, refused to a rival, reclaimed;
    and none of its statements refused by the server on the way (a refused one is retried, and costs a round trip)."""
    refused: list[str] = []
    execute = psycopg.Cursor.execute

    def counting(self: psycopg.Cursor[Any], query: Any, params: Any = None, **kwargs: Any) -> Any:
        try:
            return execute(self, query, params, **kwargs)
        except psycopg.DatabaseError as exc:
            refused.append(str(exc))
            raise

    monkeypatch.setattr(psycopg.Cursor, "execute", counting)
    holder = Mutex(dsn, lock_name, table=table, **FAST)  # type: ignore[arg-type]
    rival = Mutex(dsn, lock_name, table=table, **FAST)  # type: ignore[arg-type]
    try:
        with holder.acquire() as acquired:
            assert acquired
            with rival.acquire() as second:
                assert not second
        with rival.acquire() as after_release:
            assert after_release
        with frozen_holder(holder), rival.acquire(blocking=True, timeout=10) as reclaimed:
            assert reclaimed
    finally:
        holder.close()
        rival.close()
    assert refused == []


def test_create_schema_makes_the_functions_of_the_common_acquire_and_release(
    dsn: str, admin: psycopg.Connection[Any], lock_name: str, monkeypatch: pytest.MonkeyPatch, own_table: str
) -> None:
    LockTable(dsn, table=own_table).create()
    assert _functions(admin, own_table) == [f"{own_table}_acquire", f"{own_table}_wake"]
    _contend_and_reclaim(monkeypatch, dsn, lock_name, own_table)


def test_a_role_that_may_not_execute_the_functions_locks_with_the_statements_they_stand_for(
    dml_role: str, lock_name: str, admin: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Some databases revoke EXECUTE from PUBLIC by default; a role granted only the README's DML still locks.
    functions = "mutex_lock_acquire(text, text, float8, bigint), mutex_lock_wake(text, int, text)"
    admin.execute(f"REVOKE EXECUTE ON FUNCTION {functions} FROM PUBLIC")
    try:
        _contend_and_reclaim(monkeypatch, dml_role, lock_name)
    finally:
        admin.execute(f"GRANT EXECUTE ON FUNCTION {functions} TO PUBLIC")


def test_migrate_makes_the_functions_a_table_lacks(
    dsn: str, admin: psycopg.Connection[Any], lock_name: str, monkeypatch: pytest.MonkeyPatch, own_table: str
) -> None:
    table = own_table
    LockTable(dsn, table=table).create()
    admin.execute(f'DROP FUNCTION "{table}_acquire", "{table}_wake"')
    _contend_and_reclaim(monkeypatch, dsn, lock_name, table)  # without them: the statements
    assert LockTable(dsn, table=table).migrate() is True
    assert _functions(admin, table) == [f"{table}_acquire", f"{table}_wake"]
    assert LockTable(dsn, table=table).migrate() is False
    _contend_and_reclaim(monkeypatch, dsn, lock_name, table)


def test_functions_left_by_a_dropped_table_are_not_called_for_an_older_table_of_its_name(
    dsn: str, admin: psycopg.Connection[Any], lock_name: str, monkeypatch: pytest.MonkeyPatch, own_table: str
) -> None:
    table = own_table
    LockTable(dsn, table=table).create()
    # Dropped (the functions stay: nothing ties them to it) and made again with tokens but none of the later
    # columns, as a table migrated by an earlier release: the functions' bodies would read columns it lacks.
    admin.execute(f'DROP TABLE "{table}" CASCADE')
    admin.execute(
        f"""CREATE SEQUENCE "{table}_token_seq" AS bigint;
CREATE TABLE "{table}" (
  lock_name      VARCHAR(64) NOT NULL,
  locked         INT NOT NULL DEFAULT 1,
  instance_id    VARCHAR(64) NOT NULL,
  last_heartbeat TIMESTAMPTZ NOT NULL,
  acquired_at    TIMESTAMPTZ NOT NULL,
  token          BIGINT DEFAULT nextval('"{table}_token_seq"'),
  CONSTRAINT "uq_{table}" UNIQUE (locked, lock_name),
  CHECK (locked = 1)
);
CREATE UNIQUE INDEX "{table}_token_key" ON "{table}" (token)"""
    )
    assert _functions(admin, table) == [f"{table}_acquire", f"{table}_wake"]
    _contend_and_reclaim(monkeypatch, dsn, lock_name, table)


def test_functions_another_role_made_first_are_never_called(
    dsn: str,
    admin: psycopg.Connection[Any],
    lock_name: str,
    monkeypatch: pytest.MonkeyPatch,
    needs_superuser: None,
    own_table: str,
) -> None:
    # A role that may create in the schema makes the functions before the table's owner does: a client must not
    # trust an answer of theirs (this one says every acquire won), and the owner's making them finds them there.
    table, role = own_table, f"mutex_squatter_{uuid.uuid4().hex[:8]}"
    admin.execute(f"CREATE ROLE {role}; GRANT CREATE ON SCHEMA public TO {role}")
    try:
        admin.execute(f"SET ROLE {role}")
        admin.execute(
            f'''CREATE FUNCTION "{table}_acquire"(text, text, float8, bigint, OUT won boolean, OUT holder varchar,
  OUT heartbeat_age float8, OUT acquired_at timestamptz, OUT token bigint)
  LANGUAGE sql AS $$ SELECT true, NULL::varchar, NULL::float8, now(), 1::bigint $$;
CREATE FUNCTION "{table}_wake"(text, int, text) RETURNS text LANGUAGE sql AS $$ SELECT $1 $$'''
        )
        admin.execute("RESET ROLE")
        LockTable(dsn, table=table).create()
        _contend_and_reclaim(monkeypatch, dsn, lock_name, table)
    finally:
        admin.execute("RESET ROLE")
        admin.execute(f"DROP OWNED BY {role}")
        admin.execute(f"DROP ROLE {role}")


def test_functions_dropped_while_locks_are_in_use_leave_them_working(
    make_mutex: Callable[..., Mutex], admin: psycopg.Connection[Any], dsn: str, lock_name: str, own_table: str
) -> None:
    table = own_table
    LockTable(dsn, table=table).create()
    holder, rival = make_mutex(table=table), make_mutex(table=table)
    with holder.acquire() as acquired:  # the table inspected: its functions in use
        assert acquired
    admin.execute(f'DROP FUNCTION "{table}_acquire", "{table}_wake"')
    for _ in range(2):
        with holder.acquire() as acquired:
            assert acquired
            with rival.acquire() as second:
                assert not second
    with rival.acquire() as after:
        assert after


def test_migrate_by_a_role_that_may_not_make_the_functions_says_so_and_leaves_the_table_usable(
    dml_role: str, dsn: str, admin: psycopg.Connection[Any], lock_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A table made before its functions, migrated at start-up by the application's role (no CREATE): nothing in
    # the table changes, the role is told what it could not make, and its locks use the statements.
    admin.execute("DROP FUNCTION mutex_lock_acquire, mutex_lock_wake")
    try:
        with caplog.at_level(logging.WARNING, logger="postgres_mutex"):
            assert LockTable(dml_role).migrate() is False
        assert "its functions could not be made" in caplog.text
        assert "permission denied" in caplog.text
        holder = Mutex(dml_role, lock_name, **FAST)  # type: ignore[arg-type]
        rival = Mutex(dml_role, lock_name, **FAST)  # type: ignore[arg-type]
        with holder.acquire() as acquired, rival.acquire() as second:
            assert (acquired, second) == (True, False)
        holder.close()
        rival.close()
    finally:
        assert LockTable(dsn).migrate() is True, "the owner makes them"
