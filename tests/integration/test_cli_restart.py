"""``postgres-mutex run --restart``: a daemon kept running on exactly one of several runners."""

from __future__ import annotations

import itertools
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.integration.test_cli import FAST_FLAGS, cli, python, start
from tests.support.fixtures import read_held, start_worker, wait_until

Holder = Callable[..., str | None]

# Thresholds under which a takeover within a second or two can only be a hand-over, never a reclaim.
SLOW_FLAGS = ["--heartbeat-interval", "0.5", "--alert-threshold", "3", "--stale-threshold", "10"]

DAEMON = """
    import os, signal, sys, time
    def leave(signum, frame):
        print(f"got {signal.Signals(signum).name}", flush=True)
        sys.exit(42)
    signal.signal(signal.SIGTERM, leave)
    print("ready", os.environ.get("POSTGRES_MUTEX_TOKEN"), flush=True)
    time.sleep(60)
"""


class Lines:
    """A process's output lines, read in the background so that a test can wait for one with a deadline."""

    def __init__(self, stream: Any) -> None:
        self._lines: queue.Queue[str] = queue.Queue()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            self._lines.put(line.rstrip("\n"))

    def next(self, timeout: float = 15.0) -> str:
        try:
            return self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no output line within {timeout}s") from None


@pytest.fixture
def runners() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def runner(*args: str) -> tuple[subprocess.Popen[str], Lines, Lines]:
    proc = start("run", *args)
    assert proc.stdout is not None
    assert proc.stderr is not None
    return proc, Lines(proc.stdout), Lines(proc.stderr)


def waiting_for_the_lock(admin: psycopg.Connection[Any], proc: subprocess.Popen[str]) -> Callable[[], bool]:
    """True once the runner listens for the lock's release: it is campaigning."""

    def check() -> bool:
        found = admin.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE %s",
            (f"postgres-mutex listener %:{proc.pid}",),
        ).fetchone()
        return found is not None and found[0] > 0

    return check


def token_of(line: str) -> int:
    word, token = line.split()
    assert word == "ready"
    return int(token)


def test_a_lost_lock_stops_the_command_and_the_runner_runs_it_again_once_it_holds_the_lock(
    dsn: str, lock_name: str, admin: psycopg.Connection[Any], holder_id: Holder, runners: list[subprocess.Popen[str]]
) -> None:
    proc, out, err = runner("--dsn", dsn, "--lock", lock_name, "--restart", *FAST_FLAGS, "--", *python(DAEMON))
    runners.append(proc)
    first = token_of(out.next())
    admin.execute("DELETE FROM mutex_lock WHERE lock_name = %s", (lock_name,))
    assert out.next() == "got SIGTERM", "stopped with SIGTERM when the lock was lost"
    second = token_of(out.next())
    assert second > first, "run again in a new term, with its token"
    assert proc.poll() is None, "the runner did not exit"
    proc.send_signal(signal.SIGTERM)
    assert out.next() == "got SIGTERM"
    assert proc.wait(timeout=10) == 42, "the runner exits with the command's status"
    assert holder_id() is None, "and released the lock"
    messages = []
    with_deadline = time.monotonic() + 5
    while time.monotonic() < with_deadline:
        line = err.next()
        messages.append(line)
        if "waiting for the lock again" in line:
            break
    assert any(f"lost lock {lock_name!r}" in line for line in messages), messages


def test_a_command_that_exits_is_run_again_after_a_back_off(
    dsn: str, lock_name: str, holder_id: Holder, runners: list[subprocess.Popen[str]]
) -> None:
    failing = """
        import time
        print("run", time.monotonic(), flush=True)
        raise SystemExit(3)
    """
    args = ["--dsn", dsn, "--lock", lock_name, "--restart", "--restart-delay", "0.2", *FAST_FLAGS]
    proc, out, err = runner(*args, "--", *python(failing))
    runners.append(proc)
    runs = [float(out.next().split()[1]) for _ in range(4)]
    gaps = [later - earlier for earlier, later in itertools.pairwise(runs)]
    assert gaps[0] >= 0.2 * 0.9, "the first failure waits --restart-delay"
    assert all(gap >= 0.4 * 0.9 for gap in gaps[1:]), "then twice as long, and longer"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) in (3, 128 + signal.SIGTERM)
    assert holder_id() is None
    lines = [err.next() for _ in range(3)]
    assert any("the command exited with status 3" in line for line in lines), lines
    assert not any("Traceback" in line for line in lines), "a command's exit status needs no traceback"


def test_the_back_off_is_each_runners_own_another_runner_starts_the_command_at_once(
    dsn: str, lock_name: str, admin: psycopg.Connection[Any], runners: list[subprocess.Popen[str]], tmp_path: Path
) -> None:
    # As the docs say: with N runners a failing command starts up to N times per --restart-delay.
    go = tmp_path / "go"
    failing = f"""
        import os, pathlib, time
        print("run", os.getppid(), flush=True)
        deadline = time.monotonic() + 30
        while not pathlib.Path({str(go)!r}).exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        raise SystemExit(3)
    """
    args = ["--dsn", dsn, "--lock", lock_name, "--restart", "--restart-delay", "10", *SLOW_FLAGS]
    first, first_out, _ = runner(*args, "--", *python(failing))
    runners.append(first)
    assert first_out.next() == f"run {first.pid}"
    second, second_out, _ = runner(*args, "--", *python(failing))
    runners.append(second)
    wait_until(waiting_for_the_lock(admin, second), timeout=15)
    failed_at = time.monotonic()
    go.touch()
    assert second_out.next(timeout=8) == f"run {second.pid}", "the other runner ran the command"
    assert time.monotonic() - failed_at < 5.0, "at once, not after the failed runner's 10 s back-off"
    for proc in (first, second):
        proc.send_signal(signal.SIGTERM)
    for proc in (first, second):
        proc.wait(timeout=10)


def test_a_command_that_cannot_be_executed_is_said_in_one_line_each_time(
    dsn: str, lock_name: str, holder_id: Holder, runners: list[subprocess.Popen[str]], tmp_path: Path
) -> None:
    command = tmp_path / "job"
    command.write_text("echo hello\n")  # no #! line: the kernel will not run it
    command.chmod(0o755)
    args = ["--dsn", dsn, "--lock", lock_name, "--restart", "--restart-delay", "0.2", *FAST_FLAGS]
    proc, _, err = runner(*args, "--", str(command))
    runners.append(proc)
    said: list[str] = []
    while sum("command could not be executed" in line for line in said) < 2:
        said.append(err.next())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) in (126, 128 + signal.SIGTERM)
    assert holder_id() is None
    assert not any("Traceback" in line for line in said), said


def test_sigterm_while_waiting_for_the_lock_stops_the_runner_at_once(
    dsn: str,
    lock_name: str,
    admin: psycopg.Connection[Any],
    holder_id: Holder,
    runners: list[subprocess.Popen[str]],
) -> None:
    # A holder in a process of its own: an in-process client's threads would linger into later tests.
    holder = start_worker("hold", dsn, lock_name)
    runners.append(holder)
    holder_instance = read_held(holder)
    proc, _, err = runner("--dsn", dsn, "--lock", lock_name, "--restart", "--", "echo", "never")
    runners.append(proc)
    wait_until(waiting_for_the_lock(admin, proc), timeout=15)
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 128 + signal.SIGTERM
    assert time.monotonic() - signalled < 2.0, "not after a poll interval or a timeout"
    assert holder_id() == holder_instance, "the holder was not disturbed"
    assert "stopped by signal SIGTERM" in err.next()
    holder.kill()
    holder.wait(timeout=10)
    for stream in (holder.stdout, holder.stderr):
        if stream is not None:
            stream.close()


def test_two_runners_keep_one_command_running_and_hand_over_at_once(
    dsn: str, lock_name: str, admin: psycopg.Connection[Any], runners: list[subprocess.Popen[str]]
) -> None:
    args = ["--dsn", dsn, "--lock", lock_name, "--restart", *SLOW_FLAGS, "--", *python(DAEMON)]
    active, active_out, _ = runner(*args)
    runners.append(active)
    first = token_of(active_out.next())
    standby, standby_out, _ = runner(*args)
    runners.append(standby)
    wait_until(waiting_for_the_lock(admin, standby), timeout=15)
    stopped = time.monotonic()
    active.send_signal(signal.SIGTERM)
    assert active_out.next() == "got SIGTERM"
    assert active.wait(timeout=10) == 42
    second = token_of(standby_out.next())
    assert time.monotonic() - stopped < 3.0, "the standby took over at once, long before stale_threshold (10s)"
    assert second > first
    standby.send_signal(signal.SIGTERM)
    assert standby.wait(timeout=10) == 42


def test_restart_refuses_a_timeout(dsn: str, lock_name: str) -> None:
    result = cli("run", "--dsn", dsn, "--lock", lock_name, "--restart", "--timeout", "5", "--", "true")
    assert result.returncode == 2
    assert "--restart" in result.stderr
    assert "Traceback" not in result.stderr
    assert os.linesep not in result.stderr.strip(), "one line"
