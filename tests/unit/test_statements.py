"""The prepared statements' numbered form: what the server receives is what psycopg would have sent.

The library sends its prepared statements with ``$1``, ``$2``... and their
values in order (`psycopg.RawCursor`), so psycopg does not convert the
``%(name)s`` placeholders in Python at every execute (it keeps that work
only for statements under 4 KiB; a semaphore's acquire is over).
"""

from __future__ import annotations

import dataclasses
import re

import pytest
from psycopg import sql

from postgres_mutex._sql.functions import define
from postgres_mutex._sql.lock import Statements
from postgres_mutex._sql.names import Names
from postgres_mutex._sql.shape import CURRENT
from postgres_mutex._sql.statement import Statement, statement


def _prepared() -> list[Statement]:
    # With and without the table's functions (`_sql.functions`), whose calls are prepared too.
    shapes = (CURRENT, dataclasses.replace(CURRENT, functions=True))
    made = [one for shape in shapes for one in vars(Statements(Names("mutex_lock"), shape)).values()]
    return [one for one in made if isinstance(one, Statement) and one.bare is not None]


def test_every_prepared_statement_has_its_numbered_form() -> None:
    prepared = _prepared()
    assert len(prepared) >= 10, "the acquires and releases of every lock kind"
    for one in prepared:
        assert one.numbered is not None
        assert "%(" not in one.numbered, one.what
        # Numbered in order of first use, each name once: as psycopg numbers them.
        first_use = list(dict.fromkeys(re.findall(r"%\((\w+)\)s", one.bare or "")))
        assert list(one.names) == first_use, one.what
        used = sorted({int(number) for number in re.findall(r"\$(\d+)\b", one.numbered)})
        assert used == list(range(1, len(one.names) + 1)), one.what


def test_a_name_used_twice_is_one_parameter_and_an_escaped_percent_is_a_percent() -> None:
    made = statement(
        "mutex_lock",
        "test",
        sql.SQL("SELECT {} || %(a)s, %(b)s::int, %(a)s, '50%%'").format(sql.Identifier("x")),
        preparable=True,
    )
    assert made.numbered == "SELECT \"x\" || $1, $2::int, $1, '50%'"
    assert made.names == ("a", "b")


def test_a_percent_that_is_no_placeholder_is_refused_when_the_statement_is_made() -> None:
    with pytest.raises(ValueError, match="neither a placeholder nor escaped"):
        statement("mutex_lock", "test", sql.SQL("SELECT 1 % 2"), preparable=True)


def test_a_function_body_whose_placeholders_are_not_its_parameters_is_refused_when_it_is_made() -> None:
    # The call binds the statement's values in the parameters' order: a body that numbers them otherwise
    # would read one value for another.
    body = sql.SQL("BEGIN PERFORM %(b)s::text, %(a)s::text; END")
    with pytest.raises(ValueError, match=r"uses \('b', 'a'\), not \('a', 'b'\)"):
        define("mutex_lock", "test", sql.Identifier("f"), ("a", "b"), body, returns="RETURNS void")
