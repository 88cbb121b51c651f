"""The peers' table gives a peer that could not run a row saying why, and keeps its columns."""

from __future__ import annotations

from pathlib import Path

from bench.peers_report import lines, splice


def _peers() -> dict[str, object]:
    measured = {
        "label": "**this**",
        "version": "0.2.0",
        "server": "PostgreSQL 18.6",
        "gives": ["a", "b", "c", "d"],
        "errors": {"contended": "WorkerFailed: peer worker 12 said nothing for 60s"},
        "cycle": {"median_ms": 1.0, "p99_ms": 2.0, "to_this": 1.0},
        "handoff": {"p50_ms": 2.0, "p99_ms": 5.0, "handoffs": 10, "acquired_before_release": 0, "to_this": 1.0},
    }
    missing = {
        "label": "redis-py `Lock`",
        "version": "8.2.0",
        "gives": ["a", "b", "c", "d"],
        "errors": {},
        "skipped": "`redis-server` is not installed (Debian: apt-get install redis-server)",
    }
    return {"settle_s": 0.02, "processes": 4, "hold_ms": 2.0, "seconds": 5.0, "peers": {"this": measured, "r": missing}}


def test_a_peer_that_could_not_run_says_why_in_every_column() -> None:
    table = [line for line in lines(_peers()) if line.startswith("| redis-py")]
    assert len(table) == 2, "a row in the figures and a row in what each gives"
    cells = table[0].strip("|").split(" | ")
    assert len(cells) == 6
    assert all("not run: `redis-server` is not installed" in cell for cell in cells[2:5])


def test_a_measure_that_failed_says_so_and_the_others_stay() -> None:
    row = next(line for line in lines(_peers()) if line.startswith("| **this**"))
    assert "1.000 ms (1.00x) / 2.000 ms" in row
    assert "failed: WorkerFailed: peer worker 12 said nothing for 60s" in row


def test_a_run_of_the_peers_alone_replaces_only_their_section(tmp_path: Path) -> None:
    figures = tmp_path / "bench.md"
    figures.write_text("## Latency\n\n<!-- --8<-- [start:latency] -->\nkept\n<!-- --8<-- [end:latency] -->\n")
    splice(figures, "peers", "The peers", ["first"])
    splice(figures, "peers", "The peers", ["second"])
    text = figures.read_text()
    assert "kept" in text
    assert "second" in text
    assert "first" not in text
    assert text.count("## The peers") == 1
