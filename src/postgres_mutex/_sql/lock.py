"""The lock's statements (`Statements`): acquire, heartbeat, release and the rest, for one table of one shape.

Each lock operation is a single statement, so it costs one round trip, and
every time comparison uses the server's ``now()``: no client clock is ever
consulted, so clock skew between instances cannot corrupt the lock. The
release and the wake-up of waiters are one statement too: ``pg_notify`` on
the channel of the one process to wake, which LISTENs there (`_sql.wake`).

Tables come in shapes: the README's five columns; the same plus a ``token``
column (fencing tokens) fed by a sequence named after the table; and, for
holders that opt in to ``reclaim_disconnected_after``, three columns that
name the holder's database session (`_sql.sessions`). `TableShape` says which
one a statement set is for, and whether the table keeps a history, which the
same statements then write (`_sql.history`).
"""

from __future__ import annotations

from collections.abc import Mapping

from psycopg import sql

from . import leases, sessions
from .functions import ACQUIRE, WAKE, Function, define
from .history import acquire_history, heartbeat_alerts, hold_ended, read_history
from .kinds import added
from .names import Names
from .queue import acquire_parts
from .shape import CURRENT, TableShape
from .statement import Statement, render, statement
from .wake import WAKE_EACH_PROCESS, after_release, nobody_waits

_NOTHING = sql.SQL("")

_TOKEN_IF_ANY = sql.SQL("(to_jsonb({}) -> 'token')::bigint")
"""The row's token if the table has that column, else NULL: valid SQL on both shapes."""


class Statements:
    """The statements for one lock table of one shape.

    Parameters (all bound): ``lock_name``, ``instance_id``, ``stale_seconds``,
    ``channel``, and ``acquired_at``: the stamp of the hold a heartbeat or
    release belongs to. Scoping those to it means a statement of an earlier
    hold that reaches the server late can never touch a later hold.

    Only the acquire and the release are prepared (on a direct connection):
    they are what a lock cycle costs, and their parameters are single values
    matched against the table's unique key, so the plan the server keeps for
    any value is the one it would make for each. A heartbeat carries an array
    of holds (up to a few hundred): planned for its length each time, since a
    kept plan guesses ten rows whatever the array holds.

    Each kind of lock but the mutex adds its own (`_sql.kinds`): None where the table lacks its columns.
    """

    acquire_permit: Statement | None
    cleanup_permit: Statement | None
    set_permits: Statement | None
    acquire_read: Statement | None
    acquire_write: Statement | None
    release_fair: Statement | None
    leave_fair: Statement | None
    acquire_permit_fair: Statement | None
    release_permit_fair: Statement | None
    leave_permit_fair: Statement | None
    acquire_write_fair: Statement | None
    release_write_fair: Statement | None
    leave_write_fair: Statement | None

    def __init__(self, names: Names, shape: TableShape) -> None:
        self.names = names
        self.shape = shape
        self.acquire = _acquire(names, shape)
        # The common case's pair: a holder that names no session and asks for no minimum hold, on a table
        # without a history (which every acquire and release writes to).
        plain = shape.tokens and not shape.history
        self.acquire_plain: Statement | None = _acquire(names, shape, plain=True) if plain else None
        self.release_plain: Statement | None = _release_plain(names) if plain else None
        if plain and shape.functions:
            # The same pair, each set up on the server only as far as it runs (`_sql.functions`).
            self.acquire_plain = lock_functions(names)[0].call
            self.release_plain = _release_plain(names, wake=names.wake_function)
        self.heartbeat, self.heartbeat_waiting = _heartbeats(names, shape, _BY_HOLD)
        self.heartbeat_by_token: tuple[Statement, Statement] | None = (
            _heartbeats(names, shape, _BY_TOKEN) if shape.tokens else None
        )
        # By lease (`_sql.leases`): the per-row heartbeat that points its rows at the lease, and the lease's renewal.
        self.heartbeat_leased: tuple[Statement, Statement] | None = (
            _heartbeats(names, shape, _BY_TOKEN, leased=True) if shape.renews_by_lease else None
        )
        self.renew_lease: Statement | None = leases.renew(names) if shape.renews_by_lease else None
        # The lease's renewal with the rows whose own heartbeat is due: one statement a round.
        self.renew_lease_with_rows: Statement | None = (
            _heartbeats(names, shape, _BY_TOKEN, renewing=True)[0] if shape.renews_by_lease else None
        )
        self.end_lease: Statement | None = leases.end(names) if shape.renews_by_lease else None
        self.release = (
            _release_keeping_minimum(names, shape)
            if shape.holds
            else _release(
                names, shape, "release", scope=sql.SQL("\n     AND acquired_at = %(acquired_at)s"), preparable=True
            )
        )
        # After an unanswered acquire the stamp is unknown: remove any row of ours, but for one a release
        # kept for its minimum hold (the job it covered ran).
        self.cleanup = _release(
            names,
            shape,
            "clean-up",
            scope=sql.SQL("\n     AND NOT {}").format(_RELEASED.format(row=sql.SQL("hold_until")))
            if shape.holds
            else _NOTHING,
            preparable=False,
        )
        # A fair Mutex's (`_sql.fair`): None where the table has no queue of waiters yet.
        self.acquire_fair: Statement | None = _acquire(names, shape, fair=True) if shape.fair else None
        self.retoken = _retoken(names) if shape.tokens else None
        self.holders = _holders(names, shape)
        self.writers_waiting: Statement | None = _writers_waiting(names) if shape.rwlocks else None
        self.force_release = _force_release(names, shape)
        self.history = read_history(names) if shape.history else None
        for attribute, made in added(names, shape).items():
            setattr(self, attribute, made)


def _acquire(names: Names, shape: TableShape, *, plain: bool = False, fair: bool = False) -> Statement:
    """One statement decides everything an acquire needs.

    - ``current`` reads the holder and its heartbeat age (for `contended` and
      the alert) from the statement's snapshot;
    - ``inserted`` wins if no row exists; a row that exists is left alone,
      unlocked (DO NOTHING), so a contender never waits on a held lock;
    - ``taken`` takes an existing row over only if it is stale, or its holder
      opted in to ``reclaim_disconnected_after`` and its session ended
      (`_sql.sessions`), or ours from an earlier statement (a reply that was
      lost, or a restarted process reusing its id). Only a row that qualifies in the snapshot is locked;
      the condition is checked again on its latest version under that row
      lock, so two reclaimers can never both win, and a reclaim waits for a
      holder's fenced transaction to end. ``acquired_at <`` keeps a statement
      of ours that was cut off but still ran on the server from overwriting a
      later hold of ours;
    - every acquisition draws a new token from the sequence when it writes
      the row, so it is greater than any token issued before.

    ``plain``: for a holder that names no session and asks for no minimum
    hold (``reclaim_disconnected_after`` and ``hold_at_least`` unset), on a
    table with tokens and no history: the same decisions, with three values
    bound instead of seven (four where rows name sessions: the caller's own
    session, never reclaimed from), and the INSERT's row answered alone when it
    won, so the common case costs the server little more than the INSERT;
    the reads and the take-over run only when a row was in the way (`_PLAIN`).

    ``fair``: a fair lock's (`_sql.queue`), which also queues the caller while the lock is not won.
    """
    return statement(
        names.table_name,
        "acquire",
        _ACQUIRE.format(**_acquire_parts(names, shape, plain=plain, fair=fair)),
        preparable=True,
        marks=shape.sessions,
    )


_INSERT = sql.SQL(
    """INSERT INTO {table} AS fresh
         (lock_name, locked, instance_id, last_heartbeat, acquired_at{token_column}{session_columns}{hold_column})
  {rows}(%(lock_name)s, 1, %(instance_id)s, now(), now(){new_token}{session_values}{hold_value}){rows_if}
  ON CONFLICT (locked, lock_name) DO NOTHING
  RETURNING acquired_at, {inserted_token} AS token"""
)
"""The acquire's INSERT: wins if no row exists, and leaves a row that exists alone (`_acquire`)."""

_ACQUIRE = sql.SQL(
    """WITH current AS (
  SELECT instance_id, acquired_at,
         EXTRACT(EPOCH FROM now() - {current_heartbeat})::float8 AS heartbeat_age, {released} AS released
    FROM {table}
   WHERE locked = 1 AND lock_name = %(lock_name)s
){marker}{ahead}, inserted AS (
  {insert}
), taken AS (
  UPDATE {table} AS existing
     SET instance_id = %(instance_id)s,
         last_heartbeat = now(),
         acquired_at = now(){update_token}{session_update}{hold_update}{lease_update}
   WHERE existing.locked = 1 AND existing.lock_name = %(lock_name)s
     AND NOT EXISTS (SELECT 1 FROM inserted)
     AND ((existing.instance_id = %(instance_id)s AND existing.acquired_at < now())
          OR (({existing_heartbeat} <= now() - make_interval(secs => %(stale_seconds)s){disconnected})
              {hold_passed}){released_over}){turn}
  RETURNING existing.acquired_at, {taken_token} AS token
){history}{queued}
{answer}"""
)


def _acquire_parts(names: Names, shape: TableShape, *, plain: bool, fair: bool) -> dict[str, sql.Composable]:
    """What `_ACQUIRE` and `_INSERT` are made of for ``shape`` (`_acquire`)."""
    tokens = shape.tokens
    written: Mapping[str, sql.Composable]
    if not shape.sessions:
        written = dict.fromkeys(sessions.written_by_acquire(), _NOTHING)
    elif plain:
        written = sessions.UNNAMED_BY_ACQUIRE
    else:
        written = sessions.written_by_acquire()
    hold = _minimum_hold(shape, plain=plain)
    parts = {
        "answer": (_PLAIN if plain else _ANSWER).format(was_released=hold["was_released"]),
        "table": names.table,
        "token_column": sql.SQL(", token") if tokens else _NOTHING,
        "new_token": sql.SQL(", nextval({})").format(names.sequence_text) if tokens else _NOTHING,
        "update_token": sql.SQL(",\n         token = nextval({})").format(names.sequence_text) if tokens else _NOTHING,
        # Without a token column in this shape, still read one if the table has
        # gained it since (a migration while this process ran): the flow
        # then inspects the table again.
        "inserted_token": sql.SQL("fresh.token") if tokens else _TOKEN_IF_ANY.format(sql.Identifier("fresh")),
        "taken_token": sql.SQL("existing.token") if tokens else _TOKEN_IF_ANY.format(sql.Identifier("existing")),
        "history": acquire_history(names) if shape.history and not plain else _NOTHING,
        "marker": sessions.MARKER if shape.sessions and not plain else _NOTHING,
        "disconnected": sql.SQL("\n          OR {}").format(sessions.disconnected("existing"))
        if shape.sessions
        else _NOTHING,
        **written,
        **hold,
        **(acquire_parts(names) if fair else _NOT_FAIR),
        **_lease_parts(names, shape),
    }
    parts["insert"] = _INSERT.format(**parts)
    return parts


_NOT_FAIR = {
    "ahead": _NOTHING,
    "rows": sql.SQL("VALUES "),
    "rows_if": _NOTHING,
    "turn": _NOTHING,
    "queued": _NOTHING,
}


def _lease_parts(names: Names, shape: TableShape) -> dict[str, sql.Composable]:
    """The acquire's parts for leases (`_sql.leases`), kept apart: a row is judged by the later of its own heartbeat
    and its lease's, and a take-over stops following the former holder's lease."""
    return {
        "current_heartbeat": leases.effective_heartbeat(names, names.table)
        if shape.leases
        else sql.SQL("last_heartbeat"),
        "existing_heartbeat": leases.effective_heartbeat(names, sql.Identifier("existing"))
        if shape.leases
        else sql.SQL("existing.last_heartbeat"),
        # Cleared by any role, whether or not it may read the leases.
        "lease_update": sql.SQL(",\n         lease_key = NULL") if shape.lease_column else _NOTHING,
    }


_ANSWER = sql.SQL(
    """SELECT CASE WHEN EXISTS (SELECT 1 FROM inserted) THEN true
            WHEN EXISTS (SELECT 1 FROM taken) THEN {was_released} END,
       current.instance_id, current.heartbeat_age,
       COALESCE((SELECT acquired_at FROM inserted), (SELECT acquired_at FROM taken)),
       COALESCE((SELECT token FROM inserted), (SELECT token FROM taken))
  FROM (VALUES (1)) AS one (x)
  LEFT JOIN current ON true"""
)
"""The acquire's one row: ``(won, holder, heartbeat_age, acquired_at, token)`` (`_state.outcome.interpret_acquire`)."""

_PLAIN = sql.SQL(
    """SELECT true, NULL::varchar, NULL::float8, acquired_at, token FROM inserted
UNION ALL
SELECT CASE WHEN EXISTS (SELECT 1 FROM taken) THEN {was_released} END,
       current.instance_id, current.heartbeat_age,
       (SELECT acquired_at FROM taken), (SELECT token FROM taken)
  FROM (VALUES (1)) AS one (x)
  LEFT JOIN current ON true
 WHERE NOT EXISTS (SELECT 1 FROM inserted)"""
)
"""`_ANSWER` in two halves, of which one answers: the inserted row's, alone, or (only when a row was in the way,
a condition the server checks once, before either half runs) the snapshot's holder and the take-over's.

``taken`` is skipped the same way (its ``NOT EXISTS (SELECT 1 FROM inserted)``), so a won INSERT costs no
read of the row and no UPDATE. A holder the snapshot showed is not answered with the inserted row: that
holder released meanwhile, and `interpret_acquire` reads an inserted row as a plain acquire anyway."""


def _minimum_hold(shape: TableShape, *, plain: bool = False) -> dict[str, sql.Composable]:
    """The acquire's parts for a minimum hold (``hold_until``; nothing on a table without that column).

    The acquire writes ``hold_until`` (``%(hold_seconds)s`` from now; NULL
    without a minimum). A release before it keeps the row, marked released
    (`_release`): its ``acquired_at`` and ``last_heartbeat`` set to
    ``hold_until``, which a live hold never has, so neither its old holder's
    statements nor its own instance's acquire (``acquired_at < now()``) take
    it before then. Until ``hold_until`` has passed, no reclaim takes a row
    (stale or disconnected alike): a killed holder keeps its minimum too. A
    released row past ``hold_until`` is free: taken as a fresh acquire is,
    with no reclaim to tell (``was_released``: the acquire's first column).
    ``plain``: an acquire without a minimum writes NULL, unbound.
    """
    if not shape.holds:
        return {
            "released": sql.SQL("false"),
            "hold_column": _NOTHING,
            "hold_value": _NOTHING,
            "hold_update": _NOTHING,
            "hold_passed": _NOTHING,
            "released_over": _NOTHING,
            "was_released": sql.SQL("false"),
        }
    hold_until = sql.SQL("NULL") if plain else sql.SQL("now() + make_interval(secs => %(hold_seconds)s::float8)")
    return {
        "released": _RELEASED.format(row=sql.SQL("hold_until")),
        "hold_column": sql.SQL(", hold_until"),
        "hold_value": sql.SQL(", {}").format(hold_until),
        "hold_update": sql.SQL(",\n         hold_until = {}").format(hold_until),
        "hold_passed": sql.SQL("AND (existing.hold_until IS NULL OR existing.hold_until <= now())"),
        "released_over": sql.SQL(
            "\n          OR (existing.acquired_at >= existing.hold_until AND existing.hold_until <= now())"
        ),
        "was_released": sql.SQL("COALESCE(current.released, false)"),
    }


_RELEASED = sql.SQL("({row} IS NOT NULL AND acquired_at >= {row})")
"""A row its holder released before its minimum hold ended (`_minimum_hold`): no live hold's ``acquired_at`` is
as late as its ``hold_until``."""


# Holds of one client that share a heartbeat interval (at most a batch of
# them, `_state.heartbeat_flows.BATCH`), renewed by one statement, which answers for
# each: renewed, busy (its row is locked by another session) or gone (deleted
# or taken over: lost). SKIP LOCKED keeps one row locked by someone else from
# holding up the heartbeats of every other lock of the process; a fence's FOR
# KEY SHARE does not conflict, so fenced holds renew. Only last_heartbeat
# (and, for a holder that names its session, session_key) changes, in no
# index: the UPDATE can stay HOT, so heartbeats need not bloat an index.
#
# Its cost follows the holds it carries, not the table's size: their rows are
# found through an index (``index_filter``: the token's, or the unique key's
# lock_name), updated where they were locked (by ctid, a TID scan), and only a
# hold that was not renewed is looked up once more, to tell busy from gone
# (from the statement's snapshot: present there, but skipped, is busy).
_HEARTBEAT = """WITH {lease}hold AS (
  SELECT * FROM {hold_keys}
){marker}, free AS (
  SELECT held.ctid, held.lock_name, held.instance_id, held.acquired_at, held.last_heartbeat AS previous
    FROM {table} AS held JOIN hold {join_keys}
   WHERE held.locked = 1 AND {index_filter}
     FOR NO KEY UPDATE OF held{skip}
), renewed AS (
  UPDATE {table} AS held SET last_heartbeat = now(){session_renewal}{lease_renewal}
   WHERE held.ctid = ANY(ARRAY(SELECT ctid FROM free))
  RETURNING held.*
){alerted}
SELECT {answer_keys}, renewed.lock_name IS NOT NULL,
       CASE WHEN renewed.lock_name IS NOT NULL THEN true
            ELSE EXISTS (SELECT FROM {table} AS held WHERE held.locked = 1 AND {match}) END{revision}
  FROM hold
  LEFT JOIN renewed {join_keys}"""

# Each hold named by its lock, instance and stamp; or, where every hold has
# one, by its token alone (a new one per acquisition), a few bytes each.
_BY_HOLD = {
    "hold_keys": sql.SQL(
        "unnest(%(lock_names)s::text[], %(instance_ids)s::text[], %(acquired_ats)s::timestamptz[])"
        " AS hold (lock_name, instance_id, acquired_at)"
    ),
    "join_keys": sql.SQL("USING (lock_name, instance_id, acquired_at)"),
    "index_filter": sql.SQL("held.lock_name = ANY(%(lock_names)s::text[])"),
    "match": sql.SQL(
        "held.lock_name = hold.lock_name AND held.instance_id = hold.instance_id"
        " AND held.acquired_at = hold.acquired_at"
    ),
    "answer_keys": sql.SQL("hold.lock_name, hold.instance_id, hold.acquired_at"),
}
_BY_TOKEN = {
    "hold_keys": sql.SQL("unnest(%(tokens)s::bigint[]) AS hold (token)"),
    "join_keys": sql.SQL("USING (token)"),
    "index_filter": sql.SQL("held.token = ANY(%(tokens)s::bigint[])"),
    "match": sql.SQL("held.token = hold.token"),
    "answer_keys": sql.SQL("hold.token"),
}


def _heartbeats(
    names: Names,
    shape: TableShape,
    keys: Mapping[str, sql.Composable],
    *,
    leased: bool = False,
    renewing: bool = False,
) -> tuple[Statement, Statement]:
    """The heartbeat that skips locked rows, and the one for the holds it skipped, naming holds by ``keys``.

    ``leased``: the rows renewed point at the lease ``%(lease_key)s`` from now on, which the same statement makes
    exist, renewed (`_sql.leases`). ``renewing``: the statement renews that lease as `_sql.leases.renew` does, and
    the rows it carries by themselves. Either way its answer ends with the lease's revision (renewing, then the
    tokens it could not detach, `_sql.leases.kept`).
    """
    fmt = {
        "lease": leases.upsert(names) if leased else leases.renewal(names) if renewing else _NOTHING,
        "lease_renewal": sql.SQL(", lease_key = (SELECT lease_key FROM lease)") if leased else _NOTHING,
        "revision": leases.REVISION if leased else leases.revision_and_kept(names) if renewing else _NOTHING,
        "table": names.table,
        "alerted": heartbeat_alerts(names) if shape.history else _NOTHING,
        "marker": sessions.MARKER if shape.sessions else _NOTHING,
        "session_renewal": sessions.renewed_by_heartbeat("held") if shape.sessions else _NOTHING,
        **keys,
    }
    marks = shape.sessions
    renew = statement(
        names.table_name,
        "heartbeat",
        sql.SQL(_HEARTBEAT).format(skip=sql.SQL(" SKIP LOCKED"), **fmt),
        marks=marks,
    )
    # For the holds the first one skipped: rows locked a moment ago by a
    # contender's acquire, usually. This one waits for the row lock, but
    # only briefly: a row someone keeps locked fails this statement alone.
    wait = statement(
        names.table_name,
        "heartbeat",
        sql.SQL("SET LOCAL lock_timeout = %(lock_timeout_ms)s; " + _HEARTBEAT).format(skip=_NOTHING, **fmt),
        marks=marks,
    )
    return renew, wait


def _ended(names: Names, shape: TableShape) -> sql.Composable:
    """How a hold ended, in the history, by the statement that ended it (nothing without a history)."""
    return hold_ended(names) if shape.history else _NOTHING


def _release(names: Names, shape: TableShape, what: str, *, scope: sql.Composable, preparable: bool) -> Statement:
    """Delete our row (the hold ``scope`` names) and wake the lock's waiters, in one statement.

    A waiter LISTENing on the channel retries at once instead of at its next poll.
    """
    return statement(
        names.table_name,
        what,
        sql.SQL(
            """WITH released AS (
  DELETE FROM {table}
   WHERE locked = 1 AND lock_name = %(lock_name)s AND instance_id = %(instance_id)s{scope}
  RETURNING lock_name, instance_id, acquired_at, last_heartbeat
){ended}
SELECT {notify} FROM released"""
        ).format(
            table=names.table, scope=scope, ended=_ended(names, shape), notify=after_release("released", answered=True)
        ),
        preparable=preparable,
    )


def _release_plain(names: Names, *, wake: sql.Identifier | None = None) -> Statement:
    """`_release` as a bare DELETE, for a hold acquired without a minimum hold on a table without a history.

    Such a hold's row has no ``hold_until`` to keep it for (its acquire wrote
    NULL), and no history row to end: the row goes, and the same
    notification as `_release`'s wakes the lock's waiters, from the DELETE's
    own ``RETURNING``, one row per row deleted: the channel notified.

    ``wake``: the table's function that chooses whom to wake (`lock_functions`), called only when someone
    registered (`_sql.wake.nobody_waits`): the server sets up the choice's subqueries only then.
    """
    notify = after_release("released", answered=True)
    if wake is not None:
        channel = sql.SQL("{}::text").format(sql.Placeholder("channel"))
        notify = sql.SQL(
            """CASE WHEN {nobody_waits} THEN {channel} || pg_notify({channel}, {each})::text
            ELSE {wake}({channel}, {own_slot}::int, "released".lock_name) END"""
        ).format(
            nobody_waits=nobody_waits("released"),
            channel=channel,
            each=sql.Literal(WAKE_EACH_PROCESS),
            wake=wake,
            own_slot=sql.Placeholder("own_slot"),
        )
    return statement(
        names.table_name,
        "release",
        sql.SQL(
            """DELETE FROM {table} AS released
 WHERE locked = 1 AND lock_name = %(lock_name)s AND instance_id = %(instance_id)s AND acquired_at = %(acquired_at)s
RETURNING {notify}"""
        ).format(table=names.table, notify=notify),
        preparable=True,
    )


def lock_functions(names: Names) -> tuple[Function, Function]:
    """The plain acquire (`Statements.acquire_plain`) as a function, and the release's choice of whom to wake.

    The acquire tries the INSERT first (the plain acquire's own) and answers
    its row when it won; the whole plain acquire runs only when a row was in
    the way. ``use_column``: the answer's names (``acquired_at``, ``token``)
    are columns too, and in the statements they are the columns.

    The wake-up is `after_release`'s choice of a registered process's slot
    and its notification, which the plain release calls only when someone
    registered (`_release_plain`).
    """
    parts = _acquire_parts(names, CURRENT, plain=True, fair=False)
    acquire = sql.SQL(
        """
#variable_conflict use_column
BEGIN
  {insert}
  INTO acquired_at, token;
  IF FOUND THEN
    won := true;
    RETURN;
  END IF;
  {plain}
  INTO won, holder, heartbeat_age, acquired_at, token;
END
"""
    ).format(insert=parts["insert"], plain=_ACQUIRE.format(**parts))
    wake = sql.SQL(
        """
BEGIN
  RETURN (SELECT {notify} FROM (SELECT %(lock_name)s::text AS lock_name) AS released);
END
"""
    ).format(notify=after_release("released", answered=True))
    return (
        define(
            names.table_name,
            "acquire",
            names.acquire_function,
            ACQUIRE,
            acquire,
            returns="OUT won boolean, OUT holder varchar, OUT heartbeat_age float8, OUT acquired_at timestamptz, "
            "OUT token bigint",
        ),
        define(names.table_name, "release", names.wake_function, WAKE, wake, returns="RETURNS text"),
    )


def create_functions(names: Names) -> Statement:
    """Make the table's functions (`lock_functions`) unless they are there.

    After the table, in a transaction of their own: their bodies are checked against what they read. A
    table left without them (its maker stopped in between) gets the statements until `migrate` makes them.
    No ``lock_timeout``, unlike a change of the table's: it takes no lock of the table's, and a maker racing
    another waits for the other's commit, a moment, then finds them made.
    """
    return statement(
        names.table_name,
        "create the functions of the common acquire and release",
        sql.SQL(";\n").join(function.create for function in lock_functions(names)),
    )


def _release_keeping_minimum(names: Names, shape: TableShape) -> Statement:
    """`_release` on a table with minimum holds: the row of a hold whose ``hold_until`` is still ahead stays.

    It is marked released (`_minimum_hold`): ``acquired_at`` and
    ``last_heartbeat`` become ``hold_until``. Nobody takes it before then,
    and nobody alerts on it: its heartbeat is in the future, so a 0.1.0
    process, which reads the heartbeat only, leaves it alone until its own
    stale threshold after ``hold_until``. Nobody is woken: a waiter woken now
    would find the lock held; they wait for its end (`_state.flows`). Either way the
    statement answers one row, as a release does; the history says the hold
    was released now (an alert episode its release ended is not counted: the
    row's heartbeat before it is not kept).
    A deleted row's answer is the channel notified, as `_release`'s is: a slot's if another process's waiter
    was woken (its releaser's next acquire lets that one go first).
    """
    mine = sql.SQL(
        "locked = 1 AND lock_name = %(lock_name)s AND instance_id = %(instance_id)s AND acquired_at = %(acquired_at)s"
    )
    return statement(
        names.table_name,
        "release",
        sql.SQL(
            """WITH deleted AS (
  DELETE FROM {table}
   WHERE {mine}
     AND (hold_until IS NULL OR hold_until <= now())
  RETURNING lock_name, instance_id, acquired_at, last_heartbeat
), kept AS (
  UPDATE {table}
     SET acquired_at = hold_until, last_heartbeat = hold_until
   WHERE {mine}
     AND hold_until > now()
  RETURNING lock_name, instance_id, %(acquired_at)s::timestamptz AS acquired_at, NULL::timestamptz AS last_heartbeat
), released AS (
  SELECT * FROM deleted UNION ALL SELECT * FROM kept
){ended}
SELECT {notify}::text FROM deleted
UNION ALL
SELECT NULL::text FROM kept"""
        ).format(
            table=names.table,
            mine=mine,
            ended=_ended(names, shape),
            notify=after_release("deleted", answered=True),
        ),
        preparable=True,
    )


def _retoken(names: Names) -> Statement:
    """A new token for a row taken over by a process that did not know the table had tokens.

    The table was migrated meanwhile: the row kept the old token.
    """
    return statement(
        names.table_name,
        "acquire",
        sql.SQL(
            """UPDATE {table} SET token = nextval({sequence})
 WHERE locked = 1 AND lock_name = %(lock_name)s AND instance_id = %(instance_id)s
   AND acquired_at = %(acquired_at)s
RETURNING token"""
        ).format(table=names.table, sequence=names.sequence_text),
    )


def _token_or_null(shape: TableShape) -> sql.Composable:
    return sql.SQL("token") if shape.tokens else sql.SQL("NULL::bigint")


def _holders(names: Names, shape: TableShape) -> Statement:
    """Every held lock (or the given ones) with its ages by the server's clock, and when a released one turns
    free (its minimum hold's end)."""
    return statement(
        names.table_name,
        "read of the lock table",
        sql.SQL(
            """SELECT lock_name, instance_id,
       EXTRACT(EPOCH FROM now() - {heartbeat})::float8 AS heartbeat_age,
       EXTRACT(EPOCH FROM now() - acquired_at)::float8 AS held_for,
       acquired_at, {token},
       {sessions},
       {writer_waits},
       {held_until}
  FROM {table}
 WHERE locked = 1 AND (%(lock_names)s::text[] IS NULL OR lock_name = ANY(%(lock_names)s::text[]){semaphores}{rwlocks})
   {not_free}
 ORDER BY lock_name"""
        ).format(
            table=names.table,
            heartbeat=leases.effective_heartbeat(names, names.table) if shape.leases else sql.SQL("last_heartbeat"),
            # A semaphore's name asks for its every holder (each permit is a row of its own), a read/write
            # lock's for its readers or its writer.
            semaphores=sql.SQL(" OR semaphore = ANY(%(lock_names)s::text[])") if shape.semaphores else _NOTHING,
            rwlocks=sql.SQL(" OR rwlock = ANY(%(lock_names)s::text[])") if shape.rwlocks else _NOTHING,
            token=_token_or_null(shape),
            sessions=sessions.read_by_holders() if shape.sessions else sessions.NOT_READ,
            # Read from the gates by a statement of its own (`writers_waiting`), sent only when read/write
            # locks are held: a role that uses mutexes alone needs no grant on the gates' table.
            writer_waits=sql.SQL("NULL::boolean AS writer_waits"),
            # A row released before its minimum hold ended: held until then, free (and not listed) after.
            held_until=sql.SQL("CASE WHEN {released} THEN hold_until END AS held_until").format(
                released=_RELEASED.format(row=sql.SQL("hold_until"))
            )
            if shape.holds
            else sql.SQL("NULL::timestamptz AS held_until"),
            not_free=sql.SQL("AND NOT ({released} AND hold_until <= now())").format(
                released=_RELEASED.format(row=sql.SQL("hold_until"))
            )
            if shape.holds
            else _NOTHING,
        ),
        marks=shape.sessions,
    )


def _writers_waiting(names: Names) -> Statement:
    """Of the read/write locks named, those a writer waits for (`_sql.rwlocks`: its claim on the gate is in
    the future), holding new readers back."""
    return statement(
        names.table_name,
        "read of the read/write locks' gates",
        sql.SQL(
            "SELECT name FROM {rwlocks} WHERE name = ANY(%(rwlocks)s::text[]) AND writer_waiting_until > now()"
        ).format(rwlocks=names.rwlocks),
    )


def _force_release(names: Names, shape: TableShape) -> Statement:
    """An operator's override: delete the lock whoever holds it, and say whom.

    It waits for a fenced transaction's row lock only briefly, and is sent
    again: waiting in one statement would keep the client's connection, and
    with it the heartbeats of every lock the process holds, from going out.
    """
    return statement(
        names.table_name,
        "forced release",
        sql.SQL(
            """SET LOCAL lock_timeout = %(lock_timeout_ms)s; WITH released AS (
  DELETE FROM {table}
   WHERE locked = 1 AND lock_name = %(lock_name)s
  RETURNING lock_name, instance_id, acquired_at, last_heartbeat,
            EXTRACT(EPOCH FROM now() - {heartbeat})::float8 AS heartbeat_age, {token} AS token{lease_key}
){ended}{revoked}
SELECT instance_id, heartbeat_age, token, {notify}::text FROM released"""
        ).format(
            table=names.table,
            token=_token_or_null(shape),
            ended=_ended(names, shape),
            notify=after_release("released"),
            heartbeat=leases.effective_heartbeat(names, names.table) if shape.leases else sql.SQL("last_heartbeat"),
            lease_key=sql.SQL(", lease_key") if shape.lease_renewal else _NOTHING,
            revoked=leases.revoked(names, "released") if shape.lease_renewal else _NOTHING,
        ),
    )


def listen(channel: str) -> str:
    """Wait for the releases of the lock whose channel (`Names.channel`) this is."""
    return render(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))


def unlisten(channel: str) -> str:
    return render(sql.SQL("UNLISTEN {}").format(sql.Identifier(channel)))
