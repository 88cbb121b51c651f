"""The examples of README.md and docs/: found, classified, and run (see docs/development.md).

Every fenced block of a page names its language. Python and shell blocks are
examples: each runs unless an HTML comment just before it says otherwise
(``<!-- example: no-run reason="..." -->``). YAML blocks are parsed. Blocks in
any other language (``text``, ``sql``, ...) are prose. Files a page includes
with pymdownx.snippets (``--8<-- "path"`` or ``--8<-- "path:section"``) are
expanded first, so a page's examples are what its reader sees.

Run as ``python -m tests.support.doc_examples`` it is the interpreter of one page's
Python examples: a JSON list of blocks on stdin, run in order in one
namespace (see `run_python_page`).
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import inspect
import json
import re
import shlex
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

LANGUAGES = {
    "python": "python",
    "py": "python",
    "bash": "shell",
    "sh": "shell",
    "shell": "shell",
    "console": "shell",
    "yaml": "yaml",
    "yml": "yaml",
}
"""Fence languages the runner acts on; any other language is prose."""

OPTIONS = {
    "python": {"needs"},
    "shell": {"needs", "exit", "stop-after"},
    "yaml": set(),
}
"""What a run marker may say, by language (see docs/development.md)."""

# --8<-- [start:substitutions]
SUBSTITUTIONS = {
    # placeholder in an example            what the suite runs instead
    "postgres://user:pass@host:5432/dbname?sslmode=require": "{dsn}",
    "postgres://user:pass@host/db": "{dsn}",
    "postgres://...": "{dsn}",
    "9464": "{port}",
}
# --8<-- [end:substitutions]
"""Placeholders replaced in the text of every example before it runs, longest first.

``{dsn}`` is the suite's PostgreSQL, as a URL whose ``search_path`` is a
schema of the examples' own; ``{port}`` is a free TCP port on 127.0.0.1.
"""

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`]*?)[ \t]*$")
_INCLUDE = re.compile(r"^(?P<indent>[ \t]*)--8<--[ \t]+\"(?P<target>[^\"]+)\"[ \t]*$")
_SECTION = re.compile(r"--8<--\s+\[(?P<edge>start|end):(?P<name>[\w-]+)\]")
_MARKER = re.compile(r"^[ \t]*<!--[ \t]*example:(?P<body>.*?)(?P<close>-->)?[ \t]*$")


@dataclass(frozen=True)
class Origin:
    """Where a line comes from: a file relative to the repository, and its line number."""

    path: str
    line: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass
class Block:
    """One fenced block of a page, as the runner sees it."""

    page: str
    origin: Origin
    """The block's first code line."""
    language: str
    """``python``, ``shell`` or ``yaml`` (see `LANGUAGES`)."""
    code: str
    run: bool = True
    reason: str = ""
    """Why a ``no-run`` block does not run."""
    options: dict[str, str] = field(default_factory=dict)
    setup: str = ""
    """Hidden code run just before this block (``<!-- example: setup``)."""
    setup_origin: Origin | None = None

    @property
    def needs(self) -> list[str]:
        return self.options["needs"].split(",") if "needs" in self.options else []

    def id(self) -> str:
        return f"{self.page}:{self.origin.line}" if self.origin.path == self.page else f"{self.page}:{self.origin}"


@dataclass
class Page:
    path: str
    blocks: list[Block] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def examples(self, language: str) -> list[Block]:
        return [block for block in self.blocks if block.language == language and block.run]

    @property
    def needs(self) -> list[str]:
        """What the page's Python examples need: they share one interpreter."""
        return sorted({need for block in self.examples("python") for need in block.needs})


def page_paths(root: Path = ROOT) -> list[Path]:
    """README.md and every page of the docs site (docs/figures holds included tables, not pages)."""
    pages = [root / "README.md"]
    pages += sorted(path for path in (root / "docs").rglob("*.md") if "figures" not in path.relative_to(root).parts)
    return pages


def load_pages(root: Path = ROOT) -> list[Page]:
    return [parse_page(path.relative_to(root).as_posix(), root) for path in page_paths(root)]


def expand(path: str, root: Path, problems: list[str], seen: tuple[str, ...] = ()) -> list[tuple[str, Origin]]:
    """The lines of ``path`` with snippets includes expanded, each with where it came from."""
    file, _, section = path.partition(":")
    try:
        text = (root / file).read_text(encoding="utf-8")
    except OSError as exc:
        problems.append(f"{' -> '.join(seen) or path}: cannot include {file}: {exc.strerror}")
        return []
    lines = [(line, Origin(file, number)) for number, line in enumerate(text.splitlines(), 1)]
    if section:
        inside = [
            index
            for index, (line, _) in enumerate(lines)
            if (found := _SECTION.search(line)) and found["name"] == section
        ]
        if len(inside) != 2:
            problems.append(f"{seen[-1] if seen else path}: {file} has no section {section!r} (start and end)")
            return []
        lines = lines[inside[0] + 1 : inside[1]]
    result: list[tuple[str, Origin]] = []
    for line, origin in lines:
        include = _INCLUDE.match(line)
        if include is None:
            if not (seen and _SECTION.search(line)):  # an included file's section markers are not shown
                result.append((line, origin))
            continue
        target = include["target"]
        if target in seen or len(seen) > 5:
            problems.append(f"{origin}: include loop through {target}")
            continue
        result += [(include["indent"] + text, where) for text, where in expand(target, root, problems, (*seen, path))]
    return result


def parse_marker(body: str) -> tuple[str, dict[str, str]]:
    """``no-run reason="..."`` -> ("no-run", {"reason": "..."}); the kind defaults to ``run``."""
    words = shlex.split(body)
    kind = "run"
    if words and "=" not in words[0]:
        kind, words = words[0], words[1:]
    options: dict[str, str] = {}
    for word in words:
        key, equals, value = word.partition("=")
        if not equals:
            raise ValueError(f"expected key=value, got {word!r}")
        options[key] = value
    return kind, options


def parse_page(path: str, root: Path = ROOT) -> Page:
    """Find a page's fenced blocks and the example markers before them."""
    page = Page(path)
    lines = expand(path, root, page.problems)
    marker: tuple[Origin, str, dict[str, str]] | None = None
    setup: tuple[Origin, str] | None = None
    index = 0

    def pending_problem(why: str) -> None:
        for found in (marker, setup):
            if found is not None:
                page.problems.append(f"{found[0]}: this example marker {why}")

    while index < len(lines):
        line, origin = lines[index]
        index += 1
        comment = _MARKER.match(line)
        if comment is not None:
            if comment["close"] is None:  # a setup block: code until the line holding -->
                kind, _ = parse_marker(comment["body"]) if comment["body"].strip() else ("", {})
                code: list[str] = []
                while index < len(lines) and "-->" not in lines[index][0]:
                    code.append(lines[index][0])
                    index += 1
                index += 1
                if kind != "setup" or setup is not None:
                    page.problems.append(f"{origin}: only '<!-- example: setup' may span lines, once per block")
                    continue
                setup = (Origin(origin.path, origin.line + 1), "\n".join(code))
                continue
            try:
                kind, options = parse_marker(comment["body"])
            except ValueError as exc:
                page.problems.append(f"{origin}: unreadable example marker: {exc}")
                continue
            if kind not in ("run", "no-run") or marker is not None:
                page.problems.append(f"{origin}: expected one 'example: [run|no-run] key=value...' before a block")
                continue
            marker = (origin, kind, options)
            continue
        if line.lstrip().startswith("<!--"):
            while "-->" not in line and index < len(lines):  # a comment of its own: nothing in it is shown
                line = lines[index][0]
                index += 1
            continue
        fence = _FENCE.match(line)
        if fence is None:
            if line.strip() and (marker or setup):
                pending_problem("is not followed by a fenced block")
                marker = setup = None
            continue
        body: list[str] = []
        indent = len(fence["indent"])
        closing = re.compile(rf"^[ \t]*{re.escape(fence['fence'][0])}{{{len(fence['fence'])},}}[ \t]*$")
        while index < len(lines) and not closing.match(lines[index][0]):
            text = lines[index][0]
            body.append(text[indent:] if text[:indent].strip() == "" else text.lstrip())
            index += 1
        index += 1
        info = fence["info"].strip().lstrip("{").lstrip(".").split()
        if not info:
            page.problems.append(f"{origin}: name the block's language (```text for plain text)")
            marker = setup = None
            continue
        language = LANGUAGES.get(info[0].lower())
        if language is None:
            if marker or setup:
                pending_problem(f"stands before a {info[0]} block, which is never run")
            marker = setup = None
            continue
        source = "\n".join(body)
        if info[0].lower() == "console":
            source = "\n".join(text[2:] for text in body if text.startswith("$ "))
            if not source:
                page.problems.append(f"{origin}: a console block runs its '$ ' lines, and this one has none")
        block = Block(page.path, Origin(origin.path, origin.line + 1), language, source)
        if setup is not None:
            block.setup_origin, block.setup = setup
        if marker is not None:
            where, kind, options = marker
            if kind == "no-run":
                block.run = False
                block.reason = options.pop("reason", "").strip()
                if not block.reason:
                    page.problems.append(f'{where}: a no-run example needs reason="why it cannot run here"')
                if options or setup is not None:
                    page.problems.append(f"{where}: a no-run example takes only a reason, and no setup")
            else:
                unknown = set(options) - OPTIONS[language]
                if unknown:
                    page.problems.append(
                        f"{where}: {language} examples take {sorted(OPTIONS[language])}, not {unknown}"
                    )
                block.options = options
        for key in ("exit", "stop-after"):
            if key in block.options and not re.fullmatch(r"\d+(\.\d+)?", block.options[key]):
                page.problems.append(f"{block.origin}: {key}= takes a number")
        page.blocks.append(block)
        marker = setup = None
    if marker or setup:
        pending_problem("is not followed by a fenced block")
    return page


def substitute(text: str, values: dict[str, str]) -> str:
    """Replace `SUBSTITUTIONS`' placeholders, longest first, with ``values``."""
    for placeholder in sorted(SUBSTITUTIONS, key=len, reverse=True):
        text = text.replace(placeholder, SUBSTITUTIONS[placeholder].format(**values))
    return text


# -- the interpreter of one page's Python examples ----------------------------------


def _compile(code: str, origin: Origin) -> Any:
    # Blank lines first, and the file's full path, so a traceback names and quotes the markdown line.
    source = "\n" * (origin.line - 1) + code
    filename = str(ROOT / origin.path)
    return compile(source, filename, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)


def run_python_page(parts: list[tuple[str, Origin]], prelude: dict[str, Any]) -> None:
    """Run code in order in one namespace, top-level ``await`` allowed, on one event loop.

    At the end, close what the page left open (as an application would before
    exiting): Mutexes, watchers and pools, the latest first.
    """
    namespace: dict[str, Any] = {"__name__": "__main__", **prelude}
    with asyncio.Runner() as loop:
        try:
            for code, origin in parts:
                result = eval(_compile(code, origin), namespace)  # noqa: S307 - the docs' own examples
                if inspect.iscoroutine(result):
                    loop.run(result)
        finally:
            for closer in _closers(namespace):
                with contextlib.suppress(Exception):
                    result = closer()
                    if inspect.iscoroutine(result):
                        loop.run(result)


def python_parts(blocks: list[Block], values: dict[str, str]) -> list[tuple[str, Origin]]:
    """A page's Python examples, setup code first, placeholders substituted."""
    parts: list[tuple[str, Origin]] = []
    for block in blocks:
        if block.setup and block.setup_origin is not None:
            parts.append((substitute(block.setup, values), block.setup_origin))
        parts.append((substitute(block.code, values), block.origin))
    return parts


def _closers(namespace: dict[str, Any]) -> Iterator[Callable[[], object]]:
    from psycopg_pool import AsyncConnectionPool, ConnectionPool

    from postgres_mutex import Mutex
    from postgres_mutex.watcher import StaleWatcher

    for value in reversed(list(namespace.values())):
        if isinstance(value, Mutex | StaleWatcher):
            yield value.aclose
            yield value.close
        elif isinstance(value, ConnectionPool | AsyncConnectionPool):
            yield value.close


def main() -> None:
    from tests.support import doc_prelude

    parts = [(code, Origin(path, line)) for code, path, line in json.load(sys.stdin)]
    run_python_page(parts, {name: getattr(doc_prelude, name) for name in doc_prelude.__all__})


if __name__ == "__main__":
    main()
