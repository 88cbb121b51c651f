"""Fixtures for the chaos suite: one Toxiproxy server a session, a clean client a test.

PostgreSQL fixtures live in tests/fixtures.py (loaded for both suites by the root conftest.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from toxiproxy import Toxiproxy

from chaos.harness import ALERT, STALE, TIMING, WATCH_INTERVAL, Events, Net, Report
from chaos.toxiproxy import ToxiproxyEndpoint, toxiproxy_client, toxiproxy_endpoint
from postgres_mutex import Mutex
from postgres_mutex.watcher import StaleWatcher
from tests.exclusion import Sections
from tests.fixtures import wait_until
from tests.postgres_server import PostgresServer

log = logging.getLogger(__name__)


@pytest.fixture(scope="session")
def toxiproxy_server_endpoint() -> Iterator[ToxiproxyEndpoint]:
    """The session's Toxiproxy server, with the kind that was picked (see chaos.toxiproxy)."""
    with toxiproxy_endpoint() as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def toxiproxy_url(toxiproxy_server_endpoint: ToxiproxyEndpoint) -> str:
    """The API base URL of the session's Toxiproxy server, e.g. http://127.0.0.1:8474."""
    return toxiproxy_server_endpoint.url


@pytest.fixture
def toxiproxy(toxiproxy_url: str) -> Iterator[Toxiproxy]:
    """A toxiproxy-python client for the session's server; every proxy is deleted afterwards.

    Repointed for each test because the client's address is process-wide state.
    """
    client = toxiproxy_client(toxiproxy_url)
    yield client
    # Repoint again: the test may have pointed the client elsewhere.
    toxiproxy_client(toxiproxy_url).destroy_all()


@pytest.fixture(scope="session")
def report(
    request: pytest.FixtureRequest, toxiproxy_server_endpoint: ToxiproxyEndpoint, pg: PostgresServer
) -> Iterator[Report]:
    """Measured figures, written to $CHAOS_REPORT_DIR (default chaos/report) when the session ends.

    A session that ran every scenario, with no test failed, also rewrites
    docs/figures/chaos-report.md: the table the docs' failure-modes page includes.
    """
    collected = Report(Path(os.environ.get("CHAOS_REPORT_DIR") or Path(__file__).parent / "report"))
    yield collected
    if collected.scenarios:
        collected.write(toxiproxy_server_endpoint.kind.value, pg.version, docs_copy=request.session.testsfailed == 0)


class Chaos:
    """One scenario's world: the lock, proxies in front of PostgreSQL, the section log, a watcher."""

    def __init__(
        self, toxiproxy: Toxiproxy, pg: PostgresServer, admin: psycopg.Connection[Any], lock_name: str
    ) -> None:
        self.toxiproxy = toxiproxy
        self.pg = pg
        self.admin = admin
        self.lock_name = lock_name
        self.sections = Sections()
        self.events = Events()
        self.watcher_events = Events()
        self._upstream = os.environ.get("CHAOS_UPSTREAM") or f"{pg.host}:{pg.port}"
        self._mutexes: list[Mutex] = []
        self._watchers: list[StaleWatcher] = []

    def net(self, name: str, server: PostgresServer | None = None) -> Net:
        target = server or self.pg
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
        # A connection of its own each time: a scenario may have restarted the server.
        with psycopg.connect(self.pg.dsn(), autocommit=True, connect_timeout=5) as conn:
            query = "SELECT instance_id FROM mutex_lock WHERE lock_name = %s"
            found = conn.execute(query, (self.lock_name,)).fetchone()
        return None if found is None else str(found[0])

    def close(self) -> None:
        for watcher in self._watchers:
            watcher.close()
        for mutex in self._mutexes:
            with contextlib.suppress(Exception):
                mutex.close()


@pytest.fixture
def chaos(toxiproxy: Toxiproxy, pg: PostgresServer, admin: psycopg.Connection[Any], lock_name: str) -> Iterator[Chaos]:
    """A scenario's world; whatever the scenario asserts, an overlap or an orphaned row fails it."""
    world = Chaos(toxiproxy, pg, admin, lock_name)
    try:
        yield world
    finally:
        world.close()
    overlaps = world.sections.overlaps()
    assert overlaps == [], f"two holders at once: {overlaps}"
    # Every holder has released: a row left now is one nobody holds.
    wait_until(lambda: world.holder_id() is None, timeout=10)
