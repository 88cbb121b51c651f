"""What each kind of lock adds to a table's statements: registered by its part of `_sql`, read by `Statements`.

A mutex's statements are `Statements`' own (`_sql.lock`). Another kind (a semaphore's,
`_sql.semaphores`; a read/write lock's modes, `_sql.rwlocks`) registers, with `adds`, the function that
makes its statements for a table of a given shape: `Statements` sets each one it returns as an
attribute of its own, None where the table lacks what the kind needs (its migration not run yet). The
package imports every part of `_sql`, so every kind is registered before a `Statements` is made; and
the lock's statements need not import the kinds' (nor the kinds' one another's).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .names import Names
    from .shape import TableShape
    from .statement import Statement

Adder = Callable[["Names", "TableShape"], Mapping[str, "Statement | None"]]
"""A kind's statements for a table of one shape, by the attribute of `Statements` each is."""

_ADDERS: list[Adder] = []


def adds(adder: Adder) -> Adder:
    """Register ``adder`` (as a decorator): every `Statements` made from now on has its statements."""
    _ADDERS.append(adder)
    return adder


def added(names: Names, shape: TableShape) -> dict[str, Statement | None]:
    """Every registered kind's statements for ``names``' table of ``shape``."""
    found: dict[str, Statement | None] = {}
    for adder in _ADDERS:
        found.update(adder(names, shape))
    return found
