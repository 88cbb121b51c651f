"""The docs' copy of the infrastructure figures shows one whole run that passed, and nothing else."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from chaos.harness import SCENARIOS, Report
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


def ignored_by_git(path: Path) -> bool:
    found = subprocess.run(
        ["git", "check-ignore", "--quiet", "--no-index", str(path)], cwd=module.ROOT, check=False, timeout=30
    )
    return found.returncode == 0


@pytest.mark.parametrize("name", ["pgbouncer-report", "failover-report"])
def test_a_test_run_writes_the_docs_copy_where_git_ignores_it_unless_asked_to_refresh(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pytest` leaves the checkout clean; `pytest --refresh-figures` rewrites the committed figures."""
    monkeypatch.delenv("CHAOS_REPORT_DIR", raising=False)
    monkeypatch.setattr(module, "_pending", {})
    monkeypatch.setattr(module, "_refresh", False)
    Figures(name, "measured by a test", {}).write(tmp_path / "run", docs_copy=True)
    (queued,) = module._pending
    assert queued.name == f"{name}.md"
    assert ignored_by_git(queued), f"a test run would dirty the checkout: {queued}"
    assert queued.parent != module.DOCS_FIGURES

    module._pending.clear()
    monkeypatch.setattr(module, "_refresh", True)
    Figures(name, "measured by a test", {}).write(tmp_path / "refresh", docs_copy=True)
    (queued,) = module._pending
    assert queued == module.DOCS_FIGURES / f"{name}.md"
    assert not ignored_by_git(queued), "the refreshed copy is the committed one"


def test_the_chaos_suites_docs_copy_is_written_where_git_ignores_it_unless_asked_to_refresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    report = Report(tmp_path / "report")
    for scenario in SCENARIOS:
        report.record(scenario, overlaps=0, rows_left=0)
    monkeypatch.delenv("CHAOS_REPORT_DIR", raising=False)
    monkeypatch.setattr(module, "_refresh", False)
    assert ignored_by_git(module.docs_copy_directory() / "chaos-report.md")
    monkeypatch.setattr(module, "_refresh", True)
    assert module.docs_copy_directory() == module.DOCS_FIGURES

    monkeypatch.setattr(module, "_refresh", False)
    monkeypatch.setenv("CHAOS_REPORT_DIR", str(tmp_path / "report"))
    report.write("test", 18, docs_copy=True)
    copy = tmp_path / "report" / "figures" / "chaos-report.md"
    assert "| 1. partition < alert | 0 | 0 |" in copy.read_text(), "a whole run's copy, beside the report"
