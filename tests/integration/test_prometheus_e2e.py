"""The proof that the dashboard and the alert rules work: a real Prometheus, real exporters, real Postgres.

A fleet process contends for one lock, waits to reclaim another from a holder
the test kills, and holds a third whose heartbeats the test blocks until the
lock is lost; a holder of a fourth lock is killed with nobody to take over; it
takes turns on a semaphore and on read/write locks, one of whose writers goes
silent and is taken over; a watcher exports the table's state, and a second
watcher target is down. A
real Prometheus scrapes them all. Then every panel query of the committed
dashboard and every alert rule expression is evaluated through Prometheus's
HTTP API, and each must return data.

Needs Debian's ``prometheus`` package: skipped locally without it, failed in CI.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import threading
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml

from tests.support.fixtures import ROOT, read_held, required_tool, row_locked, start_worker, wait_until
from tests.support.postgres_server import free_port
from tests.support.prometheus_rules import ALERTS_FILE, rule_expressions

DASHBOARD = ROOT / "grafana" / "postgres-mutex.json"
# What the dashboard's Grafana variables stand for when Prometheus evaluates a panel alone.
RATE_INTERVAL = "30s"


def panel_queries() -> list[tuple[str, str]]:
    spec = importlib.util.spec_from_file_location("build_dashboard", ROOT / "grafana" / "build_dashboard.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    dashboard = json.loads(DASHBOARD.read_text())
    queries: list[tuple[str, str]] = module.panel_queries(dashboard)
    return [
        (title, expr.replace("$__rate_interval", RATE_INTERVAL).replace("$lock_name", ".*")) for title, expr in queries
    ]


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, expr: str, at: float | None = None) -> list[Any]:
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{urllib.parse.urlencode(params)}", timeout=10) as reply:
            body = json.load(reply)
        assert body["status"] == "success", body
        result: list[Any] = body["data"]["result"]
        return result

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as reply:
                return bool(reply.status == 200)
        except OSError:
            return False


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[tuple[Prometheus, Path]]:
    binary = required_tool("prometheus", "prometheus")
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text("global: {}\n")  # replaced by the test before Prometheus reloads it
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--web.enable-lifecycle",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    server = Prometheus(f"http://127.0.0.1:{port}")
    try:
        wait_until(server.ready, timeout=30, interval=0.1)
        yield server, config
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


def configure(server: Prometheus, config: Path, *, fleet: list[int], watchers: list[int]) -> None:
    config.write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": [str(ALERTS_FILE)],
                "scrape_configs": [
                    {"job_name": "postgres_mutex", "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in fleet]}]},
                    {
                        "job_name": "postgres_mutex_watcher",
                        "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in watchers]}],
                    },
                ],
            }
        )
    )
    request = urllib.request.Request(f"{server.url}/-/reload", method="POST")
    with urllib.request.urlopen(request, timeout=10) as reply:
        assert reply.status == 200


@pytest.mark.timeout(180)
def test_every_panel_query_and_alert_rule_returns_data(
    prometheus: tuple[Prometheus, Path],
    dsn: str,
    admin: psycopg.Connection[Any],
    workers: list[subprocess.Popen[str]],
) -> None:
    server, config = prometheus
    before_any_sample = time.time() - 60
    prefix = f"e2e-{uuid.uuid4().hex[:8]}"
    fleet_port, watcher_port, dead_watcher_port = free_port(), free_port(), free_port()

    stuck = start_worker("hold", dsn, f"{prefix}-stuck")
    doomed = start_worker("hold", dsn, f"{prefix}-reclaimed")
    workers.extend([stuck, doomed])
    read_held(stuck)
    read_held(doomed)
    fleet = start_worker("fleet", dsn, prefix, str(fleet_port))
    watcher = start_worker("watcher", dsn, "-", str(watcher_port))
    workers.extend([fleet, watcher])
    read_held(fleet)
    read_held(watcher)
    configure(server, config, fleet=[fleet_port], watchers=[watcher_port, dead_watcher_port])

    # A crash with nobody to take over (alerting, then reclaimable), and one the fleet reclaims.
    os.kill(stuck.pid, signal.SIGKILL)
    os.kill(doomed.pid, signal.SIGKILL)
    # Block the stalled holder's heartbeats until its lease runs out: failures, then a loss.
    wait_until(lambda: _holds(admin, f"{prefix}-stalled") and _holds(admin, f"{prefix}-flaky"), timeout=30)
    with row_locked(dsn, f"{prefix}-stalled"):
        time.sleep(3.0)  # longer than the stalled holder's lease (1.4 s): the point is that it runs out
    # Keep the flaky holder's heartbeats failing now and then, never for a whole lease.
    done = threading.Event()
    flaky = threading.Thread(target=_stall_now_and_then, args=(dsn, f"{prefix}-flaky", done))
    flaky.start()
    try:
        queries = [(f"panel {title!r}", expr) for title, expr in panel_queries()]
        queries += [(f"alert {name}", expr) for name, expr in rule_expressions()]
        deadline = time.monotonic() + 90
        while True:
            empty = [(what, expr) for what, expr in queries if not _has_data(server, what, expr, before_any_sample)]
            if not empty or time.monotonic() > deadline:
                break
            time.sleep(2)
    finally:
        done.set()
        flaky.join()
    assert empty == [], "queries without data: " + "; ".join(f"{what}: {expr}" for what, expr in empty)
    assert len(queries) >= 20


def _has_data(server: Prometheus, what: str, expr: str, before_any_sample: float) -> bool:
    if what == "alert PostgresMutexWatcherAbsent":
        # It fires only when no watcher reports at all: the state before any scrape.
        return bool(server.query(expr, at=before_any_sample))
    return bool(server.query(expr))


def _stall_now_and_then(dsn: str, lock_name: str, done: threading.Event) -> None:
    while not done.is_set():
        with row_locked(dsn, lock_name):
            done.wait(0.7)
        done.wait(0.5)


def _holds(admin: psycopg.Connection[Any], lock_name: str) -> bool:
    found = admin.execute("SELECT 1 FROM mutex_lock WHERE lock_name = %s", (lock_name,)).fetchone()
    return found is not None
