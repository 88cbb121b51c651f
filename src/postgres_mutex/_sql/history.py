"""The history of holds (``<table>_history``): how a hold can end, what writes it, and its read.

A table with a history gets one row per hold, written by the lock statements
themselves, in the same statement (no second round trip, and no hold that is
in the table but not in its history): the parts of those statements that
write it are here, as common table expressions the lock statements append
(`acquire_history`, `heartbeat_alerts`, `hold_ended`). The history table
itself is created and its retention set by the schema statements.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from psycopg import sql

from .statement import Statement, statement

if TYPE_CHECKING:
    from .names import Names

HISTORY_ENDINGS = (
    "released",
    "reclaimed",
    "reclaimed_disconnected",
    "replaced",
    "lost",
    "abandoned",
    "force_released",
)
"""How a hold can end, in the history: released by its holder; reclaimed by another instance after
the stale threshold; reclaimed_disconnected, by another instance after the holder's
``reclaim_disconnected_after``, its database session having ended; replaced by its own instance (an
acquire that took its row back); lost (its
lease ran out and its row was deleted after); abandoned (a row an unanswered acquire left, deleted
by the clean-up); force_released (an operator's ``release --force``)."""


FAMILY = sql.SQL("split_part(lock_name, chr(31), 1)")
"""The lock a history row's hold was of: its ``lock_name`` up to the unit separator (`_state.rows`), so one
lock's name finds its mutex's holds, or its every permit's, reader's and writer's; the history's index is on
it (`_sql.schema.create_history`)."""


def acquire_history(names: Names) -> sql.Composable:
    """The acquire's part: a row for the new hold, the end of those it replaced, and the sweep of expired rows.

    Every hold of the lock still open in the history has ended: the one taken
    over (reclaimed, or taken back by its own instance), and any whose end
    nobody wrote (a process that keeps no history ended it): how is unknown.
    Expired rows go, a hundred at a time, so retention needs no cron job.
    SKIP LOCKED: acquires of other locks sweeping at the same moment never
    wait for each other (nor deadlock) over the same expired rows. Reads the
    acquire's ``inserted`` and ``taken``.
    """
    return sql.SQL(
        """, opened AS (
  INSERT INTO {history} (lock_name, token, holder, acquired_at, keep_until)
  SELECT %(lock_name)s, token, %(instance_id)s, acquired_at, NULL::timestamptz FROM inserted
  UNION ALL
  SELECT %(lock_name)s, token, %(instance_id)s, acquired_at, NULL::timestamptz FROM taken
), closed AS (
  UPDATE {history} AS past
     SET ended_at = now(), keep_until = DEFAULT,
         ended_how = CASE WHEN NOT EXISTS (SELECT 1 FROM taken) THEN NULL
                          WHEN past.holder = %(instance_id)s THEN 'replaced'
                          WHEN (SELECT heartbeat_age FROM current) < %(stale_seconds)s THEN 'reclaimed_disconnected'
                          ELSE 'reclaimed' END,
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


def acquire_permit_history(names: Names) -> sql.Composable:
    """`acquire_history` for a permit: the row's hold opened, the one it replaced ended, expired rows swept.

    Reads the permit acquire's ``won`` (the row it wrote, fresh or not) and ``current`` (its snapshot).
    """
    return sql.SQL(
        """, opened AS (
  INSERT INTO {history} (lock_name, token, holder, acquired_at, keep_until)
  SELECT lock_name, token, %(instance_id)s, acquired_at, NULL::timestamptz FROM won
), closed AS (
  UPDATE {history} AS past
     SET ended_at = now(), keep_until = DEFAULT,
         ended_how = CASE WHEN won.fresh THEN NULL
                          WHEN past.holder = %(instance_id)s THEN 'replaced'
                          WHEN (SELECT heartbeat_age FROM current WHERE current.lock_name = won.lock_name)
                               < %(stale_seconds)s THEN 'reclaimed_disconnected'
                          ELSE 'reclaimed' END,
         ended_by = CASE WHEN NOT won.fresh THEN %(instance_id)s END,
         alerts = past.alerts + CASE WHEN NOT won.fresh AND past.holder <> %(instance_id)s THEN 1 ELSE 0 END
    FROM won
   WHERE past.lock_name = won.lock_name AND past.ended_at IS NULL
), expired AS (
  DELETE FROM {history}
   WHERE id IN (SELECT id FROM {history} WHERE keep_until < now()
                 ORDER BY keep_until LIMIT 100 FOR UPDATE SKIP LOCKED)
)"""
    ).format(history=names.history)


def acquire_rw_history(names: Names, *, deleted: str) -> sql.Composable:
    """`acquire_permit_history` for a read/write lock's holder, and the end of the holds its acquire deleted.

    A reader's acquire deletes a dead writer's row, a writer's the rows of
    dead readers (``deleted``: the CTE that returns their ``lock_name``):
    those holds were reclaimed by this instance, as a row taken over is.
    """
    return sql.Composed(
        [
            acquire_permit_history(names),
            sql.SQL(
                """, reclaimed AS (
  UPDATE {history} AS past
     SET ended_at = now(), keep_until = DEFAULT,
         ended_how = CASE WHEN (SELECT heartbeat_age FROM current WHERE current.lock_name = gone_row.lock_name)
                               < %(stale_seconds)s THEN 'reclaimed_disconnected'
                          ELSE 'reclaimed' END,
         ended_by = %(instance_id)s,
         alerts = past.alerts + 1
    FROM {deleted} AS gone_row
   WHERE past.lock_name = gone_row.lock_name AND past.ended_at IS NULL
)"""
            ).format(history=names.history, deleted=sql.Identifier(deleted)),
        ]
    )


def heartbeat_alerts(names: Names) -> sql.Composable:
    """The heartbeat's part: one after a silence past the alert threshold ends an alert episode, and counts it.

    Reads the heartbeat's ``free`` (the rows it renews, with their previous heartbeat).
    """
    return sql.SQL(
        """, alerted AS (
  UPDATE {history} AS past SET alerts = past.alerts + 1
    FROM free
   WHERE free.previous <= now() - make_interval(secs => %(alert_seconds)s)
     AND past.lock_name = free.lock_name AND past.holder = free.instance_id
     AND past.acquired_at = free.acquired_at AND past.ended_at IS NULL
)"""
    ).format(history=names.history)


def hold_ended(names: Names) -> sql.Composable:
    """The part of a statement that deletes a lock's row: how the hold ended (``%(ended_how)s``).

    Reads the statement's ``released`` (the deleted rows). ``ended_by`` stays
    NULL: no other instance ended it (a reclaim is written by the acquire).
    """
    return sql.SQL(
        """, ended AS (
  UPDATE {history} AS past
     SET ended_at = now(), keep_until = DEFAULT, ended_how = %(ended_how)s, ended_by = NULL,
         alerts = past.alerts + CASE WHEN released.last_heartbeat
                                          <= now() - make_interval(secs => %(alert_seconds)s) THEN 1 ELSE 0 END
    FROM released
   WHERE past.lock_name = released.lock_name AND past.holder = released.instance_id
     AND past.acquired_at = released.acquired_at AND past.ended_at IS NULL
)"""
    ).format(history=names.history)


def read_history(names: Names) -> Statement:
    """The history, newest first: every hold of a lock (or of all), since a moment.

    A lock's holds are those of its rows: the mutex's one, a semaphore's
    numbered ones, a read/write lock's readers and writer (`FAMILY`); ``row``
    narrows them to one row's.
    """
    return statement(
        names.table_name,
        "read of the history",
        sql.SQL(
            """SELECT lock_name, token, holder, acquired_at, ended_at, ended_how, ended_by, alerts,
       EXTRACT(EPOCH FROM coalesce(ended_at, now()) - acquired_at)::float8
  FROM {history}
 WHERE (%(family)s::text IS NULL OR {family} = %(family)s)
   AND (%(row)s::text IS NULL OR lock_name = %(row)s)
   AND (%(since)s::timestamptz IS NULL OR coalesce(ended_at, 'infinity') >= %(since)s)
   AND (%(since_seconds)s::float8 IS NULL
        OR coalesce(ended_at, 'infinity') >= now() - make_interval(secs => %(since_seconds)s::float8))
 ORDER BY acquired_at DESC, id DESC
 LIMIT %(limit)s"""
        ).format(history=names.history, family=FAMILY),
    )
