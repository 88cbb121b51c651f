"""Scenario 19: writers of a ledger under a read/write lock, frozen and killed, while readers read it.

Three writer processes take one `RWLock` for writing in turn and move a two-row
ledger on, each increment one transaction fenced with ``rw.fence(conn)``
(chaos/rw_ledger_worker.py); three reader processes take it for reading, over
and over, and read row 1, row 2 and row 1 again under their hold. Meanwhile one
writer is frozen (SIGSTOP) in the middle of an increment until its row is stale
by the server's clock, then resumed; another is killed (SIGKILL) in the middle
of one. The checker proves:

- no update was lost: both rows end equal to the number of increments the
  writers saw committed (the frozen writer's fenced transaction included: the
  takeover waited for it);
- no reader saw a half-done write: every read hold saw one version of the
  ledger, its three reads equal (a writer committing beside a reader would
  show as rows that differ);
- no writer believed it held beside a reader or another writer (the sections
  each printed, on the machine's monotonic clock).
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

WRITERS = 3
READERS = 3


@dataclass
class Worker:
    """One worker process and every line it printed, each stamped when the test read it."""

    name: str
    role: str
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

    def drain(self) -> Worker:
        while not self.lines.empty():
            self.seen.append(self.lines.get_nowait())
        return self

    def said(self, prefix: str) -> list[str]:
        return [line for _, line in self.drain().seen if line.split(" ", 1)[0] == prefix]

    def wait_for(self, prefix: str, *, after: int = 0, timeout: float = 30.0) -> None:
        """Until it has printed more than ``after`` lines starting with ``prefix``."""
        wait_until(lambda: len(self.said(prefix)) > after, timeout=timeout)

    def sections(self, lock: str, killed_at: float | None = None) -> list[Section]:
        """Its holds as it printed them; one it never printed the end of is open, or ends at ``killed_at``."""
        found: list[Section] = []
        believed: list[float] = []
        for _, line in self.seen:
            words = line.split()
            if not words:
                continue
            if words[0] == "held":
                found.append(Section(self.name, float(words[1]), lock=lock))
                believed = []
            elif words[0] == "believed":
                believed.append(float(words[1]))
            elif words[0] == "exit" and found and found[-1].exit is None:
                section = found[-1]
                section.exit = float(words[1])
                section.held_at_exit = words[2] == "1"
                section.believed_until = section.exit if section.held_at_exit else max(believed, default=section.enter)
        if killed_at is not None and found and found[-1].exit is None:
            found[-1].exit = killed_at  # a killed holder believes nothing after it
        return found


def beside(readers: list[Section], writers: list[Section], now: float) -> list[tuple[Section, Section]]:
    """Pairs of a reader's and a writer's holds during which both holders believed they held the lock."""
    return [
        (reader, writer)
        for reader in readers
        for writer in writers
        if reader.enter < writer.belief_end(now) and writer.enter < reader.belief_end(now)
    ]


def torn(seen: list[str]) -> list[str]:
    """The reads that did not see one version of the ledger: ``saw a b a-again`` with the three unequal."""
    return [line for line in seen if len(set(line.split()[1:])) != 1]


@pytest.fixture
def ledger(admin: psycopg.Connection[Any]) -> Iterator[str]:
    name = f"rw_ledger_{uuid.uuid4().hex[:8]}"
    admin.execute(f"CREATE TABLE {name} (id int PRIMARY KEY, counter int NOT NULL)")
    admin.execute(f"INSERT INTO {name} VALUES (1, 0), (2, 0)")  # noqa: S608
    yield name
    admin.execute(f"DROP TABLE {name}")


@pytest.mark.scenario("19. ledger, read/write lock, writers frozen and killed")
@pytest.mark.timeout(180)
def test_19_writers_lose_no_update_and_readers_never_see_half_a_write(
    pg: PostgresServer, admin: psycopg.Connection[Any], ledger: str, chaos: Chaos, tmp_path: Path
) -> None:
    rwlock = f"{chaos.lock_name}-rw"  # its rows are named after it: the chaos fixture looks for rows left
    stop = tmp_path / "stop"
    env = {**os.environ, "CHAOS_TIMING": json.dumps(TIMING)}
    workers: list[Worker] = []
    death: dict[str, float] = {}
    """When each killed worker died: the end of the hold it never printed the end of."""

    def start(role: str, name: str) -> Worker:
        proc = subprocess.Popen(
            [sys.executable, "-m", "chaos.rw_ledger_worker", pg.dsn(), rwlock, ledger, role, name, str(stop)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        worker = Worker(name, role, proc)
        worker.start_reading()
        workers.append(worker)
        return worker

    def no_fresh_row(name: str) -> bool:
        """``name`` has no row renewed within the stale threshold (by the server's clock): stale, or taken over."""
        found = admin.execute(
            "SELECT NOT EXISTS (SELECT 1 FROM mutex_lock WHERE rwlock = %s AND instance_id = %s "
            "AND last_heartbeat >= now() - make_interval(secs => %s))",
            (rwlock, name, STALE + 0.5),
        ).fetchone()
        return found is not None and bool(found[0])

    def total(prefix: str, role: str) -> int:
        return sum(len(worker.said(prefix)) for worker in workers if worker.role == role)

    def slow(worker: Worker) -> None:
        """Have ``worker``'s next increment work long; return once it is in it, between reading and writing."""
        before = len(worker.said("read-slow"))
        Path(f"{stop}.{worker.name}.slow").touch()
        worker.wait_for("read-slow", after=before)

    try:
        writers = [start("writer", f"writer-{n}") for n in range(WRITERS)]
        for n in range(READERS):
            start("reader", f"reader-{n}")
        # The stream runs: writers commit, readers read, in turn.
        wait_until(lambda: total("committed", "writer") >= 6 and total("saw", "reader") >= 6, timeout=60)

        frozen = writers[0]
        slow(frozen)
        exits = len(frozen.said("exit"))  # before the end of the hold it is frozen in
        os.kill(frozen.proc.pid, signal.SIGSTOP)  # in an increment, its fence's row lock held
        frozen_at = time.monotonic()
        committed_at_freeze = total("committed", "writer")
        wait_until(lambda: no_fresh_row(frozen.name), timeout=30)
        committed_while_frozen = total("committed", "writer") - committed_at_freeze
        os.kill(frozen.proc.pid, signal.SIGCONT)
        resumed_at = time.monotonic()
        frozen.wait_for("exit", after=exits)  # its frozen increment ended, then its hold

        killed = writers[1]
        slow(killed)
        os.kill(killed.proc.pid, signal.SIGKILL)  # in an increment: it rolls back
        killed_at = death[killed.name] = time.monotonic()
        killed.proc.wait(timeout=10)
        # The others carry on once its row is reclaimed: writers commit again, readers read again.
        after_kill = (total("committed", "writer"), total("saw", "reader"))
        wait_until(
            lambda: total("committed", "writer") >= after_kill[0] + 3 and total("saw", "reader") >= after_kill[1] + 3,
            timeout=60,
        )
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
            if worker.role == "writer":
                # Writers exclude each other: the chaos fixture's checker counts their overlaps for the report.
                for section in worker.sections(rwlock, death.get(worker.name)):
                    chaos.sections.add(section)

    now = time.monotonic()
    writer_holds = [s for w in workers if w.role == "writer" for s in w.sections(rwlock, death.get(w.name))]
    reader_holds = [s for w in workers if w.role == "reader" for s in w.sections(rwlock)]
    reads = [line for worker in workers if worker.role == "reader" for line in worker.said("saw")]
    committed = total("committed", "writer")
    found = admin.execute(f"SELECT counter FROM {ledger} ORDER BY id").fetchall()  # noqa: S608
    rows = [int(counter) for (counter,) in found]
    taken_over = [
        float(line.split()[1])
        for worker in workers
        if worker.role == "writer" and worker is not frozen
        for line in worker.said("held")
        if float(line.split()[1]) > frozen_at
    ]
    reclaimed = [
        float(line.split()[1])
        for worker in workers
        if worker is not killed
        for line in worker.said("held")
        if float(line.split()[1]) > killed_at
    ]
    readers_beside_writers = beside(reader_holds, writer_holds, now)
    chaos.record(
        writers=WRITERS,
        readers=READERS,
        writer_holds=len(writer_holds),
        reader_holds=len(reader_holds),
        increments_committed=committed,
        final_counters=rows,
        lost_updates=committed - rows[0],
        reads=len(reads),
        torn_reads=len(torn(reads)),
        readers_beside_writers=len(readers_beside_writers),
        fenced_out=sum(len(worker.said("fenced-out")) for worker in workers),
        frozen_s=resumed_at - frozen_at,
        committed_while_frozen=committed_while_frozen,
        taken_over_after_freeze_s=min(taken_over) - frozen_at if taken_over else None,
        held_again_after_kill_s=min(reclaimed) - killed_at if reclaimed else None,
    )
    assert rows[0] == rows[1], f"the ledger's rows differ: {rows}"
    assert rows[0] == committed, f"every committed increment counts: {committed} committed, counters {rows}"
    assert torn(reads) == [], "a reader saw the ledger change under its read hold"
    assert readers_beside_writers == [], "a reader and a writer believed they held at once"
    assert committed_while_frozen == 0, "no writer took over while the frozen one's fenced increment was open"
    assert taken_over, "another writer took over after the frozen one"
    assert min(taken_over) >= resumed_at, "once the frozen writer's fenced transaction had ended"
    assert reclaimed, "the killed writer's hold was reclaimed"
    assert len(frozen.said("committed")) >= 1, "the frozen writer's increment, fenced in time, committed"


def test_the_checker_sees_a_reader_beside_a_writer_and_a_read_across_a_write() -> None:
    def hold(who: str, enter: float, leave: float, believed: float | None = None) -> Section:
        return Section(who, enter, leave, lock="rw", held_at_exit=believed is None, believed_until=believed)

    readers = [hold("reader-0", 0.0, 1.0), hold("reader-1", 0.5, 1.5)]
    assert beside(readers, [hold("writer-0", 1.5, 2.0)], now=3.0) == [], "touching is not beside"
    assert len(beside(readers, [hold("writer-0", 1.2, 2.0)], now=3.0)) == 1
    # A writer that stopped believing (told of its loss) before the reader came is not beside it.
    assert beside(readers[1:], [hold("writer-0", 0.0, 2.0, believed=0.4)], now=3.0) == []
    assert torn(["saw 3 3 3", "saw 4 3 4", "saw 4 4 5"]) == ["saw 4 3 4", "saw 4 4 5"]
