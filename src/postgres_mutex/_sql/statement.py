"""How a statement is sent: `Statement`, the settings each one carries, and a session's instead.

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
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from psycopg import sql

# Before every statement, in its own transaction: a server-side deadline and
# the isolation the statements are written for. The timeout is in milliseconds.
SETTINGS = "SET LOCAL statement_timeout = %(_server_timeout_ms)s; SET LOCAL transaction_isolation = 'read committed'; "
SCHEMA_CHANGE_SETTINGS = "SET LOCAL lock_timeout = '50ms'; " + SETTINGS
"""For a change of the schema: it waits a moment at most for the table's lock, and the caller retries.

Queued behind a long transaction (a holder's fenced one, a reader's), a
waiting ALTER would make every heartbeat and acquire queue behind it.
"""


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
    marks: bool = False
    """It names or asks about holders' sessions (`_sql.sessions`): the engine binds
    ``_session_key`` (its connection's key, None on a pool's) and ``_backend_pid``."""
    numbered: str | None = field(default=None, init=False)
    """`bare` with ``$1``, ``$2``... for its placeholders, as the server reads it, sent with `names`' values in
    order (`psycopg.RawCursor`): psycopg converts ``%(name)s`` placeholders in Python at every execute, and keeps
    the conversion only for statements under 4 KiB, which a semaphore's or a fair lock's acquire is not."""
    names: tuple[str, ...] = field(default=(), init=False)
    """The parameters of `numbered`, in order."""

    def __post_init__(self) -> None:
        if self.bare is not None:
            numbered, names = number_placeholders(self.bare)
            object.__setattr__(self, "numbered", numbered)
            object.__setattr__(self, "names", names)


_PLACEHOLDER = re.compile(r"%\((\w+)\)s|%%|%")


def number_placeholders(text: str) -> tuple[str, tuple[str, ...]]:
    """``text``'s placeholders numbered, as psycopg numbers them (a name used twice is one parameter)."""
    names: dict[str, int] = {}

    def number(match: re.Match[str]) -> str:
        name = match.group(1)
        if name is None:
            if match.group(0) == "%%":
                return "%"
            raise ValueError(f"a % that is neither a placeholder nor escaped, in {text[:80]!r}")
        return f"${names.setdefault(name, len(names) + 1)}"

    return _PLACEHOLDER.sub(number, text), tuple(names)


def render(composed: sql.Composable) -> str:
    """The text of ``composed``: identifiers quoted, values left as placeholders or literals."""
    return composed.as_string(None)


def statement(
    table: str,
    what: str,
    composed: sql.Composable,
    *,
    preparable: bool = False,
    marks: bool = False,
) -> Statement:
    """A statement sent with its own settings; ``preparable``: also kept bare, for a direct connection."""
    text = render(composed)
    return Statement(SETTINGS + text, table, what, text if preparable else None, marks)


def schema_change(table: str, what: str, composed: sql.Composable) -> Statement:
    """A change of the schema: sent with its own settings and a short ``lock_timeout``, never prepared."""
    return Statement(SCHEMA_CHANGE_SETTINGS + render(composed), table, what)


def session_setup(backend_pid: int, timeout_ms: int) -> str:
    """Whether the connection reaches PostgreSQL directly and, only if it does, its session settings.

    ``backend_pid`` is the process id the connection was given at start-up
    (psycopg's ``info.backend_pid``). A direct connection's is the server
    process running this statement; PgBouncer (in any mode) hands out its own,
    so a different one means a pooler sits between, and the settings are not
    made. Sent after a lock statement in the same message; the answer is the
    first column of the message's last result.

    The statements the library prepares are planned once, for any values
    (``plan_cache_mode``): their parameters are single values matched
    against a unique key, so one plan suits all. Left to choose, the server
    re-planned some of them at every execution (a release of a permit or a
    read/write hold, whose ``own_slot`` prunes a branch when planned for its
    value), which cost more than running them.
    """
    return render(
        sql.SQL(
            """SELECT direct, CASE WHEN direct THEN
       set_config('default_transaction_isolation', 'read committed', false)
       || set_config('plan_cache_mode', 'force_generic_plan', false)
       || set_config('statement_timeout', {timeout_ms}, false) END
  FROM (SELECT pg_backend_pid() = {backend_pid} AS direct) AS connection"""
        ).format(backend_pid=sql.Literal(backend_pid), timeout_ms=sql.Literal(str(timeout_ms)))
    )


def end_session_left_behind(backend_pid: int, own_pid: int, seconds_since: float, wait_ms: int) -> sql.Composed:
    """End the server process of a connection the library cut off a statement on, and wait for it.

    A statement given up on may still sit unread on the server, which runs it
    whenever it reads it: an acquire run after the next acquire of the same
    holder would take that hold's row over (it carries the same
    ``instance_id``). Once its process has ended, nothing it was sent can run.

    Sent on the library's new connection, and only when it reaches PostgreSQL
    directly (``own_pid``: the process id that connection was given, as in
    `session_setup`): behind a pooler ``backend_pid`` names no server process.
    A process that started after the cut (``seconds_since`` ago, measured by
    the server's clock from now) merely reuses the id, and is left alone.
    """
    return sql.SQL(
        """SELECT pg_terminate_backend(pid, {wait_ms})
  FROM pg_stat_activity
 WHERE pid = {backend_pid} AND pg_backend_pid() = {own_pid} AND usename = session_user
   AND backend_start < now() - make_interval(secs => {seconds_since})"""
    ).format(
        wait_ms=sql.Literal(wait_ms),
        backend_pid=sql.Literal(backend_pid),
        own_pid=sql.Literal(own_pid),
        seconds_since=sql.Literal(seconds_since),
    )
