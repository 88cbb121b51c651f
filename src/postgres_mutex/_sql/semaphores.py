"""The statements of semaphores: a permit is a row of the lock table, so these are few.

A hold of one permit of semaphore S is a row of the lock table whose
``lock_name`` is S, the unit separator (``chr(31)``) and the permit's number,
and whose ``semaphore``, ``permit`` and ``permits`` columns say the same. The
heartbeat, the release and the fence address it by that ``lock_name`` like
any mutex's row, with the mutex's statements. What is new is taking a permit
(`acquire_permit`), the clean-up of a stray one, and the administrator's
change of a semaphore's number of permits (`set_permits`).

The limit is the schema's, not these statements' (`_sql.schema`): a permit
row must name a semaphore declared with exactly the row's number N, a permit
below N, and one row per permit. Whatever a client sends, N + 1 rows cannot
exist.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from psycopg import sql

from . import sessions
from .history import acquire_permit_history, hold_ended
from .kinds import adds
from .queue import permit_parts
from .statement import Statement, statement
from .wake import WAKE_ALL, after_release

if TYPE_CHECKING:
    from .names import Names
    from .shape import TableShape

_NOTHING = sql.SQL("")

_NOT_FAIR = dict.fromkeys(("ahead", "insert_if", "take_if", "queued"), _NOTHING)


def acquire_permit(names: Names, *, history: bool, fair: bool = False) -> Statement:
    """One statement per attempt, in the spirit of the mutex's acquire.

    - ``declared`` creates the semaphore with this Semaphore's N if nobody has
      (racing declarers: the first one's N stands; no conflict target, since
      a racer's row conflicts on the (name, permits) key the foreign key
      needs as well as on the name, and a conflict on a key that is not the
      target is an error, not nothing); ``stored`` reads it, and
      nothing is written unless it agrees with ours (``agreed``): the reply
      carries the stored N, so the client can say both;
    - ``mine`` takes back a permit row of ours (a lost reply, or a restarted
      process reusing its id), as the mutex's acquire does;
    - else ``inserted`` takes a free permit chosen at random, so contenders
      rarely race for the same one; a row that appeared meanwhile is left
      alone (DO NOTHING), so a contender never waits on a held permit;
    - else ``taken`` takes over a permit row that is stale, or whose holder
      opted in to ``reclaim_disconnected_after`` and whose session ended,
      checked again on the row's latest version under its row lock, so two
      reclaimers never both win.

    ``fair``: a fair Semaphore's (`_sql.queue.permit_parts`): a free permit
    goes to the oldest live waiters first, and the caller is queued while
    nothing is won.

    The reply: whether a fresh row won (NULL: nothing won), the holder shown
    (the previous one of a row taken over; else the one with the oldest
    heartbeat) and its heartbeat age, the hold's stamp and token, its row's
    ``lock_name``, the stored N, and how many permits were held in the
    statement's snapshot.
    """
    written = sessions.written_by_acquire()
    return statement(
        names.table_name,
        "acquire",
        sql.SQL(
            """WITH declared AS (
  INSERT INTO {semaphores} (name, permits) VALUES (%(semaphore)s, %(permits)s)
  ON CONFLICT DO NOTHING
  RETURNING permits
), stored AS (
  SELECT COALESCE((SELECT permits FROM declared),
                  (SELECT permits FROM {semaphores} WHERE name = %(semaphore)s)) AS permits
), agreed AS (
  SELECT permits FROM stored WHERE permits = %(permits)s
), current AS (
  SELECT lock_name, permit, instance_id, acquired_at, last_heartbeat, session_key, session_hold, reclaim_after,
         EXTRACT(EPOCH FROM now() - last_heartbeat)::float8 AS heartbeat_age
    FROM {table}
   WHERE locked = 1 AND semaphore = %(semaphore)s
){marker}{ahead}, mine AS (
  UPDATE {table} AS existing
     SET last_heartbeat = now(),
         acquired_at = now(),
         token = nextval({sequence_text}){session_update}
   WHERE existing.locked = 1
     AND existing.lock_name = (SELECT lock_name FROM current WHERE instance_id = %(instance_id)s
                                ORDER BY permit LIMIT 1)
     AND existing.instance_id = %(instance_id)s AND existing.acquired_at < now()
     AND EXISTS (SELECT 1 FROM agreed)
  RETURNING existing.lock_name, existing.acquired_at, existing.token
), free AS (
  SELECT permit FROM agreed, generate_series(0, agreed.permits - 1) AS permit
   WHERE permit NOT IN (SELECT permit FROM current)
), inserted AS (
  INSERT INTO {table} AS fresh
         (lock_name, locked, instance_id, last_heartbeat, acquired_at, token{session_columns},
          semaphore, permit, permits)
  SELECT %(semaphore)s || chr(31) || chosen.permit, 1, %(instance_id)s, now(), now(),
         nextval({sequence_text}){session_values}, %(semaphore)s, chosen.permit, %(permits)s
    FROM (SELECT permit FROM free ORDER BY random() LIMIT 1) AS chosen
   WHERE NOT EXISTS (SELECT 1 FROM mine){insert_if}
  ON CONFLICT DO NOTHING
  RETURNING fresh.lock_name, fresh.acquired_at, fresh.token
), taken AS (
  UPDATE {table} AS existing
     SET instance_id = %(instance_id)s,
         last_heartbeat = now(),
         acquired_at = now(),
         token = nextval({sequence_text}){session_update}
   WHERE existing.locked = 1
     AND existing.lock_name = (SELECT lock_name FROM current
                                WHERE last_heartbeat <= now() - make_interval(secs => %(stale_seconds)s)
                                   OR {disconnected_current}
                                ORDER BY last_heartbeat LIMIT 1)
     AND NOT EXISTS (SELECT 1 FROM mine) AND NOT EXISTS (SELECT 1 FROM free){take_if}
     AND (existing.last_heartbeat <= now() - make_interval(secs => %(stale_seconds)s)
          OR {disconnected_existing})
  RETURNING existing.lock_name, existing.acquired_at, existing.token
), won AS (
  SELECT true AS fresh, * FROM inserted
  UNION ALL SELECT false, * FROM mine
  UNION ALL SELECT false, * FROM taken
){history}{queued}
SELECT won.fresh, shown.instance_id, shown.heartbeat_age, won.acquired_at, won.token, won.lock_name,
       (SELECT permits FROM stored), (SELECT count(*) FROM current)::int
  FROM (VALUES (1)) AS one (x)
  LEFT JOIN won ON true
  LEFT JOIN LATERAL (
    SELECT instance_id, heartbeat_age FROM current
     WHERE won.lock_name IS NULL OR current.lock_name = won.lock_name
     ORDER BY last_heartbeat LIMIT 1
  ) AS shown ON won.fresh IS NOT TRUE"""
        ).format(
            table=names.table,
            semaphores=names.semaphores,
            sequence_text=names.sequence_text,
            marker=sessions.MARKER,
            disconnected_current=sessions.disconnected("current"),
            disconnected_existing=sessions.disconnected("existing"),
            history=acquire_permit_history(names) if history else _NOTHING,
            **written,
            **(permit_parts(names) if fair else _NOT_FAIR),
        ),
        preparable=True,
        marks=True,
    )


def cleanup_permit(names: Names, *, history: bool) -> Statement:
    """After an unanswered acquire: delete any permit row of ours of this semaphore, and wake its waiters.

    Which permit the statement took is unknown; at most one row of ours can
    be the semaphore's (an acquire takes a row of ours back before any other).
    """
    return statement(
        names.table_name,
        "clean-up",
        sql.SQL(
            """WITH released AS (
  DELETE FROM {table}
   WHERE locked = 1 AND semaphore = %(semaphore)s AND instance_id = %(instance_id)s
  RETURNING lock_name, instance_id, acquired_at, last_heartbeat
){ended}
SELECT {notify} FROM released"""
        ).format(table=names.table, ended=hold_ended(names) if history else _NOTHING, notify=after_release("released")),
    )


def set_permits(names: Names, *, history: bool) -> Statement:
    """An administrator's change of a semaphore's N, in one statement (one transaction).

    The permit rows at or above the new N are deleted (their holders learn it
    at their next heartbeat, as after a forced release), the semaphore's
    waiters are woken, and N is changed, carried over to the remaining rows
    by the foreign key's ON UPDATE CASCADE; a semaphore nobody declared yet
    is declared. Its notification's payload is ``*``: a raised N frees many
    permits at once, so every waiter of each process tries, not one. A
    permit taken with the old N meanwhile makes the change fail on the
    permits' check (the caller sends it again), never succeed
    with more than N holders. Waits for a fenced transaction's row lock only
    briefly, as the forced release does. Replies the previous N (NULL if
    none) and how many holders were released.
    """
    return statement(
        names.table_name,
        "change of the number of permits",
        sql.SQL(
            """SET LOCAL lock_timeout = %(lock_timeout_ms)s; WITH previous AS (
  SELECT permits FROM {semaphores} WHERE name = %(semaphore)s
), released AS (
  DELETE FROM {table}
   WHERE locked = 1 AND semaphore = %(semaphore)s AND permit >= %(permits)s
  RETURNING lock_name, instance_id, acquired_at, last_heartbeat
){ended}, changed AS (
  INSERT INTO {semaphores} (name, permits) VALUES (%(semaphore)s, %(permits)s)
  ON CONFLICT (name) DO UPDATE SET permits = EXCLUDED.permits
  RETURNING permits
)
SELECT (SELECT permits FROM previous), (SELECT count(*) FROM released)::int,
       (SELECT count(*) FROM changed)::int, pg_notify(%(channel)s, {wake_all})::text"""
        ).format(
            table=names.table,
            semaphores=names.semaphores,
            wake_all=sql.Literal(WAKE_ALL),
            ended=hold_ended(names) if history else _NOTHING,
        ),
    )


@adds
def _statements(names: Names, shape: TableShape) -> dict[str, Statement | None]:
    """A semaphore's statements for a table of ``shape``, and a fair one's where it has the queue of waiters."""
    # The permit columns, and tokens and sessions, which every migration adds before them.
    ready = shape.semaphores and shape.tokens and shape.sessions
    fair = ready and shape.fair
    return {
        "acquire_permit": acquire_permit(names, history=shape.history) if ready else None,
        "cleanup_permit": cleanup_permit(names, history=shape.history) if ready else None,
        "set_permits": set_permits(names, history=shape.history) if ready else None,
        "acquire_permit_fair": acquire_permit(names, history=shape.history, fair=True) if fair else None,
    }
