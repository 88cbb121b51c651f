"""What the command line says to a person: typos, closed pipes, waits, and the command line's own words."""

from __future__ import annotations

import contextlib
import os
import pty
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from postgres_mutex import Mutex
from tests.support.fixtures import ROOT, process_listens, wait_until
from tests.support.postgres_server import PASSWORD, PostgresServer

# The default lock table exists whichever of these tests runs first, or alone.
pytestmark = pytest.mark.usefixtures("schema")


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "postgres_mutex", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        check=False,
    )


# -- a typo in a lock's name ----------------------------------------------------------


def test_status_of_a_misspelt_lock_says_no_such_lock_is_held_and_names_the_close_ones(
    make_mutex: Callable[..., Mutex], dsn: str, lock_name: str
) -> None:
    holder = make_mutex(lock_name=f"{lock_name}-nightly-report")
    typo = f"{lock_name}-nightly-reprot"
    with holder.acquire():
        result = cli("status", "--dsn", dsn, "--lock", typo)
    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        f"no lock named {typo!r} is held in table mutex_lock; held with a similar name: {holder.lock_name!r}\n"
    )


def test_release_of_a_misspelt_lock_says_no_such_lock_is_held_and_names_the_close_ones(
    make_mutex: Callable[..., Mutex], dsn: str, lock_name: str
) -> None:
    holder = make_mutex(lock_name=f"{lock_name}-nightly-report")
    typo = f"{lock_name}-nightly-reprot"
    with holder.acquire():
        result = cli("release", typo, "--dsn", dsn, "--force")
        assert holder.held, "nothing released"
    assert result.returncode == 1
    assert result.stdout == (
        f"no lock named {typo!r} is held in table mutex_lock: nothing to release; "
        f"held with a similar name: {holder.lock_name!r}\n"
    )


# -- a reader that stops reading ------------------------------------------------------


@pytest.fixture(scope="module")
def history_table(dsn: str, schema: None) -> Iterator[str]:
    """A lock table with a history, and one hold recorded in it."""
    table = f"pipes_{time.monotonic_ns()}"
    assert cli("init", "--dsn", dsn, "--table", table, "--history").returncode == 0
    held = cli("run", "--dsn", dsn, "--table", table, "--lock", "recorded", "--", "true")
    assert held.returncode == 0, held.stderr
    yield table
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(f'DROP TABLE "{table}", "{table}_history"')


@pytest.mark.parametrize("args", [["status"], ["status", "--json"], ["history"], ["history", "--json"], ["--help"]])
def test_a_closed_pipe_ends_the_command_quietly_as_it_ends_a_unix_tool(
    dsn: str, history_table: str, args: list[str]
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "postgres_mutex", *args, "--dsn", dsn, "--table", history_table],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the command writes a line (| head, once it had enough)
    stderr = proc.stderr.read()
    code = proc.wait(timeout=60)
    assert stderr == "", "no traceback, no message: the reader asked for no more"
    assert code == (0 if args == ["--help"] else 141), "as SIGPIPE ends a Unix tool (128 + 13)"


# -- what a wait tells a person ---------------------------------------------------------


def _wait_behind(
    holder: Mutex, dsn: str, admin: psycopg.Connection[Any], *flags: str, terminal: bool = False
) -> tuple[int, str]:
    """``run --wait`` started while ``holder`` holds the lock, which it releases once the runner waits; its
    stderr a pipe, or a terminal's."""
    acquisition = holder.acquire()
    assert acquisition.__enter__()
    main, tty = pty.openpty() if terminal else (-1, subprocess.PIPE)
    proc = subprocess.Popen(
        [sys.executable, "-m", "postgres_mutex", "run", *flags, "--dsn", dsn, "--lock", holder.lock_name, "--", "true"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=tty,
        text=True,
    )
    try:
        wait_until(lambda: process_listens(admin, holder.lock_name), timeout=30)
    finally:
        acquisition.__exit__(None, None, None)
    if not terminal:
        _, stderr = proc.communicate(timeout=30)
        return proc.returncode, stderr
    os.close(tty)
    code = proc.wait(timeout=30)
    said = b""
    with contextlib.suppress(OSError):  # EIO: the terminal's other end is closed, all of it read
        while chunk := os.read(main, 4096):
            said += chunk
    os.close(main)
    return code, said.decode().replace("\r\n", "\n")


def test_run_v_says_that_it_waits_for_whom_and_what_it_runs(
    make_mutex: Callable[..., Mutex], dsn: str, admin: psycopg.Connection[Any]
) -> None:
    holder = make_mutex()
    code, stderr = _wait_behind(holder, dsn, admin, "-v", "--wait", "--timeout", "30")
    assert code == 0, stderr
    said = [line for line in stderr.splitlines() if "INFO" not in line]
    assert said[0] == (
        f"postgres-mutex: lock {holder.lock_name!r} is held by {holder.instance_id}; waiting up to 30s for it"
    )
    assert said[1].startswith(f"postgres-mutex: holding lock {holder.lock_name!r} (token ")
    assert said[1].endswith("): running true")
    assert said[2].startswith("postgres-mutex: the command exited with status 0 after ")
    assert said[2].endswith(f"; released lock {holder.lock_name!r}")


def test_a_wait_with_stderr_to_a_log_says_nothing_unless_asked(
    make_mutex: Callable[..., Mutex], dsn: str, admin: psycopg.Connection[Any]
) -> None:
    code, stderr = _wait_behind(make_mutex(), dsn, admin, "--wait")
    assert (code, stderr) == (0, "")


def test_a_wait_at_a_terminal_says_that_it_waits_and_for_whom(
    make_mutex: Callable[..., Mutex], dsn: str, admin: psycopg.Connection[Any]
) -> None:
    holder = make_mutex()
    code, stderr = _wait_behind(holder, dsn, admin, "--wait", terminal=True)
    assert (code, stderr) == (
        0,
        f"postgres-mutex: lock {holder.lock_name!r} is held by {holder.instance_id}; waiting for it\n",
    )


# -- the command line's own words ------------------------------------------------------


@pytest.fixture
def role_without_create(pg: PostgresServer, admin: psycopg.Connection[Any], needs_superuser: None) -> Iterator[str]:
    """A login role that may create nothing (PostgreSQL 14 and older let everyone create tables in public)."""
    role = f"mutex_newcomer_{uuid.uuid4().hex[:8]}"
    admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{PASSWORD}'")
    admin.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")
    yield pg.dsn(user=role, password=PASSWORD)
    admin.execute(f"DROP OWNED BY {role}")
    admin.execute(f"DROP ROLE {role}")


def test_init_as_a_role_that_may_not_create_speaks_the_command_lines_words(role_without_create: str) -> None:
    result = cli("init", "--dsn", role_without_create, "--table", "app_locks")
    assert result.returncode == 69
    assert result.stderr.startswith(
        "postgres-mutex: error: creation of table app_locks failed: the role may not create it"
    ), result.stderr
    assert result.stderr.endswith("and skip 'postgres-mutex init'\n")
    assert "create_schema" not in result.stderr


def test_the_demo_as_a_role_that_may_not_create_says_what_the_demo_needs(role_without_create: str) -> None:
    result = cli("demo", "--dsn", role_without_create, "--workers", "2")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "the demo creates a table of its own" in result.stderr
    assert "or without --dsn (it then starts a throwaway PostgreSQL)" in result.stderr
    assert "postgres-mutex init" not in result.stderr, "advice for init, which the demo does not run"


def test_status_help_says_what_each_threshold_is_for() -> None:
    result = cli("status", "--help")
    assert result.returncode == 0
    flattened = " ".join(result.stdout.split())
    assert "--alert-threshold ALERT_THRESHOLD a holder silent this many seconds shows as 'alerting'" in flattened
    assert "--stale-threshold STALE_THRESHOLD a holder silent this many seconds shows as 'reclaimable'" in flattened
