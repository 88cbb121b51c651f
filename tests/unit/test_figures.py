"""The docs' copy of the infrastructure figures shows one whole run that passed, and nothing else."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support import figures as module
from tests.support.figures import Figures, flush_docs_copies, ran_whole


def measured(**scenarios: float) -> Figures:
    made = Figures("report", "measured by a test", {"heartbeat_interval": 0.2})
    for scenario, value in scenarios.items():
        made.record(scenario, seconds=value)
    return made


def test_the_docs_copy_is_written_once_the_session_passed_with_that_runs_figures_only(tmp_path: Path) -> None:
    report, docs = tmp_path / "report", tmp_path / "docs"
    docs.mkdir()
    copy = docs / "report.md"
    measured(a=1.0, b=2.0).write(report, docs_copy=True, docs=docs)
    assert not copy.exists(), "not before the session's verdict"
    flush_docs_copies(passed=True)
    assert "seconds: 1.0" in copy.read_text()

    measured(a=3.0, b=4.0).write(report, docs_copy=True, docs=docs)
    flush_docs_copies(passed=False)
    assert "seconds: 1.0" in copy.read_text(), "a session that failed leaves it alone"

    measured(a=5.0).write(report, docs_copy=False, docs=docs)
    flush_docs_copies(passed=True)
    assert "seconds: 1.0" in copy.read_text(), "so does a partial run of the module"
    assert "seconds: 5.0" in (report / "report.md").read_text(), "which adds to the report"

    measured(c=6.0).write(report, docs_copy=True, docs=docs)
    flush_docs_copies(passed=True)
    text = copy.read_text()
    assert "| c |" in text
    assert "| a |" not in text, "one run's figures: a row it did not measure is gone"


class Item:
    """What pytest_deselected reads of a test item."""

    def __init__(self, path: Path, *, slow: bool) -> None:
        self.path = path
        self._slow = slow

    def get_closest_marker(self, name: str) -> Any:
        return object() if name == "slow" and self._slow else None


def test_a_module_runs_whole_unless_a_test_other_than_a_slow_one_is_left_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(module, "_partial", set())
    suite, other = tmp_path / "test_suite.py", tmp_path / "test_other.py"
    module.pytest_deselected([Item(suite, slow=True)])  # type: ignore[list-item]
    assert ran_whole(suite), "the slow variants are not part of the run the docs show"
    module.pytest_deselected([Item(suite, slow=False)])  # type: ignore[list-item]
    assert not ran_whole(suite)
    assert ran_whole(other)
