"""Upgrading from 0.1.0: its programs run unchanged, and a fleet mixing both versions is safe.

0.1.0 is the release published on PyPI under this package's name. The
session installs it from PyPI into a virtual environment of its own
(`release_0_1_0`) and reads everything from the real package: its public
surface, its README, its behaviour. Programs written against 0.1.0's API
(tests/support/written_for_0_1_0/) run twice, with 0.1.0 and with this version, as
standalone scripts (``python -I``: nothing of this repository is importable
but the installed package), and what they report is compared. Where this
version behaves differently on purpose, the difference is listed here with
its reason and asserted as it now is; docs/how-to/upgrading.md says the same
to users. Where 0.1.0's behaviour should come back, the check is a strict
xfail whose reason is the library change needed.

The mixed fleet: 0.1.0 workers and this version's workers contend for one
lock in one table, on the chaos suite's timing (heartbeat 0.2 s, alert 1 s,
stale 3 s), with critical sections checked by tests.support.exclusion.Sections; crashed
holders of either version are alerted on and reclaimed by the other; this
version's tools (status, LockTable, the watcher and its metrics) see 0.1.0
holders; fencing is never fooled by a 0.1.0 holder's row.
"""

from __future__ import annotations

import ast
import itertools
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import psycopg
import pytest
from prometheus_client import CollectorRegistry

import postgres_mutex
from chaos.harness import ALERT, HEARTBEAT, STALE, TIMING
from postgres_mutex import FanOutMetrics, LockNotHeldError, Mutex, MutexClient
from postgres_mutex.prometheus import PrometheusMetrics
from postgres_mutex.watcher import StaleWatcher
from tests.support.doc_examples import parse_page, python_parts
from tests.support.exclusion import Sections
from tests.support.fixtures import ROOT, RecordingMetrics, freeze, skip_or_fail_in_ci, wait_until
from tests.support.postgres_server import PostgresServer
from tests.support.written_for_0_1_0 import program, worker

PUBLISHED = "0.1.0"
WRITTEN = ROOT / "tests" / "support" / "written_for_0_1_0"
LOCK = "nightly-report"
HEARTBEAT_LATE = 0.3
"""Slack for a heartbeat that is late on a busy machine (as tests/integration/test_crash_recovery.py allows)."""


# -- the two releases -------------------------------------------------------------------


@dataclass(frozen=True)
class Release:
    """An interpreter whose ``import postgres_mutex`` is one release, and where that package must come from."""

    label: str
    python: Path
    version: str
    package_file: str

    def script(self, name: str, *args: str) -> list[str]:
        """Run one of tests/support/written_for_0_1_0/ in isolation (-I: no PYTHONPATH, no script directory on path)."""
        return [str(self.python), "-I", str(WRITTEN / name), *args]

    def check(self, event: dict[str, Any]) -> None:
        """A worker's "start" event names the package it imported: it must be this release's."""
        assert (event["version"], event["file"]) == (self.version, self.package_file), (
            f"a {self.label} worker imported the wrong package: {event}"
        )


@pytest.fixture(scope="session")
def release_0_1_0(tmp_path_factory: pytest.TempPathFactory) -> Release:
    """postgres-mutex 0.1.0 from PyPI, in a virtual environment of its own, built once a session."""
    venv = tmp_path_factory.mktemp("postgres-mutex-0.1.0") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    install = [
        str(python),
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
        "--no-input",
        # [pool] brings psycopg-pool, for the pool-mode checks of the program written for 0.1.0.
        f"postgres-mutex[pool]=={PUBLISHED}",
        "psycopg[binary]",
    ]
    try:
        subprocess.run(install, check=True, capture_output=True, text=True, timeout=600)
    except subprocess.CalledProcessError as exc:
        skip_or_fail_in_ci(f"could not install postgres-mutex=={PUBLISHED} from PyPI: {exc.stderr.strip()[-600:]}")
    except subprocess.TimeoutExpired:
        skip_or_fail_in_ci(f"installing postgres-mutex=={PUBLISHED} from PyPI took over 600 s")
    found = subprocess.run(
        [
            str(python),
            "-I",
            "-c",
            "import json, postgres_mutex as p; "
            "print(json.dumps([p.__version__, p.__file__, hasattr(p.Mutex, 'fence')]))",
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    version, package_file, has_fence = json.loads(found.stdout)
    assert version == PUBLISHED, f"not the published {PUBLISHED}: {found.stdout}"
    assert not has_fence, f"not the published {PUBLISHED}: {found.stdout}"
    assert Path(package_file).is_relative_to(venv), f"0.1.0's interpreter imports {package_file}"
    return Release(PUBLISHED, python, version, package_file)


@pytest.fixture(scope="session")
def this_release() -> Release:
    return Release("this version", Path(sys.executable), postgres_mutex.__version__, postgres_mutex.__file__)


@pytest.fixture(scope="session")
def readme_0_1_0(release_0_1_0: Release) -> str:
    """0.1.0's README, as published: the long description in its package metadata."""
    found = subprocess.run(
        [
            str(release_0_1_0.python),
            "-I",
            "-c",
            "import importlib.metadata as m; print(m.metadata('postgres-mutex').get_payload(), end='')",
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "# postgres-mutex" in found.stdout
    return found.stdout


# -- where each test runs: a schema of its own --------------------------------------------


@dataclass(frozen=True)
class Place:
    schema: str
    dsn: str
    """Connects with ``search_path`` set to the schema: every process finds its own ``mutex_lock`` there."""


def make_place(pg: PostgresServer) -> Place:
    schema = f"upgrade_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg.dsn(), autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    return Place(schema, pg.dsn(options=f"-csearch_path={schema}"))


def drop_place(pg: PostgresServer, place: Place) -> None:
    with psycopg.connect(pg.dsn(), autocommit=True) as conn:
        conn.execute("SET lock_timeout = '10s'")
        conn.execute(f"DROP SCHEMA {place.schema} CASCADE")


@pytest.fixture
def place(pg: PostgresServer) -> Iterator[Place]:
    made = make_place(pg)
    yield made
    drop_place(pg, made)


# -- worker processes --------------------------------------------------------------------


class Worker:
    """A process printing one JSON event a line (tests/support/written_for_0_1_0/worker.py), read as it goes."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], logs: Path) -> None:
        self.name = name
        self.stderr_path = logs / f"{name}.stderr"
        with open(self.stderr_path, "w") as stderr:
            self.proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
        self._events: queue.Queue[dict[str, Any]] = queue.Queue()
        self._seen: list[dict[str, Any]] = []
        assert self.proc.stdout is not None
        self._reader = threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True)
        self._reader.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            try:
                self._events.put(json.loads(line))
            except json.JSONDecodeError:
                self._events.put({"event": "output", "line": line})

    def expect(self, event: str, timeout: float) -> dict[str, Any]:
        """The next event of that name (earlier ones of other names are kept in `seen`)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                item = self._events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"{self.name}: no {event!r} within {timeout:g}s; saw {self._seen}; stderr:\n{self.stderr()}"
                ) from None
            self._seen.append(item)
            if item["event"] == event:
                return item

    def stderr(self) -> str:
        return self.stderr_path.read_text()[-3000:]

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} still running after {timeout:g}s; stderr:\n{self.stderr()}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def close(self) -> None:
        """Kill it if it still runs, and let go of its output once read to the end."""
        self.kill()
        self._reader.join(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class Fleet:
    """The worker processes of one test, on one lock in one place; all killed when the test ends."""

    def __init__(self, place: Place, logs: Path) -> None:
        self.place = place
        self.logs = logs
        self.workers: list[Worker] = []
        self.env = {**os.environ, "POSTGRES_MUTEX_DSN": place.dsn, "CHAOS_LOCK": LOCK}

    def start(self, release: Release, command: str, name: str, *args: str, wait: bool = True) -> Worker:
        """tests/support/written_for_0_1_0/worker.py under ``release``.

        Its first event names the package it imported: with ``wait``, that is checked before returning.
        """
        started = Worker(name, release.script("worker.py", command, name, *args), self.env, self.logs)
        self.workers.append(started)
        if wait:
            release.check(started.expect("start", timeout=60))
        return started

    def create_schema(self, release: Release) -> None:
        """The lock table as ``release``'s ``create_schema()`` makes it."""
        made = Worker(
            f"create-schema-{len(self.workers)}", release.script("worker.py", "create-schema"), self.env, self.logs
        )
        self.workers.append(made)
        release.check(made.expect("start", timeout=60))
        made.expect("created", timeout=30)
        assert made.wait(30) == 0

    def close(self) -> None:
        for running in self.workers:
            running.close()


@pytest.fixture
def fleet(place: Place, tmp_path: Path) -> Iterator[Fleet]:
    workers = Fleet(place, tmp_path)
    yield workers
    workers.close()


def test_the_workers_use_the_chaos_suites_timing() -> None:
    assert {key: value for key, value in TIMING.items() if key != "operation_timeout"} == worker.TIMING


# -- the public surface ------------------------------------------------------------------


def surface(release: Release) -> dict[str, Any]:
    found = subprocess.run(release.script("surface.py"), check=True, capture_output=True, text=True, timeout=60)
    description: dict[str, Any] = json.loads(found.stdout)
    assert (description["version"], description["file"]) == (release.version, release.package_file)
    return description


def compare_signature(where: str, old: list[list[str]] | None, new: list[list[str]] | None) -> list[str]:
    """What a call written for ``old`` may find changed in ``new``: names, kinds, positions, defaults."""
    if old is None:
        return []
    if new is None:
        return [f"{where}: no signature to read"]
    problems = []
    by_name = {parameter[0]: (index, parameter) for index, parameter in enumerate(new)}
    for index, (name, kind, default) in enumerate(old):
        if kind.startswith("VAR_"):
            continue
        found = by_name.get(name)
        if found is None:
            problems.append(f"{where}({name}): gone")
            continue
        new_index, (_, new_kind, new_default) = found
        if new_kind != kind:
            problems.append(f"{where}({name}): {kind} -> {new_kind}")
        elif kind != "KEYWORD_ONLY" and new_index != index:
            problems.append(f"{where}({name}): moved from position {index} to {new_index}")
        # A parameter 0.1.0 required may take a default now; one with a default must keep it.
        if default != "<required>" and new_default != default:
            problems.append(f"{where}({name}): default {default} -> {new_default}")
    known = {parameter[0] for parameter in old}
    for name, kind, default in new:
        if name not in known and default == "<required>" and not kind.startswith("VAR_"):
            problems.append(f"{where}({name}): a new required parameter")
    return problems


REQUIREMENT = re.compile(r"([A-Za-z0-9_.-]+)(?:\[([^\]]*)\])?")


def compare_surfaces(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Every way in which ``new`` could break a program that used ``old``'s public surface."""
    problems: list[str] = []
    if old["requires_python"] != new["requires_python"]:
        problems.append(f"Requires-Python: {old['requires_python']} -> {new['requires_python']}")
    required = {match[1].lower(): match[2] or "" for match in map(REQUIREMENT.match, new["requires"]) if match}
    for match in map(REQUIREMENT.match, old["requires"]):
        assert match is not None
        name, extras = match[1].lower(), match[2] or ""
        if name not in required:
            problems.append(f"requires {name}: no longer")
        elif required[name] != extras:
            problems.append(f"requires {name}: extras [{extras}] -> [{required[name]}]")
    for name in old["all"]:
        if name not in new["all"]:
            problems.append(f"{name}: not exported")
            continue
        was, now = old["names"][name], new["names"][name]
        if was["kind"] != now["kind"]:
            problems.append(f"{name}: a {was['kind']}, now a {now['kind']}")
            continue
        if was["kind"] == "class":
            problems += [
                f"{name}: no longer a {base}" for base in was["exported_bases"] if base not in now["exported_bases"]
            ]
            problems += [
                f"{name}: no longer a {base}" for base in was["builtin_bases"] if base not in now["builtin_bases"]
            ]
            problems += compare_signature(name, was["signature"], now["signature"])
    for module, names in old["modules"].items():
        offered = new["modules"].get(module)
        if not isinstance(offered, list):
            problems.append(f"postgres_mutex.{module}: {offered or 'gone'}")
            continue
        problems += [f"postgres_mutex.{module}.{name}: gone" for name in names if name not in offered]
    for member, was in old["mutex"].items():
        now = new["mutex"].get(member)
        where = f"Mutex.{member}"
        if now is None:
            problems.append(f"{where}: gone")
        elif was["kind"] == "attribute" and now["kind"] == "property":
            if not now["settable"]:
                problems.append(f"{where}: a plain attribute, now a read-only property")
        elif was["kind"] != now["kind"]:
            problems.append(f"{where}: a {was['kind']}, now a {now['kind']}")
        elif was["kind"] == "property" and was["settable"] and not now["settable"]:
            problems.append(f"{where}: no longer settable")
        else:
            problems += compare_signature(where, was.get("signature"), now.get("signature"))
    for method, signature in old["hook_methods"].items():
        if method not in new["hook_methods"]:
            problems.append(f"MetricsHook.{method}: gone")
        else:
            problems += compare_signature(f"MetricsHook.{method}", signature, new["hook_methods"][method])
    problems += [f"NullMetrics.{m}: gone" for m in old["null_metrics_methods"] if m not in new["null_metrics_methods"]]
    if old["six_method_hook_is_a_metrics_hook"] != new["six_method_hook_is_a_metrics_hook"]:
        problems.append(
            "isinstance(a hook with 0.1.0's six methods, MetricsHook): "
            f"{old['six_method_hook_is_a_metrics_hook']} -> {new['six_method_hook_is_a_metrics_hook']}"
        )
    for field, value in old["config"].items():
        if field not in new["config"]:
            problems.append(f"Mutex.config.{field}: gone")
        elif new["config"][field] != value:
            problems.append(f"Mutex.config.{field}: {value!r} -> {new['config'][field]!r}")
    return problems


LIBRARY_CHANGE = "library change wanted"
"""Marks a surface difference whose fix a strict xfail here describes."""
KEYWORDS = (
    "0.1.0's calls work unchanged, by position and by keyword (LockAcquisitionTimeout('job', 30), "
    "LockNotHeldError(lock_name='job')): the first positional parameter is now the message, taken for the lock "
    "name when lock_name is not given; the program's checks of both are run"
)

SURFACE_CHANGES: dict[str, str] = {
    "Requires-Python: >=3.10 -> >=3.11": (
        "this version is built and tested for Python 3.11 and later; on 3.10, pip keeps 0.1.0"
    ),
    "requires psycopg: extras [binary] -> []": (
        "a library should not force psycopg's binary wheel on applications (psycopg's own advice); "
        "install postgres-mutex[binary] to get it as 0.1.0 did"
    ),
    "Mutex(lock_name): default '' -> None": (
        "both mean 'required': 0.1.0 raised ValueError for the empty default, this version raises an error that is "
        "both a TypeError and a ValueError"
    ),
    "Mutex.acquire(blocking): default False -> None": (
        "None tries once, as False did, unless a timeout is given: then it waits, as the timeout asks"
    ),
    "Mutex.singleton(blocking): default False -> None": (
        "None tries once, as False did, unless a timeout is given: then it waits, as the timeout asks"
    ),
    "Mutex.dsn: a plain attribute, now a read-only property": "a Mutex is bound to its client when constructed",
    "Mutex.pool: a plain attribute, now a read-only property": "a Mutex is bound to its client when constructed",
    "Mutex.async_pool: a plain attribute, now a read-only property": "a Mutex is bound to its client when constructed",
    "Mutex.config: a plain attribute, now a read-only property": "settings are validated once, at construction",
    "Mutex.metrics: a plain attribute, now a read-only property": "the hook is wrapped once, at construction",
    "LockAcquisitionTimeout(lock_name): POSITIONAL_OR_KEYWORD -> KEYWORD_ONLY": KEYWORDS,
    "LockNotHeldError(lock_name): POSITIONAL_OR_KEYWORD -> KEYWORD_ONLY": KEYWORDS,
}
"""Every way this version's surface differs from 0.1.0's, with why (see docs/how-to/upgrading.md)."""


def test_every_public_name_and_member_of_0_1_0_is_here_with_a_compatible_signature(
    release_0_1_0: Release, this_release: Release
) -> None:
    """Read from the published package: its names, submodules, Mutex members and their signatures, hooks, config."""
    old, new = surface(release_0_1_0), surface(this_release)
    assert set(old["all"]) == {
        "Mutex",
        "PgMutexError",
        "LockAcquisitionTimeout",
        "LockNotHeldError",
        "MetricsHook",
        "NullMetrics",
        "__version__",
    }, "the names the upgrade guide promises are 0.1.0's"
    assert tuple(map(int, new["version"].split(".")[:3])) > (0, 1, 0)
    found = compare_surfaces(old, new)
    unexpected = [problem for problem in found if problem not in SURFACE_CHANGES]
    vanished = [problem for problem in SURFACE_CHANGES if problem not in found]
    assert unexpected == [], (
        "new differences from 0.1.0's surface: fix them, or list them in SURFACE_CHANGES and the upgrade guide"
    )
    assert vanished == [], "these differences are gone: remove them from SURFACE_CHANGES and the upgrade guide"


def test_0_1_0s_public_submodules_still_import(release_0_1_0: Release) -> None:
    import importlib

    for module, names in surface(release_0_1_0)["modules"].items():
        found = importlib.import_module(f"postgres_mutex.{module}")
        for name in names:
            assert getattr(found, name) is getattr(postgres_mutex, name), f"postgres_mutex.{module}.{name}"


# -- a program written for 0.1.0, run with both --------------------------------------------

CHECKS = list(program.CHECKS)

CHANGED: dict[str, tuple[dict[str, Any], str]] = {
    "acquire() given a timeout without blocking, lock busy": (
        {
            "trace": [],
            "raised": ["LockAcquisitionTimeout", "PgMutexError", "TimeoutError"],
            "attributes": {"lock_name": "nonblocking-timeout", "timeout": 1.0},
        },
        "a timeout says how long to wait: 0.1.0 ignored it and tried once",
    ),
    "a schema-qualified table name": ({"trace": [], "returned": "constructed"}, "accepts more: table='ops.mutex_lock'"),
    "stale_threshold under three heartbeat intervals": (
        {"trace": [], "raised": ["ValueError"]},
        "the holder's lease (stale_threshold - heartbeat_interval) must leave room for a retried heartbeat",
    ),
    "a pool-like object that is not a psycopg_pool pool": (
        {"trace": [], "raised": ["TypeError"]},
        "pool and async_pool must be psycopg_pool pools, as 0.1.0's README said",
    ),
    "both a dsn and a pool": (
        {"trace": [], "raised": ["ValueError"]},
        "one way to reach PostgreSQL, as 0.1.0's README said ('pick one'): with a pool the library opens nothing",
    ),
    "release() inside the with block": (
        {"trace": [True, False], "returned": "left the block"},
        "the block's exit no longer raises LockNotHeldError for a lock the block itself released",
    ),
    "heartbeats held up past stale_threshold": (
        {
            "trace": [True, True, False],
            "raised": ["LockNotHeldError", "PgMutexError"],
            "attributes": {"lock_name": "heartbeats-stalled"},
        },
        "lock loss is signalled: held turns false when the lease runs out, and leaving the block raises",
    ),
    "close() while holding": (
        {"trace": [True, True], "returned": True},
        "close() releases the lock (and logs a warning)",
    ),
    "acquire() again on a Mutex that holds its lock": (
        {"trace": [True], "raised": ["PgMutexError"]},
        "LockAlreadyHeldError (a PgMutexError) instead of a False that wrongly says 'held elsewhere'",
    ),
    "a row left behind under this Mutex's instance_id": (
        {"trace": [], "returned": True},
        "own-row re-acquire: a restarted process reusing its instance_id takes its row back at once (with a warning)",
    ),
    "acquire() with PostgreSQL unreachable": (
        {"trace": [], "raised": ["PgMutexError"]},
        "database failures raise DatabaseError (a PgMutexError) with psycopg's error as __cause__; 0.1.0 let "
        "psycopg's exceptions through, which its README did not document",
    ),
    "acquire() on a lock table that does not exist": (
        {"trace": [], "raised": ["PgMutexError"]},
        "SchemaError (a DatabaseError) saying what to do, instead of psycopg's UndefinedTable",
    ),
    "the type of the seconds a hook's alert() is given": (
        {"trace": [False], "returned": ["float"]},
        "a float, as MetricsHook's signature always said; 0.1.0 passed the decimal.Decimal PostgreSQL returned",
    ),
}
"""Checks whose outcome changed on purpose: the outcome now, and why (docs/how-to/upgrading.md)."""

NEEDS_LIBRARY_CHANGE: dict[str, str] = {}
"""Checks where 0.1.0's behaviour should come back: each a strict xfail, its reason the change needed."""

WARNED: dict[str, str] = {}
"""Checks whose 0.1.0 behaviour should now come with a warning."""


def outcome(report: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in report.items() if key not in ("detail", "warnings")}


def as_0_1_0_did(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """The same values seen and returned; or an error that is every type 0.1.0's was, with its attributes."""
    if old["trace"] != new["trace"]:
        return False
    if "raised" not in old:
        return "returned" in new and new["returned"] == old["returned"]
    attributes = new.get("attributes", {})
    return set(old["raised"]) <= set(new.get("raised", ["<nothing raised>"])) and all(
        attributes.get(key) == value for key, value in old.get("attributes", {}).items()
    )


@pytest.fixture(scope="module")
def program_reports(
    pg: PostgresServer, release_0_1_0: Release, this_release: Release, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """tests/support/written_for_0_1_0/program.py run by 0.1.0 and this version at once, each in its own schema."""
    places = [make_place(pg), make_place(pg)]
    logs = tmp_path_factory.mktemp("program")
    runs = []
    try:
        for release, place in zip((release_0_1_0, this_release), places, strict=True):
            stderr = open(logs / f"{release.version}.stderr", "w")  # noqa: SIM115 - closed below
            runs.append(
                (
                    release,
                    subprocess.Popen(
                        release.script("program.py", place.dsn), stdout=subprocess.PIPE, stderr=stderr, text=True
                    ),
                    stderr,
                )
            )
        reports = []
        for release, proc, stderr in runs:
            out, _ = proc.communicate(timeout=90)
            stderr.close()
            assert proc.returncode == 0, f"{release.label}: {(logs / f'{release.version}.stderr').read_text()[-3000:]}"
            report = json.loads(out)
            assert report["version"] == release.version
            reports.append(report["checks"])
        yield reports[0], reports[1]
    finally:
        for _, proc, stderr in runs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
            stderr.close()
        for place in places:
            drop_place(pg, place)


def test_the_program_reports_every_check(program_reports: tuple[dict[str, Any], dict[str, Any]]) -> None:
    old, new = program_reports
    assert list(old) == list(new) == CHECKS
    assert set(CHANGED) | set(NEEDS_LIBRARY_CHANGE) <= set(CHECKS)
    assert not set(CHANGED) & set(NEEDS_LIBRARY_CHANGE)


@pytest.mark.parametrize(
    "check",
    [
        pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=NEEDS_LIBRARY_CHANGE[name]))
        if name in NEEDS_LIBRARY_CHANGE
        else name
        for name in CHECKS
    ],
)
def test_a_program_written_for_0_1_0_sees_what_it_saw(
    check: str, program_reports: tuple[dict[str, Any], dict[str, Any]]
) -> None:
    """Each documented call of 0.1.0, run with 0.1.0 and with this version: the same, or changed on purpose."""
    old, new = (reports[check] for reports in program_reports)
    shown = f"\n0.1.0:        {old}\nthis version: {new}"
    if check in CHANGED:
        expected, why = CHANGED[check]
        assert not as_0_1_0_did(old, new), f"no longer differs from 0.1.0: drop it from CHANGED and the guide{shown}"
        assert outcome(new) == expected, f"changed on purpose ({why}), but not as expected{shown}"
        return
    assert as_0_1_0_did(old, new), f"a program written for 0.1.0 sees something else{shown}"
    if check in WARNED:
        assert WARNED[check] in new.get("warnings", []), f"expected a {WARNED[check]}{shown}"


def test_0_1_0s_readme_examples_run_unchanged(readme_0_1_0: str, place: Place, tmp_path: Path) -> None:
    """Every Python block of 0.1.0's README that is a program runs, in order, against this version."""
    (tmp_path / "README.md").write_text(readme_0_1_0)
    blocks = parse_page("README.md", tmp_path).examples("python")
    programs, signatures = [], []
    for block in blocks:
        try:
            compile(block.code, "README.md", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        except SyntaxError:
            signatures.append(block)
        else:
            programs.append(block)
    # The API section lists Mutex's parameters as a signature, not as a call: that block is no program.
    assert [block.code.splitlines()[0] for block in signatures] == ["Mutex("]
    assert len(programs) == 6, "quickstart, async, decorator, dsn, pool, metrics hook"
    parts = python_parts(programs, {"dsn": place.dsn, "port": "0"})
    result = subprocess.run(
        [sys.executable, "-X", "dev", "-m", "tests.support.doc_examples"],
        input=json.dumps([(code, origin.path, origin.line) for code, origin in parts]),
        cwd=tmp_path,
        env={**os.environ, "POSTGRES_MUTEX_DSN": place.dsn, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert result.returncode == 0, f"0.1.0's README fails on this version:\n{result.stdout}\n{result.stderr}"
    assert result.stdout.count("the job ran") == 2, "the quickstart and the async example each ran the job"


# -- the table -------------------------------------------------------------------------------


def table_definition(conn: psycopg.Connection[Any], schema: str) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    columns = conn.execute(
        "SELECT column_name, data_type, character_maximum_length, is_nullable, column_default "
        "FROM information_schema.columns WHERE table_schema = %s AND table_name = 'mutex_lock' "
        "ORDER BY ordinal_position",
        (schema,),
    ).fetchall()
    constraints = conn.execute(
        "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
        # Not the NOT NULL constraints PostgreSQL 18 lists too: the columns say those.
        "WHERE conrelid = to_regclass(%s) AND contype <> 'n' ORDER BY contype, conname",
        (f"{schema}.mutex_lock",),
    ).fetchall()
    return columns, constraints


def test_the_table_is_0_1_0s_table_plus_a_token_column(
    readme_0_1_0: str, release_0_1_0: Release, pg: PostgresServer, tmp_path: Path
) -> None:
    """0.1.0's README DDL, 0.1.0's create_schema() and this version's create_schema(): one table, told apart here."""
    (ddl,) = re.findall(r"```sql\n(CREATE TABLE mutex_lock.*?)```", readme_0_1_0, re.DOTALL)
    readme, old, new = (make_place(pg) for _ in range(3))
    workers = Fleet(old, tmp_path)
    try:
        with psycopg.connect(pg.dsn(options=f"-csearch_path={readme.schema}"), autocommit=True) as conn:
            conn.execute(ddl)
        workers.create_schema(release_0_1_0)
        with MutexClient(new.dsn) as client:
            assert client.table().create() is True, "this version's table has fencing tokens"
        with psycopg.connect(pg.dsn(), autocommit=True) as conn:
            readme_columns, readme_constraints = table_definition(conn, readme.schema)
            old_columns, old_constraints = table_definition(conn, old.schema)
            new_columns, new_constraints = table_definition(conn, new.schema)
    finally:
        workers.close()
        for place in (readme, old, new):
            drop_place(pg, place)
    assert old_columns == readme_columns
    assert new_columns[:5] == readme_columns, "the same five columns, in the same order"
    (name, kind, _, nullable, default) = new_columns[5]
    assert (name, kind, nullable) == ("token", "bigint", "YES")
    # Then what names a holder's session, for reclaim_disconnected_after: NULL in every row 0.1.0 writes.
    assert [(name, nullable, default) for name, _, _, nullable, default in new_columns[6:]] == [
        ("session_key", "YES", None),
        ("session_hold", "YES", None),
        ("reclaim_after", "YES", None),
        # And a semaphore's permit (concepts/semaphores.md): NULL in every row 0.1.0 writes.
        ("semaphore", "YES", None),
        ("permit", "YES", None),
        ("permits", "YES", None),
        # And a read/write lock's row (concepts/rwlocks.md): NULL in every row 0.1.0 writes.
        ("rwlock", "YES", None),
        ("rw_mode", "YES", None),
        # And a minimum hold's end (hold_at_least): NULL in every row 0.1.0 writes.
        ("hold_until", "YES", None),
        # And the lease a mutex's row follows (concepts/the-table.md#leases): NULL in every row 0.1.0 writes.
        ("lease_key", "YES", None),
    ]
    assert re.fullmatch(r"nextval\('([a-z0-9_]+\.)?mutex_lock_token_seq'::regclass\)", default), (
        f"a row 0.1.0 inserts takes a token from the column's default: {default}"
    )
    readme_definitions = [definition for _, definition in readme_constraints]
    assert [definition for _, definition in old_constraints] == readme_definitions
    # The semaphores' and read/write locks' constraints check nothing in a row whose columns of theirs are
    # NULL, as 0.1.0's are.
    permits = {
        "mutex_lock_permit_declared",
        "mutex_lock_permit_in_range",
        "mutex_lock_rw_gated",
        "mutex_lock_rw_paired",
    }
    assert {name for name, _ in new_constraints} - permits == {"chk_locked", "uq_mutex_lock"}
    new_constraints = [(name, definition) for name, definition in new_constraints if name not in permits]
    assert [definition for _, definition in new_constraints] == readme_definitions
    assert [name for name, _ in readme_constraints] == ["chk_locked", "uq_mutex_lock"]
    assert [name for name, _ in new_constraints] == ["chk_locked", "uq_mutex_lock"], "the README's names"
    assert [name for name, _ in old_constraints] == ["mutex_lock_chk_locked", "mutex_lock_uq"], (
        "0.1.0's create_schema() named them after the table, not as its README did"
    )


# -- the mixed fleet ------------------------------------------------------------------------

TABLES = ["made by 0.1.0", "made by 0.1.0, then migrated", "made by this version"]


def prepare(table: str, fleet: Fleet, release_0_1_0: Release) -> bool:
    """Make the lock table as ``table`` says; returns whether it has fencing tokens."""
    with MutexClient(fleet.place.dsn) as client:
        if table == "made by this version":
            return client.table().create()
        fleet.create_schema(release_0_1_0)
        if table == "made by 0.1.0, then migrated":
            assert client.table().migrate() is True
        return client.table().has_tokens()


CONTEND_SECONDS = 4.0


@pytest.mark.parametrize("table", TABLES)
def test_a_mixed_fleet_never_has_two_holders(
    table: str, fleet: Fleet, release_0_1_0: Release, this_release: Release, tmp_path: Path
) -> None:
    """0.1.0 processes and this version's contend for one lock: every one gets it, never two at once."""
    tokens = prepare(table, fleet, release_0_1_0)
    # The rollout's shape: one program, two of its processes still on 0.1.0, two already on this version.
    # (chaos/soak_worker.py, this version's own worker, asks again within 50 ms of each release: with this
    # version's waiters woken at a release and 0.1.0's polling, 0.1.0's would then hardly ever get a turn.)
    releases = {"old-1": release_0_1_0, "old-2": release_0_1_0, "new-1": this_release, "new-2": this_release}
    logs = {name: tmp_path / f"{name}.log" for name in releases}
    contenders = [
        fleet.start(release, "contend", name, str(CONTEND_SECONDS), str(logs[name]), wait=False)
        for name, release in releases.items()
    ]
    for contender, release in zip(contenders, releases.values(), strict=True):
        release.check(contender.expect("start", timeout=60))
    for contender in contenders:
        assert contender.wait(CONTEND_SECONDS + 60) == 0, contender.stderr()
    sections = Sections()
    for log in logs.values():
        sections.add_log(log)
    taken = sorted(sections.all(), key=lambda section: section.enter)
    assert {section.who for section in taken} == set(logs), "every worker, of either version, got the lock"
    versions = ["old" if section.who.startswith("old") else "new" for section in taken]
    hand_offs = set(itertools.pairwise(versions))
    assert {("old", "new"), ("new", "old")} <= hand_offs, (
        f"the lock passed between versions both ways: {[(s.who, round(s.enter, 2)) for s in taken]}"
    )
    assert sections.overlaps() == [], f"two holders at once, across versions ({len(taken)} sections)"
    with psycopg.connect(fleet.place.dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM mutex_lock").fetchone() == (0,), "everyone released"
        if tokens:
            (drawn,) = conn.execute("SELECT last_value FROM mutex_lock_token_seq").fetchone() or (0,)
            assert drawn >= len(taken), "every acquisition drew a token, 0.1.0's from the column's default"


DIRECTIONS = {
    "0.1.0 holder, reclaimed by this version": ("0.1.0", "this version"),
    "this version's holder, reclaimed by 0.1.0": ("this version", "0.1.0"),
}


@pytest.mark.parametrize("table", ["made by 0.1.0", "made by 0.1.0, then migrated"])
@pytest.mark.parametrize("direction", list(DIRECTIONS))
def test_a_killed_holder_of_either_version_is_seen_alerted_on_and_reclaimed_by_the_other(
    direction: str, table: str, fleet: Fleet, release_0_1_0: Release, this_release: Release
) -> None:
    """SIGKILL a holder: status, holders() and the watcher see it; the other version alerts, then reclaims on time."""
    releases = {"0.1.0": release_0_1_0, "this version": this_release}
    holder_release, reclaimer_release = (releases[label] for label in DIRECTIONS[direction])
    tokens = prepare(table, fleet, release_0_1_0)
    sections = Sections()
    holder = fleet.start(holder_release, "hold", "holder")
    held = holder.expect("held", timeout=30)
    holding = sections.enter("holder", at=held["at"])
    registry, seen = CollectorRegistry(), RecordingMetrics()
    with MutexClient(fleet.place.dsn) as client:
        watcher = StaleWatcher(
            client=client,
            lock_names=[LOCK],
            alert_threshold=ALERT,
            stale_threshold=STALE,
            metrics=FanOutMetrics(PrometheusMetrics(registry), seen),
        )
        # Whichever version holds it, this version's tools see the holder.
        (live,) = watcher.check()
        assert (live.holder, live.alerting) == ("holder", False)
        assert (live.token is not None) == tokens, "on a migrated table, a 0.1.0 holder's row has a token too"
        (listed,) = client.table().holders([LOCK], alert_threshold=ALERT, stale_threshold=STALE)
        assert (listed.holder, listed.token) == ("holder", live.token)
        status = subprocess.run(
            [
                *(sys.executable, "-m", "postgres_mutex", "status", "--json", "--dsn", fleet.place.dsn),
                *("--lock", LOCK, "--alert-threshold", str(ALERT), "--stale-threshold", str(STALE)),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        (shown,) = json.loads(status.stdout)["locks"]
        assert (shown["holder"], shown["state"], shown["token"]) == ("holder", "ok", live.token)

        reclaimer = fleet.start(reclaimer_release, "reclaim", "reclaimer")
        holder.kill()
        sections.leave(holding)
        killed_at = holding.exit
        assert killed_at is not None

        alert = reclaimer.expect("alert", timeout=STALE + 10)
        assert alert["holder"] == "holder"
        assert ALERT <= alert["seconds_since_heartbeat"] < STALE
        wait_until(lambda: any(observed.alerting for observed in watcher.check()), timeout=STALE)
        assert [call["holder"] for call in seen.named("alert")] == ["holder"], "the watcher alerted, once"
        labels = {"lock_name": LOCK, "permit": "", "mode": ""}  # a mutex's holder: no permit, no mode
        assert registry.get_sample_value("postgres_mutex_holder_info", {**labels, "holder": "holder"}) == 1
        assert registry.get_sample_value("postgres_mutex_alerting", labels) == 1, "the dashboard shows it alerting"

        reclaimed = reclaimer.expect("stale_reclaimed", timeout=STALE + 10)
        assert reclaimed["previous_holder"] == "holder"
        got = reclaimer.expect("held", timeout=10)
        assert got["at"] - killed_at >= STALE - HEARTBEAT - HEARTBEAT_LATE, "reclaimed before the holder was stale"
        left = reclaimer.expect("left", timeout=10)
        sections.enter("reclaimer", at=got["at"]).exit = left["at"]
        reclaimer.expect("released", timeout=10)
        assert reclaimer.wait(30) == 0
        assert watcher.check() == [], "released"
    assert sections.overlaps() == []


@pytest.mark.parametrize("table", ["made by 0.1.0, then migrated", "made by this version"])
def test_a_killed_0_1_0_holder_is_not_reclaimed_early_by_a_contender_that_names_its_session(
    table: str, fleet: Fleet, release_0_1_0: Release
) -> None:
    """0.1.0 writes no session into its row: a contender with reclaim_disconnected_after waits out the threshold."""
    prepare(table, fleet, release_0_1_0)
    holder = fleet.start(release_0_1_0, "hold", "holder")
    holder.expect("held", timeout=30)
    contender = Mutex(fleet.place.dsn, LOCK, **TIMING, reclaim_disconnected_after=STALE / 3)  # type: ignore[arg-type]
    try:
        holder.kill()
        killed_at = time.monotonic()
        with contender.acquire(blocking=True, timeout=STALE + 10) as acquired:
            assert acquired
            waited = time.monotonic() - killed_at
        assert waited >= STALE - HEARTBEAT - HEARTBEAT_LATE, f"a 0.1.0 holder reclaimed after {waited:.2f}s"
    finally:
        contender.close()


def test_a_0_1_0_process_never_takes_a_lock_within_its_minimum_hold(
    fleet: Fleet, release_0_1_0: Release, this_release: Release
) -> None:
    """Released before its minimum (hold_at_least), the lock stays taken for 0.1.0 too, which reads the heartbeat.

    The row's heartbeat is the minimum's end: a 0.1.0 process sees a holder
    that went silent then, and takes the lock its stale threshold later.
    """
    assert prepare("made by 0.1.0, then migrated", fleet, release_0_1_0)
    minimum = STALE - 0.5
    with MutexClient(fleet.place.dsn) as client:
        mine = client.mutex(LOCK, instance_id="new-holder", **TIMING)
        with mine.acquire(hold_at_least=minimum) as acquired:
            assert acquired
            acquired_at = time.monotonic()
            reclaimer = fleet.start(release_0_1_0, "reclaim", "old-reclaimer")
        got = reclaimer.expect("held", timeout=minimum + STALE + 10)
        assert got["at"] - acquired_at >= minimum + STALE - HEARTBEAT_LATE, (
            f"a 0.1.0 process took it {got['at'] - acquired_at:.2f}s after the acquire, within the minimum"
        )
        alerts = [event for event in reclaimer._seen if event["event"] == "alert"]
        assert all(event["at"] - acquired_at >= minimum for event in alerts), "no alert within the minimum"
        reclaimer.expect("released", timeout=10)
        assert reclaimer.wait(30) == 0


# -- fencing, when 0.1.0 processes hold the lock too ----------------------------------------


def test_fence_is_never_fooled_by_a_0_1_0_holders_row(fleet: Fleet, release_0_1_0: Release) -> None:
    """A new holder's fence() passes for its own hold, and refuses once a 0.1.0 process holds the lock."""
    assert prepare("made by 0.1.0, then migrated", fleet, release_0_1_0)
    with MutexClient(fleet.place.dsn) as client:
        # Long thresholds: the holder must still believe it holds when its row has gone to a 0.1.0 process.
        mine = client.mutex(
            LOCK, instance_id="new-holder", heartbeat_interval=0.5, alert_threshold=5, stale_threshold=20
        )
        with pytest.raises(LockNotHeldError), mine.acquire() as acquired:
            assert acquired
            with psycopg.connect(fleet.place.dsn) as conn, conn.transaction():
                assert mine.fence(conn) == mine.token
            freeze(mine)
            removed = client.table().force_release(LOCK)
            assert removed is not None
            assert (removed.holder, removed.token) == ("new-holder", mine.token)
            old = fleet.start(release_0_1_0, "hold", "old-holder")
            old.expect("held", timeout=30)
            assert mine.held, "its heartbeats are paused: it has not noticed"
            with (
                psycopg.connect(fleet.place.dsn) as conn,
                pytest.raises(LockNotHeldError, match="old-holder") as refused,
                conn.transaction(),
            ):
                mine.fence(conn)
            assert refused.value.reason.startswith("fenced out")
            (now,) = client.table().holders([LOCK])
            assert now.holder == "old-holder"
            assert now.token is not None
            assert mine.token is not None
            assert now.token > mine.token, "its token came from the sequence, after the new holder's"


def test_a_fenced_transaction_holds_off_a_0_1_0_reclaimer(fleet: Fleet, release_0_1_0: Release) -> None:
    """While a holder's fenced transaction is open, a 0.1.0 process cannot take the lock, however stale the row."""
    assert prepare("made by 0.1.0, then migrated", fleet, release_0_1_0)
    with MutexClient(fleet.place.dsn) as client, psycopg.connect(fleet.place.dsn, autocommit=True) as admin:
        mine = client.mutex(LOCK, instance_id="new-holder", **TIMING)
        # Its lease runs out while the transaction is open (the row is reclaimable then): leaving raises.
        with pytest.raises(LockNotHeldError), mine.acquire() as acquired:
            assert acquired
            with psycopg.connect(fleet.place.dsn) as conn:
                with conn.transaction():
                    token = mine.fence(conn)
                    freeze(mine)  # the row goes stale while the transaction is open
                    reclaimer = fleet.start(release_0_1_0, "reclaim", "old-reclaimer")

                    def blocked_and_stale() -> bool:
                        row = admin.execute(
                            "SELECT EXTRACT(EPOCH FROM now() - last_heartbeat)::float8 FROM mutex_lock"
                        ).fetchone()
                        waiting = admin.execute(
                            "SELECT count(*) FROM pg_stat_activity "
                            "WHERE wait_event_type = 'Lock' AND query LIKE '%FOR UPDATE%'"
                        ).fetchone()
                        return row is not None and row[0] > STALE + 0.5 and waiting is not None and waiting[0] > 0

                    wait_until(blocked_and_stale, timeout=STALE + 10)
                    row = admin.execute("SELECT instance_id, token FROM mutex_lock").fetchone()
                    assert row == ("new-holder", token), "the 0.1.0 process waits on the fenced row"
                committed_at = time.monotonic()
            # Still inside the block: leaving it would delete our stale row before the 0.1.0 process reclaims it.
            reclaimed = reclaimer.expect("stale_reclaimed", timeout=10)
            assert reclaimed["previous_holder"] == "new-holder"
            assert reclaimer.expect("held", timeout=10)["at"] > committed_at, "only after the fenced transaction ended"
        assert reclaimer.wait(30) == 0


def test_a_new_only_feature_degrades_clearly_on_a_0_1_0_table(fleet: Fleet, release_0_1_0: Release) -> None:
    """On a table 0.1.0 made and nobody migrated, a holder has no token, and fence() says so."""
    assert prepare("made by 0.1.0", fleet, release_0_1_0) is False
    with MutexClient(fleet.place.dsn) as client:
        mine = client.mutex(LOCK, **TIMING)
        with mine.acquire() as acquired, psycopg.connect(fleet.place.dsn) as conn:
            assert acquired
            assert mine.token is None
            with pytest.raises(postgres_mutex.SchemaError, match="migrate"), conn.transaction():
                mine.fence(conn)


def test_a_process_that_used_the_table_before_its_migration_never_leaves_an_old_token_in_its_row(
    fleet: Fleet, release_0_1_0: Release
) -> None:
    assert prepare("made by 0.1.0", fleet, release_0_1_0) is False
    with MutexClient(fleet.place.dsn) as client, psycopg.connect(fleet.place.dsn, autocommit=True) as admin:
        early = client.mutex(LOCK, instance_id="early", **TIMING)
        with early.acquire() as acquired:
            assert acquired, "it has read the table's shape: no tokens"
        with MutexClient(fleet.place.dsn) as operator:
            assert operator.table().migrate() is True
        # A 0.1.0 holder that went silent: its row takes a token from the column's default.
        admin.execute(
            "INSERT INTO mutex_lock (lock_name, locked, instance_id, last_heartbeat, acquired_at) "
            "VALUES (%s, 1, 'silent-holder', now() - interval '1 minute', now() - interval '1 minute')",
            (LOCK,),
        )
        row = admin.execute("SELECT token FROM mutex_lock").fetchone()
        assert row is not None
        (silent_token,) = row
        assert silent_token is not None
        with early.acquire() as reclaimed:
            assert reclaimed
            assert admin.execute("SELECT instance_id, token FROM mutex_lock").fetchone() != ("early", silent_token)
