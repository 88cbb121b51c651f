"""The common acquire and release as functions on the server, made once by whoever creates or migrates the table.

The server sets up every part of a statement before it runs any of it: the
plain acquire's read of the holder and its take-over, which run only when a
row was in the way, cost a won acquire about 20 µs of the server's time, and a
release's choice of a waiter to wake (`_sql.wake`) about 24 µs when nobody
waits. A PL/pgSQL function sets up each of its statements only when it
reaches it: the acquire tries the INSERT alone and runs the whole statement
(`_sql.lock`) only when a row was in the way; the release deletes the row
and chooses whom to wake only when someone registered. Each is still one
round trip, and decides and answers as the statement it stands for.

The bodies are the statements' own SQL with their placeholders numbered
(`number_placeholders`): a function's parameters are those placeholders, in
order, so the call binds the same values the statement would.

Made by `create_table` and `migrate_steps`, never at run time (a role that
only uses the table needs no CREATE). SECURITY INVOKER, the default: the
caller needs the privileges the statements need, and PostgreSQL grants
EXECUTE to PUBLIC unless the owner revoked it. A table without them, or a role
that may not execute them, gets the statements (`_sql.schema.inspect_table`).
A body is fixed when it is made: a later version that changes one must give
the function another name.
"""

from __future__ import annotations

from dataclasses import dataclass

from psycopg import sql

from .statement import Statement, number_placeholders, render, statement

ACQUIRE = ("lock_name", "instance_id", "stale_seconds", "_session_key")
"""The acquire's parameters, in order: the plain acquire's placeholders (`_sql.lock.lock_functions`)."""

WAKE = ("channel", "own_slot", "lock_name")
"""The wake-up's parameters, in order: a release's choice of whom to wake (`_sql.wake.after_release`)."""

_TYPES = {
    "lock_name": "text",
    "instance_id": "text",
    "stale_seconds": "float8",
    "_session_key": "bigint",
    "channel": "text",
    "own_slot": "int",
}
"""Each placeholder's type, as the function declares its parameter."""


@dataclass(frozen=True, slots=True)
class Function:
    """One function of a lock table: how it is made and how it is called."""

    create: sql.Composable
    """Makes it unless it exists; idempotent (racing makers: the loser's unique violation is retried)."""
    call: Statement
    """Its call, with the placeholders of the statement it stands for: one row, as that statement answers."""


def signature(name: sql.Identifier, params: tuple[str, ...]) -> sql.Literal:
    """The function ``name`` with ``params`` (`ACQUIRE`, `WAKE`), as ``to_regprocedure`` reads it."""
    return sql.Literal(render(sql.SQL("{}({})").format(name, _types(params))))


def _types(params: tuple[str, ...]) -> sql.Composable:
    return sql.SQL(", ").join(sql.SQL(_TYPES[param]) for param in params)


def define(
    table: str, what: str, name: sql.Identifier, params: tuple[str, ...], body: sql.Composable, *, returns: str
) -> Function:
    """A PL/pgSQL function ``name`` whose body is ``body`` with its placeholders as its parameters ``params``.

    ``returns``: its OUT parameters (``OUT ...``, one row) or ``RETURNS SETOF ...`` (as many rows as it returns).
    """
    text, used = number_placeholders(render(body))
    if used != params:
        raise ValueError(f"the body of {render(name)} uses {used}, not {params}, in that order")
    types = _types(params)
    one_row = returns.startswith("OUT ")
    outs, result = sql.SQL(", " + returns if one_row else ""), sql.SQL("" if one_row else " " + returns)
    create = sql.SQL(
        """DO $create$ BEGIN
  IF to_regprocedure({signature}) IS NULL THEN
    CREATE FUNCTION {name}({types}{outs}){result} LANGUAGE plpgsql AS $body${body}$body$;
  END IF;
END $create$"""
    ).format(signature=signature(name, params), name=name, types=types, outs=outs, result=result, body=sql.SQL(text))
    call = statement(
        table,
        what,
        sql.SQL("SELECT * FROM {}({})").format(
            name,
            sql.SQL(", ").join(
                sql.SQL("{}::{}").format(sql.Placeholder(param), sql.SQL(_TYPES[param])) for param in params
            ),
        ),
        preparable=True,
        marks="_session_key" in params,
    )
    return Function(create, call)
