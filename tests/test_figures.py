"""The docs' copy of the infrastructure figures is rewritten only by a run that measured all it shows."""

from __future__ import annotations

from pathlib import Path

from tests.figures import Figures, shown_scenarios


def figures(**scenarios: float) -> Figures:
    made = Figures("report", "measured by a test", {"heartbeat_interval": 0.2})
    for scenario, value in scenarios.items():
        made.record(scenario, seconds=value)
    return made


def test_a_whole_run_rewrites_the_docs_copy_with_its_own_figures_only(tmp_path: Path) -> None:
    report, docs = tmp_path / "report", tmp_path / "docs"
    docs.mkdir()
    figures(a=1.0, b=2.0).write(report, docs_copy=True, docs=docs)
    assert shown_scenarios(docs / "report.md") == {"a", "b"}

    figures(a=3.0).write(report, docs_copy=True, docs=docs)
    assert "seconds: 1.0" in (docs / "report.md").read_text(), "a partial run leaves the docs' copy alone"
    assert "seconds: 3.0" in (report / "report.md").read_text(), "and adds to the report"

    figures(a=4.0, b=5.0).write(report, docs_copy=False, docs=docs)
    assert "seconds: 1.0" in (docs / "report.md").read_text(), "a run with a failed test leaves it alone"

    figures(a=6.0, b=7.0, c=8.0).write(report, docs_copy=True, docs=docs)
    copy = (docs / "report.md").read_text()
    assert shown_scenarios(docs / "report.md") == {"a", "b", "c"}
    assert "seconds: 6.0" in copy
    assert "seconds: 1.0" not in copy
