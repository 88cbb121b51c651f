"""Scenario 12: several processes contend for one lock while random faults come and go."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
from pathlib import Path

from chaos.conftest import Chaos
from chaos.harness import LEASE, Net, Report
from tests.fixtures import ROOT

WORKERS = 4
SECONDS = 20.0


def inject_faults(nets: list[Net], stop: threading.Event, injected: list[str]) -> None:
    """Random toxics on random workers' paths, each for a while; never a partition as long as a lease."""
    rng = random.Random(12)
    while not stop.wait(rng.uniform(0.2, 0.6)):
        net = rng.choice(nets)
        kind = rng.choice(["latency", "partition", "reset_peer", "bandwidth", "slicer"])
        if kind == "partition":
            net.partition()
        elif kind == "latency":
            net.toxic("latency", rng.choice(["upstream", "downstream"]), latency=rng.randint(50, 600))
        elif kind == "reset_peer":
            net.toxic("reset_peer", "downstream", timeout=rng.randint(0, 200))
        elif kind == "bandwidth":
            net.toxic("bandwidth", "downstream", rate=rng.randint(1, 20))
        else:
            net.toxic("slicer", "downstream", average_size=8, size_variation=4, delay=rng.randint(0, 2000))
        injected.append(kind)
        stop.wait(rng.uniform(0.1, LEASE / 2))
        net.clear()


def test_12_soak_no_overlap_no_orphan_every_process_finishes(chaos: Chaos, report: Report, tmp_path: Path) -> None:
    nets = [chaos.net(f"soak-{n}") for n in range(WORKERS)]
    logs = [tmp_path / f"soak-{n}.log" for n in range(WORKERS)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "chaos.soak_worker", f"soak-{n}", str(SECONDS), str(logs[n])],
            cwd=ROOT,
            env={**os.environ, "POSTGRES_MUTEX_DSN": nets[n].dsn, "CHAOS_LOCK": chaos.lock_name},
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in range(WORKERS)
    ]
    stop = threading.Event()
    injected: list[str] = []
    chaos_thread = threading.Thread(target=inject_faults, args=(nets, stop, injected))
    chaos_thread.start()
    try:
        codes = [proc.wait(timeout=SECONDS + 60) for proc in procs]
    finally:
        stop.set()
        chaos_thread.join(10)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            if proc.stderr is not None:
                proc.stderr.close()
    assert codes == [0] * WORKERS, "every process finished"
    for log in logs:
        chaos.sections.add_log(log)
    sections = chaos.sections.all()
    holders = {section.who for section in sections}
    assert len(sections) >= 10, "the soak did contend"
    assert len(holders) >= 2
    report.record(
        "12. soak",
        processes=WORKERS,
        seconds=SECONDS,
        critical_sections=len(sections),
        faults_injected=len(injected),
        overlaps=len(chaos.sections.overlaps()),
    )
