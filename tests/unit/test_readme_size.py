"""The README is a landing page: it fits in 16 KB, and the detail lives on the docs site."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"

LIMIT = 16 * 1024


def test_the_readme_fits_in_16_kb() -> None:
    size = len(README.read_bytes())
    assert size < LIMIT, f"README.md is {size} bytes, over {LIMIT}: move detail to a page of docs/ and link to it"
