"""MkDocs hooks for the documentation site (mkdocs.yml ``hooks:``); nothing here is a page.

- A page shows a section of the README (between ``<!-- --8<-- [start:SECTION] -->``
  and ``<!-- --8<-- [end:SECTION] -->``) as a copy between ``<!-- README.md:SECTION -->``
  and ``<!-- end of README.md:SECTION -->``, with its links into ``docs/`` made
  relative to the page: readable as Markdown (on GitHub, in an editor), and replaced
  by the README's current text at build time, so the README and the site share one
  text. ``python docs/hooks.py`` rewrites the copies after the README changed
  (tests/unit/test_readme_copies.py fails until then). ``--8<-- "README.md:SECTION"``
  still includes a section unseen; other files are included by pymdownx.snippets.
- ``<!-- cli-help: SUBCOMMAND -->`` becomes the output of ``postgres-mutex
  SUBCOMMAND --help`` (empty SUBCOMMAND: the top-level help), so the command-line
  reference is the parser's own text.
- After the build, every public name of the package must be in the API reference
  (mkdocstrings' objects.inv); a missing one is a warning, which fails a strict build.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import logging
import os
import posixpath
import re
import zlib
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.hooks.postgres_mutex")

ROOT = Path(__file__).resolve().parent.parent

PUBLIC_MODULES = (
    "postgres_mutex",
    "postgres_mutex.errors",
    "postgres_mutex.watcher",
    "postgres_mutex.prometheus",
    "postgres_mutex.otel",
    "postgres_mutex.metric_names",
)
"""Modules whose public names the API reference must cover: ``__all__``, else every public name defined there."""

_README_INCLUDE = re.compile(r'^(?P<indent>[ \t]*)--8<--[ \t]+"README\.md:(?P<section>[\w-]+)"[ \t]*$', re.MULTILINE)
_README_COPY = re.compile(
    r"^(?P<indent>[ \t]*)<!-- README\.md:(?P<section>[\w-]+) -->\n(?:.*?\n)??"
    r"(?P=indent)<!-- end of README\.md:(?P=section) -->[ \t]*$",
    re.MULTILINE | re.DOTALL,
)
_SECTION = re.compile(r"--8<--\s+\[(?P<edge>start|end):(?P<name>[\w-]+)\]")
_LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")
_CLI_HELP = re.compile(r"^<!--[ \t]*cli-help:[ \t]*(?P<command>[\w-]*)[ \t]*-->[ \t]*$", re.MULTILINE)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    page_dir = posixpath.dirname("docs/" + page.file.src_uri)
    markdown = _README_COPY.sub(lambda found: _readme_section(found["section"], page_dir, found["indent"]), markdown)
    markdown = _README_INCLUDE.sub(lambda found: _readme_section(found["section"], page_dir, found["indent"]), markdown)
    return _CLI_HELP.sub(lambda found: _cli_help(found["command"]), markdown)


def refresh_readme_copies(markdown: str, page: str) -> str:
    """``markdown`` (of ``page``, a path such as ``docs/index.md``) with its README copies as the README has them."""
    page_dir = posixpath.dirname(page)

    def copy(found: re.Match[str]) -> str:
        indent, section = found["indent"], found["section"]
        body = _readme_section(section, page_dir, indent)
        return f"{indent}<!-- README.md:{section} -->\n{body}\n{indent}<!-- end of README.md:{section} -->"

    return _README_COPY.sub(copy, markdown)


def _readme_section(name: str, page_dir: str, indent: str) -> str:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    edges = [index for index, line in enumerate(lines) if (found := _SECTION.search(line)) and found["name"] == name]
    if len(edges) != 2:
        log.warning("README.md has no section %r (start and end markers) to include", name)
        return ""

    def relink(found: re.Match[str]) -> str:
        target = found["target"]
        if re.match(r"[a-z]+:|#", target):
            return found[0]
        if not target.startswith("docs/"):
            log.warning("README.md section %r links to %s, outside docs/: the site cannot follow it", name, target)
            return found[0]
        return f"]({posixpath.relpath(target, page_dir)})"

    text = "\n".join(indent + line for line in lines[edges[0] + 1 : edges[1]])
    return _LINK.sub(relink, text)


def _cli_help(command: str) -> str:
    from postgres_mutex.cli import main

    out = io.StringIO()
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal: the same width on every machine
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            main([*([command] if command else []), "--help"])
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous
    return "```text\n$ postgres-mutex " + (command + " " if command else "") + "--help\n" + out.getvalue() + "```"


def public_names() -> list[tuple[str, str, str | None]]:
    """(module, name, the object's own path if it has one) for every name the reference must show."""
    names: list[tuple[str, str, str | None]] = []
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        exported = getattr(module, "__all__", None)
        if exported is None:
            exported = [
                name
                for name, value in vars(module).items()
                if not name.startswith("_")
                and not inspect.ismodule(value)
                and getattr(value, "__module__", module_name) == module_name
            ]
        for name in exported:
            if name.startswith("__"):
                continue
            value = getattr(module, name)
            own = getattr(value, "__module__", None)
            qualname = getattr(value, "__qualname__", None)
            names.append((module_name, name, f"{own}.{qualname}" if own and qualname else None))
    return names


def _inventory(site_dir: Path) -> set[str]:
    data = (site_dir / "objects.inv").read_bytes()
    body = data.split(b"\n", 4)[4]  # four header lines, then zlib
    return {line.split(" ", 1)[0] for line in zlib.decompress(body).decode().splitlines() if line}


def on_post_build(config: Any) -> None:
    documented = _inventory(Path(config["site_dir"]))
    missing = [
        f"{module}.{name}"
        for module, name, own in public_names()
        if f"{module}.{name}" not in documented and own not in documented
    ]
    if missing:
        log.warning("the API reference (docs/reference/) lacks public names: %s", ", ".join(missing))


if __name__ == "__main__":
    # Rewrite every page's copies of README sections after the README changed.
    for path in sorted((ROOT / "docs").rglob("*.md")):
        text = path.read_text(encoding="utf-8")
        refreshed = refresh_readme_copies(text, path.relative_to(ROOT).as_posix())
        if refreshed != text:
            path.write_text(refreshed, encoding="utf-8")
            print(f"rewrote the README copies in {path.relative_to(ROOT)}")
