"""Figures the infrastructure tests measure, written where the docs take them from.

Each test records what it measured (seconds, counts) under a scenario name;
at the end of the module the figures go to ``$CHAOS_REPORT_DIR`` (default
``chaos/report/``, gitignored) as ``NAME.json`` and ``NAME.md``. Every run
rewrites the scenarios it ran and keeps the others, so a partial run (one
test, ``-m slow``) adds to the last full one instead of erasing it.

The docs include a committed copy, ``docs/figures/NAME.md``, with one run's
figures alone, so the docs never mix two runs. A test run leaves it alone: the
copy a run would commit goes to ``figures/`` under the report directory
(ignored by git). Only ``pytest --refresh-figures`` writes the committed copy,
as ``python -m bench`` does for the bench's tables. Either copy is written only
by a whole run of the module — every test selected but the ``slow`` ones (no
``-k``, no node id, no other marker), none skipped — and only once the whole
session has passed: this module registers pytest hooks that track both
(``pytest_plugins`` in the root conftest loads it).
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


DOCS_FIGURES = ROOT / "docs" / "figures"

REFRESH_OPTION = "--refresh-figures"

_refresh = False
"""Whether this session rewrites the committed copies (``--refresh-figures``)."""

_partial: set[Path] = set()
"""Test modules this session did not run whole (a test deselected or skipped, a node id given)."""

_pending: dict[Path, str] = {}
"""Docs copies to write if the session passes."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        REFRESH_OPTION,
        action="store_true",
        help="rewrite the figures the docs include (docs/figures/*-report.md) with this run's, "
        "if it ran their module whole and passed (default: a copy under chaos/report/figures/)",
    )


def pytest_configure(config: pytest.Config) -> None:
    global _refresh
    _refresh = bool(config.getoption(REFRESH_OPTION, default=False))
    for arg in config.args:
        path, separator, _ = arg.partition("::")
        if separator:
            _partial.add(Path(path).resolve())


def pytest_deselected(items: Iterable[pytest.Item]) -> None:
    # The slow variants are left out of the run the docs show: leaving them out keeps it whole.
    for item in items:
        if item.get_closest_marker("slow") is None:
            _partial.add(Path(item.path).resolve())


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped:
        _partial.add(Path(report.fspath).resolve())


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    flush_docs_copies(passed=exitstatus == 0)


def ran_whole(module: Path) -> bool:
    """Whether this session ran every test of ``module`` (but its slow ones), none skipped so far."""
    return module.resolve() not in _partial


def flush_docs_copies(*, passed: bool) -> None:
    """Write the docs copies a whole run queued, if the session passed; forget them either way."""
    if passed:
        for path, text in _pending.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    _pending.clear()


def report_directory() -> Path:
    return Path(os.environ.get("CHAOS_REPORT_DIR") or ROOT / "chaos" / "report")


def docs_copy_directory() -> Path:
    """Where a whole run's copy for the docs goes: the committed ``docs/figures/`` under ``--refresh-figures``.

    Otherwise ``figures/`` under the report directory, which git ignores, so a test run leaves the
    checkout as it found it.
    """
    if _refresh:
        return DOCS_FIGURES
    return report_directory() / "figures"


class Figures:
    """Measured figures per scenario, merged into ``NAME.json`` / ``NAME.md`` by `write`."""

    def __init__(self, name: str, title: str, settings: dict[str, Any]) -> None:
        self.name = name
        self.title = title
        self.settings = settings
        self.scenarios: dict[str, dict[str, Any]] = {}

    def record(self, scenario: str, **figures: Any) -> None:
        self.scenarios.setdefault(scenario, {}).update(
            {key: round(value, 3) if isinstance(value, float) else value for key, value in figures.items()}
        )

    def write(self, directory: Path | None = None, *, docs_copy: bool = False, docs: Path | None = None) -> Path:
        """Merge this run's figures into the report; with ``docs_copy``, queue the docs' copy of this run's alone.

        The docs' copy goes to ``docs`` (default: `docs_copy_directory`).
        """
        directory = directory or report_directory()
        docs = docs or docs_copy_directory()
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{self.name}.json"
        scenarios: dict[str, Any] = {}
        if path.exists():
            try:
                scenarios = json.loads(path.read_text()).get("scenarios", {})
            except ValueError:
                scenarios = {}
        scenarios.update(self.scenarios)
        ordered = dict(sorted(scenarios.items()))
        payload = {
            "title": self.title,
            "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": f"{platform.node()} ({os.cpu_count()} CPUs)",
            "settings": self.settings,
            "scenarios": ordered,
        }
        path.write_text(json.dumps(payload, indent=2) + "\n")
        (directory / f"{self.name}.md").write_text(self.markdown(ordered))
        if docs_copy:
            _pending[docs / f"{self.name}.md"] = self.markdown(dict(sorted(self.scenarios.items())))
        return path

    def markdown(self, scenarios: dict[str, dict[str, Any]]) -> str:
        settings = ", ".join(f"{key} {value}" for key, value in self.settings.items())
        lines = [f"{self.title}. Settings: {settings}.", "", "| scenario | measured |", "|---|---|"]
        for scenario, figures in scenarios.items():
            measured = "; ".join(f"{key}: {value}" for key, value in figures.items())
            lines.append(f"| {scenario} | {measured} |")
        return "\n".join(lines) + "\n"
