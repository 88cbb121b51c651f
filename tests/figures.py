"""Figures the infrastructure tests measure, written where the docs take them from.

Each test records what it measured (seconds, counts) under a scenario name;
at the end of the module the figures go to ``$CHAOS_REPORT_DIR`` (default
``chaos/report/``, gitignored) as ``NAME.json`` and ``NAME.md``. Every run
rewrites the scenarios it ran and keeps the others, so a partial run (one
test, ``-m slow``) adds to the last full one instead of erasing it.

The docs include a committed copy, ``docs/figures/NAME.md``: a run with no
failed test that measured every scenario the copy shows rewrites it with this
run's figures alone, so the docs never mix two runs. (A scenario renamed or
removed keeps its old row until the copy is deleted and the module run again.)
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


DOCS_FIGURES = ROOT / "docs" / "figures"


def report_directory() -> Path:
    return Path(os.environ.get("CHAOS_REPORT_DIR") or ROOT / "chaos" / "report")


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

    def write(self, directory: Path | None = None, *, docs_copy: bool = False, docs: Path = DOCS_FIGURES) -> Path:
        """Merge this run's figures into the report; with ``docs_copy``, rewrite the docs' copy if it covers it."""
        directory = directory or report_directory()
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
        copy = docs / f"{self.name}.md"
        if docs_copy and shown_scenarios(copy) <= set(self.scenarios):
            copy.write_text(self.markdown(dict(sorted(self.scenarios.items()))))
        return path

    def markdown(self, scenarios: dict[str, dict[str, Any]]) -> str:
        settings = ", ".join(f"{key} {value}" for key, value in self.settings.items())
        lines = [f"{self.title}. Settings: {settings}.", "", "| scenario | measured |", "|---|---|"]
        for scenario, figures in scenarios.items():
            measured = "; ".join(f"{key}: {value}" for key, value in figures.items())
            lines.append(f"| {scenario} | {measured} |")
        return "\n".join(lines) + "\n"


def shown_scenarios(table: Path) -> set[str]:
    """The scenarios a written table shows (none if it does not exist)."""
    if not table.exists():
        return set()
    rows = [line.split("|")[1].strip() for line in table.read_text().splitlines() if line.startswith("| ")]
    return set(rows[1:])  # the first row is the header
