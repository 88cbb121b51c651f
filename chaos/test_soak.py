"""Scenario 12: several processes contend for one lock while random faults come and go."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from chaos.conftest import Chaos
from chaos.harness import LEASE, Net
from tests.support.fixtures import ROOT

WORKERS = 4
SECONDS = 20.0
# Faults stop this long before the workers do, so they end (and clean up) on a sound network.
QUIET_END = 5.0


def inject_faults(net: Net, seed: int, until: float, injected: list[str]) -> None:
    """Random toxics on one worker's path, one after another, until ``until`` (monotonic).

    Now and then a partition outlasts the lease: its holder loses the lock and
    another reclaims it, which is where the overlap checker earns its keep.
    """
    rng = random.Random(seed)
    while True:
        time.sleep(rng.uniform(0.2, 1.0))
        kind = rng.choice(["latency", "partition", "long partition", "reset_peer", "bandwidth", "slicer"])
        duration = LEASE * 1.5 if kind == "long partition" else rng.uniform(0.1, LEASE / 2)
        if time.monotonic() + duration >= until:
            return
        if kind in ("partition", "long partition"):
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
        time.sleep(duration)
        net.clear()


@pytest.mark.scenario("12. soak")
def test_12_soak_no_overlap_no_orphan_every_process_finishes(chaos: Chaos, tmp_path: Path) -> None:
    nets = [chaos.net(f"soak-{n}") for n in range(WORKERS)]
    logs = [tmp_path / f"soak-{n}.log" for n in range(WORKERS)]
    started = time.monotonic()
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
    injected: list[str] = []
    faults_until = time.monotonic() + SECONDS - QUIET_END
    injectors = [
        threading.Thread(target=inject_faults, args=(net, seed, faults_until, injected))
        for seed, net in enumerate(nets)
    ]
    for injector in injectors:
        injector.start()
    try:
        codes = [proc.wait(timeout=SECONDS + 60) for proc in procs]
    finally:
        for injector in injectors:
            injector.join(30)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            if proc.stderr is not None:
                proc.stderr.close()
    ran = time.monotonic() - started
    for log in logs:
        chaos.sections.add_log(log)
    sections = chaos.sections.all()
    holders = {section.who for section in sections}
    chaos.record(
        processes_finished=codes.count(0),
        processes=len(codes),
        ran_s=ran,
        critical_sections=len(sections),
        holders=len(holders),
        faults_injected=len(injected),
        long_partitions=injected.count("long partition"),
    )
    assert codes == [0] * WORKERS, "every process finished"
    assert len(sections) >= 10, "the soak did contend"
    assert len(holders) >= 2
