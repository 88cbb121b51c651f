"""A holder's database session, named in its row: the parts of the lock statements that write and read it.

A holder that opts in to ``reclaim_disconnected_after`` names its session in
its row, so that a contender may reclaim the row early once that session has
ended, and only then. The name is a *session key*: a random 63-bit number that
each connection of the library's own takes as a session-level advisory lock
(``pg_try_advisory_lock``) the first time a statement needs it. PostgreSQL
releases it when the session ends, whichever way: the process exited or was
killed, the connection was cut, the server restarted or failed over. A process
that is merely slow or frozen keeps its connection, and its key.

Three columns carry it: ``session_key``; ``session_hold``, the ``acquired_at``
of the hold the key belongs to, so a row taken over by a process that knows
nothing of keys (0.1.0, which leaves the columns alone) is never judged by a
former holder's key; and ``reclaim_after``, the holder's own
``reclaim_disconnected_after`` in seconds. A contender asks whether the key is
still held with ``pg_try_advisory_xact_lock_shared``: it fails at once while the
holder's session holds the key, and when it succeeds the lock it took ends
with the contender's transaction. Nobody needs a privilege for either, and
neither depends on process ids, which the server reuses.

The key is written only by a statement that reaches PostgreSQL directly: a
pooler may run the statement on a server session that outlives the client,
or share one among clients. Behind one (``pg_backend_pid()`` is not the
process id the connection was given) the key is NULL, and the hold falls back
to ``stale_threshold``.
"""

from __future__ import annotations

from psycopg import sql

COLUMNS = ("session_key", "session_hold", "reclaim_after")
"""The lock table's columns that name a holder's session."""

MARKER = sql.SQL(
    """, marker AS MATERIALIZED (
  SELECT CASE WHEN %(_session_key)s::bigint IS NOT NULL AND pg_backend_pid() = %(_backend_pid)s::int
              THEN CASE WHEN pg_try_advisory_lock(%(_session_key)s::bigint) THEN %(_session_key)s::bigint END
         END AS session
)"""
)
"""This statement's session key, once its session holds it: NULL behind a pooler. Read with
``(SELECT session FROM marker)``, evaluated only where needed (at most once a statement). Each
evaluation takes the key again: session-level advisory locks count, and a count only grows, at no
cost, until the session ends and with it every count of the key."""

KEY_NOW = sql.SQL("(SELECT session FROM marker)")


def written_by_acquire() -> dict[str, sql.Composable]:
    """What the acquire writes: the columns, their values for a new row, and their update for a row taken over."""
    return {
        "session_columns": sql.SQL(", session_key, session_hold, reclaim_after"),
        "session_values": sql.SQL(
            ", CASE WHEN %(reclaim_seconds)s::float8 IS NOT NULL THEN {key} END, now(), %(reclaim_seconds)s::float8"
        ).format(key=KEY_NOW),
        "session_update": sql.SQL(
            """,
         session_key = CASE WHEN %(reclaim_seconds)s::float8 IS NOT NULL THEN {key} END,
         session_hold = now(),
         reclaim_after = %(reclaim_seconds)s::float8"""
        ).format(key=KEY_NOW),
    }


UNNAMED_BY_ACQUIRE: dict[str, sql.Composable] = {
    "session_columns": sql.SQL(", session_key, session_hold, reclaim_after"),
    "session_values": sql.SQL(", NULL, now(), NULL"),
    "session_update": sql.SQL(
        """,
         session_key = NULL,
         session_hold = now(),
         reclaim_after = NULL"""
    ),
}
"""`written_by_acquire` for a holder that names no session (no ``reclaim_disconnected_after``): the same
values, written without the parameter or the key."""


def disconnected(row: str) -> sql.Composable:
    """Whether ``row``'s holder may be reclaimed early: it opted in, its heartbeat is older than its own
    ``reclaim_after``, and its session is gone. The session is asked last, and only then (a CASE: the
    order of an AND's terms is the planner's)."""
    return sql.SQL(
        """CASE WHEN {row}.session_key IS NOT NULL AND {row}.session_hold = {row}.acquired_at
               AND {row}.last_heartbeat <= now() - make_interval(secs => {row}.reclaim_after)
               AND {row}.session_key IS DISTINCT FROM %(_session_key)s::bigint
          THEN pg_try_advisory_xact_lock_shared({row}.session_key) ELSE false END"""
    ).format(row=sql.Identifier(row))


def renewed_by_heartbeat(row: str) -> sql.Composable:
    """The heartbeat's part: the key of the session that renews an opted-in hold, now (NULL behind a pooler)."""
    return sql.SQL(
        """,
         session_key = CASE WHEN {row}.reclaim_after IS NULL THEN {row}.session_key ELSE {key} END"""
    ).format(row=sql.Identifier(row), key=KEY_NOW)


def read_by_holders() -> sql.Composable:
    """What a read of the table says of each holder's session: alive (or NULL: not named, or not known),
    and ``reclaim_after``.

    The reader's own session is alive: its key is its own, which a try from the
    same session would take. A standby knows nothing of the primary's sessions
    (none of its own holds a key): read there, every session is unknown.
    """
    return sql.SQL(
        """CASE WHEN session_key IS NULL OR session_hold IS DISTINCT FROM acquired_at THEN NULL
            WHEN pg_is_in_recovery() THEN NULL
            WHEN session_key = %(_session_key)s::bigint THEN true
            ELSE NOT pg_try_advisory_xact_lock_shared(session_key) END AS session_alive,
       CASE WHEN session_hold = acquired_at THEN reclaim_after END AS reclaim_after"""
    )


NOT_READ = sql.SQL("NULL::boolean AS session_alive, NULL::float8 AS reclaim_after")
"""What a read of a table without the session columns says of its holders' sessions."""
