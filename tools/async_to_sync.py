"""Generate each sync module (``_io/engine.py`` ...) from its async twin (``_io/engine_async.py`` ...).

Every ``_X_async.py`` module of the package has its sync twin ``_X.py``
generated (`PAIRS`): the engine and its parts, `LockTable`'s methods, what a
holder does with the database, the Mutex's decorators, what its closing does
with the lock, an RWLock's methods, and an Election's run, close and reads of
its leader.

The async module is the one written by hand; the sync one is derived from it
token by token, so the two cannot drift apart:

- the ``async`` and ``await`` keywords are dropped;
- names are renamed: ``AsyncFoo`` becomes ``Foo`` (psycopg's classes and
  ours), ``foo_async`` becomes ``foo``, and the paired primitives of
  ``_base/acompat.py`` take their sync twin's name (`RENAMES`);
- a line ending in a ``# sync: <code>`` comment is replaced by ``<code>``,
  for the rare place where the two genuinely differ;
- lines between ``# async-only`` and ``# end async-only`` are dropped, and
  lines between ``# sync-only`` and ``# end sync-only`` (comments in the
  async module, each ``# `` followed by the sync text) are uncommented:
  for code, or a docstring, that only one flavour has. The code of a
  ``# sync:`` directive and a sync-only line are the sync text as written:
  nothing in them is renamed;
- in comments and docstrings, names are renamed as in the code (so
  `AsyncAcquisition` and ``fence_async()`` read `Acquisition` and
  ``fence()``), and the phrases of `TEXT_RENAMES` are replaced.

Layout is kept; ``ruff format`` then settles it. Beyond its two-line
header, a generated module may not speak of async code in its comments and
docstrings (`ASYNC_WORDS`): the generator fails, naming the line, if one
does. ``--check`` exits 1 if the committed file is not what this generates
(CI runs it).

    python tools/async_to_sync.py          # rewrite the generated modules
    python tools/async_to_sync.py --check  # fail if it is out of date
"""

from __future__ import annotations

import argparse
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "postgres_mutex"
PAIRS = sorted(
    (source, source.with_name(source.name.removesuffix("_async.py") + ".py")) for source in PACKAGE.rglob("*_async.py")
)
"""Every hand-written ``{part}_async.py`` of the package's tree and its generated twin ``{part}.py`` beside it."""

RENAMES = {
    "ACancelled": "Cancelled",
    "AEvent": "Event",
    "AGate": "Gate",
    "AWorker": "Worker",
    "AWaker": "Waker",
    "AReader": "Reader",
    "asleep": "sleep",
    "auncancellable": "uncancellable",
    "ato_the_end": "to_the_end",
    "asynccontextmanager": "contextmanager",
    "AbstractAsyncContextManager": "AbstractContextManager",
    "__aenter__": "__enter__",
    "__aexit__": "__exit__",
    "aclose": "close",
    "enter_async_context": "enter_context",
    "_engine_async": "_engine",
}

TEXT_RENAMES = {
    "``async with``": "``with``",
    "``async for``": "``for``",
    "``async with ": "``with ",
    "``async for ": "``for ",
}

ASYNC_WORDS = re.compile(r"\b(async|await|awaits|awaited|asyncio|coroutines?|tasks?)\b|event loops?", re.IGNORECASE)
"""What a generated module's comments and docstrings may not say."""

_ASYNC_CLASS = re.compile(r"Async([A-Z]\w*)")
_WORD = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*\b")
_SYNC_DIRECTIVE = re.compile(r"^(?P<indent>\s*).*#\s*sync:\s*(?P<code>.*?)\s*$")

HEADER = (
    "# Generated from {source} by tools/async_to_sync.py: do not edit.\n"
    "# Change the async module and run `python tools/async_to_sync.py`.\n"
)


def rename(name: str) -> str:
    if name in RENAMES:
        return RENAMES[name]
    if match := _ASYNC_CLASS.fullmatch(name):
        return match.group(1)
    if name.endswith("_async") and len(name) > len("_async"):
        return name.removesuffix("_async")
    return name


def flavour_blocks(source: str) -> list[str]:
    """The lines of the sync module: async-only blocks dropped, sync-only ones uncommented."""
    return [line for line, _ in _flavoured_lines(source)]


def _flavoured_lines(source: str) -> list[tuple[str, bool]]:
    """`flavour_blocks`'s lines, each with whether it is sync text already (a sync-only line, a ``# sync:``
    directive's code): such a line is taken as written, never renamed."""
    lines: list[tuple[str, bool]] = []
    block: str | None = None
    for line in source.splitlines(keepends=True):
        marker = line.strip()
        if marker in ("# async-only", "# sync-only") and block is None:
            block = marker[2:]
            continue
        if marker in ("# end async-only", "# end sync-only"):
            if block != marker[6:]:
                raise SyntaxError(f"{marker!r} closes no {marker[6:]} block")
            block = None
            continue
        if block == "async-only":
            continue
        if block == "sync-only":
            indent = line[: len(line) - len(line.lstrip())]
            body = line.lstrip()
            if not body.startswith("#"):
                raise SyntaxError(f"a sync-only line must be a comment: {line.strip()!r}")
            line = indent + body[1:].removeprefix(" ") if body.strip() != "#" else "\n"
            lines.append((line, True))
            continue
        if directive := _SYNC_DIRECTIVE.match(line):
            lines.append((f"{directive['indent']}{directive['code']}\n", True))
            continue
        lines.append((line, False))
    if block is not None:
        raise SyntaxError(f"a {block} block is not closed")
    return lines


def rename_text(text: str) -> str:
    """A comment or a docstring as the sync module says it."""
    for phrase, replacement in TEXT_RENAMES.items():
        text = text.replace(phrase, replacement)
    return _WORD.sub(lambda word: rename(word.group()), text)


def _text_edits(token: tokenize.TokenInfo) -> list[tuple[int, int, int, str]]:
    """The renames inside a comment or a string, row by row (a docstring spans several)."""
    edits = []
    (first, start), (last, end) = token.start, token.end
    rows = token.line.splitlines(keepends=True) if first != last else [token.line]
    for offset, line in enumerate(rows):
        row = first + offset
        begin = start if row == first else 0
        stop = end if row == last else len(line.rstrip("\n"))
        segment = line[begin:stop]
        renamed = rename_text(segment)
        if renamed != segment:
            edits.append((row, begin, stop, renamed))
    return edits


def async_words(code: str) -> list[str]:
    """Where a generated module's comments and docstrings still speak of async code (its header aside)."""
    found = []
    for token in tokenize.generate_tokens(io.StringIO(code).readline):
        if token.type in (tokenize.COMMENT, tokenize.STRING) and token.start[0] > len(HEADER.splitlines()):
            for offset, line in enumerate(token.string.splitlines()):
                if ASYNC_WORDS.search(line):
                    found.append(f"{token.start[0] + offset}: {line.strip()}")
    return found


def convert(source: str, source_name: str) -> str:
    flavoured = _flavoured_lines(source)
    text = "".join(line for line, _ in flavoured)
    as_written = {row for row, (_, verbatim) in enumerate(flavoured, start=1) if verbatim}

    # Edits as (row, start column, end column, replacement), applied right to left.
    edits: list[tuple[int, int, int, str]] = []
    tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    for index, token in enumerate(tokens):
        if token.type in (tokenize.COMMENT, tokenize.STRING):
            edits.extend(_text_edits(token))
            continue
        if token.type != tokenize.NAME:
            continue
        (row, col), (_, end) = token.start, token.end
        if token.string in ("async", "await"):
            following = tokens[index + 1] if index + 1 < len(tokens) else None
            # Drop the keyword and the blank that follows it on the same line.
            if following is not None and following.start[0] == row:
                end = following.start[1]
            edits.append((row, col, end, ""))
            continue
        renamed = rename(token.string)
        if renamed != token.string:
            edits.append((row, col, end, renamed))

    rows = text.splitlines(keepends=True)
    for row, start, end, replacement in sorted(edits, reverse=True):
        if row in as_written:
            continue
        line = rows[row - 1]
        rows[row - 1] = line[:start] + replacement + line[end:]
    header = HEADER.format(source=source_name)
    return header + "".join(rows)


def formatted(code: str, path: Path) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--stdin-filename", str(path), "-"],
        input=code,
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    fixed = subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            "check",
            "--fix-only",
            "--quiet",
            "--select",
            "I,F401",
            "--stdin-filename",
            str(path),
            "-",
        ],
        input=result.stdout,
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    return fixed.stdout or result.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a generated module is out of date")
    args = parser.parse_args()
    stale = []
    for source, target in PAIRS:
        generated = formatted(convert(source.read_text(), source.name), target)
        if leftovers := async_words(generated):
            for leftover in leftovers:
                print(f"{target.relative_to(ROOT)}:{leftover}", file=sys.stderr)
            print(
                f"say it for both flavours in {source.relative_to(ROOT)} (see this tool's docstring)", file=sys.stderr
            )
            return 1
        if args.check:
            if not target.exists() or target.read_text() != generated:
                stale.append(target)
        else:
            target.write_text(generated)
    if stale:
        for target in stale:
            print(f"{target.relative_to(ROOT)} is out of date: run python tools/async_to_sync.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
