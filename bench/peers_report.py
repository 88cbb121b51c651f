"""The peers section as markdown: the figures, then what each peer gives for them.

Kept apart from `bench.report` so that a run of the peers alone
(``python -m bench --only-peers``) can write its section into
docs/figures/bench.md without rewriting the others (`splice`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any


def _ms(value: float) -> str:
    return f"{value:.3f} ms" if value < 10 else f"{value:.1f} ms"


def _ratio(figures: dict[str, Any]) -> str:
    return f" ({figures['to_this']:.2f}x)" if "to_this" in figures else ""


def _cell(row: dict[str, Any], measure: str) -> str | None:
    """Why a measure has no figures, if it has none."""
    if "skipped" in row:
        return "not run: " + str(row["skipped"]).replace("|", "\\|")
    if measure in row["errors"]:
        return "failed: " + str(row["errors"][measure]).replace("|", "\\|")
    if measure not in row:
        return "n/a"
    return None


def _figures(row: dict[str, Any]) -> list[str]:
    """A peer's cycle, hand-off, contended rate and two-holders count, as its cells say them."""
    cycle = _cell(row, "cycle") or (
        f"{_ms(row['cycle']['median_ms'])}{_ratio(row['cycle'])} / {_ms(row['cycle']['p99_ms'])}"
    )
    handoff = _cell(row, "handoff") or (
        f"{_ms(row['handoff']['p50_ms'])}{_ratio(row['handoff'])} / {_ms(row['handoff']['p99_ms'])} "
        f"({row['handoff']['handoffs']})"
    )
    contended = _cell(row, "contended") or (
        f"{row['contended']['cycles_per_s']:,.0f}{_ratio(row['contended'])}, shares "
        f"{row['contended']['share_min'] * 100:.0f} to {row['contended']['share_max'] * 100:.0f} %"
    )
    # Two holders at once: overlapping contended sections, or a waiter that returned before the release.
    counted = [row[m][f] for m, f in (("contended", "overlaps"), ("handoff", "acquired_before_release")) if m in row]
    return [cycle, handoff, contended, str(sum(counted)) if counted else "n/a"]


def lines(peers: dict[str, Any]) -> list[str]:
    # This version's fair mode is said apart, after the table: the table is what you would use instead.
    others = [row for key, row in peers["peers"].items() if key != "fair"]
    rows = [[row["label"], f"{row['version']}, {row.get('server', 'n/a')}", *_figures(row)] for row in others]
    gives = [[row["label"], *row["gives"]] for row in others]
    return [
        f"Each peer on this machine in the same run; ratios (in brackets) are to postgres-mutex (this version) "
        f"in the same run. Cycle: one worker per peer, interleaved rounds. Hand-off: the waiter blocked "
        f"{peers['settle_s'] * 1e3:.0f} ms before the release. Contended: {peers['processes']} processes, one "
        f"lock, {peers['hold_ms']:g} ms hold, {peers['seconds']:g} s each.",
        "",
        *_table(
            [
                "lock",
                "version, server",
                "acquire + release: median (ratio) / p99",
                "hand-off: p50 (ratio) / p99 (count)",
                "contended cycles/s (ratio), shares",
                "two holders at once",
            ],
            rows,
        ),
        *_fair(peers["peers"]),
        "",
        "What each gives for that price:",
        "",
        *_table(
            ["lock", "liveness of a holder", "before a holder's lock is taken over", "fencing", "a blocked waiter"],
            gives,
        ),
    ]


def _fair(rows: dict[str, Any]) -> list[str]:
    """This version's fair mode, measured as a peer in the same run: a sentence, its hand-off against PALs' too."""
    fair = rows.get("fair")
    if fair is None:
        return []
    cycle, handoff, contended, overlaps = _figures(fair)
    pals = rows.get("pals", {}).get("handoff")
    against = f", {fair['handoff']['p50_ms'] / pals['p50_ms']:.2f}x PALs'" if "handoff" in fair and pals else ""
    return [
        "",
        f"{fair['label']}, measured the same way in the same run ({fair['gives'][3]}): "
        f"acquire + release {cycle}; hand-off {handoff}{against}; contended cycles/s {contended}; two holders "
        f"at once {overlaps}.",
    ]


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return out + ["| " + " | ".join(row) + " |" for row in rows]


def splice(path: Path, name: str, title: str, body: list[str]) -> None:
    """Put section ``name`` of a figures file in place: replaced between its markers, or appended."""
    start, end = f"<!-- --8<-- [start:{name}] -->", f"<!-- --8<-- [end:{name}] -->"
    text = path.read_text() if path.exists() else ""
    block = "\n".join([start, *body, end])
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text, count=1)
    else:
        text = text.rstrip("\n") + f"\n\n## {title}\n\n{block}\n"
    path.write_text(text)
