"""The postgres-mutex command, end to end, as a subprocess against real PostgreSQL."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time
import urllib.request
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import psycopg
import pytest

from postgres_mutex import Mutex
from tests.support.fixtures import ROOT, freeze, process_listens, read_line, skip_or_fail_in_ci, wait_until
from tests.support.postgres_server import free_port
from tests.support.timing import FAST, cli_flags

Holder = Callable[..., str | None]
# The default lock table exists whichever of these tests runs first, or alone.
pytestmark = pytest.mark.usefixtures("schema")

FAST_FLAGS = cli_flags()
SECRET = "Cli-s3cret-pw"


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


def start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "postgres_mutex", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=None if env is None else {**os.environ, **env},
    )


@pytest.fixture
def demo_tmp() -> Iterator[Path]:
    """A temporary directory of the demo's own (its TMPDIR): other test runs on this machine start
    throwaway servers in the system's, so only a directory of its own tells what the demo left."""
    directory = Path(tempfile.mkdtemp(prefix="postgres-mutex-demo-test-"))
    directory.chmod(0o755)  # the server runs as another user when the suite runs as root
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


# -- run ----------------------------------------------------------------------


def test_run_holds_the_lock_while_the_command_runs_and_passes_its_exit_code_on(
    dsn: str, lock_name: str, holder_id: Holder, workers: list[subprocess.Popen[str]]
) -> None:
    proc = start(
        "run",
        "--dsn",
        dsn,
        "--lock",
        lock_name,
        *FAST_FLAGS,
        "--",
        *python("""
        import sys, time
        print("started", flush=True)
        time.sleep(0.5)
        sys.exit(3)
    """),
    )
    workers.append(proc)
    assert proc.stdout is not None
    assert proc.stdout.readline() == "started\n"
    assert holder_id() is not None, "held while the command runs"
    assert proc.wait(timeout=30) == 3, "the command's own exit code"
    assert holder_id() is None, "released when it ends"


def test_run_exits_zero_when_the_command_succeeds(dsn: str, lock_name: str) -> None:
    result = cli("run", "--dsn", dsn, "--lock", lock_name, "--", *python("print('job done')"))
    assert result.returncode == 0, result.stderr
    assert result.stdout == "job done\n"


def test_a_busy_lock_exits_75_and_says_who_holds_it(make_mutex: Callable[..., Mutex], dsn: str) -> None:
    holder = make_mutex()
    with holder.acquire():
        result = cli("run", "--dsn", dsn, "--lock", holder.lock_name, "--", *python("print('must not run')"))
        custom = cli("run", "--dsn", dsn, "--lock", holder.lock_name, "--conflict-exit-code", "0", "--", "true")
    assert result.returncode == 75
    assert result.stdout == ""
    assert holder.instance_id in result.stderr
    assert custom.returncode == 0, "a busy lock need not be a failure (the README's CronJob)"


@pytest.mark.parametrize("wait", [["--wait"], []], ids=["wait", "timeout-alone"])
def test_wait_with_a_timeout_gives_up_with_the_busy_code(
    make_mutex: Callable[..., Mutex], dsn: str, wait: list[str]
) -> None:
    holder = make_mutex()
    with holder.acquire():
        started = time.monotonic()
        result = cli("run", "--dsn", dsn, "--lock", holder.lock_name, *wait, "--timeout", "0.5", "--", "true")
        elapsed = time.monotonic() - started
    assert result.returncode == 75
    assert "still held by" in result.stderr
    assert elapsed >= 0.5


def test_wait_runs_the_command_once_the_holder_releases(
    make_mutex: Callable[..., Mutex], dsn: str, admin: psycopg.Connection[Any], workers: list[subprocess.Popen[str]]
) -> None:
    holder = make_mutex()
    acquire = holder.acquire()
    assert acquire.__enter__()
    proc = start("run", "--dsn", dsn, "--lock", holder.lock_name, "--wait", "--timeout", "30", "--", "echo", "ran")
    workers.append(proc)
    wait_until(lambda: process_listens(admin, holder.lock_name), timeout=30)  # it waits, listening for the release
    assert proc.poll() is None, "still waiting"
    acquire.__exit__(None, None, None)
    assert proc.wait(timeout=30) == 0
    assert proc.stdout is not None
    assert proc.stdout.read() == "ran\n"


TRAP = """
    import signal, sys, time
    def leave(signum, frame):
        print(f"got {signal.Signals(signum).name}", flush=True)
        sys.exit(42)
    for name in ("SIGINT", "SIGTERM", "SIGHUP"):
        signal.signal(getattr(signal, name), leave)
    print("ready", flush=True)
    time.sleep(60)
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_signals_are_forwarded_to_the_command(
    dsn: str, lock_name: str, holder_id: Holder, workers: list[subprocess.Popen[str]], signum: int
) -> None:
    proc = start("run", "--dsn", dsn, "--lock", lock_name, *FAST_FLAGS, "--", *python(TRAP))
    workers.append(proc)
    assert proc.stdout is not None
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signum)
    assert proc.wait(timeout=30) == 42, "the command's exit code, after it handled the signal"
    assert proc.stdout.read() == f"got {signal.Signals(signum).name}\n"
    assert holder_id() is None


def test_a_command_killed_by_a_signal_exits_128_plus_n(dsn: str, lock_name: str, holder_id: Holder) -> None:
    result = cli("run", "--dsn", dsn, "--lock", lock_name, "--", *python("import os; os.kill(os.getpid(), 9)"))
    assert result.returncode == 128 + 9
    assert holder_id() is None


def test_a_lost_lock_stops_the_command_and_exits_76(
    dsn: str, lock_name: str, admin: psycopg.Connection[Any], holder_id: Holder, workers: list[subprocess.Popen[str]]
) -> None:
    proc = start("run", "--dsn", dsn, "--lock", lock_name, *FAST_FLAGS, "--", *python(TRAP))
    workers.append(proc)
    assert proc.stdout is not None
    assert proc.stdout.readline() == "ready\n"
    admin.execute("DELETE FROM mutex_lock WHERE lock_name = %s", (lock_name,))
    assert proc.wait(timeout=30) == 76
    assert proc.stdout.read() == "got SIGTERM\n", "stopped with SIGTERM first"
    assert proc.stderr is not None
    assert "lock was lost" in proc.stderr.read()


def test_a_command_ignoring_sigterm_is_killed_after_the_grace_period(
    dsn: str, lock_name: str, admin: psycopg.Connection[Any], workers: list[subprocess.Popen[str]]
) -> None:
    stubborn = """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", flush=True)
        time.sleep(60)
    """
    proc = start("run", "--dsn", dsn, "--lock", lock_name, *FAST_FLAGS, "--kill-after", "0.05", "--", *python(stubborn))
    workers.append(proc)
    assert proc.stdout is not None
    assert proc.stdout.readline() == "ready\n"
    admin.execute("DELETE FROM mutex_lock WHERE lock_name = %s", (lock_name,))
    assert proc.wait(timeout=30) == 76
    assert proc.stderr is not None
    assert "killing it" in proc.stderr.read()


def test_sigterm_while_waiting_for_the_lock_leaves_nothing_behind(
    make_mutex: Callable[..., Mutex],
    dsn: str,
    admin: psycopg.Connection[Any],
    holder_id: Holder,
    workers: list[subprocess.Popen[str]],
) -> None:
    holder = make_mutex()
    with holder.acquire():
        proc = start("run", "--dsn", dsn, "--lock", holder.lock_name, "--wait", "--", "echo", "never")
        workers.append(proc)
        # The command installs its SIGTERM handler before it first tries the lock: once it
        # LISTENs for the release (pg_stat_activity shows it), the handler is in place.
        wait_until(lambda: process_listens(admin, holder.lock_name), timeout=30)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        assert holder_id() == holder.instance_id


def test_run_needs_a_command(dsn: str, lock_name: str) -> None:
    result = cli("run", "--dsn", dsn, "--lock", lock_name)
    assert result.returncode == 2
    assert "needs a command" in result.stderr


@pytest.mark.parametrize("command", ["/no/such/command", "no-such-command-on-path"])
def test_a_missing_command_exits_127(dsn: str, lock_name: str, holder_id: Holder, command: str) -> None:
    result = cli("run", "--dsn", dsn, "--lock", lock_name, "--", command)
    assert result.returncode == 127
    assert f"command not found: {command}" in result.stderr
    assert holder_id() is None


@pytest.mark.parametrize("what", ["no #! line", "not executable", "a directory", "a missing #! interpreter"])
def test_a_command_that_cannot_be_executed_exits_126_with_one_line(
    dsn: str, lock_name: str, holder_id: Holder, tmp_path: Path, what: str
) -> None:
    command = tmp_path / "job"
    if what == "a directory":
        command.mkdir()
    elif what == "a missing #! interpreter":
        command.write_text("#!/nonexistent/interpreter\necho hello\n")
        command.chmod(0o755)
    else:
        command.write_text("echo hello\n")
        command.chmod(0o755 if what == "no #! line" else 0o644)
    result = cli("run", "--dsn", dsn, "--lock", lock_name, "--", str(command))
    assert result.returncode == 126, result.stderr
    lines = result.stderr.strip().splitlines()
    assert any(f"command could not be executed: {command}" in line for line in lines), lines
    assert "Traceback" not in result.stderr
    assert holder_id() is None


# -- status ----------------------------------------------------------------------


def test_status_shows_each_lock_with_its_state_by_the_server_clock(
    make_mutex: Callable[..., Mutex], dsn: str, row: Callable[..., tuple[Any, ...] | None]
) -> None:
    # The healthy holder names its session (reclaim_disconnected_after); the silent one does not.
    healthy = make_mutex(operation_timeout=0.3, reclaim_disconnected_after=0.8)
    silent = make_mutex(lock_name=f"silent-{time.monotonic_ns()}")
    alert = FAST["alert_threshold"]
    # A wide alerting window: each command below takes a moment to start.
    thresholds = ["--alert-threshold", f"{alert:g}", "--stale-threshold", "60"]

    def silent_for() -> float:
        found = row(silent.lock_name)
        return 0.0 if found is None else float(found[1])

    with healthy.acquire():
        acquire = silent.acquire()
        assert acquire.__enter__()
        freeze(silent)
        wait_until(lambda: silent_for() >= alert, timeout=10)  # silent past the alert threshold, by the server's clock
        tokens = {healthy.lock_name: healthy.token, silent.lock_name: silent.token}
        text = cli("status", "--dsn", dsn, *thresholds)
        data = cli(
            "status", "--dsn", dsn, "--json", *thresholds, "--lock", healthy.lock_name, "--lock", silent.lock_name
        )
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0].split() == ["LOCK", "HOLDER", "HELD", "FOR", "SINCE", "HEARTBEAT", "STATE", "TOKEN", "SESSION"]
    shown = {line.split()[0]: line.split() for line in lines[1:]}
    assert shown[healthy.lock_name][1] == healthy.instance_id
    assert shown[healthy.lock_name][-3:] == ["ok", str(tokens[healthy.lock_name]), "alive"]
    assert shown[silent.lock_name][-3:] == ["alerting", str(tokens[silent.lock_name]), "-"]
    assert data.returncode == 0, data.stderr
    report = json.loads(data.stdout)
    assert report["alert_threshold"] == alert
    states = {lock["lock_name"]: lock for lock in report["locks"]}
    assert set(states) == {healthy.lock_name, silent.lock_name}
    assert states[silent.lock_name]["state"] == "alerting"
    assert states[silent.lock_name]["seconds_since_heartbeat"] >= alert
    assert states[healthy.lock_name]["held_for_seconds"] >= alert, "held since before the silent one was"
    assert states[healthy.lock_name]["token"] == tokens[healthy.lock_name] is not None
    assert states[healthy.lock_name]["session"] == "alive"
    assert states[healthy.lock_name]["reclaim_disconnected_after"] == 0.8
    assert states[silent.lock_name]["session"] is None
    silent.close()


def test_status_of_an_empty_table(dsn: str, admin: psycopg.Connection[Any]) -> None:
    table = f"empty_{time.monotonic_ns()}"
    assert cli("init", "--dsn", dsn, "--table", table).returncode == 0
    result = cli("status", "--dsn", dsn, "--table", table)
    assert result.stdout == f"no lock is held in table {table}\n"
    assert json.loads(cli("status", "--dsn", dsn, "--table", table, "--json").stdout)["locks"] == []
    admin.execute(f'DROP TABLE "{table}"')


# -- init, release ----------------------------------------------------------------


def test_init_creates_the_table_once(dsn: str, admin: psycopg.Connection[Any]) -> None:
    table = f"init_{time.monotonic_ns()}"
    first, second = cli("init", "--dsn", dsn, "--table", table), cli("init", "--dsn", dsn, "--table", table)
    assert (first.returncode, second.returncode) == (0, 0)
    assert first.stdout == f"table {table} is ready\n"
    assert admin.execute("SELECT to_regclass(%s)", (table,)).fetchone() == (table,)
    admin.execute(f'DROP TABLE "{table}"')


def test_init_makes_the_integrations_tables_it_is_asked_for_and_names_the_flag_it_lacks(
    dsn: str, admin: psycopg.Connection[Any], dml_role: str
) -> None:
    beat, ledger = f"beat_{time.monotonic_ns()}", f"ledger_{time.monotonic_ns()}"
    made = cli("init", "--dsn", dsn, "--celery-beat", beat, "--apscheduler", ledger)
    assert made.returncode == 0, made.stderr
    assert f"the Celery beat table {beat} is ready" in made.stdout
    assert admin.execute("SELECT to_regclass(%s), to_regclass(%s)", (beat, ledger)).fetchone() == (beat, ledger)
    # A role without CREATE: init passes where the tables exist, and names the flag where one is missing.
    assert cli("init", "--dsn", dml_role, "--celery-beat", beat, "--apscheduler", ledger).returncode == 0
    refused = cli("init", "--dsn", dml_role, "--apscheduler", f"{ledger}_missing")
    assert refused.returncode == 69
    assert "may not create it" in refused.stderr
    assert "'postgres-mutex init --apscheduler'" in refused.stderr
    assert "LockTable.create" not in refused.stderr
    admin.execute(f'DROP TABLE "{beat}", "{ledger}"')


def test_release_force_removes_a_dead_holders_row_and_names_it(
    make_mutex: Callable[..., Mutex], dsn: str, holder_id: Holder
) -> None:
    holder = make_mutex()
    acquire = holder.acquire()
    assert acquire.__enter__()
    freeze(holder)
    refused = cli("release", holder.lock_name, "--dsn", dsn)
    assert refused.returncode == 2
    assert "--force" in refused.stderr
    assert holder_id() == holder.instance_id, "nothing removed without --force"
    forced = cli("release", holder.lock_name, "--dsn", dsn, "--force")
    assert forced.returncode == 0, forced.stderr
    assert holder.instance_id in forced.stdout
    assert holder_id() is None
    again = cli("release", holder.lock_name, "--dsn", dsn, "--force")
    assert again.returncode == 1
    assert again.stdout == f"no lock named {holder.lock_name!r} is held in table mutex_lock: nothing to release\n"
    holder.close()


# -- watch --------------------------------------------------------------------------


def test_watch_serves_metrics_that_show_a_lock_going_stale(
    make_mutex: Callable[..., Mutex], dsn: str, workers: list[subprocess.Popen[str]]
) -> None:
    port = free_port()
    proc = start(
        "watch",
        "--dsn",
        dsn,
        "--listen",
        f"127.0.0.1:{port}",
        "--interval",
        "0.2",
        "--alert-threshold",
        f"{FAST['alert_threshold']:g}",
        "--stale-threshold",
        f"{FAST['stale_threshold']:g}",
    )
    workers.append(proc)
    holder = make_mutex()
    acquire = holder.acquire()
    assert acquire.__enter__()
    freeze(holder)

    def scrape() -> str:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
                return str(reply.read().decode())
        except OSError:
            return ""

    # A mutex's holder has no permit nor mode: those labels are empty (absent, once Prometheus stores them).
    series = f'postgres_mutex_reclaimable{{lock_name="{holder.lock_name}",mode="",permit=""}} 1.0'
    wait_until(lambda: series in scrape(), timeout=20)
    text = scrape()
    assert f'postgres_mutex_alerting{{lock_name="{holder.lock_name}",mode="",permit=""}} 1.0' in text
    holder_info = f'{{holder="{holder.instance_id}",lock_name="{holder.lock_name}",mode="",permit=""}}'
    assert f"postgres_mutex_holder_info{holder_info} 1.0" in text
    assert "postgres_mutex_alerts_total" in text
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert proc.stderr is not None
    assert "has not heartbeated" in proc.stderr.read(), "the alert is logged"
    holder.close()


def test_watch_ends_on_sigterm_wherever_the_signal_lands() -> None:
    """SIGTERM ends ``watch`` at any point of its main thread once it watches: there the handler may
    interrupt the very wait it ends. Each run lands the handler at one more point (from the watcher's
    start on, in the command and the threading machinery); past the last, a real SIGTERM ends the run."""
    code = f"""
        import os, queue, signal, sys, threading
        from postgres_mutex._cli import _admin
        from postgres_mutex.cli import main
        from postgres_mutex.watcher import StaleWatcher
        from tests.support.signal_points import RunAtCheck

        state = {{"armed": False, "fired": False}}
        start = StaleWatcher.start

        def armed_start(self):
            start(self)
            state["armed"] = True

        StaleWatcher.start = armed_start

        class AfterStart(RunAtCheck):  # the points from the watcher's start on, until a signal came
            def _check(self, frame):
                if state["armed"] and not state["fired"]:
                    super()._check(frame)

        def watched(name):
            return name in (threading.__file__, queue.__file__, _admin.__file__)

        def fire():
            state["fired"] = True
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)

        def backstop():  # past the last point: the real signal, as a pod's stop sends it
            if not state["fired"]:
                state["fired"] = True
                os.kill(os.getpid(), signal.SIGTERM)

        for at in range(1, 200):
            state.update(armed=False, fired=False)
            handler = AfterStart(at, fire, watched)
            timer = threading.Timer(1.0, backstop)
            timer.start()
            print("at", at, flush=True)
            sys.settrace(handler)
            try:
                code = main(["watch", "--dsn", "postgresql://app@127.0.0.1:{free_port()}/db?connect_timeout=2",
                             "--listen", "127.0.0.1:0", "--interval", "0.2"])
            finally:
                sys.settrace(None)
                timer.cancel()
            print("ended", code, handler.where or "by the real signal", flush=True)
            if not handler.where:
                break
    """
    with subprocess.Popen(python(code), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as proc:
        try:
            stdout, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, _ = proc.communicate()
    lines = stdout.splitlines()
    assert lines, "the program started"
    # Where the interpreter's trace sees no point before the wait (3.12 and later, which trace fewer),
    # only the real signal lands: it must end the command all the same.
    assert lines[-1] == "ended 0 by the real signal", f"watch did not end after {lines[-2:]}"


# -- demo ---------------------------------------------------------------------------


def _story(output: str) -> list[str]:
    """The demo's turning points; an alert is counted in the freeze only (the crash's comes when it comes)."""
    words = ("CRASHED", "ALERT", "RECLAIMED", "FROZEN", "RESUMED")
    seen = [word for line in output.splitlines() for word in words if word in line]
    frozen = seen.index("FROZEN") if "FROZEN" in seen else len(seen)
    return [word for n, word in enumerate(seen) if word != "ALERT" or n > frozen]


# The crash is reclaimed once its session is gone; the freeze keeps its session: alerted on, not reclaimed.
STORY = ["CRASHED", "RECLAIMED", "FROZEN", "ALERT", "RESUMED"]


def test_demo_on_a_throwaway_server_tells_the_whole_story_and_cleans_up(demo_tmp: Path) -> None:
    result = cli("demo", timeout=120, env={"TMPDIR": str(demo_tmp)})
    assert result.returncode == 0, result.stdout + result.stderr
    assert _story(result.stdout) == STORY
    assert "throwaway PostgreSQL" in result.stdout
    assert "crash -> reclaim" in result.stdout
    assert list(demo_tmp.glob("postgres-mutex-data-*")) == [], "its server's files are gone"


def test_demo_on_your_own_server_leaves_no_table_behind(dsn: str, admin: psycopg.Connection[Any]) -> None:
    result = cli("demo", "--dsn", dsn, "--workers", "2", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert _story(result.stdout) == STORY
    assert "its database session had ended" in result.stdout
    shown = sum(line.split(maxsplit=2)[-1].startswith("ALERT:") for line in result.stdout.splitlines() if line)
    counted = re.search(r"^  alerts (\d+), one per silent holder as the timeline shows them", result.stdout, re.M)
    assert counted is not None, result.stdout
    assert int(counted.group(1)) == shown, "the summary counts the alerts the timeline shows"
    leftovers = admin.execute("SELECT tablename FROM pg_tables WHERE tablename LIKE 'postgres_mutex_demo_%'").fetchall()
    assert leftovers == []
    functions = admin.execute("SELECT proname FROM pg_proc WHERE proname LIKE 'postgres_mutex_demo_%'").fetchall()
    assert functions == []


# -- errors, help, secrets -----------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["run", "--lock", "", "--", "true"], 2, "--lock must be 1 to 64 characters"),
        (["run", "--lock", "x", "--alert-threshold", "700", "--", "true"], 2, "--alert-threshold (700s) must be"),
        (["run", "--lock", "x", "--heartbeat-interval", "-1", "--", "true"], 2, "heartbeat-interval"),
        (["run", "--lock", "x", "--heartbeat-interval", "0.001", "--", "true"], 2, "--heartbeat-interval must be at"),
        (
            [
                *("run", "--lock", "x", "--heartbeat-interval", "15"),
                *("--alert-threshold", "20", "--stale-threshold", "40", "--", "true"),
            ],
            2,
            "--stale-threshold (40s) must be at least three times --heartbeat-interval (15s)",
        ),
        (["status", "--table", "no_such_table"], 69, "run 'postgres-mutex init'"),
        (["status", "--table", "a.b.c"], 2, "--table must be 'name' or 'schema.name'"),
        (["run", "--lock", "", "--restart", "--", "true"], 2, "--lock must be 1 to 64 characters"),
        (["history", "--table", "no_such_table"], 69, "postgres-mutex init"),
        (["watch", "--listen", "nonsense"], 2, "HOST:PORT"),
        (["watch", "--listen", "127.0.0.1:99999"], 2, "a port from 0 to 65535"),
        (["watch", "--listen", "127.0.0.1:\u00b2"], 2, "a port from 0 to 65535"),
        (["watch", "--listen", "127.0.0.1:\u0661"], 2, "a port from 0 to 65535"),
    ],
)
def test_user_errors_are_one_line_and_no_traceback(dsn: str, args: list[str], code: int, message: str) -> None:
    result = cli(*args, "--dsn", dsn)
    assert result.returncode == code, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    for python_word in ("create_schema", "LockTable", "_threshold", "_interval", "blocking=", "lock_name"):
        assert python_word not in result.stderr, "said in the flags' words, not the Python API's"


def test_a_connection_string_libpq_cannot_read_is_named_as_the_flag_and_its_variable() -> None:
    result = cli("status", "--dsn", "host=127.0.0.1 no_such_option=1")
    assert result.returncode == 2, result.stderr
    assert "--dsn (or POSTGRES_MUTEX_DSN) is not a valid connection string" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("command", ["run --lock x -- true", "status", "init", "release x --force", "watch"])
def test_no_output_ever_shows_the_password(command: str) -> None:
    dsn = f"postgresql://app:{SECRET}@127.0.0.1:{free_port()}/db?connect_timeout=2"
    result = cli(*command.split(), "--dsn", dsn, timeout=60) if command != "watch" else None
    if result is None:
        proc = start("watch", "--dsn", dsn, "--listen", f"127.0.0.1:{free_port()}", "--interval", "0.2")
        assert proc.stderr is not None
        # Its first line says what it watches; then it tells its first failed connection: wait for that.
        seen = [read_line(proc.stderr, timeout=30)]
        while "could not connect" not in seen[-1] and len(seen) < 20:
            seen.append(read_line(proc.stderr, timeout=30))
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=30)
        result = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, "".join(seen) + stderr)
    assert "could not connect" in result.stderr
    assert SECRET not in result.stdout + result.stderr
    assert "Traceback" not in result.stderr


def test_the_dsn_can_come_from_the_environment(dsn: str, lock_name: str) -> None:
    result = cli("run", "--lock", lock_name, "--", "true", env={"POSTGRES_MUTEX_DSN": dsn})
    assert result.returncode == 0, result.stderr


def _subcommands() -> list[str]:
    """The parser's own subcommands, in its order: the reference and the help are held against them."""
    from postgres_mutex._cli._parser import parser

    (commands,) = (action for action in parser()._actions if isinstance(action, argparse._SubParsersAction))
    return list(commands.choices)


def test_the_parser_has_the_subcommands_these_tests_know() -> None:
    # A guard on _subcommands itself: a parser read wrongly would make the tests below vacuous.
    assert {"run", "status", "watch", "init", "migrate", "history", "release", "demo"} <= set(_subcommands())


@pytest.mark.parametrize("command", _subcommands())
def test_every_subcommand_has_help_with_examples(command: str) -> None:
    result = cli(command, "--help")
    assert result.returncode == 0
    assert "examples:" in result.stdout
    assert f"postgres-mutex {command}" in result.stdout


def test_the_command_line_reference_shows_every_subcommand_in_the_parsers_order() -> None:
    reference = (ROOT / "docs" / "reference" / "cli.md").read_text(encoding="utf-8")
    sections = re.findall(r"^## (\S+)$", reference, re.MULTILINE)
    helps = re.findall(r"^<!-- cli-help: (\S+) -->$", reference, re.MULTILINE)
    assert sections == _subcommands(), "docs/reference/cli.md: one section per subcommand, as the parser orders them"
    assert helps == sections, "each section of docs/reference/cli.md shows its own subcommand's --help"


def test_version_and_the_console_script() -> None:
    result = cli("--version")
    assert result.returncode == 0
    assert result.stdout.startswith("postgres-mutex ")
    # The suite runs from an installed package (pip install -e ".[dev]", as .ci/run does): its
    # console script must be there. Run from a bare source tree, that is a gap, not a pass.
    try:
        metadata.distribution("postgres-mutex")
    except metadata.PackageNotFoundError:
        skip_or_fail_in_ci('postgres-mutex is not installed: pip install -e ".[dev]" installs its console script')
    script = Path(sysconfig.get_path("scripts")) / "postgres-mutex"
    assert script.exists(), f"the console script is missing: {script}"
    installed = subprocess.run([str(script), "--version"], capture_output=True, text=True, check=False, timeout=60)
    assert installed.returncode == 0, installed.stderr
    assert installed.stdout == result.stdout


# -- the command's process group, job control, environment ---------------------------


def test_the_lock_is_kept_until_the_commands_background_processes_exit(
    dsn: str, lock_name: str, holder_id: Holder, workers: list[subprocess.Popen[str]]
) -> None:
    proc = start("run", "--dsn", dsn, "--lock", lock_name, "--", "sh", "-c", "sleep 3 & echo $$")
    workers.append(proc)
    assert proc.stdout is not None
    shell = int(proc.stdout.readline())
    wait_until(lambda: _exited(shell), timeout=10)
    assert proc.poll() is None, "the shell exited, its background sleep runs on: still holding"
    assert holder_id() is not None
    assert proc.wait(timeout=30) == 0
    assert holder_id() is None


def _exited(pid: int) -> bool:
    """The process has ended (gone, or a zombie its parent has not reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rpartition(")")[2].split()[0] in {"Z", "X"}


def _processes_with(marker: str) -> list[str]:
    found = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True, check=False)
    return found.stdout.split()


def test_a_lost_lock_stops_the_whole_process_group(
    dsn: str, lock_name: str, admin: psycopg.Connection[Any], workers: list[subprocess.Popen[str]]
) -> None:
    marker = f"pm-group-{time.monotonic_ns()}"
    script = f'(trap "" TERM; exec sleep 40 {marker}) 2>/dev/null & echo started; sleep 40 {marker}'
    proc = start(
        "run", "--dsn", dsn, "--lock", lock_name, *FAST_FLAGS, "--kill-after", "0.05", "--", "sh", "-c", script
    )
    workers.append(proc)
    assert proc.stdout is not None
    assert proc.stdout.readline() == "started\n"
    admin.execute("DELETE FROM mutex_lock WHERE lock_name = %s", (lock_name,))
    assert proc.wait(timeout=30) == 76
    assert _processes_with(marker) == [], "nothing the command started outlives the lock"


def test_kill_after_must_leave_the_command_gone_before_anyone_may_reclaim(dsn: str, lock_name: str) -> None:
    result = cli("run", "--dsn", dsn, "--lock", lock_name, *FAST_FLAGS, "--kill-after", "0.5", "--", "true")
    assert result.returncode == 2
    assert "must be shorter than --heartbeat-interval" in result.stderr


def test_the_command_does_not_inherit_the_connection_string(dsn: str, lock_name: str) -> None:
    code = "import os; print('POSTGRES_MUTEX_DSN' in os.environ)"
    result = cli("run", "--lock", lock_name, "--", *python(code), env={"POSTGRES_MUTEX_DSN": dsn})
    assert result.returncode == 0, result.stderr
    assert result.stdout == "False\n"


def test_run_works_with_stdin_closed(dsn: str, lock_name: str) -> None:
    result = subprocess.run(
        [
            "sh",
            "-c",
            f'exec 0<&-; exec "{sys.executable}" -m postgres_mutex run --dsn "{dsn}" --lock {lock_name} -- true',
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def test_ctrl_z_stops_the_command_and_gives_the_terminal_back_and_fg_resumes_it(dsn: str, lock_name: str) -> None:
    import pty

    code = "import sys; print('ready', flush=True); sys.stdin.readline(); print('done', flush=True)"
    argv = [sys.executable, "-m", "postgres_mutex", "run", "--dsn", dsn, "--lock", lock_name, "--", *python(code)]
    pid, master = pty.fork()
    if pid == 0:  # the child: postgres-mutex, leading a session on the pty
        os.chdir(ROOT)
        os.execv(sys.executable, argv)  # noqa: S606 - a fixed argument list
    output = b""
    try:
        output += _read_until(master, b"ready")
        os.write(master, b"\x1a")  # Ctrl-Z
        _, status = os.waitpid(pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status), "postgres-mutex stopped with its command, as a shell expects"
        os.kill(pid, signal.SIGCONT)  # fg
        os.write(master, b"go on\n")
        output += _read_until(master, b"done")
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status)
        assert os.WEXITSTATUS(status) == 0, output
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        os.close(master)


def _read_until(fd: int, wanted: bytes, timeout: float = 30) -> bytes:
    import select

    seen = b""
    deadline = time.monotonic() + timeout
    while wanted not in seen:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"never saw {wanted!r}: {seen!r}"
        ready, _, _ = select.select([fd], [], [], remaining)
        if ready:
            seen += os.read(fd, 1024)
    return seen


def test_a_terminated_demo_still_removes_its_server_and_files(
    workers: list[subprocess.Popen[str]], demo_tmp: Path
) -> None:
    proc = start("demo", env={"TMPDIR": str(demo_tmp)})
    workers.append(proc)
    assert proc.stdout is not None
    line = ""
    for _ in range(20):
        line = proc.stdout.readline()
        if "started a throwaway PostgreSQL" in line:
            break
    port = line.rsplit(":", 1)[1].strip()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert list(demo_tmp.glob("postgres-mutex-data-*")) == []
    assert _processes_with(f"-p {port} ") == [], "its PostgreSQL is stopped"
    # Its workers carry its server's DSN in their environment: other demos on this machine are not its own.
    assert [pid for pid in _processes_with("postgres_mutex._cli._demo") if f"port={port} " in _dsn_of(pid)] == [], (
        "no worker left behind"
    )


def _dsn_of(pid: str) -> str:
    """The POSTGRES_MUTEX_DSN of a running process ("" if it has none or is gone)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return ""
    found = [entry for entry in environ if entry.startswith(b"POSTGRES_MUTEX_DSN=")]
    return found[0].decode(errors="replace") if found else ""
