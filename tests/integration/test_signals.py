"""SIGTERM, the way pods, services and deploys are stopped: with exit_on_sigterm, locks come back at once.

``postgres-mutex run`` stopped by SIGTERM or SIGHUP while its acquire waits on the server
leaves nothing behind either.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from postgres_mutex import MutexError, exit_on_sigterm
from tests.support.fixtures import FAST, ROOT, wait_until

Holder = Callable[..., str | None]

HOLDERS = {
    "with-block": """
with mutex.acquire(blocking=True, timeout=30):
    print("held", flush=True)
    while True:
        time.sleep(60)
""",
    "daemon-thread": """
entered = threading.Event()
def job():
    with mutex.acquire(blocking=True, timeout=30):
        entered.set()
        while True:
            time.sleep(60)
threading.Thread(target=job, daemon=True).start()
entered.wait(30)
print("held", flush=True)
threading.Event().wait()
""",
    "asyncio": """
async def main():
    async with mutex.acquire_async(blocking=True, timeout=30):
        print("held", flush=True)
        await asyncio.Event().wait()
asyncio.run(main())
""",
    # The signal lands inside a task that is running, not in the loop's wait.
    "asyncio-busy-task": """
async def spin():
    while True:
        sum(range(10_000))
        await asyncio.sleep(0)
async def main():
    busy = asyncio.create_task(spin())
    async with mutex.acquire_async(blocking=True, timeout=30):
        print("held", flush=True)
        await asyncio.Event().wait()
asyncio.run(main())
""",
}


def _holder(dsn: str, lock_name: str, body: str, *, helper: bool) -> subprocess.Popen[str]:
    code = f"""
import asyncio, faulthandler, signal, threading, time
faulthandler.register(signal.SIGUSR1)  # a test that gives up on it asks where every thread is
from postgres_mutex import Mutex, exit_on_sigterm
{"exit_on_sigterm()" if helper else ""}
mutex = Mutex({dsn!r}, {lock_name!r}, **{FAST!r})
{body}
"""
    return subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _stop(proc: subprocess.Popen[str]) -> tuple[int, str]:
    assert proc.stdout is not None
    assert proc.stderr is not None
    line = proc.stdout.readline()
    assert line.strip() == "held", proc.stderr.read()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        # Still running: where is each of its threads? (faulthandler writes them to stderr.)
        proc.send_signal(signal.SIGUSR1)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=2)
        proc.kill()
        proc.wait(timeout=10)
        pytest.fail(f"the SIGTERMed holder did not exit within 20 s; its threads:\n{proc.stderr.read()}")
    finally:
        if proc.poll() is None:
            proc.kill()
    return code, proc.stderr.read()


@pytest.mark.parametrize("how", sorted(HOLDERS))
def test_a_sigtermed_holder_has_released_its_lock_by_the_time_it_has_exited(
    dsn: str, lock_name: str, holder_id: Holder, how: str
) -> None:
    code, stderr = _stop(_holder(dsn, lock_name, HOLDERS[how], helper=True))
    assert code == 143, stderr  # 128 + SIGTERM, as a shell reports a process SIGTERM ended
    assert holder_id() is None, "the row is gone at once, not after stale_threshold"
    assert "Traceback" not in stderr, stderr


def test_without_it_a_sigtermed_holder_leaves_its_row_behind(dsn: str, lock_name: str, holder_id: Holder) -> None:
    # Why the helper exists: Python's default action runs no release at all.
    code, _ = _stop(_holder(dsn, lock_name, HOLDERS["with-block"], helper=False))
    assert code == -signal.SIGTERM
    assert holder_id() is not None


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_run_stopped_by_a_signal_while_its_acquire_waits_on_the_server_leaves_nothing_behind(
    dsn: str, lock_name: str, uncommitted_insert: psycopg.Connection[Any], admin: psycopg.Connection[Any], signum: int
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "postgres_mutex", "run", "--dsn", dsn, "--lock", lock_name, "--", "true"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Observed, not slept on: the command's acquire is waiting on the other session's row.
        wait_until(
            lambda: (
                admin.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND application_name LIKE %s",
                    (f"postgres-mutex %:{proc.pid}",),
                ).fetchone()
                == (1,)
            ),
            timeout=20,
        )
        proc.send_signal(signum)
        assert proc.wait(timeout=10) == 128 + signum
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)
    uncommitted_insert.rollback()
    time.sleep(0.5)  # what was still running on the server would have landed by now
    result = subprocess.run(
        [sys.executable, "-m", "postgres_mutex", "run", "--dsn", dsn, "--lock", lock_name, "--", "true"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, f"the next run got the lock at once: {result.stderr}"


@pytest.fixture
def default_sigterm() -> Iterator[None]:
    before = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGTERM, before)


def _applications_handler(signum: int, frame: Any) -> None:
    raise SystemExit(0)


@pytest.mark.usefixtures("default_sigterm")
@pytest.mark.parametrize("installed", [_applications_handler, signal.SIG_IGN], ids=["handler", "SIG_IGN"])
def test_it_refuses_to_replace_a_handler_the_application_installed(installed: Any) -> None:
    signal.signal(signal.SIGTERM, installed)
    with pytest.raises(MutexError, match=r"SIGTERM already has a handler .*does not replace it"):
        exit_on_sigterm()
    assert signal.getsignal(signal.SIGTERM) is installed


@pytest.mark.usefixtures("default_sigterm")
def test_calling_it_twice_is_harmless() -> None:
    exit_on_sigterm()
    handler = signal.getsignal(signal.SIGTERM)
    exit_on_sigterm()
    assert signal.getsignal(signal.SIGTERM) is handler
    assert handler is not signal.SIG_DFL


@pytest.mark.usefixtures("default_sigterm")
def test_outside_the_main_thread_it_says_where_to_call_it() -> None:
    errors: list[BaseException] = []

    def call() -> None:
        try:
            exit_on_sigterm()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    thread.join(10)
    assert len(errors) == 1
    assert isinstance(errors[0], MutexError)
    assert "main thread" in str(errors[0])
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
