"""The schema's statements: create the lock table and its history, inspect them, migrate a 0.1.0 table.

Tables come in shapes: the README's five columns, and the same plus a
``token`` column (fencing tokens) fed by a sequence named after the table and
the columns that name a holder's session (`_sql.sessions`), added by
`migrate_steps`. `inspect_table` says which a table has (and whether it has a
history), so the lock statements can be made for it. Every
statement here is idempotent (``IF NOT EXISTS``), so racing creators and a
retried step are harmless.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from psycopg import sql

from .functions import ACQUIRE, WAKE, signature
from .history import FAMILY, HISTORY_ENDINGS
from .leases import COLUMN as LEASE_COLUMN
from .leases import add_column as add_lease_column
from .leases import create_leases
from .sessions import COLUMNS as SESSION_COLUMNS
from .statement import Statement, render, schema_change, statement

if TYPE_CHECKING:
    from .names import Names

FILLFACTOR = sql.Literal(50)
"""How full the lock table's pages are filled: half, so a heartbeat's new row version fits on its page.

An update whose new version fits on the row's page, and changes no indexed
column (a heartbeat changes ``last_heartbeat`` alone), is HOT: it writes no
index entry, and the page's dead versions are cleared as it is next read.
On pages packed full, each heartbeat moves its row to another page and adds
an entry to every index, which costs a heartbeat of hundreds of locks about
twice the time, and bloats the indexes until vacuum. The table holds one row
per lock held, so the room costs little.
"""


def create_table(names: Names) -> Statement:
    """The README's table plus the token column, its sequence and its unique index, and the session
    columns; all IF NOT EXISTS.

    Sent as one message, so it is one transaction: a table never exists without
    its sequence. ``CACHE 1`` (the default, stated) keeps tokens in the order
    sessions draw them. Like the lock statements, it sets its own deadline and
    isolation first: a session of the library's may carry another deadline.
    """
    return statement(
        names.table_name,
        "create_schema",
        sql.SQL(
            """CREATE SEQUENCE IF NOT EXISTS {sequence} AS bigint CACHE 1 NO CYCLE;
{semaphores};
{rwlocks};
{leases};
CREATE TABLE IF NOT EXISTS {table} (
  lock_name      VARCHAR(64) NOT NULL,
  locked         INT NOT NULL DEFAULT 1,
  instance_id    VARCHAR(64) NOT NULL,
  last_heartbeat TIMESTAMPTZ NOT NULL,
  acquired_at    TIMESTAMPTZ NOT NULL,
  token          BIGINT DEFAULT nextval({sequence_text}),
  session_key    BIGINT,
  session_hold   TIMESTAMPTZ,
  reclaim_after  FLOAT8,
  semaphore      VARCHAR(64),
  permit         INT,
  permits        INT,
  rwlock         VARCHAR(64),
  rw_mode        TEXT,
  hold_until     TIMESTAMPTZ,
  lease_key      BIGINT,
  CONSTRAINT {unique} UNIQUE (locked, lock_name),
  CONSTRAINT chk_locked CHECK (locked = 1),
  {permit_constraints},
  {rw_constraints}
) WITH (fillfactor = {fillfactor});
ALTER SEQUENCE {sequence} OWNED BY {table}.token;
CREATE UNIQUE INDEX IF NOT EXISTS {token_index} ON {table} (token);
{permit_index};
{rw_writer_index};
{queue}"""
        ).format(
            table=names.table,
            unique=names.unique,
            sequence=names.sequence,
            sequence_text=names.sequence_text,
            token_index=names.token_index,
            semaphores=_create_semaphores(names),
            permit_constraints=sql.SQL(",\n  ").join(_permit_constraints(names)),
            permit_index=_permit_index(names),
            rwlocks=_create_rwlocks(names),
            leases=create_leases(names),
            rw_constraints=sql.SQL(",\n  ").join(_rw_constraints(names)),
            rw_writer_index=_rw_writer_index(names),
            queue=_create_queue(names),
            fillfactor=FILLFACTOR,
        ),
    )


def _create_semaphores(names: Names) -> sql.Composable:
    """The semaphores' own table: each one's number of permits, fixed by whoever declared it first."""
    return sql.SQL(
        """CREATE TABLE IF NOT EXISTS {semaphores} (
  name    VARCHAR(64) NOT NULL,
  permits INT NOT NULL CHECK (permits > 0),
  CONSTRAINT {pkey} PRIMARY KEY (name),
  CONSTRAINT {unique} UNIQUE (name, permits)
)"""
    ).format(semaphores=names.semaphores, pkey=names.semaphores_pkey, unique=names.semaphores_unique)


def _permit_constraints(names: Names) -> list[sql.Composable]:
    """What makes more holders than permits impossible, whatever a client sends.

    A permit row names a semaphore that exists with exactly the row's number of
    permits (the foreign key; a mutex's row leaves all three columns NULL, and
    MATCH SIMPLE checks nothing for it), and a permit below that number (the
    check). With one row per (semaphore, permit) (`_permit_index`), at most N
    rows can exist. ON UPDATE CASCADE: an administrator's change of N carries
    over to the rows that remain, once those at or above the new N are gone.
    """
    return [
        sql.SQL(
            "CONSTRAINT {declared} FOREIGN KEY (semaphore, permits) REFERENCES {semaphores} (name, permits) "
            "ON UPDATE CASCADE"
        ).format(declared=sql.Identifier(names.permit_declared), semaphores=names.semaphores),
        sql.SQL(
            "CONSTRAINT {in_range} CHECK ((semaphore IS NULL) = (permit IS NULL) AND (semaphore IS NULL) = "
            "(permits IS NULL) AND permit >= 0 AND permit < permits)"
        ).format(in_range=sql.Identifier(names.permit_in_range)),
    ]


def _permit_index(names: Names) -> sql.Composable:
    """One row per permit; mutexes' rows are not in it."""
    return sql.SQL(
        "CREATE UNIQUE INDEX IF NOT EXISTS {index} ON {table} (semaphore, permit) WHERE semaphore IS NOT NULL"
    ).format(index=names.permit_index, table=names.table)


def _create_rwlocks(names: Names) -> sql.Composable:
    """The read/write locks' gates: the mode each lock's rows may take now, and a waiting writer's claim.

    ``writer_waiting_until``: while it is in the future, no new reader is let in
    (`_sql.rwlocks`); a waiting writer moves it on at each attempt.
    """
    return sql.SQL(
        """CREATE TABLE IF NOT EXISTS {rwlocks} (
  name                 VARCHAR(64) NOT NULL,
  mode                 TEXT NOT NULL CHECK (mode IN ('read', 'write')),
  writer_waiting_until TIMESTAMPTZ,
  CONSTRAINT {pkey} PRIMARY KEY (name),
  CONSTRAINT {unique} UNIQUE (name, mode)
)"""
    ).format(rwlocks=names.rwlocks, pkey=names.rwlocks_pkey, unique=names.rwlocks_unique)


def _rw_constraints(names: Names) -> list[sql.Composable]:
    """What makes a reader and a writer at once impossible, whatever a client sends.

    A read/write lock's row names its lock and its mode, and the gate of that
    lock must say the same mode (the foreign key). NO ACTION: the gate cannot
    change mode while a row of the other mode refers to it, so rows of both
    modes never exist together. A mutex's or a permit's row leaves both
    columns NULL, which MATCH SIMPLE does not check.
    """
    return [
        sql.SQL("CONSTRAINT {gated} FOREIGN KEY (rwlock, rw_mode) REFERENCES {rwlocks} (name, mode)").format(
            gated=sql.Identifier(names.rw_gated), rwlocks=names.rwlocks
        ),
        sql.SQL(
            "CONSTRAINT {paired} CHECK ((rwlock IS NULL) = (rw_mode IS NULL) AND (rwlock IS NULL OR semaphore IS NULL))"
        ).format(paired=sql.Identifier(names.rw_paired)),
    ]


def _rw_writer_index(names: Names) -> sql.Composable:
    """One writer per read/write lock, whatever its row is named."""
    return sql.SQL("CREATE UNIQUE INDEX IF NOT EXISTS {index} ON {table} (rwlock) WHERE rw_mode = 'write'").format(
        index=names.rw_writer_index, table=names.table
    )


def _create_queue(names: Names) -> sql.Composable:
    """The fair locks' waiters (`_sql.fair`): one row per waiter, numbered in the order it came.

    ``seen`` is the waiter's last attempt (by the server's clock): a waiter
    not seen for a while is passed over, and its row deleted by a release.
    ``wait_id`` names the waiter's current acquire, which a hand-off's
    notification names (one meant for an earlier acquire is not taken).
    """
    return sql.SQL(
        """CREATE TABLE IF NOT EXISTS {queue} (
  lock_name   VARCHAR(64) NOT NULL,
  instance_id VARCHAR(64) NOT NULL,
  ticket      BIGINT GENERATED ALWAYS AS IDENTITY,
  seen        TIMESTAMPTZ NOT NULL,
  wait_id     TEXT NOT NULL,
  CONSTRAINT {pkey} PRIMARY KEY (lock_name, instance_id)
);
CREATE INDEX IF NOT EXISTS {order} ON {queue} (lock_name, ticket)"""
    ).format(queue=names.queue, pkey=names.queue_pkey, order=names.queue_order)


def inspect_table(names: Names) -> Statement:
    """What the table has: one row ``(exists, has_token, has_history, has_sessions, has_semaphores, has_rwlocks,
    has_hold_until, has_queue, leases, functions)``, under its own deadline (`TableShape.inspected` reads it).
    Semaphores (read/write locks) count only once their last migration step (the unique index) is done.
    ``leases`` (`TableShape.with_leases`): 0, no ``lease_key`` column; 1, the column but no lease the role may
    read (it clears the column where it takes a row over, and judges each row by its own heartbeat, as 0.1.0
    does); 2, leases it may read (it judges a row by its lease too); 3, leases it may renew as well.
    ``functions``: 0, the functions of the common acquire and release (`_sql.functions`) are not there; 1, they
    are, but the role may not execute them, or another role than the table's owner made them (a role that may
    create in the schema could have made them first: their answers would be trusted); 2, they may be used."""
    return statement(
        names.table_name,
        "inspection",
        sql.SQL(
            """SELECT to_regclass({table_text}) IS NOT NULL,
       EXISTS (SELECT 1 FROM pg_attribute
                WHERE attrelid = to_regclass({table_text}) AND attname = 'token' AND NOT attisdropped),
       to_regclass({history_text}) IS NOT NULL,
       (SELECT count(*) = {count} FROM pg_attribute
         WHERE attrelid = to_regclass({table_text}) AND attname = ANY({columns}) AND NOT attisdropped),
       to_regclass({semaphores_text}) IS NOT NULL AND to_regclass({permit_index_text}) IS NOT NULL,
       to_regclass({rw_writer_index_text}) IS NOT NULL,
       EXISTS (SELECT 1 FROM pg_attribute
                WHERE attrelid = to_regclass({table_text}) AND attname = 'hold_until' AND NOT attisdropped),
       to_regclass({queue_text}) IS NOT NULL,
       CASE WHEN NOT EXISTS (SELECT 1 FROM pg_attribute
                              WHERE attrelid = to_regclass({table_text}) AND attname = {lease_column}
                                AND NOT attisdropped) THEN 0
            WHEN to_regclass({leases_text}) IS NULL
                 OR NOT has_table_privilege(to_regclass({leases_text}), 'SELECT') THEN 1
            WHEN has_table_privilege(to_regclass({leases_text}), 'INSERT')
                 AND has_table_privilege(to_regclass({leases_text}), 'UPDATE')
                 AND has_table_privilege(to_regclass({leases_text}), 'DELETE') THEN 3
            ELSE 2 END,
       CASE WHEN to_regprocedure({acquire_function}) IS NULL OR to_regprocedure({wake_function}) IS NULL THEN 0
            WHEN has_function_privilege(to_regprocedure({acquire_function}), 'EXECUTE')
                 AND has_function_privilege(to_regprocedure({wake_function}), 'EXECUTE')
                 AND (SELECT count(DISTINCT owner) = 1 FROM (
                        SELECT relowner FROM pg_class WHERE oid = to_regclass({table_text})
                        UNION ALL SELECT proowner FROM pg_proc WHERE oid = to_regprocedure({acquire_function})
                        UNION ALL SELECT proowner FROM pg_proc WHERE oid = to_regprocedure({wake_function})
                      ) AS owners (owner)) THEN 2
            ELSE 1 END"""
        ).format(
            acquire_function=signature(names.acquire_function, ACQUIRE),
            wake_function=signature(names.wake_function, WAKE),
            queue_text=names.queue_text,
            table_text=sql.Literal(render(names.table)),
            semaphores_text=names.semaphores_text,
            permit_index_text=names.permit_index_text,
            rw_writer_index_text=names.rw_writer_index_text,
            leases_text=names.leases_text,
            lease_column=sql.Literal(LEASE_COLUMN),
            history_text=sql.Literal(render(names.history)),
            count=sql.Literal(len(SESSION_COLUMNS)),
            columns=sql.Literal(list(SESSION_COLUMNS)),
        ),
    )


def pages_have_room(names: Names) -> Statement:
    """Whether the table's pages leave room for heartbeats (the fillfactor `migrate_steps` sets last): one row."""
    return statement(
        names.table_name,
        "inspection",
        sql.SQL(
            "SELECT coalesce((SELECT 'fillfactor=' || {fillfactor} = ANY(reloptions) "
            "FROM pg_class WHERE oid = to_regclass({table_text})), false)"
        ).format(
            fillfactor=FILLFACTOR,
            table_text=sql.Literal(render(names.table)),
        ),
    )


def create_history(names: Names, retention_seconds: float) -> Statement:
    """The history table and its indexes, IF NOT EXISTS; retention set as the default of ``keep_until``.

    A row's ``keep_until`` is NULL while its hold lasts and set to ``DEFAULT``
    (now + retention) by the statement that ends it: changing the retention
    (`history_retention`) applies to holds that end afterwards.
    """
    return schema_change(
        names.table_name,
        "create the history table",
        sql.SQL(
            """CREATE TABLE IF NOT EXISTS {history} (
  id          BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  lock_name   VARCHAR(64) NOT NULL,
  token       BIGINT,
  holder      VARCHAR(64) NOT NULL,
  acquired_at TIMESTAMPTZ NOT NULL,
  ended_at    TIMESTAMPTZ,
  ended_how   TEXT CHECK (ended_how IN ({endings})),
  ended_by    VARCHAR(64),
  alerts      INT NOT NULL DEFAULT 0,
  keep_until  TIMESTAMPTZ DEFAULT now() + make_interval(secs => {retention})
);
CREATE INDEX IF NOT EXISTS {by_lock} ON {history} (({family}), acquired_at);
CREATE INDEX IF NOT EXISTS {by_expiry} ON {history} (keep_until);
CREATE INDEX IF NOT EXISTS {open} ON {history} (lock_name) WHERE ended_at IS NULL"""
        ).format(
            history=names.history,
            endings=sql.SQL(", ").join(sql.Literal(ending) for ending in HISTORY_ENDINGS),
            retention=sql.Literal(float(retention_seconds)),
            by_lock=names.history_by_lock,
            # A lock's holds are read by its name, whichever of its rows held it.
            family=FAMILY,
            by_expiry=names.history_by_expiry,
            # An acquire ends the lock's open holds: found among its few open
            # ones, not among every hold it had within the retention.
            open=names.history_open,
        ),
    )


def history_retention(names: Names, retention_seconds: float) -> Statement:
    """Keep holds that end from now on ``retention_seconds`` after their end."""
    return schema_change(
        names.table_name,
        "set the history's retention",
        sql.SQL(
            "ALTER TABLE {history} ALTER COLUMN keep_until SET DEFAULT now() + make_interval(secs => {retention})"
        ).format(history=names.history, retention=sql.Literal(float(retention_seconds))),
    )


def _add_constraints_once(names: Names, first: str, constraints: list[sql.Composable]) -> sql.Composable:
    """ALTER TABLE ... ADD ``constraints`` unless the one named ``first`` exists.

    ADD CONSTRAINT has no IF NOT EXISTS: asked first, so the step can be run again.
    """
    return sql.SQL(
        """DO $migrate$ BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_constraint WHERE conrelid = {table_text}::regclass AND conname = {first}) THEN
    ALTER TABLE {table} ADD {constraints};
  END IF;
END $migrate$"""
    ).format(
        table_text=sql.Literal(render(names.table)),
        first=sql.Literal(first),
        constraints=sql.SQL(", ADD ").join(constraints),
        table=names.table,
    )


def migrate_steps(names: Names) -> list[Statement]:
    """Add the token column, the session columns, what semaphores and read/write locks need and the minimum
    hold's column to an existing table, online, one short step at a time.

    Each step is idempotent, and takes the table's lock only as long as a
    catalog change does: ``ADD COLUMN`` without a default and ``SET DEFAULT``
    rewrite nothing, and the unique index is built on a table of one row per
    lock. The caller runs each with a short ``lock_timeout`` and retries, so a
    step never queues behind a long transaction while holders wait behind it.
    """

    def step(what: str, composed: sql.Composable) -> Statement:
        return schema_change(names.table_name, what, composed)

    fmt = {
        "table": names.table,
        "sequence": names.sequence,
        "sequence_text": names.sequence_text,
        "token_index": names.token_index,
    }
    return [
        step(
            "create the token sequence",
            sql.SQL("CREATE SEQUENCE IF NOT EXISTS {sequence} AS bigint CACHE 1 NO CYCLE").format(**fmt),
        ),
        step(
            "add the token column", sql.SQL("ALTER TABLE {table} ADD COLUMN IF NOT EXISTS token BIGINT").format(**fmt)
        ),
        step(
            "tie the sequence to the column", sql.SQL("ALTER SEQUENCE {sequence} OWNED BY {table}.token").format(**fmt)
        ),
        step(
            "feed the token column from the sequence",
            sql.SQL("ALTER TABLE {table} ALTER COLUMN token SET DEFAULT nextval({sequence_text})").format(**fmt),
        ),
        step(
            "index the token column",
            sql.SQL("CREATE UNIQUE INDEX IF NOT EXISTS {token_index} ON {table} (token)").format(**fmt),
        ),
        step(
            "add the columns that name a holder's session",
            sql.SQL(
                "ALTER TABLE {table} ADD COLUMN IF NOT EXISTS session_key BIGINT, "
                "ADD COLUMN IF NOT EXISTS session_hold TIMESTAMPTZ, ADD COLUMN IF NOT EXISTS reclaim_after FLOAT8"
            ).format(**fmt),
        ),
        step("create the semaphores' table", _create_semaphores(names)),
        step(
            "add the columns of semaphores' permits",
            sql.SQL(
                "ALTER TABLE {table} ADD COLUMN IF NOT EXISTS semaphore VARCHAR(64), "
                "ADD COLUMN IF NOT EXISTS permit INT, ADD COLUMN IF NOT EXISTS permits INT"
            ).format(**fmt),
        ),
        step(
            "tie each permit row to its semaphore",
            _add_constraints_once(names, names.permit_declared, _permit_constraints(names)),
        ),
        step("index the permits, one row each", _permit_index(names)),
        step("create the read/write locks' gates", _create_rwlocks(names)),
        step(
            "add the columns of read/write locks' rows",
            sql.SQL(
                "ALTER TABLE {table} ADD COLUMN IF NOT EXISTS rwlock VARCHAR(64), ADD COLUMN IF NOT EXISTS rw_mode TEXT"
            ).format(**fmt),
        ),
        step(
            "tie each read/write lock's row to its gate",
            _add_constraints_once(names, names.rw_gated, _rw_constraints(names)),
        ),
        step("index the writers, one per read/write lock", _rw_writer_index(names)),
        step(
            "add the column of a minimum hold",
            sql.SQL("ALTER TABLE {table} ADD COLUMN IF NOT EXISTS hold_until TIMESTAMPTZ").format(**fmt),
        ),
        step(
            "leave room on each page for heartbeats",
            # Pages written from now on; a catalog change, rewriting nothing.
            sql.SQL("ALTER TABLE {table} SET (fillfactor = {fillfactor})").format(fillfactor=FILLFACTOR, **fmt),
        ),
        step("create the fair locks' queue of waiters", _create_queue(names)),
        # The leases come last: a table counts as having them (`inspect_table`) once both steps are done.
        step("create the leases' table", create_leases(names)),
        step("add the column that names a row's lease", add_lease_column(names)),
    ]
