"""Every SQL statement postgres-mutex sends, composed with `psycopg.sql`.

Identifiers are validated and quoted; every value is bound as a parameter.
Each lock operation is a single statement, so it costs one round trip, and
every time comparison uses the server's ``now()``: no client clock is ever
consulted, so clock skew between instances cannot corrupt the lock.

A statement is sent as one simple-protocol message that first sets, for its
own transaction only, a server-side ``statement_timeout`` (so a statement the
client gave up on cannot go on running on the server, blocked behind someone
else's row lock, and land later) and the ``read committed`` isolation the
statements are designed for, whatever the role's or database's defaults. It is
still one round trip, it prepares nothing, and it works behind PgBouncer in
transaction mode. Parameters are bound on the client (`psycopg.ClientCursor`).

On a connection of the library's own that reaches PostgreSQL directly (no
pooler between: `session_setup` checks), the same settings are made once for
the session instead, and a lock statement is sent alone, prepared on its first
use: the server then skips parsing and planning it, which is most of what it
costs. A pooler may run two transactions of one client on different server
sessions, or one server session for several clients: a session setting or a
prepared statement there could reach someone else, so behind one (and on a
pool's connections, which belong to the application) nothing is set on the
session and nothing is prepared.

Tables come in two shapes: the README's five columns, and the same plus a
``token`` column (fencing tokens) fed by a sequence named after the table,
added by `migrate`. `TableShape` says which one a statement set is for.
"""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass

from psycopg import sql

# Unquoted-identifier shape: conservative, so a typo fails loudly at
# construction instead of silently naming a different, case-sensitive table.
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_$]*")
# PostgreSQL truncates identifiers past NAMEDATALEN - 1 bytes.
_MAX_IDENTIFIER_BYTES = 63

# Before every statement, in its own transaction: a server-side deadline and
# the isolation the statements are written for. The timeout is in milliseconds.
_PREFIX = "SET LOCAL statement_timeout = %(_server_timeout_ms)s; SET LOCAL transaction_isolation = 'read committed'; "
_DDL_PREFIX = "SET LOCAL lock_timeout = '50ms'; " + _PREFIX
"""For a change of the schema: it waits a moment at most for the table's lock, and the caller retries.

Queued behind a long transaction (a holder's fenced one, a reader's), a
waiting ALTER would make every heartbeat and acquire queue behind it.
"""


def parse_table(table: object) -> tuple[str, ...]:
    """Split ``"table"`` or ``"schema.table"`` into validated parts."""
    if not isinstance(table, str):
        raise TypeError(f"table must be a str, not {type(table).__name__}")
    parts = tuple(table.split("."))
    if len(parts) > 2:
        raise ValueError(f"table must be 'name' or 'schema.name', got {table!r}")
    for part in parts:
        # Leave room for the names derived from the table (_token_seq, _history).
        if not _IDENTIFIER.fullmatch(part) or len(part.encode()) > _MAX_IDENTIFIER_BYTES:
            raise ValueError(
                f"table must be 'name' or 'schema.name' made of letters, digits, '_' or '$' "
                f"(at most {_MAX_IDENTIFIER_BYTES} bytes each, not starting with a digit), got {table!r}"
            )
    return parts


@dataclass(frozen=True, slots=True)
class TableShape:
    """What a lock table has beyond the README's five columns."""

    tokens: bool
    """A ``token`` column fed by the table's sequence: acquisitions get fencing tokens."""
    history: bool = False
    """A history table next to it (``<table>_history``): one row per hold, written by the same statements."""


LEGACY = TableShape(tokens=False)
CURRENT = TableShape(tokens=True)
CURRENT_WITH_HISTORY = TableShape(tokens=True, history=True)


@dataclass(frozen=True, slots=True)
class Statement:
    """One statement, rendered once, with what a failure of it should be called."""

    text: str
    """The statement, with ``%(name)s`` placeholders, preceded by the per-statement settings."""
    table: str
    """The lock table it reads or writes, for messages."""
    what: str
    """What it does, for messages: "acquire", "add the token column", ..."""
    bare: str | None = None
    """The statement alone, without the settings, to be prepared on a connection
    that reaches PostgreSQL directly (see `session_setup`); None for one that
    must carry its own settings (a schema change, a ``lock_timeout``)."""


def _render(composed: sql.Composable) -> str:
    return composed.as_string(None)


def _derived(parts: tuple[str, ...], suffix: str, *, prefix: str = "") -> tuple[str, ...]:
    """A name derived from the table's, in the table's schema, that always fits and never collides.

    ``prefix + table + suffix`` when it fits in 63 bytes (so the README's
    ``uq_mutex_lock``). A longer one is not left for PostgreSQL to truncate,
    which would cut the suffixes off and give the sequence, the history table
    and their indexes one name, or two tables sharing a long prefix one
    constraint: the table's name is shortened instead, and a digest of it
    keeps names of different tables apart.
    """
    name = prefix + parts[-1] + suffix
    if len(name.encode()) > _MAX_IDENTIFIER_BYTES:
        digest = hashlib.sha256(".".join(parts).encode()).hexdigest()[:8]
        room = _MAX_IDENTIFIER_BYTES - len(prefix.encode()) - len(suffix.encode()) - len(digest) - 1
        head = parts[-1].encode()[:room].decode(errors="ignore")
        name = f"{prefix}{head}_{digest}{suffix}"
    return (*parts[:-1], name)


class Names:
    """The identifiers of one lock table and of what belongs to it."""

    def __init__(self, table: str) -> None:
        self.parts = parse_table(table)
        self.table_name = ".".join(self.parts)
        self.table = sql.Identifier(*self.parts)
        # Index names share the schema's namespace: derive the unique
        # constraint's name from the table so several lock tables can coexist.
        # For the default table this is exactly the README's uq_mutex_lock.
        self.unique = sql.Identifier(_derived(self.parts, "", prefix="uq_")[-1])
        self.sequence_parts = _derived(self.parts, "_token_seq")
        self.sequence = sql.Identifier(*self.sequence_parts)
        self.token_index = sql.Identifier(_derived(self.parts, "_token_key")[-1])
        # nextval() takes the sequence's name as text: quoted, so case and schema are kept.
        self.sequence_text = sql.Literal(_render(self.sequence))
        self.history_parts = _derived(self.parts, "_history")
        self.history_name = ".".join(self.history_parts)
        self.history = sql.Identifier(*self.history_parts)
        self.history_by_lock = sql.Identifier(_derived(self.parts, "_history_by_lock")[-1])
        self.history_by_expiry = sql.Identifier(_derived(self.parts, "_history_by_expiry")[-1])
        self.history_open = sql.Identifier(_derived(self.parts, "_history_open")[-1])

    @functools.cached_property
    def fence(self) -> str:
        """The fence check, sent on the user's connection in their own transaction (no settings prefix).

        FOR KEY SHARE on this hold's row: a reclaim (which writes the uniquely
        indexed token) and a DELETE wait for the user's transaction; a
        heartbeat, which changes no key column, does not. The second column
        says who holds the lock now, for the error when the hold is gone.
        """
        return _render(
            sql.SQL(
                """WITH mine AS (
  SELECT token FROM {table}
   WHERE locked = 1 AND lock_name = %(lock_name)s AND instance_id = %(instance_id)s
     AND acquired_at = %(acquired_at)s AND token = %(token)s
     FOR KEY SHARE
)
SELECT (SELECT token FROM mine),
       (SELECT instance_id FROM {table} WHERE locked = 1 AND lock_name = %(lock_name)s)"""
            ).format(table=self.table)
        )

    def channel(self, lock_name: str) -> str:
        """The NOTIFY channel for one lock of this table.

        One channel per lock, so waiters are woken only by their own lock; a
        digest keeps it under the 63-byte identifier limit whatever the names.
        """
        digest = hashlib.sha256(f"{self.table_name}\x00{lock_name}".encode()).hexdigest()
        return f"postgres_mutex_{digest[:40]}"


_TOKEN_IF_ANY = sql.SQL("(to_jsonb({}) -> 'token')::bigint")
"""The row's token if the table has that column, else NULL: valid SQL on both shapes."""


class Statements:
    """The statements for one lock table of one shape.

    Parameters (all bound): ``lock_name``, ``instance_id``, ``stale_seconds``,
    ``channel``, and ``acquired_at``: the stamp of the hold a heartbeat or
    release belongs to. Scoping those to it means a statement of an earlier
    hold that reaches the server late can never touch a later hold.
    """

    def __init__(self, names: Names, shape: TableShape) -> None:
        self.names = names
        self.shape = shape
        t = names.table
        tokens = shape.tokens
        token_column = sql.SQL(", token") if tokens else sql.SQL("")
        new_token = sql.SQL(", nextval({})").format(names.sequence_text) if tokens else sql.SQL("")

        # Only the acquire and the release are prepared (on a direct connection):
        # they are what a lock cycle costs, and their parameters are single
        # values matched against the table's unique key, so the plan the
        # server keeps for any value is the one it would make for each. A
        # heartbeat carries an array of holds: planned for its length each
        # time, since a kept plan guesses ten rows, and for ten thousand locks
        # would pick one that runs for minutes.
        def statement(what: str, composed: sql.Composable, *, preparable: bool = False) -> Statement:
            text = _render(composed)
            return Statement(_PREFIX + text, names.table_name, what, text if preparable else None)

        # One statement decides everything an acquire needs:
        # - `current` reads the holder and its heartbeat age (for `contended`
        #   and the alert) from the statement's snapshot;
        # - `inserted` wins if no row exists; a row that exists is left alone,
        #   unlocked (DO NOTHING), so a contender never waits on a held lock;
        # - `taken` takes an existing row over only if it is stale, or ours from
        #   an earlier statement (a reply that was lost, or a restarted process
        #   reusing its id). Only a row that qualifies in the snapshot is locked;
        #   the condition is checked again on its latest version under that row
        #   lock, so two reclaimers can never both win, and a reclaim waits for
        #   a holder's fenced transaction to end. `acquired_at <` keeps a
        #   statement of ours that was cut off but still ran on the server from
        #   overwriting a later hold of ours;
        # - every acquisition draws a new token from the sequence when it writes
        #   the row, so it is greater than any token issued before.
        self.acquire = statement(
            "acquire",
            preparable=True,
            composed=sql.SQL(
                """WITH current AS (
  SELECT instance_id, acquired_at,
         EXTRACT(EPOCH FROM now() - last_heartbeat)::float8 AS heartbeat_age
    FROM {table}
   WHERE locked = 1 AND lock_name = %(lock_name)s
), inserted AS (
  INSERT INTO {table} AS fresh (lock_name, locked, instance_id, last_heartbeat, acquired_at{token_column})
  VALUES (%(lock_name)s, 1, %(instance_id)s, now(), now(){new_token})
  ON CONFLICT (locked, lock_name) DO NOTHING
  RETURNING acquired_at, {inserted_token} AS token
), taken AS (
  UPDATE {table} AS existing
     SET instance_id = %(instance_id)s,
         last_heartbeat = now(),
         acquired_at = now(){update_token}
   WHERE existing.locked = 1 AND existing.lock_name = %(lock_name)s
     AND NOT EXISTS (SELECT 1 FROM inserted)
     AND ((existing.instance_id = %(instance_id)s AND existing.acquired_at < now())
          OR existing.last_heartbeat <= now() - make_interval(secs => %(stale_seconds)s))
  RETURNING existing.acquired_at, {taken_token} AS token
){history}
SELECT CASE WHEN EXISTS (SELECT 1 FROM inserted) THEN true
            WHEN EXISTS (SELECT 1 FROM taken) THEN false END,
       current.instance_id, current.heartbeat_age,
       COALESCE((SELECT acquired_at FROM inserted), (SELECT acquired_at FROM taken)),
       COALESCE((SELECT token FROM inserted), (SELECT token FROM taken))
  FROM (VALUES (1)) AS one (x)
  LEFT JOIN current ON true"""
            ).format(
                table=t,
                token_column=token_column,
                new_token=new_token,
                update_token=sql.SQL(",\n         token = nextval({})").format(names.sequence_text)
                if tokens
                else sql.SQL(""),
                # Without a token column in this shape, still read one if the table has
                # gained it since (a migration while this process ran): the flow
                # then inspects the table again.
                inserted_token=sql.SQL("fresh.token") if tokens else _TOKEN_IF_ANY.format(sql.Identifier("fresh")),
                taken_token=sql.SQL("existing.token") if tokens else _TOKEN_IF_ANY.format(sql.Identifier("existing")),
                # The history: a row for the new hold; every hold of the lock still
                # open in it has ended: the one taken over (reclaimed, or taken back by
                # its own instance), and any whose end nobody wrote (a process that
                # keeps no history ended it): how is unknown. Expired rows go,
                # a hundred at a time, so retention needs no cron job. SKIP LOCKED:
                # acquires of other locks sweeping at the same moment never wait
                # for each other (nor deadlock) over the same expired rows.
                history=sql.SQL(
                    """, opened AS (
  INSERT INTO {history} (lock_name, token, holder, acquired_at, keep_until)
  SELECT %(lock_name)s, token, %(instance_id)s, acquired_at, NULL::timestamptz FROM inserted
  UNION ALL
  SELECT %(lock_name)s, token, %(instance_id)s, acquired_at, NULL::timestamptz FROM taken
), closed AS (
  UPDATE {history} AS past
     SET ended_at = now(), keep_until = DEFAULT,
         ended_how = CASE WHEN NOT EXISTS (SELECT 1 FROM taken) THEN NULL
                          WHEN past.holder = %(instance_id)s THEN 'replaced' ELSE 'reclaimed' END,
         ended_by = CASE WHEN EXISTS (SELECT 1 FROM taken) THEN %(instance_id)s END,
         alerts = past.alerts + CASE WHEN EXISTS (SELECT 1 FROM taken) AND past.holder <> %(instance_id)s
                                     THEN 1 ELSE 0 END
   WHERE past.lock_name = %(lock_name)s AND past.ended_at IS NULL
     AND (EXISTS (SELECT 1 FROM inserted) OR EXISTS (SELECT 1 FROM taken))
), expired AS (
  DELETE FROM {history}
   WHERE id IN (SELECT id FROM {history} WHERE keep_until < now()
                 ORDER BY keep_until LIMIT 100 FOR UPDATE SKIP LOCKED)
)"""
                ).format(history=names.history)
                if shape.history
                else sql.SQL(""),
            ),
        )

        # Every hold of one client that shares a heartbeat interval, renewed by
        # one statement, which answers for each: renewed, busy (its row is
        # locked by another session) or gone (deleted or taken over: lost).
        # SKIP LOCKED keeps one row locked by someone else from holding up the
        # heartbeats of every other lock of the process; a fence's FOR KEY
        # SHARE does not conflict, so fenced holds renew. Only last_heartbeat
        # changes and it is in no index: the UPDATE stays HOT, so heartbeats
        # never bloat an index.
        # With a history: a heartbeat that comes after a silence past the
        # alert threshold ends an alert episode of the hold, and counts it.
        alerted = (
            sql.SQL(
                """, alerted AS (
  UPDATE {history} AS past SET alerts = past.alerts + 1
    FROM free
   WHERE free.previous <= now() - make_interval(secs => %(alert_seconds)s)
     AND past.lock_name = free.lock_name AND past.holder = free.instance_id
     AND past.acquired_at = free.acquired_at AND past.ended_at IS NULL
)"""
            ).format(history=names.history)
            if shape.history
            else sql.SQL("")
        )
        heartbeat = """WITH hold AS (
  SELECT * FROM {hold_keys}
), free AS (
  SELECT held.ctid, held.lock_name, held.instance_id, held.acquired_at, held.last_heartbeat AS previous
    FROM {table} AS held JOIN hold {join_keys}
   WHERE held.locked = 1
     FOR NO KEY UPDATE OF held{skip}
), renewed AS (
  UPDATE {table} AS held SET last_heartbeat = now()
    FROM free WHERE held.ctid = free.ctid
  RETURNING held.*
), present AS (
  SELECT held.* FROM {table} AS held JOIN hold {join_keys} WHERE held.locked = 1
){alerted}
SELECT {answer_keys}, renewed.lock_name IS NOT NULL, present.lock_name IS NOT NULL
  FROM hold
  LEFT JOIN renewed {join_keys}
  LEFT JOIN present {join_keys}"""

        def heartbeats(keys: dict[str, sql.Composable]) -> tuple[Statement, Statement]:
            renew = statement(
                "heartbeat", sql.SQL(heartbeat).format(table=t, skip=sql.SQL(" SKIP LOCKED"), alerted=alerted, **keys)
            )
            # For the holds the first one skipped: rows locked a moment ago by a
            # contender's acquire, usually. This one waits for the row lock, but
            # only briefly: a row someone keeps locked fails this statement alone.
            wait = statement(
                "heartbeat",
                sql.SQL("SET LOCAL lock_timeout = %(lock_timeout_ms)s; " + heartbeat).format(
                    table=t, skip=sql.SQL(""), alerted=alerted, **keys
                ),
            )
            return renew, wait

        # Each hold named by its lock, instance and stamp; or, where every hold
        # has one, by its token alone (a new one per acquisition), a few bytes
        # each: 10,000 locks in one statement.
        self.heartbeat, self.heartbeat_waiting = heartbeats(
            {
                "hold_keys": sql.SQL(
                    "unnest(%(lock_names)s::text[], %(instance_ids)s::text[], %(acquired_ats)s::timestamptz[])"
                    " AS hold (lock_name, instance_id, acquired_at)"
                ),
                "join_keys": sql.SQL("USING (lock_name, instance_id, acquired_at)"),
                "answer_keys": sql.SQL("hold.lock_name, hold.instance_id, hold.acquired_at"),
            }
        )
        self.heartbeat_by_token: tuple[Statement, Statement] | None = (
            heartbeats(
                {
                    "hold_keys": sql.SQL("unnest(%(tokens)s::bigint[]) AS hold (token)"),
                    "join_keys": sql.SQL("USING (token)"),
                    "answer_keys": sql.SQL("hold.token"),
                }
            )
            if tokens
            else None
        )

        # The DELETE and the wake-up of waiters are one statement: a waiter
        # LISTENing on the channel retries at once instead of at its next poll.
        # How a hold ended, in the history, by the statement that ended it.
        ended = (
            sql.SQL(
                """, ended AS (
  UPDATE {history} AS past
     SET ended_at = now(), keep_until = DEFAULT, ended_how = %(ended_how)s, ended_by = {ended_by},
         alerts = past.alerts + CASE WHEN released.last_heartbeat
                                          <= now() - make_interval(secs => %(alert_seconds)s) THEN 1 ELSE 0 END
    FROM released
   WHERE past.lock_name = released.lock_name AND past.holder = released.instance_id
     AND past.acquired_at = released.acquired_at AND past.ended_at IS NULL
)"""
            )
            if shape.history
            else None
        )

        def ending(ended_by: sql.Composable) -> sql.Composable:
            return sql.SQL("") if ended is None else ended.format(history=names.history, ended_by=ended_by)

        release = """WITH released AS (
  DELETE FROM {table}
   WHERE locked = 1 AND lock_name = %(lock_name)s AND instance_id = %(instance_id)s{scope}
  RETURNING lock_name, instance_id, acquired_at, last_heartbeat
){ended}
SELECT pg_notify(%(channel)s, '') FROM released"""
        self.release = statement(
            "release",
            preparable=True,
            composed=sql.SQL(release).format(
                table=t,
                scope=sql.SQL("\n     AND acquired_at = %(acquired_at)s"),
                ended=ending(sql.SQL("NULL")),
            ),
        )
        # After an unanswered acquire the stamp is unknown: remove any row of ours.
        self.cleanup = statement(
            "clean-up", sql.SQL(release).format(table=t, scope=sql.SQL(""), ended=ending(sql.SQL("NULL")))
        )

        # A new token for a row taken over by a process that did not know the
        # table had tokens (it was migrated meanwhile): the row kept the old one.
        self.retoken = (
            statement(
                "acquire",
                sql.SQL(
                    """UPDATE {table} SET token = nextval({sequence})
 WHERE locked = 1 AND lock_name = %(lock_name)s AND instance_id = %(instance_id)s
   AND acquired_at = %(acquired_at)s
RETURNING token"""
                ).format(table=t, sequence=names.sequence_text),
            )
            if tokens
            else None
        )

        # Every held lock (or the given ones) with its ages by the server's clock.
        self.holders = statement(
            "read of the lock table",
            sql.SQL(
                """SELECT lock_name, instance_id,
       EXTRACT(EPOCH FROM now() - last_heartbeat)::float8 AS heartbeat_age,
       EXTRACT(EPOCH FROM now() - acquired_at)::float8 AS held_for,
       acquired_at, {token}
  FROM {table}
 WHERE locked = 1 AND (%(lock_names)s::text[] IS NULL OR lock_name = ANY(%(lock_names)s::text[]))
 ORDER BY lock_name"""
            ).format(table=t, token=sql.SQL("token") if tokens else sql.SQL("NULL::bigint")),
        )

        # An operator's override: delete the lock whoever holds it, and say whom.
        # It waits for a fenced transaction's row lock only briefly, and is sent
        # again: waiting in one statement would keep the client's connection, and
        # with it the heartbeats of every lock the process holds, from going out.
        self.force_release = statement(
            "forced release",
            sql.SQL(
                """SET LOCAL lock_timeout = %(lock_timeout_ms)s; WITH released AS (
  DELETE FROM {table}
   WHERE locked = 1 AND lock_name = %(lock_name)s
  RETURNING lock_name, instance_id, acquired_at, last_heartbeat,
            EXTRACT(EPOCH FROM now() - last_heartbeat)::float8 AS heartbeat_age, {token} AS token
){ended}
SELECT instance_id, heartbeat_age, token, pg_notify(%(channel)s, '')::text FROM released"""
            ).format(
                table=t,
                token=sql.SQL("token") if tokens else sql.SQL("NULL::bigint"),
                ended=ending(sql.SQL("NULL")),
            ),
        )
        # The history, newest first: every hold of a lock (or of all), since a moment.
        self.history = (
            statement(
                "read of the history",
                sql.SQL(
                    """SELECT lock_name, token, holder, acquired_at, ended_at, ended_how, ended_by, alerts,
       EXTRACT(EPOCH FROM coalesce(ended_at, now()) - acquired_at)::float8
  FROM {history}
 WHERE (%(lock_name)s::text IS NULL OR lock_name = %(lock_name)s)
   AND (%(since)s::timestamptz IS NULL OR coalesce(ended_at, 'infinity') >= %(since)s)
   AND (%(since_seconds)s::float8 IS NULL
        OR coalesce(ended_at, 'infinity') >= now() - make_interval(secs => %(since_seconds)s::float8))
 ORDER BY acquired_at DESC, id DESC
 LIMIT %(limit)s"""
                ).format(history=names.history),
            )
            if shape.history
            else None
        )


def create_table(names: Names) -> Statement:
    """The README's table plus the token column, its sequence and its unique index; all IF NOT EXISTS.

    Sent as one message, so it is one transaction: a table never exists without
    its sequence. ``CACHE 1`` (the default, stated) keeps tokens in the order
    sessions draw them. Like the lock statements, it sets its own deadline and
    isolation first: a session of the library's may carry another deadline.
    """
    return Statement(
        _PREFIX
        + _render(
            sql.SQL(
                """CREATE SEQUENCE IF NOT EXISTS {sequence} AS bigint CACHE 1 NO CYCLE;
CREATE TABLE IF NOT EXISTS {table} (
  lock_name      VARCHAR(64) NOT NULL,
  locked         INT NOT NULL DEFAULT 1,
  instance_id    VARCHAR(64) NOT NULL,
  last_heartbeat TIMESTAMPTZ NOT NULL,
  acquired_at    TIMESTAMPTZ NOT NULL,
  token          BIGINT DEFAULT nextval({sequence_text}),
  CONSTRAINT {unique} UNIQUE (locked, lock_name),
  CONSTRAINT chk_locked CHECK (locked = 1)
);
ALTER SEQUENCE {sequence} OWNED BY {table}.token;
CREATE UNIQUE INDEX IF NOT EXISTS {token_index} ON {table} (token)"""
            ).format(
                table=names.table,
                unique=names.unique,
                sequence=names.sequence,
                sequence_text=names.sequence_text,
                token_index=names.token_index,
            )
        ),
        names.table_name,
        "create_schema",
    )


def inspect_table(names: Names) -> Statement:
    """What the table has: one row ``(exists, has_token, has_history)``, under its own deadline."""
    return Statement(
        _PREFIX
        + _render(
            sql.SQL(
                """SELECT to_regclass({table_text}) IS NOT NULL,
       EXISTS (SELECT 1 FROM pg_attribute
                WHERE attrelid = to_regclass({table_text}) AND attname = 'token' AND NOT attisdropped),
       to_regclass({history_text}) IS NOT NULL"""
            ).format(table_text=sql.Literal(_render(names.table)), history_text=sql.Literal(_render(names.history)))
        ),
        names.table_name,
        "inspection",
    )


HISTORY_ENDINGS = ("released", "reclaimed", "replaced", "lost", "abandoned", "force_released")
"""How a hold can end, in the history: released by its holder; reclaimed by another instance after
the stale threshold; replaced by its own instance (an acquire that took its row back); lost (its
lease ran out and its row was deleted after); abandoned (a row an unanswered acquire left, deleted
by the clean-up); force_released (an operator's ``release --force``)."""


def create_history(names: Names, retention_seconds: float) -> Statement:
    """The history table and its indexes, IF NOT EXISTS; retention set as the default of ``keep_until``.

    A row's ``keep_until`` is NULL while its hold lasts and set to ``DEFAULT``
    (now + retention) by the statement that ends it: changing the retention
    (`history_retention`) applies to holds that end afterwards.
    """
    return Statement(
        _DDL_PREFIX
        + _render(
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
CREATE INDEX IF NOT EXISTS {by_lock} ON {history} (lock_name, acquired_at);
CREATE INDEX IF NOT EXISTS {by_expiry} ON {history} (keep_until);
CREATE INDEX IF NOT EXISTS {open} ON {history} (lock_name) WHERE ended_at IS NULL"""
            ).format(
                history=names.history,
                endings=sql.SQL(", ").join(sql.Literal(ending) for ending in HISTORY_ENDINGS),
                retention=sql.Literal(float(retention_seconds)),
                by_lock=names.history_by_lock,
                by_expiry=names.history_by_expiry,
                # An acquire ends the lock's open holds: found among its few open
                # ones, not among every hold it had within the retention.
                open=names.history_open,
            )
        ),
        names.table_name,
        "create the history table",
    )


def history_retention(names: Names, retention_seconds: float) -> Statement:
    """Keep holds that end from now on ``retention_seconds`` after their end."""
    return Statement(
        _DDL_PREFIX
        + _render(
            sql.SQL(
                "ALTER TABLE {history} ALTER COLUMN keep_until SET DEFAULT now() + make_interval(secs => {retention})"
            ).format(history=names.history, retention=sql.Literal(float(retention_seconds)))
        ),
        names.table_name,
        "set the history's retention",
    )


def migrate_steps(names: Names) -> list[Statement]:
    """Add the token column to an existing table, online, one short step at a time.

    Each step is idempotent, and takes the table's lock only as long as a
    catalog change does: ``ADD COLUMN`` without a default and ``SET DEFAULT``
    rewrite nothing, and the unique index is built on a table of one row per
    lock. The caller runs each with a short ``lock_timeout`` and retries, so a
    step never queues behind a long transaction while holders wait behind it.
    """

    def step(what: str, composed: sql.Composable) -> Statement:
        return Statement(_DDL_PREFIX + _render(composed), names.table_name, what)

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
    ]


def session_setup(backend_pid: int, timeout_ms: int) -> str:
    """Whether the connection reaches PostgreSQL directly and, only if it does, its session settings.

    ``backend_pid`` is the process id the connection was given at start-up
    (psycopg's ``info.backend_pid``). A direct connection's is the server
    process running this statement; PgBouncer (in any mode) hands out its own,
    so a different one means a pooler sits between, and the settings are not
    made. Sent after a lock statement in the same message; the answer is the
    first column of the message's last result.
    """
    return _render(
        sql.SQL(
            """SELECT direct, CASE WHEN direct THEN
       set_config('default_transaction_isolation', 'read committed', false)
       || set_config('statement_timeout', {timeout_ms}, false) END
  FROM (SELECT pg_backend_pid() = {backend_pid} AS direct) AS connection"""
        ).format(backend_pid=sql.Literal(backend_pid), timeout_ms=sql.Literal(str(timeout_ms)))
    )


def listen(channel: str) -> str:
    return _render(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))


def unlisten(channel: str) -> str:
    return _render(sql.SQL("UNLISTEN {}").format(sql.Identifier(channel)))
