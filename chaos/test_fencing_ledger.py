"""Fencing, end to end: a holder frozen past the stale threshold cannot corrupt the data it protects.

Two workers increment one ledger row under one lock, each increment a
read-modify-write transaction. The first is frozen (SIGSTOP) between reading
and writing, long past the stale threshold, then resumed. Without a fence,
the second reclaims the lock, increments, and the resumed first writes its
stale value over those increments: lost updates. With ``fence``, the reclaim
waits for the frozen transaction, and every committed increment counts.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest

from chaos.conftest import Chaos
from chaos.harness import STALE, TIMING
from tests.support.exclusion import Section
from tests.support.fixtures import ROOT, wait_until
from tests.support.postgres_server import PostgresServer


@dataclass
class Worker:
    name: str
    proc: subprocess.Popen[str]
    lines: queue.Queue[tuple[float, str]] = field(default_factory=queue.Queue)
    seen: list[tuple[float, str]] = field(default_factory=list)
    reader: threading.Thread | None = None

    def start_reading(self) -> None:
        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.put((time.monotonic(), line.strip()))

        self.reader = threading.Thread(target=read, daemon=True)
        self.reader.start()

    def wait_for(self, prefix: str, timeout: float = 30.0) -> float:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"{self.name} never printed {prefix!r}: {self.seen[-5:]}"
            try:
                at, line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            self.seen.append((at, line))
            if line.startswith(prefix):
                return at

    def drain(self) -> None:
        while not self.lines.empty():
            self.seen.append(self.lines.get_nowait())

    def drained(self) -> Worker:
        self.drain()
        return self

    def committed(self) -> int:
        return sum(1 for _, line in self.seen if line.startswith("committed"))

    def section(self, lock: str) -> Section | None:
        """Its critical section as it printed it, for the suite's overlap checker (an open one if it never ended)."""
        said = [line.split() for _, line in self.seen if line]
        entered = [float(words[1]) for words in said if words[0] == "held"]
        if not entered:
            return None
        enter = entered[0]
        believed = [float(words[1]) for words in said if words[0] == "believed"]
        ended = [words for words in said if words[0] == "exit"]
        if not ended:
            return Section(self.name, enter, lock=lock)
        exit_at, held = float(ended[0][1]), ended[0][2] == "1"
        return Section(
            self.name,
            enter,
            exit_at,
            lock=lock,
            held_at_exit=held,
            believed_until=exit_at if held else max(believed, default=enter),
        )


@pytest.fixture
def ledger(admin: psycopg.Connection[Any]) -> Iterator[str]:
    name = f"ledger_{uuid.uuid4().hex[:8]}"
    admin.execute(f"CREATE TABLE {name} (id int PRIMARY KEY, counter int NOT NULL)")
    admin.execute(f"INSERT INTO {name} VALUES (1, 0)")  # noqa: S608
    yield name
    admin.execute(f"DROP TABLE {name}")


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param(mode, marks=pytest.mark.scenario(f"13. ledger, holder frozen past stale ({mode})"))
        for mode in ("fenced", "unfenced")
    ],
)
def test_13_a_frozen_holder_cannot_corrupt_a_ledger_it_fences(
    pg: PostgresServer,
    admin: psycopg.Connection[Any],
    ledger: str,
    lock_name: str,
    tmp_path: Path,
    chaos: Chaos,
    mode: str,
) -> None:
    stop = tmp_path / "stop"
    env = {**os.environ, "CHAOS_TIMING": json.dumps(TIMING)}
    workers: list[Worker] = []

    def start(name: str, **extra: str) -> Worker:
        proc = subprocess.Popen(
            [sys.executable, "-m", "chaos.ledger_worker", pg.dsn(), lock_name, ledger, mode, name, str(stop)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**env, **extra},
        )
        worker = Worker(name, proc)
        worker.start_reading()
        workers.append(worker)
        return worker

    try:
        first = start("first", CHAOS_FIRST_WORK="2")
        first.wait_for("read")
        os.kill(first.proc.pid, signal.SIGSTOP)  # in its first increment, between reading and writing back
        frozen_at = time.monotonic()
        second = start("second")
        # Past the stale threshold, and long enough for the second to get going if it can.
        time.sleep(STALE + 2.0)
        second.drain()
        second_before_resume = second.committed()
        os.kill(first.proc.pid, signal.SIGCONT)
        resumed_at = time.monotonic()
        first.wait_for("committed", timeout=30)  # the write it was frozen before
        # The second carries on after the first is gone: a few more increments.
        wait_until(lambda: second.drained().committed() >= second_before_resume + 5, timeout=30)
    finally:
        stop.touch()
        for worker in workers:
            if worker.proc.poll() is None:
                os.kill(worker.proc.pid, signal.SIGCONT)
            try:
                worker.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.proc.kill()
                worker.proc.wait()
            if worker.reader is not None:
                worker.reader.join(10)  # every line it printed, up to its last
            worker.drain()
            # Even when the scenario failed: its row of the report counts the overlaps all the same.
            if (section := worker.section(lock_name)) is not None:
                chaos.sections.add(section)
    committed = sum(worker.committed() for worker in workers)
    found = admin.execute(f"SELECT counter FROM {ledger} WHERE id = 1").fetchone()  # noqa: S608
    assert found is not None
    final = int(found[0])
    lost = committed - final
    reclaimed = [at for at, line in second.seen if line.startswith("held")]
    figures: dict[str, Any] = {
        "increments_committed": committed,
        "final_counter": final,
        "lost_updates": lost,
        "frozen_s": resumed_at - frozen_at,
        "second_committed_while_first_was_frozen": second_before_resume,
    }
    if reclaimed:
        figures["reclaimed_after_freeze_s"] = reclaimed[0] - frozen_at
    chaos.record(**figures)
    if mode == "fenced":
        assert lost == 0, f"every committed increment counts: {committed} committed, counter {final}"
        assert second_before_resume == 0, "the reclaim waited for the frozen holder's fenced transaction"
        assert reclaimed, "the reclaim went through"
        assert reclaimed[0] >= resumed_at, "once the frozen transaction ended"
    else:
        assert lost > 0, "without a fence, the resumed holder wrote over the new holder's increments"
