"""What every chaos scenario shares: proxies, faults, the report.

The mutual-exclusion checker is tests/support/exclusion.py.

Timings are shortened (heartbeat 0.2 s, alert 1 s, stale 3 s) so each fault
plays out in seconds; their ratios are what the library cares about.

Where proxies listen and what they forward to can be set for setups where
Toxiproxy runs elsewhere (a container): ``CHAOS_PROXY_LISTEN_HOST`` (default
127.0.0.1), ``CHAOS_PROXY_PORTS`` (a range such as ``20000-20039``; default:
any free port), ``CHAOS_PROXY_CONNECT_HOST`` (how clients reach the proxies;
default the listen host) and ``CHAOS_UPSTREAM`` (PostgreSQL as Toxiproxy sees
it; default the test server's host:port).
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from postgres_mutex import ExtendedMetricsHook
from tests.support.figures import docs_copy_directory

HEARTBEAT, ALERT, STALE = 0.2, 1.0, 3.0
LEASE = STALE - HEARTBEAT
POLL = 0.1
OPERATION_TIMEOUT = 0.5
WATCH_INTERVAL = 0.1

SCENARIOS = (
    "1. partition < alert",
    "2. partition > alert, < stale",
    "3. partition > stale",
    "4. slow holder < alert",
    "5. slow holder > alert",
    "6. holder crash (SIGKILL)",
    "7. reset while acquiring",
    "8. reset during release",
    "9. PostgreSQL restart",
    "10. waiter partitioned at release",
    "11. clock skew (+3h / -3h)",
    "12. soak",
    "13. ledger, holder frozen past stale (fenced)",
    "13. ledger, holder frozen past stale (unfenced)",
    "14. nemesis",
    "15. nemesis, broken lease (caught)",
    "17. nemesis, semaphore of 3",
    "19. ledger, read/write lock, writers frozen and killed",
)
"""Every scenario the report names, in its order; the docs' copy is rewritten only by a run that measured them all."""

ON_DEMAND = ("16. nemesis, long", "18. nemesis, semaphore of 3, long")
"""Scenarios run only on demand (marker slow): reported when they ran, never required for the docs' copy."""

MEASURED_BY_FIXTURE = ("overlaps", "rows_left")
"""Figures the `chaos` fixture measures for every scenario, after it ends: the table's own columns."""

DOCS_FIGURE_NAME = "chaos-report.md"
"""The copy docs/failure-modes.md includes, in docs/figures/: committed, rewritten by ``pytest --refresh-figures``."""

TIMING: dict[str, float] = {
    "heartbeat_interval": HEARTBEAT,
    "alert_threshold": ALERT,
    "stale_threshold": STALE,
    "poll_interval": POLL,
    "operation_timeout": OPERATION_TIMEOUT,
}


def _port_range() -> Iterator[int] | None:
    text = os.environ.get("CHAOS_PROXY_PORTS")
    if not text:
        return None
    low, _, high = text.partition("-")
    return itertools.cycle(range(int(low), int(high or low) + 1))


_PORTS = _port_range()
_PORTS_LOCK = threading.Lock()


def listen_address() -> str:
    host = os.environ.get("CHAOS_PROXY_LISTEN_HOST", "127.0.0.1")
    with _PORTS_LOCK:
        port = 0 if _PORTS is None else next(_PORTS)
    return f"{host}:{port}"


def client_dsn(base: dict[str, Any], listen: str) -> str:
    """A DSN reaching PostgreSQL through a proxy listening at ``listen``."""
    host, _, port = listen.rpartition(":")
    wildcard = host in ("", "0.0.0.0", "[::]")  # noqa: S104 - a listen address, read, never bound here
    host = os.environ.get("CHAOS_PROXY_CONNECT_HOST") or ("127.0.0.1" if wildcard else host)
    params = {**base, "host": host, "port": port, "sslmode": "disable", "gssencmode": "disable"}
    return " ".join(f"{key}={value}" for key, value in params.items() if value is not None)


class Net:
    """The network path of one client: a Toxiproxy proxy, and the faults it can inject."""

    def __init__(self, client: Any, upstream: str, base_dsn: dict[str, Any], name: str) -> None:
        self.proxy = client.create(upstream=upstream, name=f"{name}-{uuid.uuid4().hex[:6]}", listen=listen_address())
        self.dsn = client_dsn(base_dsn, self.proxy.listen)
        self._toxics: list[str] = []

    def toxic(self, kind: str, stream: str = "downstream", **attributes: int) -> str:
        name = f"{kind}_{stream}_{len(self._toxics)}"
        self.proxy.add_toxic(type=kind, stream=stream, name=name, attributes=attributes)
        self._toxics.append(name)
        return name

    def remove(self, name: str) -> None:
        self.proxy.destroy_toxic(name)
        self._toxics.remove(name)

    def clear(self) -> None:
        for name in list(self._toxics):
            self.remove(name)

    def partition(self) -> None:
        """A silent partition: nothing gets through either way, no RST, no FIN."""
        self.toxic("timeout", "upstream", timeout=0)
        self.toxic("timeout", "downstream", timeout=0)

    @contextmanager
    def partitioned(self) -> Iterator[None]:
        """Partitioned for the duration of the block, healed after (Toxiproxy closes the cut connections)."""
        self.partition()
        try:
            yield
        finally:
            self.clear()


@dataclass
class Event:
    at: float
    name: str
    lock_name: str
    fields: dict[str, Any]


class Events:
    """A metrics hook that timestamps every call (monotonic clock), for assertions and figures."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        if name not in _HOOK_METHODS:
            raise AttributeError(name)

        def record(*args: Any, **kwargs: Any) -> None:
            lock_name = args[0] if args and isinstance(args[0], str) else ""
            if args and not isinstance(args[0], str):
                # A watcher's "observed" passes its observations first: keep them.
                kwargs = {"observations": args[0], **kwargs}
            with self._lock:
                self.events.append(Event(time.monotonic(), name, lock_name, kwargs))

        return record

    def named(self, name: str) -> list[Event]:
        with self._lock:
            return [event for event in self.events if event.name == name]

    def first(self, name: str) -> Event | None:
        found = self.named(name)
        return found[0] if found else None


_HOOK_METHODS = frozenset(name for name in dir(ExtendedMetricsHook) if not name.startswith("_"))


@dataclass
class Report:
    """Measured figures per scenario, written as JSON and a markdown table at the end of the session."""

    directory: Path
    scenarios: dict[str, dict[str, Any]] = field(default_factory=dict)

    def record(self, scenario: str, **figures: Any) -> None:
        assert scenario in SCENARIOS + ON_DEMAND, f"add {scenario!r} to SCENARIOS: the docs' copy lists every scenario"
        self.scenarios.setdefault(scenario, {}).update(
            {key: round(value, 3) if isinstance(value, float) else value for key, value in figures.items()}
        )

    def complete(self) -> bool:
        """Every scenario ran, and the fixture measured its overlaps and rows: what the docs' copy needs."""
        return all(
            all(key in self.scenarios.get(scenario, {}) for key in MEASURED_BY_FIXTURE) for scenario in SCENARIOS
        )

    def write(self, toxiproxy: str, postgres: int, *, docs_copy: bool, docs: Path | None = None) -> None:
        """Write this session's figures; with ``docs_copy``, the docs' copy too if every scenario ran.

        The docs' copy goes to ``docs`` (default: `docs_copy_directory`, the committed one only under
        ``pytest --refresh-figures``).
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        payload = {
            "timing": {"heartbeat_interval": HEARTBEAT, "alert_threshold": ALERT, "stale_threshold": STALE},
            "toxiproxy": toxiproxy,
            "postgres": postgres,
            "scenarios": self.scenarios,
        }
        (self.directory / "chaos-report.json").write_text(json.dumps(payload, indent=2) + "\n")
        table = self.markdown(toxiproxy, postgres)
        (self.directory / "chaos-report.md").write_text(table)
        # A partial run (-k, one file) would leave the docs with half a table: only a whole one replaces it.
        if docs_copy and self.complete():
            docs = docs or docs_copy_directory()
            docs.mkdir(parents=True, exist_ok=True)
            (docs / DOCS_FIGURE_NAME).write_text(table)

    def markdown(self, toxiproxy: str, postgres: int) -> str:
        lines = [
            f"Chaos report: heartbeat {HEARTBEAT:g}s, alert {ALERT:g}s, stale {STALE:g}s; "
            f"PostgreSQL {postgres}; Toxiproxy: {toxiproxy}",
            "",
            "| scenario | overlaps | rows left | measured |",
            "|---|---|---|---|",
        ]
        order = {name: index for index, name in enumerate(SCENARIOS + ON_DEMAND)}
        for scenario, figures in sorted(self.scenarios.items(), key=lambda item: order[item[0]]):
            measured = "; ".join(f"{key}: {value}" for key, value in figures.items() if key not in MEASURED_BY_FIXTURE)
            overlaps, rows = (figures.get(key, "not measured") for key in MEASURED_BY_FIXTURE)
            lines.append(f"| {scenario} | {overlaps} | {rows} | {measured} |")
        return "\n".join(lines) + "\n"
