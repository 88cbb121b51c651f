"""Every example of README.md and the docs runs against real PostgreSQL, as docs/development.md says.

A block that stops working fails here; a block nobody marked runs; a marker
that does not parse fails `test_every_example_marker_is_well_formed`.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import psycopg
import pytest
import yaml

from postgres_mutex import Mutex
from tests.support.doc_examples import ROOT, Block, Page, load_pages, parse_page, python_parts, substitute
from tests.support.doc_prelude import SHELL_FILES
from tests.support.postgres_server import PostgresServer, free_port

PAGES = load_pages()
SCHEMA = "docs_examples"
TIMEOUT = 90.0


def _params(language: str) -> list[Block]:
    return [block for page in PAGES for block in page.examples(language)]


@pytest.fixture
def values(pg: PostgresServer, request: pytest.FixtureRequest) -> Iterator[dict[str, str]]:
    """What `SUBSTITUTIONS` fills in: a fresh schema holding an empty lock table, and a free port."""
    auth = quote(pg.user, safe="") + (f":{quote(pg.password, safe='')}" if pg.password else "")
    host = quote(pg.host, safe="") if "/" in pg.host else pg.host
    url = f"postgresql://{auth}@{host}:{pg.port}/{quote(pg.dbname, safe='')}?options=-csearch_path%3D{SCHEMA}"
    with psycopg.connect(pg.dsn(), autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE; CREATE SCHEMA {SCHEMA}")
    bootstrap = Mutex(url, "docs-bootstrap")
    bootstrap.create_schema()
    bootstrap.close()
    yield {"dsn": url, "port": str(free_port())}
    with psycopg.connect(pg.dsn(), autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")


def _with_needs(values: dict[str, str], needs: list[str], request: pytest.FixtureRequest) -> dict[str, str]:
    """``needs=NAME``: the fixture ``docs_example_NAME`` starts what is needed and overrides values."""
    merged = dict(values)
    for need in needs:
        merged.update(request.getfixturevalue("docs_example_" + need.replace("-", "_")))
    return merged


def _environment(values: dict[str, str]) -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    return {
        **os.environ,
        "POSTGRES_MUTEX_DSN": values["dsn"],
        "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "PYTHONUNBUFFERED": "1",
    }


def _scratch(tmp_path: Path) -> Path:
    for name, content in SHELL_FILES.items():
        (tmp_path / name).write_text(content)
        (tmp_path / name).chmod(0o755)
    return tmp_path


# -- the markers ------------------------------------------------------------------------


def test_every_example_marker_is_well_formed() -> None:
    problems = [problem for page in PAGES for problem in page.problems]
    assert problems == [], "\n".join(problems)


def test_every_page_is_seen() -> None:
    seen = {page.path for page in PAGES}
    assert {"README.md", "docs/index.md", "docs/getting-started.md"} <= seen
    assert sum(len(page.examples("python")) for page in PAGES) >= 10, "the Python examples were found"


# -- the examples -----------------------------------------------------------------------


@pytest.mark.parametrize("page", [page for page in PAGES if page.examples("python")], ids=lambda page: page.path)
def test_python_examples(page: Page, values: dict[str, str], request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """A page's Python examples run in order, in one interpreter, as its reader would run them."""
    values = _with_needs(values, page.needs, request)
    parts = python_parts(page.examples("python"), values)
    payload = json.dumps([(code, origin.path, origin.line) for code, origin in parts])
    result = subprocess.run(
        [sys.executable, "-X", "dev", "-W", "error::DeprecationWarning", "-m", "tests.support.doc_examples"],
        input=payload,
        cwd=_scratch(tmp_path),
        env=_environment(values),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert result.returncode == 0, f"{page.path}: an example failed\n{result.stdout}\n{result.stderr}"


@pytest.mark.parametrize("block", _params("shell"), ids=Block.id)
def test_shell_example(block: Block, values: dict[str, str], request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """A shell block runs with bash (-e, pipefail) in a scratch directory; its exit code is 0 or ``exit=``."""
    values = _with_needs(values, block.needs, request)
    script = "set -eo pipefail\n" + substitute(block.setup, values) + "\n" + substitute(block.code, values) + "\n"
    expected = int(block.options.get("exit", "0"))
    # A file, not bash -c: bash would exec a -c string's last command, and signal_children needs the shell.
    (_scratch(tmp_path) / "example.sh").write_text(script)
    proc = subprocess.Popen(
        ["bash", "example.sh"],
        cwd=tmp_path,
        env=_environment(values),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        if "stop-after" in block.options:
            # A command that runs until stopped: it must still run, then stop cleanly on SIGTERM.
            time.sleep(float(block.options["stop-after"]))
            assert proc.poll() is None, f"{block.origin}: ended by itself ({proc.returncode}): {_output(proc)}"
            _signal_children(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{block.origin}: still running after {TIMEOUT:g}s: {_output(proc)}")
        output = _output(proc)
        assert proc.returncode == expected, f"{block.origin}: exit {proc.returncode}, expected {expected}\n{output}"
    finally:
        _end_group(proc)


def _output(proc: subprocess.Popen[str]) -> str:
    """Everything the block printed; what it left running is stopped first, or reading would wait for it."""
    _end_group(proc)
    assert proc.stdout is not None
    return proc.stdout.read()


def _signal_children(shell: int, signum: int) -> None:
    """Signal the block's processes but its shell, which then goes on with the script."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid, group = int(stat.parent.name), int(fields[2])
        if group == shell and pid != shell:
            os.kill(pid, signum)


def _end_group(proc: subprocess.Popen[str]) -> None:
    """Stop what a block left running (background jobs): SIGTERM, then SIGKILL after 10 s."""
    for signum, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _group_alive(proc.pid):
            time.sleep(0.05)
    if proc.poll() is None:
        proc.wait(timeout=5)


def _group_alive(group: int) -> bool:
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            return True
    return False


@pytest.mark.parametrize("block", _params("yaml"), ids=Block.id)
def test_yaml_example_parses(block: Block) -> None:
    """YAML is not run, but every YAML block must parse: a manifest with a typo fails here."""
    try:
        list(yaml.safe_load_all(block.code))
    except yaml.YAMLError as exc:
        pytest.fail(f"{block.origin}: {exc}")


def test_the_thresholds_table_states_the_defaults() -> None:
    """docs/concepts/thresholds.md lists Mutex's defaults for the reader; the signature is the truth."""
    text = (ROOT / "docs/concepts/thresholds.md").read_text(encoding="utf-8")
    stated = {name: float(value) for name, value in re.findall(r"^\| `(\w+)` \| ([\d.]+) s \|", text, re.MULTILINE)}
    defaults = {name: param.default for name, param in inspect.signature(Mutex).parameters.items() if name in stated}
    assert len(stated) == 4
    assert stated == defaults
    # operation_timeout has no single default: it follows the thresholds, 5 s at most.
    assert inspect.signature(Mutex).parameters["operation_timeout"].default is None
    assert re.search(r"^\| `operation_timeout` \| 5 s at most \|", text, re.MULTILINE)


# -- the README's links -----------------------------------------------------------------


def test_every_relative_link_of_the_readme_resolves() -> None:
    """The README is not built by MkDocs, so its links into docs/ are checked here."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\((?!https?://|#|mailto:)([^)\s]+)\)", text)
    assert links, "the README links into the docs"
    missing = [link for link in links if not (ROOT / link.split("#")[0]).exists()]
    assert missing == []


# -- the runner itself ------------------------------------------------------------------


def _parse(tmp_path: Path, text: str, **files: str) -> Page:
    (tmp_path / "page.md").write_text(text)
    for name, content in files.items():
        (tmp_path / name).write_text(content)
    return parse_page("page.md", tmp_path)


def test_unmarked_python_and_shell_blocks_run_and_other_languages_do_not(tmp_path: Path) -> None:
    page = _parse(tmp_path, "```python\nx = 1\n```\n\n```bash\necho hi\n```\n\n```sql\nSELECT 1;\n```\n")
    assert [(block.language, block.run, block.origin.line) for block in page.blocks] == [
        ("python", True, 2),
        ("shell", True, 6),
    ]
    assert page.problems == []


def test_a_block_without_a_language_or_a_no_run_without_a_reason_is_a_problem(tmp_path: Path) -> None:
    page = _parse(tmp_path, "```\npip install x\n```\n\n<!-- example: no-run -->\n```bash\npip install x\n```\n")
    assert len(page.problems) == 2
    assert "name the block's language" in page.problems[0]
    assert "needs reason=" in page.problems[1]


def test_a_marker_must_stand_right_before_its_block(tmp_path: Path) -> None:
    page = _parse(tmp_path, '<!-- example: no-run reason="x" -->\nSome prose.\n\n```bash\necho hi\n```\n')
    assert page.problems == ["page.md:1: this example marker is not followed by a fenced block"]
    assert page.blocks[0].run, "the block after the prose is unmarked, so it runs"


def test_setup_code_is_hidden_and_runs_before_its_block(tmp_path: Path) -> None:
    page = _parse(tmp_path, "<!-- example: setup\nimport os\n-->\n```python\nos.getcwd()\n```\n")
    (block,) = page.blocks
    assert (block.setup, str(block.setup_origin), block.code) == ("import os", "page.md:2", "os.getcwd()")


def test_options_are_checked_by_language(tmp_path: Path) -> None:
    page = _parse(
        tmp_path,
        "<!-- example: exit=75 -->\n```bash\nfalse\n```\n<!-- example: stop-after=2 -->\n```python\nx = 1\n```\n",
    )
    assert page.blocks[0].options == {"exit": "75"}
    assert page.problems == ["page.md:5: python examples take ['needs'], not {'stop-after'}"]


def test_included_sections_are_examples_of_the_including_page_with_their_own_lines(tmp_path: Path) -> None:
    page = _parse(
        tmp_path,
        'Intro\n\n--8<-- "other.md:part"\n',
        **{"other.md": "a\n<!-- --8<-- [start:part] -->\n```bash\necho hi\n```\n<!-- --8<-- [end:part] -->\n"},
    )
    (block,) = page.blocks
    assert (block.page, str(block.origin), block.code) == ("page.md", "other.md:4", "echo hi")


def test_fences_inside_html_comments_are_not_examples(tmp_path: Path) -> None:
    page = _parse(tmp_path, "<!--\n```python\nraise SystemExit(1)\n```\n-->\n")
    assert page.blocks == []


def test_console_blocks_run_their_prompt_lines(tmp_path: Path) -> None:
    page = _parse(tmp_path, "```console\n$ postgres-mutex status\nno lock is held\n```\n")
    assert page.blocks[0].code == "postgres-mutex status"


def test_placeholders_are_substituted_longest_first() -> None:
    text = 'Mutex(dsn="postgres://user:pass@host/db") and --listen 127.0.0.1:9464'
    assert substitute(text, {"dsn": "D", "port": "1"}) == 'Mutex(dsn="D") and --listen 127.0.0.1:1'
