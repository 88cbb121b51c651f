"""The command line and read/write locks: ``run --read`` / ``run --write``, ``status`` of each holder's mode,
``release --writer`` / ``--reader``.

As in test_cli.py: the postgres-mutex command as a subprocess, against the
suite's real PostgreSQL.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from postgres_mutex import LockNotHeldError, RWLock
from tests.integration.test_cli import FAST_FLAGS, TRAP, cli, python, start
from tests.support.fixtures import FAST, process_listens, wait_until

pytestmark = pytest.mark.usefixtures("schema")


@pytest.fixture
def name() -> str:
    return f"cli-rw-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def rwlocks(dsn: str, name: str) -> Iterator[list[RWLock]]:
    """RWLocks of ``name`` the test makes, closed at its end."""
    made: list[RWLock] = []
    yield made
    for rwlock in made:
        with contextlib.suppress(Exception):
            rwlock.close()


def rows(admin: psycopg.Connection[Any], name: str, mode: str) -> int:
    found = admin.execute("SELECT count(*) FROM mutex_lock WHERE rwlock = %s AND rw_mode = %s", (name, mode)).fetchone()
    return 0 if found is None else int(found[0])


def test_run_read_runs_readers_together_and_run_write_waits_for_them_then_runs_alone(
    dsn: str, name: str, admin: psycopg.Connection[Any], workers: list[subprocess.Popen[str]], tmp_path: Path
) -> None:
    go = tmp_path / "go"
    # Each reader says it started, then runs until the test creates the file (30 s at most).
    reading = python(f"""
        import os, time
        print("reading", flush=True)
        deadline = time.monotonic() + 30
        while not os.path.exists({str(go)!r}) and time.monotonic() < deadline:
            time.sleep(0.02)
    """)
    readers = [
        start("run", "--dsn", dsn, "--lock", name, "--read", "--wait", "--timeout", "60", *FAST_FLAGS, "--", *reading)
        for _ in range(2)
    ]
    workers.extend(readers)
    wait_until(lambda: rows(admin, name, "read") == 2, timeout=30)
    writer = start(
        "run", "--dsn", dsn, "--lock", name, "--write", "--wait", "--timeout", "60", *FAST_FLAGS, "--",
        *python("print('writing', flush=True)"),
    )  # fmt: skip
    workers.append(writer)
    # The writer waits, listening for a release; it never runs beside the readers.
    wait_until(lambda: process_listens(admin, name, kind="read/write lock"), timeout=30)
    assert writer.poll() is None
    assert rows(admin, name, "write") == 0
    go.touch()
    for proc in readers:
        assert proc.wait(timeout=60) == 0
        assert proc.stdout is not None
        assert proc.stdout.read() == "reading\n"
    assert writer.wait(timeout=60) == 0
    assert writer.stdout is not None
    assert writer.stdout.read() == "writing\n", "the writer ran once the readers were gone"
    assert rows(admin, name, "read") + rows(admin, name, "write") == 0


def test_run_read_beside_a_writer_and_run_write_beside_a_reader_exit_75_and_say_why(
    dsn: str, name: str, rwlocks: list[RWLock]
) -> None:
    holder = RWLock(dsn, name, instance_id="in-the-way", **FAST)  # type: ignore[arg-type]
    rwlocks.append(holder)
    with holder.write() as got:
        assert got
        read = cli("run", "--dsn", dsn, "--lock", name, "--read", "--", *python("print('must not run')"))
    assert read.returncode == 75, read.stderr
    assert read.stdout == ""
    assert f"read/write lock {name!r} is closed to readers" in read.stderr
    assert "in-the-way" in read.stderr
    with holder.read() as got:
        assert got
        write = cli("run", "--dsn", dsn, "--lock", name, "--write", "--", *python("print('must not run')"))
        waited = cli(
            "run", "--dsn", dsn, "--lock", name, "--write", "--wait", "--timeout", "0.5", "--", "true"
        )  # fmt: skip
    assert write.returncode == 75, write.stderr
    assert write.stdout == ""
    assert f"read/write lock {name!r} is held (in-the-way among its holders)" in write.stderr
    assert waited.returncode == 75, waited.stderr
    assert f"read/write lock {name!r} still held" in waited.stderr
    assert "after 0.5s" in waited.stderr


def test_read_or_write_with_permits_or_restart_or_each_other_is_refused(dsn: str, name: str) -> None:
    with_permits = cli("run", "--dsn", dsn, "--lock", name, "--read", "--permits", "2", "--", "true")
    assert with_permits.returncode == 2
    assert "--read makes --lock a read/write lock, --permits a semaphore" in with_permits.stderr
    restarting = cli("run", "--dsn", dsn, "--lock", name, "--write", "--restart", "--", "true")
    assert restarting.returncode == 2
    assert "--restart" in restarting.stderr
    assert "--write" in restarting.stderr
    both = cli("run", "--dsn", dsn, "--lock", name, "--read", "--write", "--", "true")
    assert both.returncode == 2
    assert "not allowed with argument" in both.stderr


def test_a_writer_released_by_force_stops_its_command_and_exits_76(
    dsn: str, name: str, admin: psycopg.Connection[Any], workers: list[subprocess.Popen[str]]
) -> None:
    proc = start("run", "--dsn", dsn, "--lock", name, "--write", *FAST_FLAGS, "--", *python(TRAP))
    workers.append(proc)
    assert proc.stdout is not None
    assert proc.stdout.readline() == "ready\n"
    freed = cli("release", name, "--writer", "--dsn", dsn, "--force")
    assert freed.returncode == 0, freed.stderr
    assert f"released the writer of read/write lock {name!r}" in freed.stdout
    assert proc.wait(timeout=30) == 76
    assert proc.stdout.read() == "got SIGTERM\n", "stopped with SIGTERM first, as for a mutex"
    assert proc.stderr is not None
    assert f"lost read/write lock {name!r} (write) while the command ran" in proc.stderr.read()
    assert rows(admin, name, "write") == 0


def test_status_shows_each_holder_with_its_mode_and_release_frees_one_reader(
    dsn: str, name: str, admin: psycopg.Connection[Any], rwlocks: list[RWLock]
) -> None:
    first, second = (RWLock(dsn, name, instance_id=f"reader-{n}", **FAST) for n in (1, 2))  # type: ignore[arg-type]
    rwlocks += [first, second]
    held = [first.read(), second.read()]
    assert all(acquisition.__enter__() for acquisition in held)

    text = cli("status", "--dsn", dsn, "--lock", name)
    data = cli("status", "--dsn", dsn, "--lock", name, "--json")
    assert text.returncode == 0, text.stderr
    shown = [line.split()[:3] for line in text.stdout.splitlines()[1:] if line.strip()]
    assert sorted(shown) == [[name, "(read)", "reader-1"], [name, "(read)", "reader-2"]]
    report = json.loads(data.stdout)
    assert sorted((lock["rwlock"], lock["mode"], lock["holder"]) for lock in report["locks"]) == [
        (name, "read", "reader-1"),
        (name, "read", "reader-2"),
    ]

    # The lock's name alone releases nothing: which holder goes is the operator's choice.
    whole = cli("release", name, "--dsn", dsn, "--force")
    assert whole.returncode == 1
    assert "readers reader-1, reader-2: release one with --reader reader-1" in whole.stdout
    assert rows(admin, name, "read") == 2

    freed = cli("release", name, "--reader", "reader-2", "--dsn", dsn, "--force")
    assert freed.returncode == 0, freed.stderr
    assert f"released reader 'reader-2' of read/write lock {name!r}, held by reader-2" in freed.stdout
    assert rows(admin, name, "read") == 1
    # Its holder learns of it at its next heartbeat; the other reader keeps reading.
    wait_until(lambda: not second.held, timeout=10)
    assert first.held
    with pytest.raises(LockNotHeldError):
        held[1].__exit__(None, None, None)  # as for a Mutex: leaving says the lock was lost meanwhile
    held[0].__exit__(None, None, None)

    with second.write() as got:
        assert got
        text = cli("status", "--dsn", dsn)
        data = cli("status", "--dsn", dsn, "--lock", name, "--json")
        writer_gone = cli("release", name, "--reader", "reader-1", "--dsn", dsn, "--force")
    assert [line.split()[:3] for line in text.stdout.splitlines() if line.startswith(name)] == [
        [name, "(write)", "reader-2"]
    ]
    assert [(lock["mode"], lock["lock_name"]) for lock in json.loads(data.stdout)["locks"]] == [
        ("write", f"{name}\x1fw")
    ]
    assert writer_gone.returncode == 1, "reader-1 reads no more"
    assert f"read/write lock {name!r} has a writer: release it with --writer" in writer_gone.stdout


def test_release_of_a_reader_or_writer_needs_force_and_one_holder(dsn: str, name: str) -> None:
    refused = cli("release", name, "--writer", "--dsn", dsn)
    assert refused.returncode == 2
    assert "--force" in refused.stderr
    both = cli("release", name, "--writer", "--reader", "x", "--dsn", dsn, "--force")
    assert both.returncode == 2
    assert "not allowed with argument" in both.stderr
