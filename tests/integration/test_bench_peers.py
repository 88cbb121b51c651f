"""The bench's peers section (``python -m bench --quick --only-peers``) runs every peer or says why not.

Figures are not asserted (they depend on the machine); behaviour is: each of
the seven locks (this version twice: plain and fair) either produced a cycle, a hand-off and a contended figure, or
its row says why it could not run, and none of them ever let two holders in
at once. In CI everything a peer needs is installed (redis-server, etcd,
``postgres-mutex[bench]``, PyPI for 0.1.0), so there every peer must run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

from bench import peer_servers
from bench.peers import PEERS, TABLE, TABLE_0_1_0
from bench.report import PEERS_TITLE
from tests.support.fixtures import ROOT

pytestmark = pytest.mark.bench_peers

PEERS_RUN_TIMEOUT = 150.0
MEASURES = ("cycle", "handoff", "contended")


@pytest.fixture(scope="module")
def peers_run(dsn: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, Path]:
    out = tmp_path_factory.mktemp("bench-peers")
    command = [sys.executable, "-m", "bench", "--quick", "--only-peers", "--dsn", dsn, "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=PEERS_RUN_TIMEOUT, check=False)
    assert done.returncode == 0, f"python -m bench --only-peers failed:\n{done.stderr[-4000:]}"
    return json.loads((out / "bench.json").read_text()), done.stdout, out


@pytest.mark.timeout(PEERS_RUN_TIMEOUT + 20)
def test_every_peer_has_figures_or_says_why_not(peers_run: tuple[dict[str, Any], str, Path]) -> None:
    results, stdout, out = peers_run
    assert list(results) == ["meta", "peers"]
    rows = results["peers"]["peers"]
    assert list(rows) == [peer.key for peer in PEERS]
    for key, row in rows.items():
        if "skipped" in row:
            assert row["skipped"].strip(), f"{key} was not run and its row does not say why"
            continue
        for measure in MEASURES:
            assert (measure in row) != (measure in row["errors"]), f"{key}: {measure} has no figures nor a reason"
        if "cycle" in row:
            assert row["cycle"]["n"] > 0
            assert row["cycle"]["median_ms"] > 0
        if "handoff" in row:
            assert row["handoff"]["handoffs"] > 0
        if "contended" in row:
            assert row["contended"]["cycles"] > 0
    if os.environ.get("CI") == "true":
        missing = {key: row.get("skipped", row["errors"]) for key, row in rows.items()}
        missing = {key: why for key, why in missing.items() if why}
        assert not missing, f"in CI every peer must run: {missing}"
    # Every peer has a row in the printed table and in the markdown section, whether it ran or not.
    markdown = (out / "bench.md").read_text()
    assert "<!-- --8<-- [start:peers] -->" in markdown
    assert f"## {PEERS_TITLE}" in stdout
    for row in rows.values():
        assert row["label"] in markdown
        if "skipped" in row:
            assert "not run: " in markdown


@pytest.mark.timeout(PEERS_RUN_TIMEOUT + 20)
def test_no_peer_let_two_holders_in(peers_run: tuple[dict[str, Any], str, Path]) -> None:
    for key, row in peers_run[0]["peers"]["peers"].items():
        if "handoff" in row:
            assert row["handoff"]["acquired_before_release"] == 0, key
        if "contended" in row:
            assert row["contended"]["overlaps"] == 0, key


@pytest.mark.timeout(PEERS_RUN_TIMEOUT + 20)
def test_the_peers_leave_nothing_behind(peers_run: tuple[dict[str, Any], str, Path], dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        left = conn.execute("SELECT to_regclass(%s), to_regclass(%s)", (TABLE, TABLE_0_1_0)).fetchone()
    assert left == (None, None), "the peers' tables are dropped at the end"


def test_a_missing_server_is_a_reason_not_a_crash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    for start, package in ((peer_servers.redis, "redis-server"), (peer_servers.etcd, "etcd-server")):
        with pytest.raises(peer_servers.Unavailable, match=f"apt-get install {package}"), start():
            pass
