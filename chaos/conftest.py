"""Fixtures for the chaos suite: the report, and each scenario's world (`Chaos`).

The Toxiproxy server and client fixtures live in chaos/toxiproxy_fixtures.py, the PostgreSQL
ones in tests/support/fixtures.py: the root conftest.py loads both for every suite.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from toxiproxy import Toxiproxy

from chaos.harness import ALERT, STALE, TIMING, WATCH_INTERVAL, Events, Net, Report
from chaos.toxiproxy import ToxiproxyEndpoint
from postgres_mutex import Mutex
from postgres_mutex.watcher import StaleWatcher
from tests.support import exclusion
from tests.support.exclusion import Sections
from tests.support.postgres_server import PostgresServer

log = logging.getLogger(__name__)


@pytest.fixture(scope="session")
def report(
    request: pytest.FixtureRequest, toxiproxy_server_endpoint: ToxiproxyEndpoint, pg: PostgresServer
) -> Iterator[Report]:
    """Measured figures, written to $CHAOS_REPORT_DIR (default chaos/report) when the session ends.

    A session that ran every scenario, with no test failed, also writes the table the docs'
    failure-modes page includes: to chaos/report/figures/ (ignored by git), and to the committed
    docs/figures/chaos-report.md under ``pytest --refresh-figures``.
    """
    collected = Report(Path(os.environ.get("CHAOS_REPORT_DIR") or Path(__file__).parent / "report"))
    yield collected
    if collected.scenarios:
        collected.write(toxiproxy_server_endpoint.kind.value, pg.version, docs_copy=request.session.testsfailed == 0)


class Chaos:
    """One scenario's world: the lock, proxies in front of PostgreSQL, the section log, a watcher, its report row."""

    def __init__(
        self,
        toxiproxy: Toxiproxy,
        pg: PostgresServer,
        admin: psycopg.Connection[Any],
        lock_name: str,
        report: Report,
        scenario: str,
    ) -> None:
        self.toxiproxy = toxiproxy
        self.pg = pg
        self.admin = admin
        self.lock_name = lock_name
        self.report = report
        self.scenario = scenario
        self.sections = Sections()
        self.events = Events()
        self.watcher_events = Events()
        self.servers: list[PostgresServer] = [pg]
        """Every server this scenario's locks live on: the fixture looks for rows left on each."""
        self._upstream = os.environ.get("CHAOS_UPSTREAM") or f"{pg.host}:{pg.port}"
        self._mutexes: list[Mutex] = []
        self._watchers: list[StaleWatcher] = []
        self._concluded = False

    def record(self, **figures: Any) -> None:
        """This scenario's figures, as measured: record them before asserting on them."""
        self.report.record(self.scenario, **figures)

    def net(self, name: str, server: PostgresServer | None = None) -> Net:
        target = server or self.pg
        if target not in self.servers:
            self.servers.append(target)
        upstream = self._upstream if target is self.pg else f"{target.host}:{target.port}"
        base = {"user": target.user, "dbname": target.dbname, "password": target.password}
        return Net(self.toxiproxy, upstream, base, name)

    def mutex(self, who: str, dsn: str | None = None, **options: Any) -> Mutex:
        """A Mutex whose lost lock ends its section, reporting to the shared event log."""
        settings: dict[str, Any] = {**TIMING, "instance_id": who, "metrics": self.events}
        settings["on_lost"] = self.sections.on_lost(who)
        settings.update(options)
        mutex = Mutex(dsn or self.pg.dsn(), self.lock_name, **settings)
        self._mutexes.append(mutex)
        return mutex

    def watch(self) -> StaleWatcher:
        """A watcher on a direct connection, reporting to its own event log (`watcher_events`)."""
        watcher = StaleWatcher(
            self.pg.dsn(),
            lock_names=[self.lock_name],
            alert_threshold=ALERT,
            stale_threshold=STALE,
            interval=WATCH_INTERVAL,
            metrics=self.watcher_events,
        )
        watcher.start()
        self._watchers.append(watcher)
        return watcher

    def holder_id(self) -> str | None:
        found = self._row("SELECT instance_id FROM mutex_lock WHERE lock_name = %s")
        return None if found is None else str(found[0])

    def renewed(self) -> bool:
        """The holder's row has been heartbeated since it was acquired (by the server's clock)."""
        found = self._row("SELECT last_heartbeat > acquired_at FROM mutex_lock WHERE lock_name = %s")
        return found is not None and bool(found[0])

    def _row(self, query: str) -> tuple[Any, ...] | None:
        # A connection of its own each time: a scenario may have restarted the server.
        with psycopg.connect(self.pg.dsn(), autocommit=True, connect_timeout=5) as conn:
            return conn.execute(query, (self.lock_name,)).fetchone()

    def rows_left(self) -> list[str]:
        """Rows of the scenario's locks still in the table, on every server it used: "server lock holder"."""
        found = []
        for server in self.servers:
            with psycopg.connect(server.dsn(), autocommit=True, connect_timeout=5) as conn:
                if conn.execute("SELECT to_regclass('mutex_lock')").fetchone() == (None,):
                    continue
                rows = conn.execute(
                    "SELECT lock_name, instance_id FROM mutex_lock WHERE lock_name = %s OR lock_name LIKE %s",
                    (self.lock_name, f"{self.lock_name}-%"),
                ).fetchall()
            found += [f"{server.port} {lock} {holder}" for lock, holder in rows]
        return found

    def close(self) -> None:
        for watcher in self._watchers:
            watcher.close()
        for mutex in self._mutexes:
            with contextlib.suppress(Exception):
                mutex.close()

    def conclude(self, *, check: bool = True) -> None:
        """End the scenario: close everything, count overlaps and rows left, record both, then (``check``) fail
        unless both are zero. Once: the scenario's call concludes it, its teardown only if the call did not.
        """
        if self._concluded:
            return
        self._concluded = True
        self.close()
        overlaps = exclusion.overlaps(self.sections.all(), believed=True)
        # Every holder has released or is gone: a row left now is one nobody holds. Deleting it
        # may still be under way in the background (a lost reply): give it a moment, bounded.
        deadline = time.monotonic() + 10
        rows = self.rows_left()
        while rows and time.monotonic() < deadline:
            time.sleep(0.05)
            rows = self.rows_left()
        self.record(overlaps=len(overlaps), rows_left=len(rows))
        if check:
            assert overlaps == [], f"two holders at once: {overlaps}"
            assert rows == [], f"rows nobody holds: {rows}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    """A scenario that ran through is concluded as part of it: an overlap or a row left fails the scenario
    itself (not its teardown)."""
    result = yield
    world = getattr(item, "funcargs", {}).get("chaos")
    if isinstance(world, Chaos):
        world.conclude()
    return result


@pytest.fixture
def chaos(
    request: pytest.FixtureRequest,
    toxiproxy: Toxiproxy,
    pg: PostgresServer,
    admin: psycopg.Connection[Any],
    lock_name: str,
    report: Report,
) -> Iterator[Chaos]:
    """A scenario's world. When it ends, the checker's count of overlaps and the rows left are measured,
    recorded in the scenario's row of the report, and fail the scenario unless both are zero.

    The scenario names its row: ``@pytest.mark.scenario("1. partition < alert")``. Its locks are
    ``lock_name`` and names starting with ``lock_name + "-"``.
    """
    marker = request.node.get_closest_marker("scenario")
    assert marker is not None, "a chaos scenario names its row of the report: @pytest.mark.scenario(NAME)"
    world = Chaos(toxiproxy, pg, admin, lock_name, report, str(marker.args[0]))
    try:
        yield world
    finally:
        # A scenario that failed on its own is measured all the same: its row says what happened.
        world.conclude(check=False)
