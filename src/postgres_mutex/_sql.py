"""Every SQL statement postgres-mutex sends, composed with `psycopg.sql`.

Identifiers are validated and quoted; every value is bound as a parameter.
Each lock operation is a single statement, so it costs one round trip, and
every time comparison uses the server's ``now()``: no client clock is ever
consulted, so clock skew between instances cannot corrupt the lock.
"""

from __future__ import annotations

import hashlib
import re

from psycopg import sql

# Unquoted-identifier shape: conservative, so a typo fails loudly at
# construction instead of silently naming a different, case-sensitive table.
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_$]*")
# PostgreSQL truncates identifiers past NAMEDATALEN - 1 bytes.
_MAX_IDENTIFIER_BYTES = 63


def parse_table(table: object) -> tuple[str, ...]:
    """Split ``"table"`` or ``"schema.table"`` into validated parts."""
    if not isinstance(table, str):
        raise TypeError(f"table must be a str, not {type(table).__name__}")
    parts = tuple(table.split("."))
    if len(parts) > 2:
        raise ValueError(f"table must be 'name' or 'schema.name', got {table!r}")
    for part in parts:
        if not _IDENTIFIER.fullmatch(part) or len(part.encode()) > _MAX_IDENTIFIER_BYTES:
            raise ValueError(
                f"table must be 'name' or 'schema.name' made of letters, digits, '_' or '$' "
                f"(at most {_MAX_IDENTIFIER_BYTES} bytes each, not starting with a digit), got {table!r}"
            )
    return parts


class Statements:
    """The statements for one lock table.

    Parameters (all bound): ``lock_name``, ``instance_id``, ``stale_seconds``,
    ``channel``, and ``token``: the ``acquired_at`` of the hold a heartbeat or
    release belongs to. Scoping those to the token means a statement of an
    earlier hold that reaches the server late can never touch a later hold.
    """

    def __init__(self, table: str) -> None:
        self.table_parts = parse_table(table)
        self.table_name = ".".join(self.table_parts)
        ident = sql.Identifier(*self.table_parts)
        # Index names share the schema's namespace: derive the unique
        # constraint's name from the table so several lock tables can coexist.
        # For the default table this is exactly the README's uq_mutex_lock.
        unique_name = sql.Identifier(f"uq_{self.table_parts[-1]}"[:_MAX_IDENTIFIER_BYTES])

        self.create_table = sql.SQL(
            """CREATE TABLE IF NOT EXISTS {table} (
  lock_name      VARCHAR(64) NOT NULL,
  locked         INT NOT NULL DEFAULT 1,
  instance_id    VARCHAR(64) NOT NULL,
  last_heartbeat TIMESTAMPTZ NOT NULL,
  acquired_at    TIMESTAMPTZ NOT NULL,
  CONSTRAINT {unique} UNIQUE (locked, lock_name),
  CONSTRAINT chk_locked CHECK (locked = 1)
)"""
        ).format(table=ident, unique=unique_name)

        # One statement decides everything an acquire needs:
        # - `current` reads the holder and its heartbeat age (for `contended`
        #   and the alert) from the statement's snapshot;
        # - the INSERT wins if no row exists; ON CONFLICT takes the row over
        #   only if it is stale or already ours (an earlier attempt whose reply
        #   was lost, or a restarted process reusing its id). The conflict
        #   check runs on the latest row version under a row lock, so two
        #   reclaimers can never both win;
        # - `xmax = 0` tells a fresh insert from a takeover. It works on every
        #   supported PostgreSQL; RETURNING OLD would need 18.
        self.acquire = sql.SQL(
            """WITH current AS (
  SELECT instance_id,
         EXTRACT(EPOCH FROM now() - last_heartbeat)::float8 AS heartbeat_age
    FROM {table}
   WHERE locked = 1 AND lock_name = %(lock_name)s
), taken AS (
  INSERT INTO {table} AS existing (lock_name, locked, instance_id, last_heartbeat, acquired_at)
  VALUES (%(lock_name)s, 1, %(instance_id)s, now(), now())
  ON CONFLICT (locked, lock_name) DO UPDATE
     SET instance_id = EXCLUDED.instance_id,
         last_heartbeat = EXCLUDED.last_heartbeat,
         acquired_at = EXCLUDED.acquired_at
   WHERE existing.instance_id = EXCLUDED.instance_id
      OR existing.last_heartbeat <= now() - make_interval(secs => %(stale_seconds)s)
  RETURNING existing.xmax = 0 AS inserted, existing.acquired_at
)
SELECT taken.inserted, current.instance_id, current.heartbeat_age, taken.acquired_at
  FROM (VALUES (1)) AS one (x)
  LEFT JOIN taken ON true
  LEFT JOIN current ON true"""
        ).format(table=ident)

        # Only last_heartbeat changes and it is in no index: the UPDATE stays
        # HOT, so heartbeats never bloat the unique index.
        self.heartbeat = sql.SQL(
            """UPDATE {table} SET last_heartbeat = now()
 WHERE locked = 1 AND lock_name = %(lock_name)s AND instance_id = %(instance_id)s
   AND acquired_at = %(token)s"""
        ).format(table=ident)

        # The DELETE and the wake-up of waiters are one statement: a waiter
        # LISTENing on the channel retries at once instead of at its next poll.
        release = """WITH released AS (
  DELETE FROM {table}
   WHERE locked = 1 AND lock_name = %(lock_name)s AND instance_id = %(instance_id)s{scope}
  RETURNING lock_name
)
SELECT pg_notify(%(channel)s, '') FROM released"""
        self.release = sql.SQL(release).format(table=ident, scope=sql.SQL("\n     AND acquired_at = %(token)s"))
        # After an unanswered acquire the token is unknown: remove any row of ours.
        self.cleanup = sql.SQL(release).format(table=ident, scope=sql.SQL(""))

        # The watcher's one query per tick: every held lock (or the watched
        # ones) with its ages by the server's clock.
        self.watch = sql.SQL(
            """SELECT lock_name, instance_id,
       EXTRACT(EPOCH FROM now() - last_heartbeat)::float8 AS heartbeat_age,
       EXTRACT(EPOCH FROM now() - acquired_at)::float8 AS held_for
  FROM {table}
 WHERE locked = 1 AND (%(lock_names)s::text[] IS NULL OR lock_name = ANY(%(lock_names)s::text[]))
 ORDER BY lock_name"""
        ).format(table=ident)

        # An operator's override: delete the lock whoever holds it, and say whom.
        self.force_release = sql.SQL(
            """WITH released AS (
  DELETE FROM {table}
   WHERE locked = 1 AND lock_name = %(lock_name)s
  RETURNING instance_id, EXTRACT(EPOCH FROM now() - last_heartbeat)::float8 AS heartbeat_age
)
SELECT instance_id, heartbeat_age, pg_notify(%(channel)s, '')::text FROM released"""
        ).format(table=ident)

    def channel(self, lock_name: str) -> str:
        """The NOTIFY channel for one lock of this table.

        One channel per lock, so waiters are woken only by their own lock; a
        digest keeps it under the 63-byte identifier limit whatever the names.
        """
        digest = hashlib.sha256(f"{self.table_name}\x00{lock_name}".encode()).hexdigest()
        return f"postgres_mutex_{digest[:40]}"

    @staticmethod
    def listen(channel: str) -> sql.Composed:
        return sql.SQL("LISTEN {}").format(sql.Identifier(channel))

    @staticmethod
    def unlisten(channel: str) -> sql.Composed:
        return sql.SQL("UNLISTEN {}").format(sql.Identifier(channel))
