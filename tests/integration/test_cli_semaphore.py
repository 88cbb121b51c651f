"""The command line and semaphores: ``run --permits N``, ``status`` of every holder, ``release --permit K``.

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

from postgres_mutex import LockNotHeldError, Semaphore
from tests.integration.test_cli import FAST_FLAGS, cli, python, start
from tests.support.fixtures import FAST, process_listens, wait_until

pytestmark = pytest.mark.usefixtures("schema")


@pytest.fixture
def name() -> str:
    return f"cli-sem-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def semaphores(dsn: str, name: str) -> Iterator[list[Semaphore]]:
    """Semaphores of ``name`` the test makes (``Semaphore(dsn, name, permits=..., **FAST)``), closed at its end."""
    made: list[Semaphore] = []
    yield made
    for semaphore in made:
        with contextlib.suppress(Exception):
            semaphore.close()


def holders_of(admin: psycopg.Connection[Any], name: str) -> int:
    found = admin.execute("SELECT count(*) FROM mutex_lock WHERE semaphore = %s", (name,)).fetchone()
    return 0 if found is None else int(found[0])


def test_run_with_permits_runs_at_most_n_copies_and_the_rest_wait(
    dsn: str, name: str, admin: psycopg.Connection[Any], workers: list[subprocess.Popen[str]], tmp_path: Path
) -> None:
    go = tmp_path / "go"
    # Each copy says it started, then runs until the test creates the file (30 s at most).
    job = python(f"""
        import os, sys, time
        print("started", flush=True)
        deadline = time.monotonic() + 30
        while not os.path.exists({str(go)!r}) and time.monotonic() < deadline:
            time.sleep(0.02)
    """)
    runners = [
        start(
            "run", "--dsn", dsn, "--lock", name, "--permits", "2", "--wait", "--timeout", "60", *FAST_FLAGS, "--", *job
        )
        for _ in range(4)
    ]
    workers.extend(runners)
    wait_until(lambda: holders_of(admin, name) == 2, timeout=30)
    # The other two wait, listening for a release; never a third copy meanwhile.
    wait_until(lambda: process_listens(admin, name, kind="semaphore"), timeout=30)
    assert holders_of(admin, name) == 2
    assert sum(proc.poll() is not None for proc in runners) == 0
    go.touch()
    for proc in runners:
        assert proc.wait(timeout=60) == 0
        assert proc.stdout is not None
        assert proc.stdout.read() == "started\n", "each runner ran its copy once the others let it"
    assert holders_of(admin, name) == 0


def test_run_with_every_permit_taken_exits_75_and_says_so(dsn: str, name: str, semaphores: list[Semaphore]) -> None:
    holder = Semaphore(dsn, name, permits=1, **FAST)  # type: ignore[arg-type]
    semaphores.append(holder)
    with holder.acquire() as got:
        assert got
        result = cli("run", "--dsn", dsn, "--lock", name, "--permits", "1", "--", *python("print('must not run')"))
    assert result.returncode == 75, result.stderr
    assert result.stdout == ""
    assert f"all 1 permits of semaphore {name!r} are held" in result.stderr
    assert holder.instance_id in result.stderr


def test_run_with_permits_refuses_restart(dsn: str, name: str) -> None:
    result = cli("run", "--dsn", dsn, "--lock", name, "--permits", "2", "--restart", "--", "true")
    assert result.returncode == 2
    assert "--permits" in result.stderr


def test_status_shows_every_holder_and_release_frees_one_permit(
    dsn: str, name: str, admin: psycopg.Connection[Any], semaphores: list[Semaphore]
) -> None:
    first, second = (Semaphore(dsn, name, permits=3, **FAST) for _ in range(2))  # type: ignore[arg-type]
    semaphores += [first, second]
    held = [first.acquire(), second.acquire()]
    assert all(acquisition.__enter__() for acquisition in held)
    permits = {first.permit: first, second.permit: second}
    low, high = sorted(permits)  # type: ignore[type-var]  # each holds a permit: neither is None
    assert {low, high} <= {0, 1, 2}

    text = cli("status", "--dsn", dsn, "--lock", name)
    data = cli("status", "--dsn", dsn, "--lock", name, "--json")
    assert text.returncode == 0, text.stderr
    shown = [line for line in text.stdout.splitlines()[1:] if line.strip()]
    assert [line.split()[:4] for line in shown] == [
        [name, "(permit", f"{low})", permits[low].instance_id],
        [name, "(permit", f"{high})", permits[high].instance_id],
    ]
    report = json.loads(data.stdout)
    assert [(lock["semaphore"], lock["permit"], lock["holder"]) for lock in report["locks"]] == [
        (name, low, permits[low].instance_id),
        (name, high, permits[high].instance_id),
    ]

    # The semaphore's name alone releases nothing: which holder goes is the operator's choice.
    whole = cli("release", name, "--dsn", dsn, "--force")
    assert whole.returncode == 1
    assert f"--permit {low}" in whole.stdout
    assert f"permits {low}, {high}" in whole.stdout
    assert holders_of(admin, name) == 2

    freed = cli("release", name, "--permit", str(high), "--dsn", dsn, "--force")
    assert freed.returncode == 0, freed.stderr
    assert f"released permit {high} of semaphore {name!r}, held by {permits[high].instance_id}" in freed.stdout
    assert holders_of(admin, name) == 1
    # Its holder learns of it at its next heartbeat; the other keeps its permit.
    wait_until(lambda: not permits[high].held, timeout=10)
    assert permits[low].held
    again = cli("release", name, "--permit", str(high), "--dsn", dsn, "--force")
    assert again.returncode == 1
    assert "not held" in again.stdout
    held[[first, second].index(permits[low])].__exit__(None, None, None)
    with pytest.raises(LockNotHeldError):
        held[[first, second].index(permits[high])].__exit__(
            None, None, None
        )  # as for a Mutex: leaving says the permit was lost meanwhile


def test_release_of_a_permit_needs_force(dsn: str, name: str) -> None:
    refused = cli("release", name, "--permit", "0", "--dsn", dsn)
    assert refused.returncode == 2
    assert "--force" in refused.stderr
    negative = cli("release", name, "--permit", "-1", "--dsn", dsn, "--force")
    assert negative.returncode == 2
    assert "numbered from 0" in negative.stderr


def test_permits_changes_n_for_the_fleet_and_needs_force_to_release_holders(
    dsn: str, name: str, admin: psycopg.Connection[Any], semaphores: list[Semaphore]
) -> None:
    declared = cli("permits", name, "3", "--dsn", dsn)
    assert declared.returncode == 0, declared.stderr
    assert declared.stdout.strip() == f"semaphore {name!r} now allows 3 at once"
    first, second = (Semaphore(dsn, name, permits=3, **FAST) for _ in range(2))  # type: ignore[arg-type]
    semaphores += [first, second]
    held = [first.acquire(), second.acquire()]
    assert all(acquisition.__enter__() for acquisition in held)
    above = sorted(p for p in (first.permit, second.permit) if p is not None and p >= 1)
    assert above, "two holders of three permits: one holds permit 1 or 2"

    refused = cli("permits", name, "1", "--dsn", dsn)
    assert refused.returncode == 2
    assert f"permits {', '.join(map(str, above))} are held" in refused.stderr
    assert "--force" in refused.stderr
    assert holders_of(admin, name) == 2

    shrunk = cli("permits", name, "1", "--dsn", dsn, "--force")
    assert shrunk.returncode == 0, shrunk.stderr
    plural = "s" * (len(above) != 1)
    assert shrunk.stdout.strip() == (
        f"semaphore {name!r} now allows 1 at once (was 3); released {len(above)} holder{plural}"
    )
    assert holders_of(admin, name) == 2 - len(above)
    # The released holders learn it at their next heartbeat.
    wait_until(lambda: sum(s.held for s in (first, second)) == 2 - len(above), timeout=10)
    bad = cli("permits", name, "0", "--dsn", dsn, "--force")
    assert bad.returncode == 2
    assert "must be 1 or more" in bad.stderr
