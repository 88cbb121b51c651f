"""The statements of read/write locks: each holder is a row of the lock table, so these are two.

A read/write lock R has a gate, a row of ``<table>_rwlocks`` whose ``mode``
says which rows R may have: readers' (``'read'``) or one writer's
(``'write'``). A reader's row is named R, the unit separator, ``r`` and a
digest of its instance id; the writer's R, the separator and ``w``; both carry
``rwlock`` = R and ``rw_mode``. The heartbeat, the release, the clean-up and
the fence address a row by its ``lock_name`` with the mutex's statements. On
a table with a history, each acquire writes it as a permit's does, and ends
the holds of the dead holders' rows it deleted (`acquire_rw_history`).

The exclusion is the schema's (`_sql.schema`): a row's ``(rwlock, rw_mode)``
must match its gate, and the gate cannot change mode while a row of the other
mode refers to it, so readers and a writer never coexist; a unique index
allows one writer. These statements check first, so that a busy lock is
answered with a row that says so; a race lost between the check and the
write is refused by a constraint (or, rarely, ends in a deadlock the server
breaks), which aborts the statement: the acquire flow reads that error as
"busy", since nothing was written.

Writers are preferred: a blocking writer that finds the lock busy stamps the
gate's ``writer_waiting_until`` (now plus ``waiting_seconds``), moved on at
each of its attempts; while it is in the future, no new reader is let in. A
writer that stops waiting (or dies) stops moving it on, and readers proceed
once it passes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from psycopg import sql

from . import sessions
from .history import acquire_rw_history
from .kinds import adds
from .queue import writer_parts
from .statement import Statement, statement

if TYPE_CHECKING:
    from .names import Names
    from .shape import TableShape

_GATE = """WITH gate_made AS (
  INSERT INTO {rwlocks} (name, mode) VALUES (%(rwlock)s, {first_mode})
  ON CONFLICT DO NOTHING
  RETURNING mode, writer_waiting_until
), gate AS (
  SELECT mode, writer_waiting_until > now() IS TRUE AS writer_waits
    FROM (SELECT mode, writer_waiting_until FROM gate_made
          UNION ALL SELECT mode, writer_waiting_until FROM {rwlocks} WHERE name = %(rwlock)s) AS g
   LIMIT 1
), current AS (
  SELECT lock_name, rw_mode, instance_id, acquired_at, last_heartbeat, session_key, session_hold, reclaim_after,
         EXTRACT(EPOCH FROM now() - last_heartbeat)::float8 AS heartbeat_age
    FROM {table}
   WHERE locked = 1 AND rwlock = %(rwlock)s
){marker}, gone AS (
  SELECT lock_name FROM current
   WHERE last_heartbeat <= now() - make_interval(secs => %(stale_seconds)s) OR {disconnected_current}
), mine AS (
  UPDATE {table} AS existing
     SET last_heartbeat = now(),
         acquired_at = now(),
         token = nextval({sequence_text}){session_update}
   WHERE existing.locked = 1 AND existing.lock_name = %(row_name)s
     AND existing.instance_id = %(instance_id)s AND existing.acquired_at < now()
  RETURNING existing.lock_name, existing.acquired_at, existing.token
)"""

_NOT_FAIR = dict.fromkeys(("ahead", "turn", "waits", "queued"), sql.SQL(""))

_GONE_EXISTING = """(existing.last_heartbeat <= now() - make_interval(secs => %(stale_seconds)s)
          OR {disconnected_existing})"""

_REPLY = """
SELECT won.fresh, shown.instance_id, shown.heartbeat_age, won.acquired_at, won.token, won.lock_name,
       {retry}, (SELECT count(*) FROM current)::int, shown.rw_mode
  FROM (VALUES (1)) AS one (x)
  LEFT JOIN won ON true
  LEFT JOIN LATERAL (
    SELECT instance_id, heartbeat_age, rw_mode FROM current
     WHERE won.lock_name IS NULL OR current.lock_name = won.lock_name
        OR current.lock_name IN (SELECT lock_name FROM {reclaimed})
     ORDER BY rw_mode DESC, last_heartbeat LIMIT 1
  ) AS shown ON won.fresh IS NOT TRUE"""


def _format(names: Names, pieces: tuple[str, ...], **more: sql.Composable) -> sql.Composed:
    """The statement made of ``pieces``, each a template of the same names."""
    values = {
        "table": names.table,
        "rwlocks": names.rwlocks,
        "sequence_text": names.sequence_text,
        "marker": sessions.MARKER,
        "disconnected_current": sessions.disconnected("current"),
        "disconnected_existing": sessions.disconnected("existing"),
        **sessions.written_by_acquire(),
        **more,
    }
    return sql.Composed([sql.SQL(piece).format(**values) for piece in pieces])


def _history(names: Names, history: bool, *, deleted: str) -> sql.Composable:
    """With a history, the acquire's part that writes it (`acquire_rw_history`); else nothing."""
    return acquire_rw_history(names, deleted=deleted) if history else sql.SQL("")


def acquire_read(names: Names, *, history: bool = False) -> Statement:
    """A reader's attempt, in one statement.

    - ``mine`` takes back a reader row of ours (a lost reply, a restarted
      process reusing its id), as the mutex's acquire does;
    - a writer whose row is stale or disconnected is deleted (``dropped``),
      rechecked on the row's latest version under its row lock;
    - ``gate_opened`` turns a gate left at ``'write'`` back to ``'read'`` when no
      live writer holds and none waits (its NO ACTION foreign key refuses it
      while a writer's row remains);
    - ``inserted`` adds our reader row, when the gate says (or now says)
      ``'read'`` and no writer waits.

    The reply is the semaphore's shape: the mutex's five columns, the row's
    ``lock_name``, whether to try again at once (another reader was opening
    the gate), and how many rows R had in the snapshot; then the mode of the
    holder shown: whom a contender's alert names or, for a reclaim, the row
    this statement took over or deleted (a dead writer's).
    """
    pieces = (
        _GATE,
        """, live_writer AS (
  SELECT 1 FROM current WHERE rw_mode = 'write' AND lock_name NOT IN (SELECT lock_name FROM gone)
), dropped AS (
  DELETE FROM {table} AS existing
   WHERE existing.locked = 1 AND existing.rwlock = %(rwlock)s AND existing.rw_mode = 'write'
     AND existing.lock_name IN (SELECT lock_name FROM gone)
     AND NOT EXISTS (SELECT 1 FROM mine) AND NOT (SELECT writer_waits FROM gate)
     AND """,
        _GONE_EXISTING,
        """
  RETURNING existing.lock_name
), gate_opened AS (
  UPDATE {rwlocks} AS g SET mode = 'read'
   WHERE g.name = %(rwlock)s AND g.mode = 'write'
     AND NOT EXISTS (SELECT 1 FROM live_writer) AND NOT (SELECT writer_waits FROM gate)
     AND NOT EXISTS (SELECT 1 FROM mine)
  RETURNING g.mode
), inserted AS (
  INSERT INTO {table} AS fresh
         (lock_name, locked, instance_id, last_heartbeat, acquired_at, token{session_columns}, rwlock, rw_mode)
  SELECT %(row_name)s, 1, %(instance_id)s, now(), now(), nextval({sequence_text}){session_values},
         %(rwlock)s, 'read'
   WHERE NOT EXISTS (SELECT 1 FROM mine) AND NOT EXISTS (SELECT 1 FROM live_writer)
     AND NOT (SELECT writer_waits FROM gate)
     AND ((SELECT mode FROM gate) = 'read' OR EXISTS (SELECT 1 FROM gate_opened))
  ON CONFLICT DO NOTHING
  RETURNING fresh.lock_name, fresh.acquired_at, fresh.token
), won AS (
  SELECT NOT EXISTS (SELECT 1 FROM dropped) AS fresh, * FROM inserted
  UNION ALL SELECT false, * FROM mine
)""",
    )
    retry = sql.SQL(
        "CASE WHEN won.lock_name IS NULL AND (SELECT mode FROM gate) = 'write' AND NOT (SELECT writer_waits FROM gate)"
        " AND NOT EXISTS (SELECT 1 FROM live_writer) AND NOT EXISTS (SELECT 1 FROM gate_opened) THEN 1 END"
    )
    return statement(
        names.table_name,
        "acquire",
        _format(names, pieces, first_mode=sql.Literal("read"))
        + _history(names, history, deleted="dropped")
        + _format(names, (_REPLY,), retry=retry, reclaimed=sql.SQL("dropped")),
        preparable=True,
        marks=True,
    )


def acquire_write(names: Names, *, history: bool = False, fair: bool = False) -> Statement:
    """A writer's attempt, in one statement.

    - the gate is made at ``'write'`` if R had none (no row can refer to it yet);
    - ``mine`` takes back the writer row if it is ours;
    - ``others`` are the live rows of R not ours: while any exists the writer
      waits, and a blocking one (``%(waiting)s``) stamps the gate's
      ``writer_waiting_until`` so that no new reader comes in (``stamped``);
    - else stale or disconnected readers' rows are deleted (``cleared``), the
      gate is set to ``'write'`` (``gate_closed``: refused by the foreign key if a
      reader's row came in meanwhile, which aborts the statement) and its
      stamp cleared, and the writer row is inserted, or taken over if a stale
      writer's (``taken``, checked again under its row lock).

    The reply is `acquire_read`'s: for a reclaim, the holder shown is a row
    this statement deleted or took over, so its mode says whose hold it was
    (dead readers', or a dead writer's).

    ``fair``: a fair writer's (`_sql.queue.writer_parts`): it wins only if no
    live writer came before it, and is queued while it does not win.
    """
    pieces = (
        _GATE,
        """{ahead}, others AS (
  SELECT 1 FROM current
   WHERE lock_name NOT IN (SELECT lock_name FROM gone)
     AND NOT (lock_name = %(row_name)s AND instance_id = %(instance_id)s)
), stamped AS (
  UPDATE {rwlocks} AS g
     SET writer_waiting_until = GREATEST(g.writer_waiting_until, now() + make_interval(secs => %(waiting_seconds)s))
   WHERE g.name = %(rwlock)s AND %(waiting)s AND (EXISTS (SELECT 1 FROM others){waits})
     AND NOT EXISTS (SELECT 1 FROM mine)
  RETURNING 1
), cleared AS (
  DELETE FROM {table} AS existing
   WHERE existing.locked = 1 AND existing.rwlock = %(rwlock)s AND existing.rw_mode = 'read'
     AND existing.lock_name IN (SELECT lock_name FROM gone)
     AND NOT EXISTS (SELECT 1 FROM others) AND NOT EXISTS (SELECT 1 FROM mine){turn}
     AND """,
        _GONE_EXISTING,
        """
  RETURNING existing.lock_name
), gate_closed AS (
  UPDATE {rwlocks} AS g SET mode = 'write', writer_waiting_until = NULL
   WHERE g.name = %(rwlock)s AND NOT EXISTS (SELECT 1 FROM others) AND NOT EXISTS (SELECT 1 FROM mine){turn}
  RETURNING g.mode
), open_to_us AS (
  SELECT 1 FROM gate_closed UNION ALL SELECT 1 FROM gate_made
), taken AS (
  UPDATE {table} AS existing
     SET instance_id = %(instance_id)s,
         last_heartbeat = now(),
         acquired_at = now(),
         token = nextval({sequence_text}){session_update}
   WHERE existing.locked = 1 AND existing.lock_name = %(row_name)s AND existing.rw_mode = 'write'
     AND existing.lock_name IN (SELECT lock_name FROM gone)
     AND EXISTS (SELECT 1 FROM open_to_us){turn}
     AND """,
        _GONE_EXISTING,
        """
  RETURNING existing.lock_name, existing.acquired_at, existing.token
), inserted AS (
  INSERT INTO {table} AS fresh
         (lock_name, locked, instance_id, last_heartbeat, acquired_at, token{session_columns}, rwlock, rw_mode)
  SELECT %(row_name)s, 1, %(instance_id)s, now(), now(), nextval({sequence_text}){session_values},
         %(rwlock)s, 'write'
   WHERE EXISTS (SELECT 1 FROM open_to_us) AND NOT EXISTS (SELECT 1 FROM current WHERE rw_mode = 'write'){turn}
  ON CONFLICT DO NOTHING
  RETURNING fresh.lock_name, fresh.acquired_at, fresh.token
), won AS (
  SELECT NOT EXISTS (SELECT 1 FROM cleared) AS fresh, * FROM inserted
  UNION ALL SELECT false, * FROM mine
  UNION ALL SELECT false, * FROM taken
)""",
    )
    parts = writer_parts(names) if fair else _NOT_FAIR
    return statement(
        names.table_name,
        "acquire",
        _format(names, pieces, first_mode=sql.Literal("write"), **parts)
        + _history(names, history, deleted="cleared")
        + parts["queued"]
        + _format(names, (_REPLY,), retry=sql.SQL("NULL::int"), reclaimed=sql.SQL("cleared")),
        preparable=True,
        marks=True,
    )


@adds
def _statements(names: Names, shape: TableShape) -> dict[str, Statement | None]:
    """A read/write lock's statements for a table of ``shape``, and a fair writer's where it has the queue."""
    # The gates' table and columns, and tokens and sessions, which every migration adds before them.
    ready = shape.rwlocks and shape.tokens and shape.sessions
    fair = ready and shape.fair
    return {
        "acquire_read": acquire_read(names, history=shape.history) if ready else None,
        "acquire_write": acquire_write(names, history=shape.history) if ready else None,
        "acquire_write_fair": acquire_write(names, history=shape.history, fair=True) if fair else None,
    }
