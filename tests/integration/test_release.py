"""The release as a user installs it: `python -m build`'s sdist and wheel, in a clean virtual environment.

PyPI has only 0.1.0 until this version is published, so the README tells users to build the
wheel themselves: what they get must install with its ``[binary]`` extra (pip reaches PyPI for
the dependencies), put the ``postgres-mutex`` command on the PATH, run the README's Quickstart
against a real server and the demo on it. The sdist carries what a packager needs (the licence,
the README, the typing marker) and none of what a test run leaves behind.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from postgres_mutex import __version__
from tests.support.doc_examples import ROOT, parse_page, substitute
from tests.support.postgres_server import PostgresServer

BUILD_TIMEOUT = 180
"""Seconds for building, creating the environment and installing into it (pip fetches psycopg's wheel)."""


def run(*command: str | Path, timeout: float = BUILD_TIMEOUT, cwd: Path | None = None) -> str:
    done = subprocess.run(
        [str(part) for part in command], capture_output=True, text=True, timeout=timeout, check=False, cwd=cwd
    )
    assert done.returncode == 0, f"{' '.join(map(str, command))} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    run(sys.executable, "-m", "build", "--outdir", out, ROOT)
    return out


@pytest.fixture(scope="module")
def installed(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with the built wheel and its ``[binary]`` extra: its bin/ directory."""
    venv = tmp_path_factory.mktemp("venv")
    run(sys.executable, "-m", "venv", venv)
    (wheel,) = dist.glob("*.whl")
    run(venv / "bin" / "python", "-m", "pip", "install", "--quiet", f"{wheel}[binary]")
    return venv / "bin"


def test_the_sdist_carries_the_licence_readme_and_typing_marker_and_no_test_leftovers(dist: Path) -> None:
    (sdist,) = dist.glob("*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.partition("/")[2] for name in archive.getnames()}
    assert {"LICENSE", "README.md", "pyproject.toml", "src/postgres_mutex/py.typed"} <= names
    junk = {"__pycache__", ".venv", ".pytest_cache", "report", "results", "site"}
    leftovers = [name for name in names if junk.intersection(name.split("/")) or name.endswith((".pyc", ".log"))]
    assert not leftovers, f"the sdist carries what a test run leaves behind: {leftovers[:10]}"
    (wheel,) = dist.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert "postgres_mutex/py.typed" in names
    assert f"postgres_mutex-{__version__}.dist-info/licenses/LICENSE" in names
    assert not any(name.startswith(("tests/", "chaos/", "bench/")) for name in names), "the wheel is the library only"


def test_the_built_wheel_installs_and_runs_the_quickstart_and_the_demo(installed: Path, pg: PostgresServer) -> None:
    assert run(installed / "postgres-mutex", "--version").strip().endswith(__version__)

    quickstart = substitute(parse_page("README.md").examples("python")[0].code, {"dsn": pg.dsn(), "port": "0"})
    assert "mutex.acquire(" in quickstart, "the README's first Python example is its Quickstart"
    program = "def run_the_job():\n    print('the job ran')\n\n" + quickstart
    assert "the job ran" in run(installed / "python", "-c", program, timeout=60)

    demo = run(installed / "postgres-mutex", "demo", "--dsn", pg.dsn(), timeout=90)
    assert "reclaim" in demo.lower()
