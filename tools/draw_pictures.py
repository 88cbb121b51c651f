"""Draw the docs' pictures as SVG files in docs/pictures/: ``python tools/draw_pictures.py`` (``--check``).

The pictures are plain SVG, written by this script and committed, so the site needs no script,
font or service from elsewhere (it is built and read with no network), and a page shows its
picture on GitHub too. The bench's chart is drawn from docs/figures/bench.md: after a new run of
the bench, run this script again (tests/unit/test_pictures.py fails until the files match).
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from html import escape
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PICTURES = ROOT / "docs" / "pictures"
BENCH = ROOT / "docs" / "figures" / "bench.md"

HELD = "#2e9e5b"
SILENT = "#f0a020"
ALERT = "#d9342b"
WAITING = "#7a8699"
INK = "#1f2933"
MUTED = "#5f6b7a"
PAPER = "#ffffff"
FRAME = "#d5dbe3"
THIS = "#3b6fd8"
OTHER = "#9aa7b8"


@dataclass
class Svg:
    """One picture: shapes appended in drawing order, written with a white card behind them."""

    width: int
    height: int
    title: str
    parts: list[str] = field(default_factory=list)

    def text(
        self,
        x: float,
        y: float,
        words: str,
        *,
        size: int = 13,
        color: str = INK,
        anchor: str = "start",
        bold: bool = False,
    ) -> None:
        weight = ' font-weight="bold"' if bold else ""
        self.parts.append(
            f'<text x="{x:g}" y="{y:g}" font-size="{size}" fill="{color}" text-anchor="{anchor}"{weight}>'
            f"{escape(words)}</text>"
        )

    def bar(self, x1: float, x2: float, y: float, color: str, *, height: int = 14, dashed: bool = False) -> None:
        if dashed:
            self.parts.append(
                f'<line x1="{x1:g}" y1="{y:g}" x2="{x2:g}" y2="{y:g}" stroke="{color}" stroke-width="3" '
                'stroke-dasharray="6 5"/>'
            )
        else:
            self.parts.append(
                f'<rect x="{x1:g}" y="{y - height / 2:g}" width="{x2 - x1:g}" height="{height}" rx="3" fill="{color}"/>'
            )

    def line(self, x1: float, y1: float, x2: float, y2: float, *, color: str = MUTED, width: float = 1.5) -> None:
        self.parts.append(
            f'<line x1="{x1:g}" y1="{y1:g}" x2="{x2:g}" y2="{y2:g}" stroke="{color}" stroke-width="{width:g}"/>'
        )

    def arrow(self, x1: float, y1: float, x2: float, y2: float, *, color: str = INK) -> None:
        self.parts.append(
            f'<line x1="{x1:g}" y1="{y1:g}" x2="{x2:g}" y2="{y2:g}" stroke="{color}" stroke-width="1.8" '
            'marker-end="url(#head)"/>'
        )

    def dot(self, x: float, y: float, color: str, *, r: float = 5) -> None:
        self.parts.append(
            f'<circle cx="{x:g}" cy="{y:g}" r="{r:g}" fill="{color}" stroke="{PAPER}" stroke-width="1.5"/>'
        )

    def flag(self, x: float, y: float, color: str) -> None:
        """A warning triangle, for an alert."""
        self.parts.append(
            f'<path d="M{x:g} {y - 9:g} L{x + 9:g} {y + 7:g} L{x - 9:g} {y + 7:g} Z" fill="{color}"/>'
            f'<text x="{x:g}" y="{y + 5:g}" font-size="11" fill="{PAPER}" text-anchor="middle" '
            'font-weight="bold">!</text>'
        )

    def cross(self, x: float, y: float, color: str) -> None:
        self.line(x - 7, y - 7, x + 7, y + 7, color=color, width=3)
        self.line(x - 7, y + 7, x + 7, y - 7, color=color, width=3)

    def gap(self, x: float, y1: float, y2: float) -> None:
        """Where the time axis skips: two slanted strokes across it."""
        for dx in (-4, 4):
            self.line(x + dx - 4, y2 + 6, x + dx + 4, y2 - 6, color=MUTED)
        self.parts.append(
            f'<line x1="{x:g}" y1="{y1:g}" x2="{x:g}" y2="{y2:g}" stroke="{FRAME}" stroke-width="1" '
            'stroke-dasharray="2 4"/>'
        )

    def render(self) -> str:
        head = (
            f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {self.width} {self.height}" '
            f'width="{self.width}" height="{self.height}" role="img" '
            'font-family="system-ui, -apple-system, Segoe UI, Roboto, Helvetica, Arial, sans-serif">\n'
            f"<title>{escape(self.title)}</title>\n"
            '<defs><marker id="head" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
            f'orient="auto-start-reverse"><path d="M0 0 L10 5 L0 10 Z" fill="{INK}"/></marker></defs>\n'
            f'<rect x="0.5" y="0.5" width="{self.width - 1}" height="{self.height - 1}" rx="8" fill="{PAPER}" '
            f'stroke="{FRAME}"/>\n'
        )
        return head + "\n".join(self.parts) + "\n</svg>\n"


def legend(svg: Svg, x: float, y: float, entries: list[tuple[str, str, bool]]) -> None:
    for color, words, dashed in entries:
        svg.bar(x, x + 22, y, color, height=10, dashed=dashed)
        svg.text(x + 28, y + 4, words, size=12, color=MUTED)
        x += 40 + 6.6 * len(words)


def lanes(svg: Svg, names: list[tuple[float, str]]) -> None:
    for y, name in names:
        svg.text(16, y + 4, name, size=13, bold=True)


def lock_life() -> Svg:
    """Acquire, heartbeats, silence, the alert, the holder's lease running out, the reclaim."""
    svg = Svg(820, 300, "The lock's life: acquire, heartbeats, an alert at 30 s of silence, a reclaim at 10 min")
    a, watch, b, axis = 70, 130, 190, 240
    lanes(svg, [(a, "holder A"), (watch, "watcher"), (b, "waiter B")])
    svg.text(410, 28, "The lock's life, with the default thresholds", size=15, anchor="middle", bold=True)
    start, last, alert, lease, reclaim, end = 130, 360, 470, 640, 690, 800
    svg.bar(start, last, a, HELD)
    svg.bar(last, lease, a, SILENT)
    for x in range(start, last + 1, 46):
        svg.dot(x, a, INK, r=3.5)
    svg.text(start, a - 14, "acquires; a heartbeat every 10 s", size=12, color=MUTED)
    svg.text(last + 6, a - 14, "silent: slow, frozen or dead?", size=12, color=MUTED)
    svg.cross(lease, a, ALERT)
    svg.text(lease - 4, a + 26, "A's lease runs out (590 s): it knows it lost", size=12, color=MUTED, anchor="end")
    svg.bar(start, alert - 14, watch, FRAME, height=4)
    svg.flag(alert, watch, ALERT)
    svg.text(alert + 14, watch + 4, "alert: on-call can look before anything is taken", size=12, color=INK)
    svg.bar(start + 40, reclaim, b, WAITING, dashed=True)
    svg.text(start + 44, b - 12, "waits (woken by a release, or polls)", size=12, color=MUTED)
    svg.bar(reclaim, end - 10, b, HELD)
    svg.text(reclaim - 4, b + 24, "reclaims the row: a new, higher token", size=12, color=MUTED, anchor="end")
    svg.line(start - 10, axis, end, axis, color=INK)
    svg.gap(560, 44, axis)
    for x, label in ((start, "0"), (last, "T: last heartbeat"), (alert, "T + 30 s"), (reclaim, "T + 600 s")):
        svg.line(x, axis - 5, x, axis + 5, color=INK)
        svg.text(x, axis + 20, label, size=12, anchor="middle")
    legend(svg, 70, 284, [(HELD, "holds", False), (SILENT, "holds, silent", False), (WAITING, "waits", True)])
    return svg


def crashed_or_frozen() -> Svg:
    """The same silence, two causes: a dead process's session ends, a frozen one's does not."""
    svg = Svg(
        820, 310, "A crashed holder is reclaimed within seconds; a frozen one keeps its lock and its alert window"
    )
    svg.text(
        410,
        28,
        "Crashed or frozen: the holder's database session tells them apart",
        size=15,
        anchor="middle",
        bold=True,
    )
    crashed, frozen, axis = 86, 182, 250
    svg.text(16, crashed - 30, "crashed: the process died, its session ended", size=13, bold=True)
    svg.text(16, frozen - 30, "frozen: a GC or VM pause, its session stays up", size=13, bold=True)
    last, quick, alert, resume, end = 160, 250, 420, 520, 800
    svg.bar(60, last, crashed, HELD)
    svg.cross(last + 12, crashed, ALERT)
    svg.text(last + 24, crashed - 12, "session gone", size=12, color=MUTED)
    svg.bar(last + 24, quick, crashed, WAITING, dashed=True)
    svg.bar(quick, end - 10, crashed, THIS, height=10)
    svg.text(quick + 6, crashed + 24, "another process reclaims it: reclaim_disconnected_after (e.g. 5 s)", size=12)
    svg.bar(60, last, frozen, HELD)
    svg.bar(last, resume, frozen, SILENT)
    svg.flag(alert, frozen - 22, ALERT)
    svg.text(alert + 14, frozen - 18, "alert at 30 s", size=12)
    svg.bar(resume, end - 10, frozen, HELD)
    svg.text(resume + 6, frozen + 24, "wakes, heartbeats: still its lock", size=12)
    svg.text(60, frozen + 24, "nobody may take it before stale_threshold (600 s)", size=12, color=MUTED)
    svg.line(50, axis, end, axis, color=INK)
    for x, label in ((last, "last heartbeat"), (quick, "+ 5 s"), (alert, "+ 30 s"), (resume, "+ 40 s")):
        svg.line(x, axis - 5, x, axis + 5, color=INK)
        svg.text(x, axis + 20, label, size=12, anchor="middle")
    legend(svg, 60, 294, [(HELD, "holds", False), (SILENT, "holds, silent", False), (THIS, "the next holder", False)])
    return svg


def hand_off() -> Svg:
    """A release wakes one waiting process at once: no polling between holders."""
    svg = Svg(820, 260, "A hand-off: the release notifies one waiting process, whose waiter acquires at once")
    svg.text(410, 28, "A hand-off: one release, one notification, one acquire", size=15, anchor="middle", bold=True)
    a, db, b = 150, 380, 640
    for x, name in ((a, "holder A"), (db, "PostgreSQL: the lock table"), (b, "waiter B's process")):
        svg.text(x, 60, name, size=13, anchor="middle", bold=True)
        svg.line(x, 70, x, 240, color=FRAME, width=2)
    svg.parts.append(f'<rect x="{a - 5}" y="74" width="10" height="46" rx="3" fill="{HELD}"/>')
    svg.parts.append(f'<rect x="{b - 5}" y="74" width="10" height="76" rx="3" fill="{WAITING}" opacity="0.45"/>')
    svg.parts.append(f'<rect x="{b - 5}" y="206" width="10" height="34" rx="3" fill="{HELD}"/>')
    svg.arrow(a + 8, 120, db - 8, 120)
    svg.text((a + db) / 2 + 14, 112, "release: DELETE the row, pg_notify one waiter", size=12, anchor="middle")
    svg.arrow(db + 8, 150, b - 8, 150)
    svg.text((db + b) / 2, 142, "notification, on the process's listener", size=12, anchor="middle")
    svg.arrow(b - 8, 180, db + 8, 180)
    svg.text((db + b) / 2, 172, "the woken waiter's acquire: INSERT", size=12, anchor="middle")
    svg.arrow(db + 8, 206, b - 8, 206)
    svg.text((db + b) / 2, 222, "acquired", size=12, anchor="middle", color=MUTED)
    svg.text(b + 14, 226, "holds", size=12, color=MUTED)
    svg.text(b + 14, 100, "waits: no polling", size=12, color=MUTED)
    svg.text(
        16,
        252,
        "On a direct connection or session-mode PgBouncer; behind a transaction-mode pooler, waiters poll.",
        size=12,
        color=MUTED,
    )
    return svg


def fencing() -> Svg:
    """A frozen holder wakes after a reclaim: its fenced write is refused, the new holder's passes."""
    svg = Svg(820, 300, "Fencing: the late holder's write, fenced with its old token, is refused and rolled back")
    svg.text(410, 28, "Fencing: a holder that lost the lock cannot write", size=15, anchor="middle", bold=True)
    a, db, b = 150, 410, 670
    for x, name in ((a, "holder A"), (db, "the database: lock table and your data"), (b, "holder B")):
        svg.text(x, 60, name, size=13, anchor="middle", bold=True)
        svg.line(x, 70, x, 280, color=FRAME, width=2)
    svg.parts.append(f'<rect x="{a - 5}" y="76" width="10" height="30" rx="3" fill="{HELD}"/>')
    svg.parts.append(f'<rect x="{a - 5}" y="106" width="10" height="120" rx="3" fill="{SILENT}"/>')
    svg.text(a - 14, 96, "token 7", size=12, anchor="end")
    svg.text(a - 14, 170, "frozen past the", size=12, anchor="end", color=MUTED)
    svg.text(a - 14, 186, "stale threshold", size=12, anchor="end", color=MUTED)
    svg.arrow(b - 8, 130, db + 8, 130)
    svg.text((db + b) / 2, 122, "reclaims the stale row: token 8", size=12, anchor="middle")
    svg.parts.append(f'<rect x="{b - 5}" y="130" width="10" height="130" rx="3" fill="{THIS}"/>')
    svg.arrow(b - 8, 172, db + 8, 172)
    svg.text((db + b) / 2, 164, "fenced write with token 8: committed", size=12, anchor="middle")
    svg.dot(db, 172, HELD)
    svg.arrow(a + 8, 240, db - 8, 240)
    svg.text((a + db) / 2, 232, "wakes; fenced write with token 7", size=12, anchor="middle")
    svg.cross(db, 240, ALERT)
    svg.text(
        (a + db) / 2,
        266,
        "refused: LockNotHeldError, the transaction rolls back",
        size=12,
        color=ALERT,
        anchor="middle",
    )
    return svg


def _peers() -> list[tuple[str, float, float]]:
    """(lock, cycle median ms, hand-off p50 ms) per peer, from the bench's peers table."""
    text = BENCH.read_text(encoding="utf-8")
    section = text[text.index("[start:peers]") : text.index("[end:peers]")]
    rows = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        cycle = re.match(r"([\d.]+) ms", cells[2]) if len(cells) == 6 else None
        handoff = re.match(r"([\d.]+) ms", cells[3]) if len(cells) == 6 else None
        if cycle and handoff:
            rows.append((cells[0].replace("*", "").replace("`", ""), float(cycle[1]), float(handoff[1])))
    return rows


def bench_chart() -> Svg:
    """The peers' acquire + release and hand-off medians, as bars on a log scale, from docs/figures/bench.md."""
    import math

    peers = _peers()
    svg = Svg(820, 80 + 34 * len(peers), "Acquire + release and hand-off medians of each lock, from the bench's run")
    svg.text(
        410,
        28,
        "Measured beside the others (docs/figures/bench.md): lower is faster",
        size=15,
        anchor="middle",
        bold=True,
    )
    left, half = 250, 270
    top = 70
    svg.text(left, 54, "acquire + release, median", size=12, color=MUTED)
    svg.text(left + half + 20, 54, "hand-off to a blocked waiter, p50 (log scale)", size=12, color=MUTED)
    longest_cycle = max(cycle for _, cycle, _ in peers)
    longest_handoff = math.log10(max(handoff for _, _, handoff in peers) * 10)
    for index, (name, cycle, handoff) in enumerate(peers):
        y = top + 34 * index
        color = THIS if index == 0 else OTHER
        svg.text(left - 10, y + 4, name, size=12, anchor="end", bold=index == 0)
        width = (half - 80) * cycle / longest_cycle
        svg.bar(left, left + width, y, color, height=16)
        svg.text(left + width + 6, y + 4, f"{cycle:g} ms", size=12)
        start = left + half + 20
        width = (half - 80) * math.log10(handoff * 10) / longest_handoff
        svg.bar(start, start + width, y, color, height=16)
        svg.text(start + width + 6, y + 4, f"{handoff:g} ms", size=12)
    return svg


DEMO_RUN = {
    "worker-2": [("holds", 3.46, 4.24), ("crash", 4.24, 4.24)],
    "worker-3": [("waits", 3.50, 6.54), ("alert", 5.52, 5.52), ("holds", 6.54, 7.31), ("frozen", 7.31, 12.35)],
    "worker-1": [("waits", 3.52, 12.35), ("alert", 8.57, 8.57), ("holds", 12.35, 13.2)],
}
"""One run of ``postgres-mutex demo`` (seconds since it started), as its timeline printed them."""


def demo_timeline() -> Svg:
    """What ``postgres-mutex demo`` shows: a crash reclaimed in seconds, a freeze alerted and kept."""
    svg = Svg(820, 306, "The demo's timeline: a crashed holder reclaimed in seconds, a frozen one alerted and kept")
    svg.text(
        410,
        28,
        "postgres-mutex demo: three workers, one lock, a crash and a freeze",
        size=15,
        anchor="middle",
        bold=True,
    )
    first, last, left, right = 3.0, 13.2, 110, 800

    def x(seconds: float) -> float:
        return left + (right - left) * (seconds - first) / (last - first)

    for index, (worker, events) in enumerate(DEMO_RUN.items()):
        y = 70 + 55 * index
        svg.text(16, y + 4, worker, size=13, bold=True)
        for kind, start, end in events:
            if kind == "holds":
                svg.bar(x(start), x(end), y, HELD)
            elif kind == "frozen":
                svg.bar(x(start), x(end), y, SILENT)
                svg.text(x(start) + 6, y - 12, "frozen 5 s: keeps its session, and its lock", size=12, color=MUTED)
            elif kind == "waits":
                svg.bar(x(start), x(end), y, WAITING, dashed=True)
            elif kind == "crash":
                svg.cross(x(start) + 8, y, ALERT)
                svg.text(x(start) + 22, y + 4, "killed (SIGKILL) mid-job", size=12, color=MUTED)
            elif kind == "alert":
                svg.flag(x(start), y - 16, ALERT)
    svg.text(x(6.54), 70 + 55 + 22, "reclaimed 2.3 s after the crash: its session had ended", size=12)
    svg.text(x(8.57) + 12, 70 + 110 - 12, "alert after 1.5 s of silence", size=12)
    svg.text(x(12.35) - 6, 70 + 110 + 24, "the resumed holder finishes and hands over", size=12, anchor="end")
    axis = 250
    svg.line(left - 10, axis, right, axis, color=INK)
    for second in range(4, 14, 2):
        svg.line(x(second), axis - 5, x(second), axis + 5, color=INK)
        svg.text(x(second), axis + 20, f"{second} s", size=12, anchor="middle")
    legend(svg, 110, 292, [(HELD, "holds", False), (SILENT, "frozen", False), (WAITING, "waits", True)])
    return svg


PICTURES_DRAWN = {
    "demo-timeline.svg": demo_timeline,
    "lock-life.svg": lock_life,
    "crashed-or-frozen.svg": crashed_or_frozen,
    "hand-off.svg": hand_off,
    "fencing.svg": fencing,
    "bench-peers.svg": bench_chart,
}
"""Every picture: its file under docs/pictures/, and what draws it."""


def drawn() -> dict[Path, str]:
    return {PICTURES / name: draw().render() for name, draw in PICTURES_DRAWN.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/draw_pictures.py", description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if a picture differs from what this script draws")
    args = parser.parse_args(argv)
    stale = [path for path, svg in drawn().items() if not path.exists() or path.read_text(encoding="utf-8") != svg]
    if args.check:
        for path in stale:
            print(f"{path.relative_to(ROOT)} is not what tools/draw_pictures.py draws: run it", file=sys.stderr)
        return 1 if stale else 0
    PICTURES.mkdir(parents=True, exist_ok=True)
    for path, svg in drawn().items():
        path.write_text(svg, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
