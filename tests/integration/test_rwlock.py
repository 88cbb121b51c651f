"""Read/write locks: any number of readers or one writer, enforced by the table, writers not starved.

Each test uses its own lock name on the suite's table, and short thresholds
(`FAST`) where a reclaim or a loss must happen within the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from postgres_mutex import LockAcquisitionTimeout, LockNotHeldError, LockTable, MutexClient, RWLock, SchemaError
from tests.support.exclusion import Section, Sections
from tests.support.fixtures import FAST, ROOT, RecordingMetrics, closing_maker, freeze, listens, read_line, wait_until

MakeRWLock = Callable[..., RWLock]


@pytest.fixture
def name() -> str:
    return f"rw-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def make_rwlock(dsn: str, name: str, schema: None) -> Iterator[MakeRWLock]:
    """RWLocks of ``name`` with fast thresholds, each closed after the test."""
    with closing_maker(RWLock, dsn=dsn, name=name) as make:
        yield make


def test_readers_share_and_a_writer_waits_for_them(make_rwlock: MakeRWLock) -> None:
    readers = [make_rwlock() for _ in range(3)]
    writer = make_rwlock()
    with contextlib.ExitStack() as stack:
        for reader in readers:
            assert stack.enter_context(reader.read())
            assert reader.mode == "read"
        with writer.write() as got:
            assert not got, "no writer while readers hold"
        with pytest.raises(LockAcquisitionTimeout), writer.write(timeout=0.3):
            pass  # a timeout alone waits, as blocking=True does
    with writer.write() as got:
        assert got
        assert writer.mode == "write"
        with readers[0].read() as read, readers[1].write() as written:
            assert not read, "no reader while a writer holds"
            assert not written, "no second writer"
    with readers[0].read() as got:
        assert got, "the gate opens for readers again once the writer left"


def test_the_table_refuses_a_reader_beside_a_writer_and_a_second_writer_whatever_a_client_sends(
    make_rwlock: MakeRWLock, admin: psycopg.Connection[Any], name: str
) -> None:
    writer = make_rwlock()
    insert = (
        "INSERT INTO mutex_lock (lock_name, instance_id, last_heartbeat, acquired_at, rwlock, rw_mode) "
        "VALUES (%s, 'raw', now(), now(), %s, %s)"
    )
    with writer.write() as got:
        assert got
        for row_name, mode in ((f"{name}-raw-reader", "read"), (f"{name}-raw-writer", "write")):
            with pytest.raises(psycopg.errors.IntegrityError), admin.transaction():
                admin.execute(insert, (row_name, name, mode))
        with pytest.raises(psycopg.errors.IntegrityError), admin.transaction():
            admin.execute("UPDATE mutex_lock_rwlocks SET mode = 'read' WHERE name = %s", (name,))
    reader = make_rwlock()
    with reader.read() as got:
        assert got
        with pytest.raises(psycopg.errors.IntegrityError), admin.transaction():
            admin.execute("UPDATE mutex_lock_rwlocks SET mode = 'write' WHERE name = %s", (name,))


def overlapping(sections: list[Section]) -> list[tuple[Section, Section]]:
    """Pairs of sections that overlapped in time where one of them was a writer's."""
    found = []
    for i, first in enumerate(sections):
        for second in sections[i + 1 :]:
            if "writer" not in first.who and "writer" not in second.who:
                continue
            assert first.exit is not None
            assert second.exit is not None
            if first.enter < second.exit and second.enter < first.exit:
                found.append((first, second))
    return found


def test_readers_overlap_and_writers_are_alone_among_contending_holders_each_on_its_own_client(
    dsn: str, name: str, schema: None
) -> None:
    sections = Sections()
    stop = time.monotonic() + 4.0
    errors: list[BaseException] = []

    def contend(who: str) -> None:
        with MutexClient(dsn) as client:
            rwlock = client.rwlock(name, **FAST)
            try:
                while time.monotonic() < stop:
                    acquire = rwlock.write if "writer" in who else rwlock.read
                    with acquire(blocking=True, timeout=30) as got:
                        assert got
                        section = sections.enter(who)
                        time.sleep(0.05)
                        assert rwlock.held
                        sections.leave(section)
            except BaseException as exc:  # reported by the test, not lost in a thread
                errors.append(exc)

    whos = [f"reader-{i}" for i in range(4)] + [f"writer-{i}" for i in range(2)]
    threads = [threading.Thread(target=contend, args=(who,)) for who in whos]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []
    logged = sections.all()
    writes = [section for section in logged if "writer" in section.who]
    reads = [section for section in logged if "reader" in section.who]
    assert len(writes) >= 4, "writers went in and out many times"
    assert len(reads) >= 4, "readers went in and out many times"
    assert overlapping(logged) == [], "never a writer beside a reader or another writer"
    assert any(
        a.enter < b.exit and b.enter < a.exit  # type: ignore[operator]
        for i, a in enumerate(reads)
        for b in reads[i + 1 :]
    ), "readers did hold at once"


READER_HOLD = 0.5
"""How long each reader of the stream holds: `STREAM_READERS` readers on beats this far apart, staggered, each
re-acquiring at once, so the lock is never free of readers."""

STREAM_READERS = 4
WRITER_ROUNDS = 3


def test_a_writer_waiting_behind_a_stream_of_readers_gets_in_within_one_reader_hold(
    dsn: str, name: str, schema: None
) -> None:
    stop = threading.Event()
    errors: list[BaseException] = []
    sections = Sections()
    start = time.monotonic()

    def read_on_beats(k: int) -> None:
        first = start + k * READER_HOLD / STREAM_READERS
        with MutexClient(dsn) as client:
            rwlock = client.rwlock(name, **FAST)
            deadline = time.monotonic() + 60
            try:
                while not stop.is_set() and time.monotonic() < deadline:
                    with rwlock.read(blocking=True, timeout=30) as got:
                        assert got
                        section = sections.enter(f"reader-{k}")
                        entered = time.monotonic()
                        beat = first + (math.floor((entered - first) / READER_HOLD) + 1) * READER_HOLD
                        stop.wait(beat - entered)  # until its next beat: at most one hold
                        sections.leave(section)
            except BaseException as exc:  # reported by the test, not lost in a thread
                errors.append(exc)

    readers = [threading.Thread(target=read_on_beats, args=(k,)) for k in range(STREAM_READERS)]
    for thread in readers:
        thread.start()
    waits: list[tuple[float, int]] = []
    try:
        wait_until(lambda: len(sections.all()) >= 2 * STREAM_READERS, timeout=30)  # the stream runs on its beats
        with MutexClient(dsn) as client:
            writer = client.rwlock(name, **FAST)
            for _ in range(WRITER_ROUNDS):
                holding = sum(1 for section in sections.all() if section.exit is None)
                asked = time.monotonic()
                with writer.write(blocking=True, timeout=30) as got:
                    waits.append((time.monotonic() - asked, holding))
                    assert got
                    assert all(section.exit is not None for section in sections.all()), "no reader beside it"
                # The readers that waited behind it come back, onto their beats.
                began = len(sections.all())
                wait_until(lambda: len(sections.all()) >= began + STREAM_READERS, timeout=30)  # noqa: B023
    finally:
        stop.set()
        for thread in readers:
            thread.join(timeout=30)
    assert errors == []
    assert all(holding >= 1 for _, holding in waits), f"readers held whenever the writer asked: {waits}"
    # One reader's hold plus a hand-off (two polls at worst), with a second of slack for a busy machine.
    # Without the preference it would wait until the stream stops (never, here, before the timeout).
    bound = READER_HOLD + 2 * FAST["poll_interval"] + 1.0
    assert max(wait for wait, _ in waits) <= bound, f"the writer's waits {waits}, readers holding {READER_HOLD}s each"


def test_a_waiter_is_woken_by_a_release_not_by_polling(make_rwlock: MakeRWLock) -> None:
    writer = make_rwlock()
    reader = make_rwlock(poll_interval=30.0)
    took: list[float] = []
    holding = writer.write()
    assert holding.__enter__()

    def wait() -> None:
        with reader.read(blocking=True, timeout=60) as got:
            assert got
            took.append(time.monotonic())

    thread = threading.Thread(target=wait)
    thread.start()
    wait_until(lambda: listens(reader._reader), timeout=10)
    released = time.monotonic()
    holding.__exit__(None, None, None)
    thread.join(timeout=20)
    assert took, "the reader acquired"
    assert took[0] - released < 5.0, "woken by the release, long before its 30 s poll"


async def test_async_readers_share_and_an_async_writer_waits_for_them(make_rwlock: MakeRWLock) -> None:
    first, second, writer = make_rwlock(), make_rwlock(), make_rwlock()
    try:
        async with first.read_async() as one, second.read_async() as two:
            assert one
            assert two

            async def write() -> bool:
                async with writer.write_async(timeout=20) as got:
                    return got and writer.mode == "write"

            task = asyncio.ensure_future(write())
            await asyncio.sleep(0.3)
            assert not task.done(), "the writer waits while readers hold"
        assert await asyncio.wait_for(task, 20)
    finally:
        for rwlock in (first, second, writer):
            await rwlock.aclose()


def test_a_fence_works_in_either_mode_and_refuses_a_writer_after_another_took_over(
    make_rwlock: MakeRWLock, dsn: str, name: str
) -> None:
    # A lease long enough that the writer, its heartbeats stopped, still trusts it throughout.
    slow = {"heartbeat_interval": 0.5, "alert_threshold": 2.0, "stale_threshold": 20.0}
    reader, writer, other = make_rwlock(), make_rwlock(**slow), make_rwlock()
    with reader.read() as got, psycopg.connect(dsn) as conn, reader.fenced(conn) as token:
        assert got
        assert token == reader.token
    with pytest.raises(LockNotHeldError), writer.write() as got:
        assert got
        with psycopg.connect(dsn) as conn, writer.fenced(conn) as token:
            assert token == writer.token
        # Frozen (no heartbeat notices the loss), its row freed by an operator; another writer comes.
        freeze(writer._writer)
        assert LockTable(dsn).force_release(f"{name}\x1fw") is not None
        with other.write(blocking=True, timeout=20) as taken:
            assert taken
            # Told in the read/write lock's words, under its name, not its row's.
            said = f"read/write lock {name!r} changed hands"
            with psycopg.connect(dsn) as conn, pytest.raises(LockNotHeldError, match=said):
                writer.fence(conn)


def test_a_held_mode_refuses_the_other_on_the_same_rwlock_and_timeouts_say_what_waited(
    make_rwlock: MakeRWLock,
) -> None:
    rwlock, writer = make_rwlock(), make_rwlock()
    with rwlock.read() as got:
        assert got
        with pytest.raises(ValueError, match="holds"):
            rwlock.write()
    with writer.write() as got:
        assert got
        with (
            pytest.raises(LockAcquisitionTimeout, match="not granted for read"),
            rwlock.read(blocking=True, timeout=0.5),
        ):
            pytest.fail("read beside a writer")
    with pytest.raises(ValueError, match="at most 50"):
        RWLock("host=127.0.0.1", "x" * 51)


HOLDER = """
import json, sys, time
from postgres_mutex import RWLock
dsn, name, mode, options = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
rwlock = RWLock(dsn, name, **options)
print(json.dumps({"started": True}), flush=True)
with (rwlock.write if mode == "write" else rwlock.read)(blocking=True, timeout=60) as held:
    print(json.dumps({"held": held}), flush=True)
    while True:
        time.sleep(0.1)
"""
"""A process that holds (or waits for) one mode until it is killed."""

EARLY: dict[str, Any] = {
    "heartbeat_interval": 0.3,
    "alert_threshold": 0.9,
    "stale_threshold": 600.0,
    "reclaim_disconnected_after": 2.0,
    "poll_interval": 0.1,
}
"""A holder that opted in to ``reclaim_disconnected_after``: reclaimed in seconds if its process dies."""

HAND_OFF = 2.0
"""A generous bound on what a reclaim takes beyond its threshold: a poll, a statement, a loaded machine."""


@pytest.fixture
def rw_process(dsn: str, schema: None) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []

    def start(name: str, mode: str, *, wait_for_hold: bool = True, **options: Any) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, dsn, name, mode, json.dumps(options)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        started.append(proc)
        assert proc.stdout is not None
        assert json.loads(read_line(proc.stdout, timeout=30))["started"] is True
        if wait_for_hold:
            assert json.loads(read_line(proc.stdout, timeout=30))["held"] is True
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


@pytest.mark.parametrize(
    ("options", "threshold"),
    [(FAST, FAST["stale_threshold"]), (EARLY, EARLY["reclaim_disconnected_after"])],
    ids=["after the stale threshold", "early, having opted in to reclaim_disconnected_after"],
)
def test_a_killed_writer_is_reclaimed_and_readers_proceed(
    dsn: str, name: str, rw_process: Callable[..., subprocess.Popen[str]], options: dict[str, Any], threshold: float
) -> None:
    writer = rw_process(name, "write", **options)
    metrics = RecordingMetrics()
    reader = RWLock(dsn, name, metrics=metrics, **options)
    try:
        with reader.read() as got:
            assert not got, "the writer holds"
        writer_id = reader.last_holder
        assert writer_id is not None
        writer.kill()
        died = time.monotonic()
        writer.wait(10)
        with reader.read(blocking=True, timeout=threshold + HAND_OFF + 10) as acquired:
            took = time.monotonic() - died
            assert acquired
        assert took <= threshold + HAND_OFF, f"read {took:.2f}s after the writer died"
        reclaims = metrics.named("stale_reclaimed")
        assert len(reclaims) == 1, "the reader's acquire told of the writer it reclaimed"
        assert (reclaims[0]["mode"], reclaims[0]["previous_holder"]) == ("write", writer_id), "the hold taken over"
    finally:
        reader.close()


def test_a_killed_reader_is_reclaimed_by_a_writer(
    dsn: str, name: str, rw_process: Callable[..., subprocess.Popen[str]]
) -> None:
    reader = rw_process(name, "read", **EARLY)
    metrics = RecordingMetrics()
    writer = RWLock(dsn, name, metrics=metrics, **EARLY)
    try:
        reader.kill()
        died = time.monotonic()
        reader.wait(10)
        with writer.write(blocking=True, timeout=30) as acquired:
            took = time.monotonic() - died
            assert acquired
        assert took <= EARLY["reclaim_disconnected_after"] + HAND_OFF, f"wrote {took:.2f}s after the reader died"
        reclaims = metrics.named("stale_reclaimed")
        assert [(r["mode"], r["reason"]) for r in reclaims] == [("read", "disconnected")], "told of the reader"
    finally:
        writer.close()


def refused_a_read(rwlock: RWLock) -> bool:
    with rwlock.read() as got:
        return not got


def test_a_killed_waiting_writer_holds_readers_back_no_longer_than_its_claim_lasts(
    dsn: str, name: str, rw_process: Callable[..., subprocess.Popen[str]], make_rwlock: MakeRWLock
) -> None:
    first, late = make_rwlock(), make_rwlock()
    claim = 2 * FAST["poll_interval"] + FAST["operation_timeout"]  # as docs/concepts/rwlocks.md says
    with first.read() as got:
        assert got
        waiting = rw_process(name, "write", wait_for_hold=False, **FAST)
        # Once the writer waits, a new reader waits behind it.
        wait_until(lambda: refused_a_read(late), timeout=30)
        waiting.kill()
        died = time.monotonic()
        waiting.wait(10)
        with late.read(blocking=True, timeout=claim + HAND_OFF + 10) as acquired:
            took = time.monotonic() - died
            assert acquired, "readers proceed once the dead writer's claim ran out"
    assert took <= claim + HAND_OFF, f"read {took:.2f}s after the waiting writer died"


def test_a_table_without_read_write_locks_keeps_its_mutexes_and_says_to_migrate(
    dsn: str, name: str, admin: psycopg.Connection[Any]
) -> None:
    table = f"rw_{name.replace('-', '_')}"
    assert LockTable(dsn, table=table).create() is True
    # As a table made before read/write locks: migrate() adds this last, and only then do they count.
    admin.execute(f"DROP INDEX {table}_rw_writer_key")
    try:
        with MutexClient(dsn) as client:
            with client.mutex("job", table=table, **FAST).acquire() as held:
                assert held
            rwlock = client.rwlock(name, table=table, **FAST)
            with pytest.raises(SchemaError, match="migrate"), rwlock.read():
                pass
            assert LockTable(dsn, table=table).migrate() is True
            assert LockTable(dsn, table=table).migrate() is False, "idempotent"
            with rwlock.write() as got:
                assert got
    finally:
        admin.execute(f"DROP TABLE IF EXISTS {table}, {table}_semaphores, {table}_rwlocks")
        admin.execute(f"DROP SEQUENCE IF EXISTS {table}_token_seq")


@pytest.mark.parametrize("mode", ["read", "write"])
def test_a_restarted_holder_reusing_its_id_takes_its_row_back_and_the_old_hold_learns_it(
    dsn: str, name: str, schema: None, mode: str
) -> None:
    # As after a lost reply, or a process restarted with the same instance_id: the row is ours already.
    with MutexClient(dsn) as before, MutexClient(dsn) as after:
        old = before.rwlock(name, instance_id="catalogue-worker-1", **FAST)
        new = after.rwlock(name, instance_id="catalogue-worker-1", **FAST)
        other = after.rwlock(name, **FAST)
        with pytest.raises(LockNotHeldError), getattr(old, mode)() as got:
            assert got
            old_token = old.token
            assert old_token is not None
            with getattr(new, mode)() as again:
                assert again, "its own row, taken back"
                assert new.token is not None
                assert new.token > old_token
                wait_until(lambda: not old.held, timeout=10)
                if mode == "write":
                    with other.read() as read:
                        assert not read, "still one writer: the row was taken back, not doubled"


# -- decorators ------------------------------------------------------------------------------------


def test_decorated_functions_run_only_in_their_mode_and_are_skipped_otherwise(make_rwlock: MakeRWLock) -> None:
    other = make_rwlock()
    rw = make_rwlock()
    calls: list[str] = []

    @rw.read_singleton
    def read_catalogue() -> str:
        calls.append(f"read as {rw.mode}")
        return "read"

    @rw.write_singleton(blocking=False)
    def rebuild() -> str:
        calls.append(f"wrote as {rw.mode}")
        return "rebuilt"

    with other.read() as got:
        assert got
        assert read_catalogue() == "read", "readers share"
        assert rebuild() is None, "not beside a reader"
    with other.write() as got:
        assert got
        assert read_catalogue() is None, "not beside a writer"
        assert rebuild() is None
    assert rebuild() == "rebuilt"
    assert calls == ["read as read", "wrote as write"]
    assert not rw.held, "each call released what it held"


def test_a_decorated_reader_waits_with_a_timeout_and_refuses_while_its_rwlock_writes(make_rwlock: MakeRWLock) -> None:
    other = make_rwlock()
    rw = make_rwlock()

    @rw.read_singleton(blocking=True, timeout=0.3)
    def read_catalogue() -> None:
        raise AssertionError("must not run")

    with other.write() as got:
        assert got
        with pytest.raises(LockAcquisitionTimeout):
            read_catalogue()
    with rw.write() as got:
        assert got
        with pytest.raises(ValueError, match=r"holds .* for write already"):
            read_catalogue()  # its own writer would keep it waiting forever


async def test_async_decorated_functions_wait_by_default_and_skip_when_asked_not_to(make_rwlock: MakeRWLock) -> None:
    other = make_rwlock()
    rw = make_rwlock()

    @rw.read_singleton_async()
    async def read_catalogue() -> str:
        return f"read as {rw.mode}"

    @rw.write_singleton_async(blocking=False)
    async def rebuild() -> str:
        return "rebuilt"

    async with other.write_async() as got:
        assert got
        waiting = asyncio.ensure_future(read_catalogue())
        await asyncio.sleep(0)
        assert not waiting.done()
        assert await rebuild() is None
    assert await asyncio.wait_for(waiting, timeout=30) == "read as read", "woken by the writer's release"
    async with other.read_async() as got:
        assert got
        assert await rebuild() is None
    assert await rebuild() == "rebuilt"
