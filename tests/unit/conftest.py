"""Unit tests need no server: here the suite's PostgreSQL cannot be asked for, and no DSN reaches one.

A test that needs a server belongs in tests/integration/. Asking for `pg` (or a fixture built
on it) fails the test with that advice. `dsn` is a connection string for the tests that only
build objects with one (a Mutex, a pool never opened): it names a port nothing listens on, so
a test that connected after all would fail, not pass.
"""

from __future__ import annotations

from typing import NoReturn

import pytest

UNREACHABLE_DSN = "host=127.0.0.1 port=1 dbname=postgres connect_timeout=2"


@pytest.fixture
def pg() -> NoReturn:
    pytest.fail("a unit test starts no PostgreSQL: a test that needs one belongs in tests/integration/", pytrace=False)


@pytest.fixture
def dsn() -> str:
    return UNREACHABLE_DSN
