"""The library reads no wall clock for any decision: what lets clients with skewed clocks share a lock.

Leases and deadlines run on the boot-time clock (`postgres_mutex._base.clock`), staleness on the
server's. This is what makes the chaos suite's clock-skew scenario (11) sufficient: it skews the
wall clock as Python reads it in its workers, and here every wall-clock read made by the
library's own code, over its whole life cycle, sync and async, fails the test
(tests/support/wall_clock_audit.py says how reads are caught).
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.fixtures import ROOT


def test_no_wall_clock_is_read_by_the_library_over_its_whole_life_cycle(dsn: str, lock_name: str) -> None:
    audit = subprocess.run(
        [sys.executable, "-m", "tests.support.wall_clock_audit", dsn, lock_name],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert audit.returncode == 0, audit.stderr
    found = json.loads(audit.stdout.splitlines()[-1])
    # The audit sees each kind of read, on any thread (a planted probe), and nothing that is not one.
    assert sorted(found["probe"]) == sorted(
        [
            "time.time",
            "time.time_ns",
            "time.clock_gettime",
            "time.localtime",
            "datetime.datetime.now",
            "datetime.date.today",
            "time.time",  # date.today() reads time.time() itself
            "datetime.datetime.utcnow",  # on another thread
        ]
    )
    assert found["steps"] == [
        "heartbeats",
        "notified hand-off",
        "lease ran out",
        "alert",
        "reclaimed",
        "fenced",
        "status",
        "async hand-off",
        "closed",
    ], "the whole life cycle ran"
    assert found["reads"] == [], "the library read a wall clock"
