"""The Django app in a real project (tests/integrations/django_project) on the test PostgreSQL, through manage.py."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from postgres_mutex import Mutex
from postgres_mutex.integrations.django import once
from tests.support.fixtures import read_line
from tests.support.postgres_server import PASSWORD, PASSWORD_ROLE, PostgresServer

ROOT = Path(__file__).resolve().parents[2]
PROJECT = Path(__file__).resolve().parent / "django_project"


class Project:
    def __init__(self, pg: PostgresServer, schema: str) -> None:
        self.dsn = pg.dsn(options=f"-csearch_path={schema}")
        self.env = {
            **os.environ,
            "DB_NAME": pg.dbname,
            "DB_USER": pg.user,
            "DB_PASSWORD": pg.password or "",
            "DB_HOST": pg.host,
            "DB_PORT": str(pg.port),
            "DB_SCHEMA": schema,
            "PYTHONPATH": os.pathsep.join([str(PROJECT), str(ROOT)]),
        }

    def command(self, *args: str) -> list[str]:
        return [sys.executable, str(PROJECT / "manage.py"), *args]

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.command(*args), env=self.env, cwd=PROJECT, text=True, capture_output=True, timeout=60
        )

    def start(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(self.command(*args), env=self.env, cwd=PROJECT, text=True, stdout=subprocess.PIPE)


@pytest.fixture
def project(pg: PostgresServer) -> Iterator[Project]:
    schema = f"django_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg.dsn(), autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
        conn.execute(f"CREATE TABLE {schema}.nightly_runs (id serial PRIMARY KEY)")
    yield Project(pg, schema)
    with psycopg.connect(pg.dsn(), autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA {schema} CASCADE")


def test_migrate_makes_the_lock_table_and_its_history_and_the_check_reports_one_gone_since(project: Project) -> None:
    project.env["MUTEX_HISTORY"] = "1"  # POSTGRES_MUTEX["HISTORY"]
    assert project.run("check", "--database", "default").returncode == 0, "migrate is yet to make it"
    migrated = project.run("migrate")
    assert migrated.returncode == 0, migrated.stderr
    assert project.run("postgres_mutex", "history").returncode == 0, "the history was made too"
    present = project.run("check", "--database", "default")
    assert (present.returncode, present.stderr) == (0, "")

    with psycopg.connect(project.dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE mutex_lock CASCADE")
    missing = project.run("check", "--database", "default")
    assert missing.returncode == 1
    assert "postgres_mutex.E001" in missing.stderr
    assert "the lock table 'mutex_lock' does not exist in database 'default'" in missing.stderr
    assert "python manage.py postgres_mutex init" in missing.stderr
    assert project.run("postgres_mutex", "init").returncode == 0
    assert project.run("check", "--database", "default").returncode == 0


def test_a_decorated_command_runs_once_at_a_time_and_status_shows_it(project: Project, tmp_path: Path) -> None:
    assert project.run("postgres_mutex", "init").returncode == 0
    finish = tmp_path / "finish"
    first = project.start("nightly", "--until", str(finish))
    try:
        assert first.stdout is not None
        assert read_line(first.stdout, timeout=30).strip() == "running"

        status = project.run("postgres_mutex", "status")
        assert status.returncode == 0, status.stderr
        assert "django:nightly" in status.stdout

        skipped = project.run("nightly")
        assert (skipped.returncode, skipped.stdout) == (0, "")
        assert "'django:nightly' is already running elsewhere: skipped" in skipped.stderr

        refused = project.run("nightly_strict")
        assert refused.returncode == 1
        assert "CommandError: 'django:nightly' is already running: not run here" in refused.stderr
    finally:
        finish.touch()
        assert first.wait(timeout=30) == 0

    again = project.run("nightly_strict")
    assert (again.returncode, again.stdout.strip()) == (0, "running")
    released = project.run("postgres_mutex", "status")
    assert "django:nightly" not in released.stdout

    with psycopg.connect(project.dsn) as conn:
        assert conn.execute("SELECT count(*) FROM nightly_runs").fetchone() == (1,), "the skipped run did not run"


def test_the_password_from_settings_reaches_libpq_whole_and_is_never_shown(
    pg: PostgresServer, project: Project, needs_superuser: None
) -> None:
    schema = project.env["DB_SCHEMA"]
    assert project.run("postgres_mutex", "init").returncode == 0
    with psycopg.connect(pg.dsn(), autocommit=True) as conn:
        conn.execute(f"GRANT USAGE ON SCHEMA {schema} TO {PASSWORD_ROLE}")
        conn.execute(f"GRANT SELECT ON {schema}.mutex_lock TO {PASSWORD_ROLE}")
    project.env.update(DB_USER=PASSWORD_ROLE, DB_PASSWORD=PASSWORD, DB_HOST="127.0.0.1")
    status = project.run("postgres_mutex", "status")
    assert status.returncode == 0, status.stderr
    assert PASSWORD not in status.stdout + status.stderr

    # Spaces, quotes and a backslash: joined into a connection string by hand, they would not survive.
    wrong = "it's a wrong pass\\word"
    project.env["DB_PASSWORD"] = wrong
    refused = project.run("postgres_mutex", "status")
    assert refused.returncode != 0
    assert "password authentication failed" in refused.stderr
    assert wrong not in refused.stdout + refused.stderr


def test_once_refuses_a_coroutine_function_whose_lock_would_end_before_it_runs() -> None:
    async def digest() -> None:
        pass

    with pytest.raises(TypeError, match=r"@once runs functions, not coroutine functions: .*digest is async"):
        once()(digest)


ONCE_WAITING_TWICE = """
import threading, time
from postgres_mutex.integrations.django import once

@once("django:waited", on_contention="wait", wait_timeout=0.8)
def first():
    pass

@once("django:waited", on_contention="wait", wait_timeout=1.5)
def second():
    pass

def call(job):
    start = time.monotonic()
    try:
        job()
    except Exception as exc:
        print(job.__name__, type(exc).__name__, round(time.monotonic() - start, 3))

# The first call takes this process's turn at the lock and waits 0.8 s for the fleet's;
# the second waits for the turn meanwhile, then for the fleet's lock.
holder = threading.Thread(target=call, args=(first,))
holder.start()
time.sleep(0.1)
call(second)
holder.join()
"""


def test_once_waits_wait_timeout_in_all_not_once_for_its_process_and_again_for_the_fleet(project: Project) -> None:
    assert project.run("postgres_mutex", "init").returncode == 0
    elsewhere = Mutex(project.dsn, "django:waited")
    with elsewhere.acquire() as held:
        assert held
        # Two calls in one process: the second waits for the first's turn, then for the lock held here.
        ran = project.run("shell", "-c", ONCE_WAITING_TWICE)
    elsewhere.close()
    assert ran.returncode == 0, ran.stderr
    said = dict(
        (line.split()[0], line.split()[1:])
        for line in ran.stdout.splitlines()
        if line.split()[:1] in (["first"], ["second"])
    )
    assert said["first"][0] == "LockAcquisitionTimeout", ran.stdout
    assert said["second"][0] == "LockAcquisitionTimeout", ran.stdout
    assert 1.3 < float(said["second"][1]) < 1.5 + 0.4, f"wait_timeout=1.5, waited {said['second'][1]}s"
