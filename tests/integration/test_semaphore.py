"""Semaphores: at most N holders at once, enforced by the table, with every guarantee of a Mutex.

Each test uses its own semaphore name on the suite's table, and short
thresholds (`FAST`) where a reclaim or a loss must happen within the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from postgres_mutex import (
    LockAcquisitionTimeout,
    LockNotHeldError,
    MutexClient,
    PermitsMismatchError,
    Semaphore,
)
from tests.support.exclusion import Sections, most_at_once
from tests.support.fixtures import FAST, await_until, wait_until

MakeSemaphore = Callable[..., Semaphore]


@pytest.fixture
def name() -> str:
    return f"sem-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def make_semaphore(dsn: str, name: str, schema: None) -> Iterator[MakeSemaphore]:
    """Semaphores of ``name`` with fast thresholds, each closed after the test."""
    made: list[Semaphore] = []

    def make(**kwargs: Any) -> Semaphore:
        kwargs.setdefault("dsn", dsn)
        kwargs.setdefault("name", name)
        kwargs.setdefault("permits", 3)
        for key, value in FAST.items():
            kwargs.setdefault(key, value)
        semaphore = Semaphore(**kwargs)
        made.append(semaphore)
        return semaphore

    yield make
    for semaphore in made:
        with contextlib.suppress(Exception):
            semaphore.close()


def permit_rows(admin: psycopg.Connection[Any], name: str) -> list[tuple[Any, ...]]:
    """The semaphore's permit rows as the table holds them: (permit, instance_id, permits), by permit."""
    return admin.execute(
        "SELECT permit, instance_id, permits FROM mutex_lock WHERE semaphore = %s ORDER BY permit", (name,)
    ).fetchall()


def test_n_holders_at_once_and_the_next_one_is_refused(
    make_semaphore: MakeSemaphore, admin: psycopg.Connection[Any], name: str
) -> None:
    holders = [make_semaphore() for _ in range(4)]
    with contextlib.ExitStack() as stack:
        got = [stack.enter_context(semaphore.acquire()) for semaphore in holders[:3]]
        assert got == [True, True, True]
        assert sorted(semaphore.permit for semaphore in holders[:3]) == [0, 1, 2]  # type: ignore[type-var]
        assert all(semaphore.held and semaphore.token is not None for semaphore in holders[:3])
        with holders[3].acquire() as fourth:
            assert fourth is False
            assert not holders[3].held
        with pytest.raises(LockAcquisitionTimeout, match=r"semaphore '.*' has no permit free: 3 of 3 held"):
            with holders[3].acquire(blocking=True, timeout=0.3):
                pass
        rows = permit_rows(admin, name)
        assert [(permit, permits) for permit, _, permits in rows] == [(0, 3), (1, 3), (2, 3)]
        assert {holder for _, holder, _ in rows} == {semaphore.instance_id for semaphore in holders[:3]}
    assert permit_rows(admin, name) == [], "leaving the blocks releases every permit"
    with holders[3].acquire() as fourth:
        assert fourth is True
