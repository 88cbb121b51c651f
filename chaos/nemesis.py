"""The nemesis, in the style of Jepsen: worker processes contend for a few locks while faults, drawn from a
seeded schedule, freeze holders, cut their network, reset their connections, restart PostgreSQL and kill
them; then a checker says, from what the workers logged, whether mutual exclusion and the ledger held.

Three parts, each usable alone:

- `make_schedule`: the faults, drawn from a seed, before anything runs. The same seed gives the same
  schedule (replay it with ``NEMESIS_SEED``); which process a fault hits is decided when it fires
  ("the holder of lock 2, now"), so a replay aims at the same roles, not necessarily the same pids.
- `Nemesis`: runs the workers (chaos/nemesis_worker.py), each through its own proxy, and the schedule.
- `check`: the verdict, from the workers' logs, the nemesis's own log of what it did, the ledger's
  final counters and the rows left in the lock table. Pure: its tests feed it known histories.

Freezes and partitions are drawn in bands around the thresholds: shorter than the alert threshold,
between it and the lease, *across the lease* (ending between the lease and the stale threshold: the
holder must wake up knowing it lost the lock, though nobody may have taken it yet) and past the
stale threshold (someone else may have taken it: the holder must not believe it still holds it).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos.harness import ALERT, HEARTBEAT, LEASE, STALE, Net
from tests.support.exclusion import Section, overlaps

KINDS = ("freeze", "partition", "disable", "reset", "latency", "kill")
WEIGHTS = (6, 5, 1, 2, 2, 1)
"""How often each kind of fault on a worker is drawn: freezes and partitions around the thresholds are the point.
PostgreSQL restarts have a timeline of their own, every `RESTART_SPACING` to twice that."""

BANDS = {
    "< alert": (0.1, ALERT * 0.9),
    "alert..lease": (ALERT, LEASE - HEARTBEAT),
    "across lease": (LEASE - HEARTBEAT, STALE),
    "> stale": (STALE, STALE + 2.0),
}
BAND_WEIGHTS = (1, 1, 3, 3)
MEAN_GAP = 1.0
"""Mean time between two faults' starts (several run at once, on different targets)."""
RESTART_SPACING = 20.0
"""PostgreSQL restarts come this long apart, or up to twice as long."""
DID_NOT_STOP = "did not stop"
"""The band of a kill the nemesis made at the end, of a worker that did not stop when asked: a failure."""
FREE_WAIT = 2.0
"""How long a fault waits for a worker to hit when a fault under way already hits every one."""
QUIET_START = 2.0
QUIET_END = 6.0
"""No fault starts in the run's first seconds or ends in its last: the workers start, and end, on a sound system."""
NOTICE_ALLOWANCE = HEARTBEAT / 2
"""The bound the checker holds ``on_lost`` to: no later than this after another process took the lock over.

The library tells a holder the moment its lease runs out, a heartbeat interval before anyone may take
the lock: its event thread waits for that moment on the clock alone, for no lock another thread holds
across I/O, and tells the loss before logging it. What it cannot do is run when the machine does not
run it: with the whole suite and other runs on two cores, a holder's process once ran its notice 0.027 s
after the takeover, more than a heartbeat interval after its lease ran out, while ``held``, read from
the clock, had turned false on time. A notice later than this allowance is the library's fault."""


@dataclass(frozen=True)
class Fault:
    """One fault of the schedule, ``at`` seconds after the run starts."""

    at: float
    kind: str
    target: int
    """The lock whose holder it hits (the holder at that moment; a random worker if none), or -1: the server."""
    duration: float
    band: str = ""
    """For freezes and partitions: which thresholds the duration reaches."""
    pick: float = 0.0
    """A draw of the schedule's own, to choose a worker when nobody holds the target lock."""


def make_schedule(seed: int, *, seconds: float, locks: int) -> list[Fault]:
    """The faults of a run of ``seconds``, drawn from ``seed``: the same seed, the same schedule."""
    rng = random.Random(seed)
    faults: list[Fault] = []
    at = QUIET_START
    while True:
        at += rng.expovariate(1 / MEAN_GAP)
        kind = rng.choices(KINDS, WEIGHTS)[0]
        band = ""
        if kind in ("freeze", "partition"):
            band = rng.choices(list(BANDS), BAND_WEIGHTS)[0]
            duration = rng.uniform(*BANDS[band])
        elif kind == "disable":
            duration = rng.uniform(0.2, STALE)
        elif kind == "reset":
            duration = rng.uniform(0.05, 0.5)
        elif kind == "latency":
            duration = rng.uniform(0.5, STALE)
        else:
            duration = rng.uniform(0.5, 2.0)  # a kill: until a new worker takes the dead one's place
        target, pick = rng.randrange(locks), rng.random()
        if at + duration > seconds - QUIET_END:
            break
        faults.append(Fault(round(at, 3), kind, target, round(duration, 3), band, pick))
    restart = QUIET_START
    while (restart := restart + rng.uniform(RESTART_SPACING, 2 * RESTART_SPACING)) < seconds - QUIET_END:
        faults.append(Fault(round(restart, 3), "restart", -1, 0.0))
    return sorted(faults, key=lambda fault: fault.at)


# -- what happened ---------------------------------------------------------------------------


@dataclass
class Applied:
    """A fault as the nemesis applied it, on the shared monotonic clock."""

    fault: Fault
    who: str
    """The worker it hit ("" for the server, "skipped" if it could not be applied)."""
    start: float
    end: float
    holder: bool = False
    """Whether the worker it hit held a lock at that moment (by the table)."""


@dataclass
class History:
    """Everything the workers logged, read back (see chaos/nemesis_worker.py)."""

    events: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def read(cls, paths: Iterable[Path]) -> History:
        events = []
        for path in paths:
            if not path.exists():
                continue
            for line in path.read_text().splitlines():
                try:
                    events.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # the line a SIGKILL cut short
        return cls(events)

    def named(self, *names: str) -> list[dict[str, Any]]:
        return [event for event in self.events if event["ev"] in names]


@dataclass
class Verdict:
    """The checker's findings: every figure counted from what happened."""

    seed: int
    sections: int = 0
    overlaps: list[tuple[Section, Section]] = field(default_factory=list)
    """Sections that began while another holder of the lock still believed it held it: must be none."""
    overlaps_after_loss_known: int = 0
    """Sections that began while a former holder, already told of its loss, was still finishing: allowed."""
    reclaims: int = 0
    reclaims_disconnected: int = 0
    """Reclaims of a holder with reclaim_disconnected_after whose session had ended."""
    doubts: int = 0
    """Holds that turned in doubt (reclaim_disconnected_after)."""
    losses: int = 0
    late_losses: list[str] = field(default_factory=list)
    """Losses told to a running holder (``on_lost``) more than `NOTICE_ALLOWANCE` after another instance
    had taken the lock."""
    losses_within_allowance: list[str] = field(default_factory=list)
    """Losses told after the takeover, but within `NOTICE_ALLOWANCE`: the machine's scheduling, allowed."""
    min_notice_s: float | None = None
    """Of the losses followed by a reclaim of the row, the holder running: the shortest time from ``on_lost``
    to the reclaim (by design at least a heartbeat interval)."""
    notices: list[str] = field(default_factory=list)
    """Each such loss, shortest notice first: who, which lock, why, and who reclaimed it when."""
    committed: int = 0
    unknown: int = 0
    fenced: int = 0
    aborted: int = 0
    lost_updates: int = 0
    doubled_updates: int = 0
    token_order_violations: int = 0
    orphaned_rows: list[str] = field(default_factory=list)
    faults: dict[str, int] = field(default_factory=dict)
    holders_hit: dict[str, int] = field(default_factory=dict)
    """Freezes and partitions that hit a holder, by band."""
    errors: dict[str, int] = field(default_factory=dict)
    """What the workers' acquires and releases raised, by type (timeouts, losses told on leaving, outages)."""

    @property
    def sound(self) -> bool:
        return not (
            self.overlaps or self.late_losses or self.lost_updates or self.doubled_updates or self.orphaned_rows
        ) and (self.token_order_violations == 0)

    def figures(self) -> dict[str, Any]:
        """The verdict as the chaos report shows it."""
        return {
            "seed": self.seed,
            "critical_sections": self.sections,
            "believed_overlaps": len(self.overlaps),
            "overlaps_after_loss_known": self.overlaps_after_loss_known,
            "reclaims": self.reclaims,
            "reclaims_of_ended_sessions": self.reclaims_disconnected,
            "holds_in_doubt": self.doubts,
            "losses": self.losses,
            "losses_detected_late": len(self.late_losses),
            "notice_bound": f"on_lost at most {NOTICE_ALLOWANCE:g}s after the takeover",
            "losses_told_after_takeover_within_bound": len(self.losses_within_allowance),
            "min_notice_before_reclaim_s": "none" if self.min_notice_s is None else round(self.min_notice_s, 3),
            "ledger_committed": self.committed,
            "ledger_unknown": self.unknown,
            "ledger_fenced_out": self.fenced,
            "lost_updates": self.lost_updates,
            "doubled_updates": self.doubled_updates,
            "token_order_violations": self.token_order_violations,
            "orphaned_rows": len(self.orphaned_rows),
            "faults": ", ".join(f"{kind} {count}" for kind, count in sorted(self.faults.items())),
            "holders_frozen_or_cut": ", ".join(f"{band} {n}" for band, n in sorted(self.holders_hit.items())),
            "worker_errors": ", ".join(f"{kind} {n}" for kind, n in sorted(self.errors.items())) or "none",
        }

    def summary(self) -> str:
        return "; ".join(f"{key}: {value}" for key, value in self.figures().items())


def sections_of(history: History, applied: list[Applied]) -> list[Section]:
    """Every critical section, those of killed workers included (ended when the worker could last act)."""
    found = [
        Section(
            e["who"],
            e["enter"],
            e["exit"],
            lock=e["lock"],
            held_at_exit=e["held"],
            believed_until=e["believed_until"],
        )
        for e in history.named("section")
    ]
    ended = {(s.who, s.lock, s.enter) for s in found}
    killed = {a.who: a.start for a in applied if a.fault.kind == "kill" and a.who}
    believed: dict[tuple[str, str, float], float] = {}
    for seen in history.named("believed"):
        key = (seen["who"], seen["lock"], seen["enter"])
        believed[key] = max(believed.get(key, seen["at"]), seen["at"])
    for entered in history.named("enter"):
        key = (entered["who"], entered["lock"], entered["at"])
        who = entered["who"]
        if key in ended or who not in killed:
            continue  # ended, or still running when the logs were read (a check mid-run)
        # Killed while working: it could act until the kill, or until a freeze that lasted to the kill;
        # it believed it held the lock at least until it last said so.
        end = killed[who]
        for a in applied:
            if a.who == who and a.fault.kind == "freeze" and a.start <= end <= a.end:
                end = a.start
        end = max(entered["at"], end)
        found.append(
            Section(
                who,
                entered["at"],
                end,
                lock=entered["lock"],
                held_at_exit=False,
                believed_until=min(end, believed.get(key, entered["at"])),
            )
        )
    return found


def _frozen_during(applied: list[Applied], who: str, start: float, end: float) -> bool:
    return any(a.who == who and a.fault.kind == "freeze" and a.start <= end and start <= a.end for a in applied)


def check(
    history: History,
    applied: list[Applied],
    *,
    seed: int,
    ledger: dict[str, int],
    rows_left: list[tuple[str, str]],
) -> Verdict:
    """The verdict on a run.

    ``ledger``: each lock's final counter. ``rows_left``: (lock, holder) rows in the table once every
    worker that was not killed has stopped; a killed worker's row is no orphan (it goes stale).
    """
    verdict = Verdict(seed)
    sections = sections_of(history, applied)
    verdict.sections = len(sections)
    end = max([s.end(0.0) for s in sections] + [0.0])
    verdict.overlaps = overlaps(sections, now=end, believed=True)
    verdict.overlaps_after_loss_known = len(overlaps(sections, now=end)) - len(verdict.overlaps)
    verdict.reclaims = len(history.named("reclaimed"))
    verdict.reclaims_disconnected = sum(1 for r in history.named("reclaimed") if r.get("reason") == "disconnected")
    verdict.doubts = len(history.named("doubt"))

    # Losses: on_lost told a running holder in time, before anyone else took the lock?
    takeovers: dict[str, list[Section]] = {}
    for s in sorted(sections, key=lambda s: s.enter):
        takeovers.setdefault(s.lock, []).append(s)
    losses = history.named("lost")
    verdict.losses = len(losses)
    notices: list[float] = []
    told: list[tuple[float, str]] = []
    reclaims: dict[str, list[dict[str, Any]]] = {}
    for reclaim in history.named("reclaimed"):
        reclaims.setdefault(reclaim["lock"], []).append(reclaim)
    for loss in losses:
        own = [s for s in takeovers.get(loss["lock"], []) if s.who == loss["who"] and s.enter <= loss["at"]]
        if not own:
            continue
        lost_section = own[-1]
        after = [s for s in takeovers[loss["lock"]] if s.who != loss["who"] and s.enter > lost_section.enter]
        if not after:
            continue
        taken = after[0].enter
        # A holder with reclaim_disconnected_after is told first that its hold is in doubt (it stops
        # believing then), and of the loss at its next heartbeat: the doubt is its notice.
        loss = {**loss, "at": told_at(history, loss, since=lost_section.enter)}
        # The lease runs out a heartbeat interval before anyone may take the lock over, and on_lost
        # fires then: unless the holder was frozen at that moment (it is told as it resumes).
        if _frozen_during(applied, loss["who"], taken - HEARTBEAT, taken):
            continue
        # The notice is measured against reclaims of its row; the next holder may also have found
        # the lock free, the former holder having deleted its row itself once it knew of the loss.
        if any(
            r["who"] == after[0].who and r["previous"] == loss["who"] and lost_section.enter <= r["at"] <= taken
            for r in reclaims.get(loss["lock"], [])
        ):
            notices.append(taken - loss["at"])
            told.append(
                (
                    taken - loss["at"],
                    f"{taken - loss['at']:.3f}s: {loss['who']} lost {loss['lock']} at {loss['at']:.3f} "
                    f"({loss.get('reason', '')}); {after[0].who} reclaimed it at {taken:.3f}",
                )
            )
        releasing = lost_section.held_at_exit and lost_section.end(loss["at"]) <= taken
        if loss["at"] > taken and not releasing:
            # (A holder that left its section still holding, before the takeover, was releasing: its
            # release tells the loss (LockNotHeldError) once it learns it; no running job relied on it.)
            # Did the holder's process run meanwhile? Its own look at held (the clock) ended its section.
            said = (
                f"{loss['who']} on {loss['lock']}: told {loss['at'] - taken:.3f}s after {after[0].who} took it "
                f"(its section ended {lost_section.end(loss['at']) - taken:+.3f}s from the takeover)"
            )
            late = loss["at"] - taken > NOTICE_ALLOWANCE
            (verdict.late_losses if late else verdict.losses_within_allowance).append(said)
    verdict.min_notice_s = min(notices) if notices else None
    verdict.notices = [text for _, text in sorted(told)]

    # The ledger: every committed increment counted once, unknown ones at most once.
    started = {e["inc"]: e for e in history.named("inc-start")}
    outcomes = {e["inc"]: e for e in history.named("inc")}
    kinds = Counter(e["outcome"] for e in outcomes.values())
    unanswered = [inc for inc in started if inc not in outcomes]  # killed while committing
    verdict.committed, verdict.fenced, verdict.aborted = kinds["committed"], kinds["fenced"], kinds["aborted"]
    verdict.unknown = kinds["unknown"] + len(unanswered)
    for lock, final in ledger.items():
        acked = [started[inc] for inc, e in outcomes.items() if e["outcome"] == "committed" and e["lock"] == lock]
        maybe = [
            inc
            for inc in started
            if started[inc]["lock"] == lock and (inc not in outcomes or outcomes[inc]["outcome"] == "unknown")
        ]
        written = Counter(e["wrote"] for e in acked)
        duplicates = sum(n - 1 for n in written.values())
        verdict.lost_updates += max(duplicates, len(acked) - final, 0)
        verdict.doubled_updates += max(final - len(acked) - len(maybe), 0)
        tokens = [e["token"] for e in sorted(acked, key=lambda e: e["wrote"])]
        verdict.token_order_violations += sum(1 for a, b in itertools.pairwise(tokens) if b < a)

    verdict.errors = dict(Counter(e["error"] for e in history.named("error")))
    killed = {a.who for a in applied if a.fault.kind == "kill"}
    verdict.orphaned_rows = [f"{lock} held by {holder}" for lock, holder in rows_left if holder not in killed]
    verdict.faults = dict(Counter(a.fault.kind for a in applied if a.who != "skipped" and a.fault.band != DID_NOT_STOP))
    verdict.holders_hit = dict(
        Counter(a.fault.band for a in applied if a.holder and a.fault.kind in ("freeze", "partition"))
    )
    return verdict


# -- running it ----------------------------------------------------------------------------------


def told_at(history: History, loss: dict[str, Any], *, since: float) -> float:
    """When the holder learned of ``loss``: the loss, or the doubt before it that no heartbeat confirmed."""
    notice = loss["at"]
    for event in sorted(history.named("doubt", "confirmed"), key=lambda e: e["at"]):
        if event["who"] != loss["who"] or event["lock"] != loss["lock"] or not since <= event["at"] <= loss["at"]:
            continue
        notice = min(notice, event["at"]) if event["ev"] == "doubt" else loss["at"]
    return float(notice)


def new_seed() -> int:
    """The seed of this run: ``NEMESIS_SEED`` to replay one, else a fresh one."""
    given = os.environ.get("NEMESIS_SEED")
    return int(given) if given else random.SystemRandom().randrange(1, 2**31)


class Nemesis:
    """Worker processes, their proxies, and the faults of a schedule, applied on time.

    ``holders()`` says who holds each lock now (instance ids, read from the table);
    ``restart()`` restarts PostgreSQL; ``net(name)`` makes a worker's proxy.
    """

    def __init__(
        self,
        *,
        directory: Path,
        locks: list[str],
        workers: int,
        seed: int,
        net: Callable[[str], Net],
        holders: Callable[[], dict[str, str]],
        restart: Callable[[], None],
        env: dict[str, str] | None = None,
    ) -> None:
        self.directory = directory
        self.locks = locks
        self.seed = seed
        self._holders = holders
        self._restart = restart
        self._env = env or {}
        self._rng = random.Random(seed)
        self.stop_file = directory / "stop"
        self.nets = [net(f"nemesis-{n}") for n in range(workers)]
        self.generation = [0] * workers
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.slot_of: dict[str, int] = {}
        self.current: list[str] = [""] * workers
        self.applied: list[Applied] = []
        self._busy: set[int] = set()
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        self._stopped = threading.Event()

    # -- workers ---------------------------------------------------------------------

    def log_paths(self) -> list[Path]:
        return sorted(self.directory.glob("worker-*.log"))

    def start_worker(self, slot: int) -> str:
        self.generation[slot] += 1
        name = f"w{slot}g{self.generation[slot]}"
        env = {**os.environ, **self._env, "POSTGRES_MUTEX_DSN": self.nets[slot].dsn}
        args = [str(self.directory / f"worker-{name}.log"), str(self.seed), str(self.stop_file)]
        with open(self.directory / f"worker-{name}.err", "wb") as errors:  # the child keeps its own copy
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "chaos.nemesis_worker", name, ",".join(self.locks), *args],
                cwd=Path(__file__).resolve().parent.parent,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=errors,
            )
        self.slot_of[name] = slot
        self.current[slot] = name
        return name

    # -- faults ------------------------------------------------------------------------

    def _target(self, fault: Fault, holders: dict[str, str], busy: set[int]) -> tuple[int, bool] | None:
        """The worker slot a fault hits, and whether it holds a lock, or None while every slot is busy.

        The holder of the fault's lock now, else (nobody holds it, or a fault under way already hits its
        holder) a free worker that holds some lock, else any free one, each chosen by the schedule's own
        draw. Skipping a fault whose first target is busy would leave the rarer kinds untried in a run:
        holders spend much of it frozen or cut off.
        """
        holding = set(holders.values())
        holder = holders.get(self.locks[fault.target], "")
        slot = self.slot_of.get(holder)
        if slot is not None and self.current[slot] == holder and slot not in busy:
            return slot, True
        free = [n for n in range(len(self.nets)) if n not in busy]
        if not free:
            return None
        free_holders = [n for n in free if self.current[n] in holding]
        choices = free_holders or free
        slot = choices[int(fault.pick * len(choices))]
        return slot, self.current[slot] in holding

    def _apply(self, fault: Fault) -> None:
        if fault.kind == "restart":
            start = time.monotonic()
            self._restart()
            self._record(Applied(fault, "", start, time.monotonic()))
            return
        # Every worker busy with a fault: wait a little for one to end, not past the run's stop.
        deadline = time.monotonic() + FREE_WAIT
        holders = self._holders()  # a query: not under the lock the other faults record with
        with self._freed:
            while (target := self._target(fault, holders, self._busy)) is None:
                left = deadline - time.monotonic()
                if left <= 0 or self._stopped.is_set():
                    self.applied.append(Applied(fault, "skipped", time.monotonic(), time.monotonic()))
                    return
                self._freed.wait(min(left, 0.1))
            slot, holder = target
            self._busy.add(slot)
        try:
            self._hit(fault, slot, holder)
        finally:
            with self._freed:
                self._busy.discard(slot)
                self._freed.notify_all()

    def _hit(self, fault: Fault, slot: int, holder: bool) -> None:
        who, net = self.current[slot], self.nets[slot]
        proc = self.procs[who]
        start = time.monotonic()
        if fault.kind == "freeze":
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGSTOP)
            start = time.monotonic()
            self._stopped.wait(fault.duration)
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
        elif fault.kind == "partition":
            with net.partitioned():
                self._stopped.wait(fault.duration)
        elif fault.kind == "disable":
            net.proxy.disable()
            try:
                self._stopped.wait(fault.duration)
            finally:
                net.proxy.enable()
        elif fault.kind == "reset":
            net.toxic("reset_peer", "downstream", timeout=0)
            try:
                self._stopped.wait(fault.duration)
            finally:
                net.clear()
        elif fault.kind == "latency":
            net.toxic("latency", "downstream", latency=int(self._rng.uniform(50, 1500)))
            try:
                self._stopped.wait(fault.duration)
            finally:
                net.clear()
        else:
            assert fault.kind == "kill"
            proc.kill()
            start = time.monotonic()
            proc.wait(10)
            self._stopped.wait(fault.duration)
            if not self._stopped.is_set():
                self.start_worker(slot)
        self._record(Applied(fault, who, start, time.monotonic(), holder))

    def _record(self, applied: Applied) -> None:
        with self._lock:
            self.applied.append(applied)

    # -- the run -------------------------------------------------------------------------

    def run(
        self,
        schedule: list[Fault],
        *,
        seconds: float,
        stop_early: Callable[[], bool] | None = None,
        check_every: float = 2.0,
    ) -> float:
        """Start the workers, fire each fault at its time (each on a thread of its own), stop them all.

        ``stop_early`` is asked every ``check_every`` seconds; the run ends when it says so.
        Returns how long the run lasted.
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        began = time.monotonic()
        threads: list[threading.Thread] = []
        pending = sorted(schedule, key=lambda f: f.at)
        next_check = began + check_every
        try:
            for slot in range(len(self.nets)):
                self.start_worker(slot)
            while not self._stopped.is_set():
                now = time.monotonic()
                if now - began >= seconds:
                    break
                while pending and began + pending[0].at <= now:
                    thread = threading.Thread(target=self._apply, args=(pending.pop(0),), daemon=True)
                    thread.start()
                    threads.append(thread)
                if stop_early is not None and now >= next_check:
                    next_check = now + check_every
                    if stop_early():
                        break
                upcoming = [began + pending[0].at] if pending else []
                self._stopped.wait(max(0.0, min([next_check, began + seconds, *upcoming]) - time.monotonic()))
            return time.monotonic() - began
        finally:
            # Even when the run failed: a fault under way (a server restart) must not outlive it.
            self._stopped.set()  # faults under way end now: the processes go on, the network heals
            for thread in threads:
                thread.join(30)
            self.stop()

    def stop(self) -> None:
        """Let every worker finish its section and exit (SIGKILL after a deadline), frozen ones resumed first."""
        self._stopped.set()
        self.stop_file.touch()
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        for name, proc in self.procs.items():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
                self._record(Applied(Fault(0.0, "kill", -1, 0.0, band=DID_NOT_STOP), name, time.monotonic(), 0.0))

    def did_not_stop(self) -> list[str]:
        """Workers the nemesis had to kill at the end because they did not stop when asked."""
        return [a.who for a in self.applied if a.fault.band == DID_NOT_STOP]

    def history(self) -> History:
        return History.read(self.log_paths())
