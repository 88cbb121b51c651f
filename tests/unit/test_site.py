"""The docs site builds strictly, needs nothing from the network, and its pictures render in a browser.

The site is built once for the module (a few seconds) into a temporary directory. The pictures
are SVG files drawn by tools/draw_pictures.py; a page with one is opened in headless Chromium
(Debian's ``chromium``, which .ci/run installs, or Chrome) from a file:// URL with networking off, and the
screenshot must show the picture's colours, not a blank or a broken image.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.fixtures import skip_or_fail_in_ci

ROOT = Path(__file__).resolve().parents[2]
BROWSERS = ("chromium", "google-chrome", "chromium-browser")
"""Debian's package (which .ci/run installs), else the Chrome a GitHub runner has."""


def _load_draw_pictures() -> ModuleType:
    spec = importlib.util.spec_from_file_location("draw_pictures", ROOT / "tools" / "draw_pictures.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


draw_pictures = _load_draw_pictures()


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    built = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(built)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stderr[-4000:]}"
    return built


def test_the_pictures_are_what_the_script_draws() -> None:
    assert draw_pictures.main(["--check"]) == 0, "run python tools/draw_pictures.py and commit docs/pictures/"


def test_the_site_loads_no_script_style_or_font_from_elsewhere(site: Path) -> None:
    remote = re.compile(r"<(?:script|link)\b[^>]*\b(?:src|href)=\"(?:https?:)?//", re.IGNORECASE)
    pages = sorted(site.rglob("*.html"))
    assert pages
    fetching = [page.relative_to(site).as_posix() for page in pages if remote.search(page.read_text(encoding="utf-8"))]
    assert not fetching, f"pages that fetch from the network (the site is built and read offline): {fetching[:5]}"


def test_a_page_with_a_picture_renders_it_in_headless_chromium_with_no_network(site: Path, tmp_path: Path) -> None:
    image = pytest.importorskip("PIL.Image", reason="Pillow reads the screenshot (the dev extra installs it)")
    browser = next(filter(None, map(shutil.which, BROWSERS)), None)
    if browser is None:
        skip_or_fail_in_ci("no headless browser: apt-get install chromium")
    page = site / "concepts" / "thresholds" / "index.html"
    assert 'src="../../pictures/lock-life.svg"' in page.read_text(encoding="utf-8")
    shot = tmp_path / "page.png"
    subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            # Anything the page tried to fetch from elsewhere goes to a port nobody listens on.
            "--proxy-server=127.0.0.1:9",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--hide-scrollbars",
            "--window-size=1280,1200",
            f"--screenshot={shot}",
            page.as_uri(),
        ],
        capture_output=True,
        timeout=90,
        check=False,
    )
    assert shot.exists(), "Chromium wrote no screenshot"
    with image.open(shot) as opened:
        data = opened.convert("RGB").tobytes()
    pixels = [(data[index], data[index + 1], data[index + 2]) for index in range(0, len(data), 3)]

    def near(color: str) -> int:
        want = tuple(int(color[index : index + 2], 16) for index in (1, 3, 5))
        return sum(1 for pixel in pixels if all(abs(a - b) <= 12 for a, b in zip(pixel, want, strict=True)))

    assert len(set(pixels)) > 100, "the screenshot is blank"
    # The lock's life draws holds in green and silence in amber: colours the theme itself never uses.
    assert near(draw_pictures.HELD) > 1000, "the picture's holds are not on the screen"
    assert near(draw_pictures.SILENT) > 1000, "the picture's silence is not on the screen"
