"""Read/write locks in `LockTable`: each holder in `holders` with its lock and mode, and `force_release` of
the writer or of one reader, which its holder learns it lost as for a mutex."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

import pytest

from postgres_mutex import LockNotHeldError, LockTable, Mutex, RWLock
from postgres_mutex.errors import InvalidArgument
from tests.support.fixtures import FAST, await_until, wait_until

pytestmark = pytest.mark.usefixtures("schema")


@pytest.fixture
def name() -> str:
    return f"rwt-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def made(dsn: str) -> Iterator[list[RWLock | Mutex]]:
    """What the test makes, closed at its end."""
    holders: list[RWLock | Mutex] = []
    yield holders
    for holder in holders:
        with contextlib.suppress(Exception):
            holder.close()


def rwlock(dsn: str, name: str, instance_id: str, made: list[RWLock | Mutex]) -> RWLock:
    lock = RWLock(dsn, name, instance_id=instance_id, **FAST)  # type: ignore[arg-type]
    made.append(lock)
    return lock


def test_holders_name_each_reader_and_the_writer_by_their_lock_and_mode(
    dsn: str, name: str, made: list[RWLock | Mutex]
) -> None:
    readers = [rwlock(dsn, name, f"reader-{n}", made) for n in (1, 2)]
    neighbour = Mutex(dsn, f"{name}-mutex", instance_id="mutex-1", **FAST)  # type: ignore[arg-type]
    made.append(neighbour)
    table = LockTable(dsn)
    with contextlib.ExitStack() as stack:
        assert all(stack.enter_context(reader.read()) for reader in readers)
        assert stack.enter_context(neighbour.acquire())
        seen = table.holders([name])
        assert sorted((s.rwlock, s.mode, s.holder, s.token) for s in seen) == sorted(
            (name, "read", r.instance_id, r.token) for r in readers
        ), "the read/write lock's name asks for its every holder"
        assert all(s.lock_name.startswith(f"{name}\x1fr") and s.semaphore is None for s in seen)
        [mutex] = table.holders([f"{name}-mutex"])
        assert (mutex.lock_name, mutex.rwlock, mutex.mode) == (f"{name}-mutex", None, None)
    writer = rwlock(dsn, name, "writer-1", made)
    with writer.write() as got:
        assert got
        [seen_writer] = table.holders([name])
        assert (seen_writer.rwlock, seen_writer.mode, seen_writer.holder) == (name, "write", "writer-1")
        assert [s.mode for s in table.holders() if s.rwlock == name] == ["write"]


async def test_force_release_frees_the_writer_or_one_reader_and_each_learns_it_lost_the_lock(
    dsn: str, name: str, made: list[RWLock | Mutex]
) -> None:
    table = LockTable(dsn)
    writer = rwlock(dsn, name, "writer-1", made)
    with pytest.raises(LockNotHeldError), writer.write() as got:
        assert got
        assert table.force_release(name) is None, "the lock's name alone is no holder's row"
        assert table.force_release(name, reader="writer-1") is None
        removed = table.force_release(name, writer=True)
        assert removed is not None
        assert (removed.lock_name, removed.holder, removed.token) == (name, "writer-1", writer.token)
        wait_until(lambda: not writer.held, timeout=10)

    first, second = rwlock(dsn, name, "reader-1", made), rwlock(dsn, name, "reader-2", made)
    async with first.read_async() as got:
        assert got
        with pytest.raises(LockNotHeldError):
            async with second.read_async() as also:
                assert also
                removed = await table.force_release_async(name, reader="reader-2")
                assert removed is not None
                assert removed.holder == "reader-2"
                await await_until(lambda: not second.held, timeout=10)
        assert first.held, "the other reader keeps reading"
        assert [s.holder for s in await table.holders_async([name])] == ["reader-1"]


def test_force_release_takes_one_holder_at_a_time(dsn: str, name: str) -> None:
    table = LockTable(dsn)
    with pytest.raises(InvalidArgument, match="pass one of them"):
        table.force_release(name, writer=True, reader="reader-1")
    with pytest.raises(InvalidArgument, match="pass one of them"):
        table.force_release(name, permit=0, writer=True)
    with pytest.raises(InvalidArgument, match="writer must be True or False"):
        table.force_release(name, writer="yes")  # type: ignore[arg-type]
