"""The pages that show README sections carry them as text, in step with the README.

GitHub and editors do not expand includes: a page that said ``--8<-- "README.md:setup"``
showed that line to its reader. Pages carry a copy instead (docs/hooks.py replaces it with the
README's current text when the site is built); ``python docs/hooks.py`` rewrites the copies.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").rglob("*.md"))


def hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("page", PAGES, ids=lambda path: path.relative_to(ROOT).as_posix())
def test_a_page_shows_readme_sections_as_text_a_markdown_reader_sees(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    hidden = re.findall(r'^[ \t]*--8<--[ \t]+"README\.md:[\w-]+"', text, re.MULTILINE)
    assert not hidden, f"{hidden}: shown as a literal line on GitHub; copy the section (see docs/hooks.py)"


def test_the_copies_of_readme_sections_are_the_readmes_text() -> None:
    refresh = hooks().refresh_readme_copies
    stale = [
        page.relative_to(ROOT).as_posix()
        for page in PAGES
        if refresh(text := page.read_text(encoding="utf-8"), page.relative_to(ROOT).as_posix()) != text
    ]
    assert not stale, f"{stale} differ from README.md: run python docs/hooks.py"


def test_the_getting_started_page_carries_the_quickstart() -> None:
    text = (ROOT / "docs" / "getting-started.md").read_text(encoding="utf-8")
    assert "<!-- README.md:quickstart -->" in text
    assert "from postgres_mutex import Mutex" in text
