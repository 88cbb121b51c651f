"""pool / async_pool mode: borrow a connection per operation, never open one of our own."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from postgres_mutex import Mutex, MutexError
from tests.support.fixtures import wait_until

Holder = Callable[..., str | None]
APP = "mutex-pool-test"


@pytest.fixture
def pool(dsn: str) -> Iterator[ConnectionPool[Any]]:
    with ConnectionPool(dsn, min_size=2, max_size=2, kwargs={"application_name": APP}, open=True) as opened:
        opened.wait(timeout=10)
        yield opened


@pytest.fixture
async def async_pool(dsn: str) -> AsyncIterator[AsyncConnectionPool[Any]]:
    async with AsyncConnectionPool(
        dsn, min_size=2, max_size=2, kwargs={"application_name": APP + "-async"}, open=False
    ) as opened:
        await opened.wait(timeout=10)
        yield opened


def backends(admin: psycopg.Connection[Any], pattern: str) -> int:
    found = admin.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE %s", (pattern,)).fetchone()
    assert found is not None
    return int(found[0])


def sessions_opened_since(admin: psycopg.Connection[Any], since: Any) -> list[Any]:
    """Client sessions started after ``since`` (server time), besides the pools' own."""
    return admin.execute(
        """SELECT application_name FROM pg_stat_activity
            WHERE backend_type = 'client backend' AND backend_start >= %s AND application_name NOT LIKE %s""",
        (since, APP + "%"),
    ).fetchall()


def server_now(admin: psycopg.Connection[Any]) -> Any:
    found = admin.execute("SELECT now()").fetchone()
    assert found is not None
    return found[0]


def test_pool_mode_locks_through_the_pool_and_opens_nothing_else(
    make_mutex: Callable[..., Mutex], pool: ConnectionPool[Any], admin: psycopg.Connection[Any], holder_id: Holder
) -> None:
    started = server_now(admin)
    holder, waiter = make_mutex(pool=pool), make_mutex(pool=pool)
    # Set as the holder's work ends, just before it releases: a waiter that got
    # the lock any earlier would have run alongside the holder.
    done = threading.Event()

    def hold_briefly() -> None:
        with holder.acquire():
            time.sleep(0.3)
            done.set()

    with holder.acquire():
        assert holder_id() == holder.instance_id
        holder.heartbeat()
        with waiter.acquire() as acquired:
            assert not acquired
    thread = threading.Thread(target=hold_briefly)
    thread.start()
    wait_until(lambda: holder.held)
    with waiter.acquire(blocking=True, timeout=10) as acquired:
        assert acquired
        assert done.is_set()
    thread.join()
    assert sessions_opened_since(admin, started) == [], "no connection of the Mutex's own"
    assert backends(admin, APP) == 2, "only the pool's connections"
    stats = pool.get_stats()
    assert stats["pool_size"] == 2
    assert pool.get_stats()["pool_available"] == 2, "every borrowed connection was given back"


def test_pool_mode_leaves_the_borrowed_connection_as_it_found_it(
    make_mutex: Callable[..., Mutex], pool: ConnectionPool[Any]
) -> None:
    mutex = make_mutex(pool=pool)
    with mutex.acquire():
        pass
    with pool.connection() as conn:
        assert conn.autocommit is False
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


def test_the_mutex_never_closes_the_pool(make_mutex: Callable[..., Mutex], pool: ConnectionPool[Any]) -> None:
    mutex = make_mutex(pool=pool)
    with mutex.acquire():
        pass
    mutex.close()
    assert not pool.closed


def test_a_pool_whose_rows_are_dicts_serves_every_operation(dsn: str, make_mutex: Callable[..., Mutex]) -> None:
    # The application's row factory is its own: the library reads its rows as tuples regardless.
    with ConnectionPool(dsn, min_size=1, max_size=1, kwargs={"row_factory": dict_row}, open=True) as pool:
        mutex, other = make_mutex(pool=pool), make_mutex(pool=pool)
        with mutex.acquire() as acquired:
            assert acquired
            assert mutex.token is not None
            mutex.heartbeat()
            with other.acquire() as second:
                assert not second
            # So is the caller's own connection, fenced: the fence's row is read by position too.
            with psycopg.connect(dsn, row_factory=dict_row) as conn, conn.transaction():
                assert mutex.fence(conn) == mutex.token
        assert not mutex.held


async def test_async_pool_mode_opens_nothing_else(
    amake_mutex: Callable[..., Mutex], async_pool: AsyncConnectionPool[Any], admin: psycopg.Connection[Any]
) -> None:
    started = server_now(admin)
    holder, waiter = amake_mutex(async_pool=async_pool), amake_mutex(async_pool=async_pool)
    async with holder.acquire_async():
        await holder.heartbeat_async()
        async with waiter.acquire_async(blocking=False) as acquired:
            assert not acquired
        task = asyncio.create_task(_acquire(waiter))
        await asyncio.sleep(0.2)
    assert await asyncio.wait_for(task, 10)
    assert sessions_opened_since(admin, started) == [], "no connection of the Mutex's own"
    assert backends(admin, APP + "-async") == 2
    with pytest.raises(MutexError, match="only an async_pool"), holder.acquire():
        pass


async def _acquire(mutex: Mutex) -> bool:
    async with mutex.acquire_async(timeout=10) as acquired:
        return acquired


async def test_both_pools_serve_one_lock_from_sync_and_async_code(
    amake_mutex: Callable[..., Mutex], pool: ConnectionPool[Any], async_pool: AsyncConnectionPool[Any]
) -> None:
    mutex = amake_mutex(pool=pool, async_pool=async_pool)
    other = amake_mutex(pool=pool, async_pool=async_pool)
    with mutex.acquire() as acquired:
        assert acquired
        async with other.acquire_async(blocking=False) as second:
            assert not second
    async with mutex.acquire_async():
        with other.acquire() as second:
            assert not second


def test_a_busy_pool_is_waited_out_not_reported_as_a_broken_dsn(dsn: str, make_mutex: Callable[..., Mutex]) -> None:
    with ConnectionPool(dsn, min_size=1, max_size=1, open=True) as small:
        small.wait(timeout=10)
        mutex = make_mutex(pool=small, operation_timeout=0.3)
        result: list[object] = []
        thread = threading.Thread(target=_acquire_in_thread, args=(mutex, result))
        with small.connection():
            thread.start()
            # Keep the pool's only connection busy for several operation_timeouts.
            time.sleep(1.0)
        thread.join(timeout=20)
        assert result == [True]


def _acquire_in_thread(mutex: Mutex, result: list[object]) -> None:
    try:
        with mutex.acquire(blocking=True, timeout=10) as acquired:
            result.append(acquired)
    except Exception as exc:
        result.append(exc)


def test_a_pool_that_takes_closed_connections_back_survives_a_deadline(
    proxy_dsn: str, proxy: Any, make_mutex: Callable[..., Mutex]
) -> None:
    with ConnectionPool(proxy_dsn, min_size=1, max_size=1, close_returns=True, open=True) as returning:
        returning.wait(timeout=10)
        mutex = make_mutex(pool=returning, operation_timeout=0.3)
        with mutex.acquire():
            pass
        proxy.silence()
        with pytest.raises(MutexError), mutex.acquire():
            pytest.fail("must not run")
        proxy.heal()
        with mutex.acquire(blocking=True, timeout=10) as acquired:
            assert acquired, "the pool replaced the cut-off connection"
