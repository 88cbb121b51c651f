"""Figures the infrastructure tests measure, written where the docs take them from.

Each test records what it measured (seconds, counts) under a scenario name;
at the end of the module the figures go to ``$CHAOS_REPORT_DIR`` (default
``chaos/report/``, gitignored) as ``NAME.json`` and ``NAME.md``. Every run
rewrites the scenarios it ran and keeps the others, so a partial run (one
test, ``-m slow``) adds to the last full one instead of erasing it.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


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

    def write(self, directory: Path | None = None) -> Path:
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
        settings = ", ".join(f"{key} {value}" for key, value in self.settings.items())
        lines = [f"# {self.title}", "", f"Settings: {settings}.", "", "| scenario | measured |", "|---|---|"]
        for scenario, figures in ordered.items():
            measured = "; ".join(f"{key}: {value}" for key, value in figures.items())
            lines.append(f"| {scenario} | {measured} |")
        (directory / f"{self.name}.md").write_text("\n".join(lines) + "\n")
        return path
