"""The README's performance section shows the peers' tables as the bench wrote them, not typed in.

GitHub does not expand the docs' includes, so the README carries a copy of
the tables of docs/figures/bench.md's peers section; after a new run of the
peers, copy them again (this test says which line differs).
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _section(text: str, start: str, end: str) -> str:
    assert start in text, f"missing {start!r}"
    begin = text.index(start) + len(start)
    return text[begin : text.index(end, begin)]


def test_the_readme_shows_the_peers_tables_of_the_figures_file() -> None:
    figures = _section(
        (ROOT / "docs" / "figures" / "bench.md").read_text(),
        "<!-- --8<-- [start:peers] -->",
        "<!-- --8<-- [end:peers] -->",
    )
    readme = _section((ROOT / "README.md").read_text(), "\n## Performance\n", "\n## ")
    measured = [line for line in figures.splitlines() if line.startswith("|")]
    shown = [line for line in readme.splitlines() if line.startswith("|")]
    assert measured, "docs/figures/bench.md has no peers table"
    assert shown == measured, "README.md's performance tables differ from docs/figures/bench.md's peers section"
