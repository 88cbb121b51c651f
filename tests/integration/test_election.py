"""Leader election: one leader at a time, told at once when it must stop, handed over at once, seen by all.

Grouped by what a user would notice: who leads, hand-over, crash recovery,
loss, failing leads, async leads, observability, bad input. The processes
of the fleet tests run tests/support/election_worker.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry
from psycopg_pool import ConnectionPool

import postgres_mutex
from postgres_mutex import (
    Election,
    ExtendedMetricsHook,
    Leadership,
    LockNotHeldError,
    LockTable,
    Mutex,
    MutexError,
)
from postgres_mutex.prometheus import PrometheusMetrics
from tests.support.faultproxy import FaultProxy
from tests.support.fixtures import FAST, ROOT, RecordingMetrics, freeze, wait_until
from tests.support.signal_points import RaiseAtCheck

Make = Callable[..., Election]


@pytest.fixture
def make_election(dsn: str, lock_name: str, schema: None) -> Iterator[Make]:
    """Elections with the suite's fast thresholds on the test's lock; each is closed after the test."""
    made: list[Election] = []

    def make(*args: Any, **kwargs: Any) -> Election:
        if not args and "pool" not in kwargs and "client" not in kwargs:
            kwargs.setdefault("dsn", dsn)
        kwargs.setdefault("name", lock_name)
        for key, value in FAST.items():
            kwargs.setdefault(key, value)
        election = Election(*args, **kwargs)
        made.append(election)
        return election

    yield make
    for election in made:
        with contextlib.suppress(Exception):
            election.close()


class Candidate:
    """An election run in a thread, with a lead that records its terms and leads until told to end."""

    def __init__(self, election: Election, lead: Callable[[Leadership], object] | None = None) -> None:
        self.election = election
        self.terms: list[Leadership] = []
        self.returned: list[float] = []
        self.began: list[float] = []
        self.error: BaseException | None = None
        self._lead = lead
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Candidate:
        self.thread.start()
        return self

    def _run(self) -> None:
        try:
            self.election.run(self.lead)
        except BaseException as exc:
            self.error = exc

    def lead(self, leadership: Leadership) -> object:
        self.began.append(time.monotonic())
        self.terms.append(leadership)
        try:
            if self._lead is not None:
                return self._lead(leadership)
            leadership.ended.wait()
            return None
        finally:
            self.returned.append(time.monotonic())

    def leading(self) -> bool:
        """Leading, and its lead running: the term is in ``terms``.

        ``election.leading`` turns True a moment before ``lead`` is called (on
        the campaign's thread): a test that waited on it alone and then read
        ``terms`` raced that thread.
        """
        return self.election.leading and len(self.terms) > len(self.returned)

    def stop(self, timeout: float = 10.0) -> float:
        """Stop the election; returns how long run() took to return."""
        started = time.monotonic()
        self.election.stop()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "run() did not return after stop()"
        assert self.error is None, self.error
        return time.monotonic() - started


@pytest.fixture
def candidates() -> Iterator[list[Candidate]]:
    made: list[Candidate] = []
    yield made
    for candidate in made:
        candidate.election.stop()
        candidate.thread.join(10)


def token_in_table(admin: psycopg.Connection[Any], name: str) -> int | None:
    found = admin.execute("SELECT token FROM mutex_lock WHERE lock_name = %s", (name,)).fetchone()
    return None if found is None else int(found[0])


# -- who leads -----------------------------------------------------------------------------


def test_one_candidate_leads_and_leader_agrees_with_the_table(
    make_election: Make, candidates: list[Candidate], admin: psycopg.Connection[Any], lock_name: str
) -> None:
    leader = Candidate(make_election())
    candidates.append(leader.start())
    follower = make_election()  # never runs: a process that only wants to know who leads
    wait_until(leader.leading)
    seen = follower.leader()
    assert seen is not None
    assert seen.instance_id == leader.election.instance_id
    assert seen.token == leader.terms[0].token == token_in_table(admin, lock_name)
    assert seen.seconds_since_heartbeat < FAST["alert_threshold"]
    assert not seen.alerting
    assert leader.terms[0].held
    leader.terms[0].ensure_held()
    leader.stop()
    assert follower.leader() is None, "a stopped leader releases at once"
    assert token_in_table(admin, lock_name) is None
    assert leader.terms[0].ended.is_set()
    assert not leader.terms[0].lost
    with pytest.raises(LockNotHeldError, match="stop"):
        leader.terms[0].ensure_held()


def test_leader_is_none_for_a_holder_silent_past_the_stale_threshold(
    make_election: Make, admin: psycopg.Connection[Any], lock_name: str
) -> None:
    admin.execute(
        "INSERT INTO mutex_lock (lock_name, instance_id, last_heartbeat, acquired_at) "
        "VALUES (%s, 'dead-host', now() - interval '1 hour', now() - interval '2 hours')",
        (lock_name,),
    )
    assert make_election().leader() is None


def test_followers_see_each_change_of_leader(make_election: Make, candidates: list[Candidate]) -> None:
    follower = make_election()
    seen: list[tuple[str, int | None] | None] = []

    def watch() -> None:
        for leader in follower.watch_leader(interval=0.05):
            seen.append(None if leader is None else (leader.instance_id, leader.token))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    wait_until(lambda: seen == [None])
    first = Candidate(make_election())
    candidates.append(first.start())
    wait_until(first.leading)
    second = Candidate(make_election())
    candidates.append(second.start())
    wait_until(lambda: len(seen) >= 2)
    assert first.election.resign()
    wait_until(second.leading)
    wait_until(lambda: len(seen) >= 3)
    follower.stop()
    watcher.join(5)
    assert not watcher.is_alive(), "stop() ends watch_leader"
    assert seen[:3] == [
        None,
        (first.election.instance_id, first.terms[0].token),
        (second.election.instance_id, second.terms[0].token),
    ]


# -- hand-over -------------------------------------------------------------------------------


def test_resign_hands_over_at_once_and_keeps_campaigning(make_election: Make, candidates: list[Candidate]) -> None:
    first = Candidate(make_election())
    candidates.append(first.start())
    wait_until(first.leading)
    second = Candidate(make_election())
    candidates.append(second.start())
    wait_until(lambda: second.election._mutex.last_holder is not None)  # campaigning: it found the lock taken
    resigned_at = time.monotonic()
    assert first.election.resign()
    wait_until(second.leading, timeout=FAST["stale_threshold"])
    assert second.began[0] - resigned_at < 1.0, "woken by the release, not by a reclaim"
    assert first.returned[0] <= second.began[0], "the lock is released only once lead returned"
    assert second.terms[0].token is not None
    assert first.terms[0].token is not None
    assert second.terms[0].token > first.terms[0].token
    assert first.thread.is_alive(), "a candidate that resigned campaigns again"
    assert not first.election.resign(), "not leading: nothing to resign"
    second.stop()
    wait_until(first.leading)  # and wins again once the other one stops
    first.stop()


def test_close_while_lead_runs_releases_only_once_lead_returned(
    make_election: Make, candidates: list[Candidate], admin: psycopg.Connection[Any], lock_name: str
) -> None:
    held_when_told: list[int | None] = []
    closed = threading.Event()

    def lead(leadership: Leadership) -> None:
        leadership.ended.wait()
        closed.wait(10)
        held_when_told.append(token_in_table(admin, lock_name))

    candidate = Candidate(make_election(), lead=lead)
    candidates.append(candidate.start())
    wait_until(candidate.leading)
    candidate.election.close()  # from another thread than run's
    closed.set()
    candidate.thread.join(10)
    assert not candidate.thread.is_alive()
    assert held_when_told == [candidate.terms[0].token], "the lock was still held while lead ran"
    assert token_in_table(admin, lock_name) is None, "released once lead returned"


@pytest.mark.parametrize("mode", ["dsn", "pool"])
def test_stop_while_campaigning_returns_at_once(
    make_election: Make, make_mutex: Callable[..., Mutex], dsn: str, candidates: list[Candidate], mode: str
) -> None:
    holder = make_mutex()
    options: dict[str, Any] = {"poll_interval": 5.0}  # no poll can explain a prompt return
    pool = ConnectionPool(dsn, min_size=1, max_size=2, open=True) if mode == "pool" else None
    try:
        if pool is not None:
            options["pool"] = pool
        election = make_election(**options)
        with holder.acquire():
            waiting = Candidate(election)
            candidates.append(waiting.start())
            wait_until(lambda: election._mutex.last_holder == holder.instance_id)
            time.sleep(0.2)  # well into the wait for a release
            took = waiting.stop()
        assert took < 1.5, f"stop() took {took:.2f}s to end the campaign"
        assert waiting.terms == [], "it never led"
        assert election.stopped
    finally:
        if pool is not None:
            election.close()
            pool.close()


def test_stop_from_a_signal_handler_never_deadlocks_the_thread_it_interrupted(
    dsn: str, lock_name: str, schema: None
) -> None:
    """The docs' pattern, many times over: a handler calls stop() while ``lead`` waits on ``leadership.ended``.

    The signal lands at random moments of the main thread's waits, including
    the instant it holds the internal lock of the event it waits on.
    """
    script = f"""
import random, signal, sys
from postgres_mutex import Election
for trial in range(150):
    election = Election({dsn!r}, {lock_name!r}, heartbeat_interval=1, alert_threshold=2, stale_threshold=5)
    signal.signal(signal.SIGALRM, lambda *_: election.stop())
    def lead(leadership):
        signal.setitimer(signal.ITIMER_REAL, random.uniform(0.0005, 0.005))
        while not leadership.ended.wait(0.0002):
            pass
    election.run(lead)
    election.close()
print("done", flush=True)
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "done"


class Interrupt(BaseException):
    """What a signal handler raises into ``lead`` (as Ctrl-C's KeyboardInterrupt is)."""


def test_an_exception_raised_anywhere_in_leads_wait_on_ended_still_ends_the_run(
    make_election: Make, lock_name: str, admin: psycopg.Connection[Any]
) -> None:
    """Ctrl-C (or a job runner's time limit) while ``lead`` waits on ``leadership.ended``: at every point
    of that wait where a signal handler could run, ``run()`` hands the lock back and raises it."""
    library = str(Path(postgres_mutex.__file__).parent)

    def watched(name: str) -> bool:
        return name.startswith(library) or name == threading.__file__

    def run_once(at: int) -> tuple[RaiseAtCheck, BaseException | None, bool]:
        tracer = RaiseAtCheck(at, Interrupt, watched)
        election = make_election()

        def lead(leadership: Leadership) -> None:
            sys.settrace(tracer)
            try:
                leadership.ended.wait(0.001)
            finally:
                sys.settrace(None)
                election.stop()  # one term only, interrupted or not

        raised: list[BaseException] = []

        def run() -> None:
            try:
                election.run(lead)
            except BaseException as exc:
                raised.append(exc)

        runner = threading.Thread(target=run, daemon=True)
        runner.start()
        runner.join(10.0)
        ended = not runner.is_alive()
        if not ended:
            election.stop()
        return tracer, (raised[0] if raised else None), ended

    counted, _, _ = run_once(0)
    points = counted.seen
    assert points >= 3, f"the count saw the wait run ({points} points)"
    for at in range(1, points + 1):
        tracer, raised, ended = run_once(at)
        assert ended, f"run() never returned after an exception at {tracer.where}"
        if not tracer.where:
            continue  # this term's wait took fewer steps than the counted one
        assert isinstance(raised, Interrupt), f"run() raised {raised!r} after an exception at {tracer.where}"
        assert token_in_table(admin, lock_name) is None, f"the lock stayed held after an exception at {tracer.where}"


def test_a_lead_that_returns_gives_the_term_up_and_campaigns_again(
    make_election: Make, candidates: list[Candidate]
) -> None:
    election = make_election()
    candidate = Candidate(election, lead=lambda leadership: None)
    candidates.append(candidate.start())
    wait_until(lambda: len(candidate.terms) >= 2)
    candidate.stop()
    tokens = [term.token or 0 for term in candidate.terms]
    assert tokens == sorted(set(tokens)), "each term is a new acquisition, with a greater token"
    gaps = [later - earlier for earlier, later in zip(candidate.returned, candidate.began[1:], strict=False)]
    assert min(gaps) >= 0.2, "a returning lead sits out a pause so that another candidate can take over"


# -- several processes ------------------------------------------------------------------------


def start_candidate(dsn: str, name: str, out: Path, **options: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.election_worker", dsn, name, str(out), json.dumps(options)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def read_terms(*files: Path) -> list[tuple[float, float | None, int, int]]:
    """(begin, end or None, token, pid) of every term in the workers' logs, by begin."""
    terms: dict[tuple[int, int], list[Any]] = {}
    for file in files:
        if not file.exists():
            continue
        for line in complete_lines(file):
            what, *fields = line.split()
            if what not in ("begin", "end"):
                continue  # a sampling worker's beliefs and reports: read_lines
            pid, token, at = fields
            entry = terms.setdefault((int(pid), int(token)), [None, None])
            entry[0 if what == "begin" else 1] = float(at)
    return sorted((begin, end, token, pid) for (pid, token), (begin, end) in terms.items())


def assert_one_leader_at_a_time(terms: list[tuple[float, float | None, int, int]]) -> None:
    for (_, end, token, pid), (next_begin, _, next_token, next_pid) in itertools.pairwise(terms):
        assert end is not None, f"term {token} of {pid} never ended, yet {next_pid} led after it"
        assert end <= next_begin, f"terms {token} ({pid}) and {next_token} ({next_pid}) overlap"
        assert next_token > token, f"tokens must increase from term to term: {token} then {next_token}"


@pytest.fixture
def fleet() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def ready(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line == "ready\n", f"worker did not start: {line!r} {proc.stderr.read() if proc.stderr else ''}"


def test_a_fleet_has_exactly_one_leader_at_a_time(
    dsn: str, lock_name: str, schema: None, tmp_path: Path, fleet: list[subprocess.Popen[str]]
) -> None:
    logs = [tmp_path / f"candidate-{index}.log" for index in range(3)]
    for index, log in enumerate(logs):
        mode = "async" if index == 2 else "sync"
        fleet.append(start_candidate(dsn, lock_name, log, mode=mode, hold=[0.02, 0.15], **FAST))
    for proc in fleet:
        ready(proc)
    wait_until(lambda: len(read_terms(*logs)) >= 12, timeout=30)
    for proc in fleet:
        proc.send_signal(signal.SIGTERM)
    for proc in fleet:
        assert proc.wait(timeout=15) == 0, proc.stderr.read() if proc.stderr else ""
    terms = read_terms(*logs)
    assert_one_leader_at_a_time(terms)
    assert len({pid for _, _, _, pid in terms}) >= 2, "leadership moved between processes"


def complete_lines(file: Path) -> list[str]:
    """The lines of a worker's log that it has finished writing (a last one may be half written)."""
    return file.read_text().split("\n")[:-1]


def read_lines(kind: str, *files: Path) -> list[list[str]]:
    """The fields after ``kind`` of each such line in the workers' logs."""
    return [
        line.split()[1:]
        for file in files
        if file.exists()
        for line in complete_lines(file)
        if line.startswith(kind + " ")
    ]


@contextlib.contextmanager
def cpu_starved(hogs: int) -> Iterator[None]:
    """``hogs`` processes that spin (each for two minutes at most), starving everything else of CPU."""
    spin = "import time\nend = time.monotonic() + 120\nwhile time.monotonic() < end:\n    pass\n"
    procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(hogs)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)


def test_under_cpu_starvation_a_candidate_stops_believing_it_leads_before_the_next_one_leads(
    dsn: str, lock_name: str, schema: None, tmp_path: Path, fleet: list[subprocess.Popen[str]]
) -> None:
    # Each candidate reads its own leading and held every few milliseconds while the CPU is
    # starved, through stop -> resign -> stop: no stretch of belief may reach into another's term.
    options = {"heartbeat_interval": 0.2, "alert_threshold": 1.0, "stale_threshold": 3.0, "poll_interval": 0.05}
    logs = [tmp_path / f"candidate-{index}.log" for index in range(3)]
    fleet.extend(start_candidate(dsn, lock_name, log, sample=True, **options) for log in logs)
    for proc in fleet:
        ready(proc)
    by_pid = {proc.pid: proc for proc in fleet}

    def leader_after(token: int) -> tuple[int, int]:
        """The next leader's term and pid, once that leader has seen itself lead."""

        def found() -> tuple[float, int, int] | None:
            later = [(begin, t, pid) for begin, end, t, pid in read_terms(*logs) if t > token and end is None]
            return later[0] if later else None

        wait_until(lambda: found() is not None, timeout=60)
        term = found()
        assert term is not None
        _, token_after, pid = term
        # The previous term began before this one could: a belief of this pid that started
        # after it is a belief in this term (the sampler may see `leading` before `begin`).
        previous = [begin for begin, _, t, _ in read_terms(*logs) if t == token]
        after = previous[0] if previous else float("-inf")

        def believes() -> bool:
            return any(int(who) == pid and float(since) > after for who, since in read_lines("believes", *logs))

        wait_until(believes, timeout=60)  # every leader sees itself lead
        return token_after, pid

    token, pid = leader_after(0)
    with cpu_starved(hogs=4):
        by_pid[pid].send_signal(signal.SIGTERM)  # stop
        assert by_pid[pid].wait(timeout=60) == 0
        token, pid = leader_after(token)
        by_pid[pid].send_signal(signal.SIGUSR1)  # resign
        resigned = token
        token, pid = leader_after(token)
        by_pid[pid].send_signal(signal.SIGTERM)  # stop
        assert by_pid[pid].wait(timeout=60) == 0
        token, pid = leader_after(token)
    for proc in fleet:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in fleet:
        assert proc.wait(timeout=30) == 0, proc.stderr.read() if proc.stderr else ""

    terms = read_terms(*logs)
    assert len(terms) >= 4
    assert_one_leader_at_a_time(terms)
    beliefs = [(int(who), float(since), float(last)) for who, since, last in read_lines("believed", *logs)]
    for who, since, last in beliefs:
        for begin, end, term_token, term_pid in terms:
            assert end is not None
            if term_pid != who:
                overlap = min(last, end) - max(since, begin)
                assert overlap <= 0, f"{who} still believed it led {overlap:.3f}s into term {term_token} of {term_pid}"
            elif since < end:
                # Stopped or resigned: told before lead returned, so before the lock was released.
                assert last <= end, f"{who} believed it led {last - end:.3f}s after its term {term_token} ended"
    reported = {int(t): how for _, t, how in read_lines("reported", *logs)}
    assert {term_token for _, _, term_token, _ in terms} == set(reported), "every term's end was reported"
    # Resigned, or lost if its lease ran out while the CPU was starved, before the resignation.
    assert reported[resigned] in ("resigned", "lost"), reported
    assert list(reported.values()).count("resigned") <= 1, reported
    # A lease that ran out while the CPU was starved is a lost term, told as such: never a failure.
    assert set(reported.values()) <= {"stopped", "resigned", "lost"}, reported


def test_failover_is_immediate_on_a_graceful_stop_and_after_the_stale_threshold_on_a_crash(
    dsn: str, lock_name: str, schema: None, tmp_path: Path, fleet: list[subprocess.Popen[str]]
) -> None:
    # Slower thresholds than FAST: a reclaim cannot come before 3 s of silence.
    options = {"heartbeat_interval": 0.2, "alert_threshold": 1.0, "stale_threshold": 3.0, "poll_interval": 0.05}
    logs = [tmp_path / f"candidate-{index}.log" for index in range(3)]
    fleet.extend(start_candidate(dsn, lock_name, log, **options) for log in logs)
    for proc in fleet:
        ready(proc)
    by_pid = {proc.pid: proc for proc in fleet}

    def current() -> tuple[float, float | None, int, int]:
        wait_until(lambda: any(end is None for _, end, _, _ in read_terms(*logs)), timeout=20)
        return next(term for term in read_terms(*logs) if term[1] is None)

    def next_leader(after: int) -> tuple[float, float | None, int, int]:
        wait_until(lambda: any(term[2] > after for term in read_terms(*logs)), timeout=20)
        return next(term for term in read_terms(*logs) if term[2] > after)

    _, _, first_token, first_pid = current()
    stopped_at = time.monotonic()
    by_pid[first_pid].send_signal(signal.SIGTERM)
    second_begin, _, second_token, second_pid = next_leader(first_token)
    assert second_begin - stopped_at < 2.0, "a graceful stop hands over at once, long before stale_threshold"
    assert by_pid[first_pid].wait(timeout=10) == 0

    killed_at = time.monotonic()
    by_pid[second_pid].kill()
    third_begin, _, _, third_pid = next_leader(second_token)
    assert third_pid not in (first_pid, second_pid)
    silent = third_begin - killed_at
    assert silent >= options["stale_threshold"] - 2 * options["heartbeat_interval"], "reclaimed only once stale"
    assert silent < options["stale_threshold"] + 10, "the standby took over after the stale threshold"
    by_pid[third_pid].send_signal(signal.SIGTERM)
    assert by_pid[third_pid].wait(timeout=10) == 0
    # The crashed leader's term has no end: check the others' order around it.
    terms = read_terms(*logs)
    assert [term[2] for term in terms] == sorted(term[2] for term in terms)
    assert_one_leader_at_a_time([term for term in terms if term[3] != second_pid])


# -- losing leadership ------------------------------------------------------------------------


def test_lead_is_told_at_once_when_its_row_is_deleted_and_the_candidate_campaigns_again(
    make_election: Make, candidates: list[Candidate], dsn: str, lock_name: str
) -> None:
    candidate = Candidate(make_election())
    candidates.append(candidate.start())
    wait_until(candidate.leading)
    term = candidate.terms[0]
    removed = LockTable(dsn).force_release(lock_name)
    assert removed is not None
    assert removed.token == term.token
    deleted_at = time.monotonic()
    assert term.ended.wait(5)
    told = time.monotonic() - deleted_at
    assert told < 1.0, f"told {told:.2f}s after the row was deleted (heartbeat_interval is 0.1s)"
    assert term.lost
    assert term.reason is not None
    assert "deleted or taken over" in term.reason
    with pytest.raises(LockNotHeldError, match="lost"):
        term.ensure_held()
    wait_until(lambda: len(candidate.terms) == 2)  # campaigns again, and leads again
    assert candidate.terms[1].token is not None
    assert term.token is not None
    assert candidate.terms[1].token > term.token
    candidate.stop()


def test_lead_is_told_when_a_partition_outlasts_the_lease(
    make_election: Make, candidates: list[Candidate], proxy: FaultProxy, proxy_dsn: str
) -> None:
    candidate = Candidate(make_election(proxy_dsn, operation_timeout=0.3))
    candidates.append(candidate.start())
    wait_until(candidate.leading)
    term = candidate.terms[0]
    proxy.silence()
    silenced_at = time.monotonic()
    assert term.ended.wait(10)
    lease = FAST["stale_threshold"] - FAST["heartbeat_interval"]
    told = time.monotonic() - silenced_at
    assert told < lease + 1.0, f"told {told:.2f}s after the partition; the lease is {lease:g}s"
    assert term.lost
    assert not candidate.election.leading
    proxy.heal()
    wait_until(lambda: len(candidate.terms) == 2, timeout=20)
    candidate.stop()


class SlowToTell(ExtendedMetricsHook):
    """A hook that keeps the client's event thread busy past the lease's end: the loss is reported late."""

    def lease_running_out(self, lock_name: str, *, instance_id: str, seconds_left: float) -> None:
        time.sleep(seconds_left + 1.0)


def test_a_term_frozen_past_its_lease_reads_as_ended_at_once_whatever_reports_it(
    make_election: Make, candidates: list[Candidate]
) -> None:
    # The event thread that reports the loss is busy in a slow hook; the lease ends on time all the same,
    # and every flag says so from that moment, consistently: never held=False with ended unset.
    candidate = Candidate(make_election(metrics=SlowToTell()))
    candidates.append(candidate.start())
    wait_until(candidate.leading)
    term = candidate.terms[0]
    woken: list[float] = []
    waiter = threading.Thread(target=lambda: woken.append(time.monotonic()) if term.ended.wait(10) else None)
    waiter.start()
    freeze(candidate.election._mutex)
    inconsistent: list[tuple[bool, bool, bool, str | None]] = []
    seen_lost_at = None
    limit = time.monotonic() + FAST["stale_threshold"] + 5
    for _ in range(10_000_000):
        held, ended, lost, reason = term.held, term.ended.is_set(), term.lost, term.reason
        if not held and not (ended and lost and reason):
            inconsistent.append((held, ended, lost, reason))
        if not held:
            seen_lost_at = time.monotonic()
            break
        if time.monotonic() > limit:
            break
    assert seen_lost_at is not None, "the lease never ran out"
    assert inconsistent == [], "held was False while ended, lost or reason did not say so"
    assert term.reason is not None
    assert "lease" in term.reason
    waiter.join(10)
    assert woken, "ended.wait() was never woken"
    late = woken[0] - seen_lost_at
    assert late < 0.3, f"ended.wait() woke {late:.2f}s after the lease ran out: when the loss was reported"


def test_a_lead_that_ignores_the_loss_is_reported_past_the_grace_period(
    make_election: Make,
    candidates: list[Candidate],
    dsn: str,
    lock_name: str,
    metrics: RecordingMetrics,
    caplog: pytest.LogCaptureFixture,
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    let_go = threading.Event()
    stubborn = Candidate(
        make_election(grace_period=0.3, metrics=metrics, tracer_provider=provider),
        lead=lambda leadership: let_go.wait(30),
    )
    candidates.append(stubborn.start())
    wait_until(stubborn.leading)
    LockTable(dsn).force_release(lock_name)
    wait_until(lambda: metrics.named("election_grace_overrun"), timeout=5)
    (overrun,) = metrics.named("election_grace_overrun")
    assert overrun["seconds"] >= 0.3
    assert "lost" in overrun["reason"]
    assert any(
        record.levelno == logging.ERROR and "past grace_period" in record.getMessage() for record in caplog.records
    )
    assert stubborn.returned == [], "still running: an election cannot stop a thread"
    let_go.set()
    wait_until(lambda: metrics.named("election_term_ended"))
    stubborn.stop()
    ended = metrics.named("election_term_ended")[0]
    assert ended["ended"] == "lost"
    (span,) = [span for span in exporter.get_finished_spans() if span.name == "postgres_mutex.election.term"][:1]
    assert span.attributes is not None
    assert span.attributes["postgres_mutex.outcome"] == "lost"
    assert span.attributes["postgres_mutex.token"] == stubborn.terms[0].token
    events = [event.name for event in span.events]
    assert events == ["postgres_mutex.election.ending", "postgres_mutex.election.grace_overrun"]
    assert not span.status.is_ok
    provider.shutdown()


class _StuckOnOverrun(RecordingMetrics):
    """A metrics hook whose report of a grace overrun hangs, as a call to a backend that does not answer."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.unstuck = threading.Event()

    def election_grace_overrun(self, *args: Any, **kwargs: Any) -> None:
        self.entered.set()
        self.unstuck.wait(30)


def test_a_stuck_metrics_hook_does_not_keep_the_lock_once_lead_returned(
    make_election: Make,
    candidates: list[Candidate],
    admin: psycopg.Connection[Any],
    lock_name: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The term's end is reported by a thread of its own; once lead returns, the release waits for it within
    operation_timeout, not for as long as a hook hangs."""
    hook = _StuckOnOverrun()
    let_go = threading.Event()
    slow = Candidate(make_election(grace_period=0.2, metrics=hook), lead=lambda leadership: let_go.wait(30))
    candidates.append(slow.start())
    try:
        wait_until(slow.leading)
        slow.election.stop()
        assert hook.entered.wait(10), "the grace period's overrun was never reported"
        let_go.set()
        returned = time.monotonic()
        bound = FAST["operation_timeout"]
        wait_until(lambda: token_in_table(admin, lock_name) is None, timeout=bound + 3)
        released = time.monotonic() - returned
        assert released < bound + 3, f"released {released:.2f}s after lead returned"
        slow.thread.join(10)
        assert not slow.thread.is_alive(), "run() did not return after stop()"
        assert any(
            record.levelno == logging.WARNING and "reporting the end of the term" in record.getMessage()
            for record in caplog.records
        )
    finally:
        hook.unstuck.set()


# -- failing leads ---------------------------------------------------------------------------------


def test_a_lead_that_keeps_failing_backs_off_instead_of_spinning(
    make_election: Make, candidates: list[Candidate], metrics: RecordingMetrics, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[float] = []

    def failing(leadership: Leadership) -> None:
        calls.append(time.monotonic())
        raise RuntimeError("the scheduler's config is broken")

    candidate = Candidate(make_election(failure_backoff=0.2, max_failure_backoff=0.4, metrics=metrics), lead=failing)
    candidates.append(candidate.start())
    wait_until(lambda: len(calls) >= 4)
    window_start = time.monotonic()
    counted = len(calls)
    time.sleep(1.2)  # the window in which attempts are counted
    in_window = len(calls) - counted
    window = time.monotonic() - window_start
    candidate.stop()
    assert in_window <= window / 0.4 + 1, f"{in_window} attempts in {window:.1f}s: the back-off is capped at 0.4s"
    gaps = [later - earlier for earlier, later in itertools.pairwise(calls)]
    assert gaps[0] >= 0.2 * 0.9, "the first failure waits failure_backoff"
    assert all(gap >= 0.4 * 0.9 for gap in gaps[1:]), "later ones wait the doubled back-off, capped"
    failures = metrics.named("election_lead_failed")
    ended = [term["ended"] for term in metrics.named("election_term_ended")]
    assert len(ended) == len(calls), "every call of lead is one term"
    # stop() may land while the last call runs: that term ends "stopped", not counted as a failure
    assert set(ended[:-1]) == {"failed"}, ended
    assert ended[-1] in {"failed", "stopped"}, ended
    assert len(failures) == ended.count("failed")
    assert [failure["backoff"] for failure in failures[:3]] == [0.2, 0.4, 0.4]
    logged = [record for record in caplog.records if "lead raised RuntimeError" in record.getMessage()]
    assert logged
    assert logged[0].levelno == logging.ERROR
    assert logged[0].exc_info is not None, "with its traceback"


def test_an_interruption_in_lead_releases_the_lock_and_ends_the_run(
    make_election: Make, admin: psycopg.Connection[Any], lock_name: str
) -> None:
    election = make_election()

    def interrupted(leadership: Leadership) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        election.run(interrupted)
    assert token_in_table(admin, lock_name) is None


# -- async -------------------------------------------------------------------------------------


async def test_an_async_lead_is_cancelled_when_leadership_is_lost(
    make_election: Make, dsn: str, lock_name: str
) -> None:
    election = make_election()
    terms: asyncio.Queue[Leadership] = asyncio.Queue()
    cancelled = asyncio.Event()

    async def lead(leadership: Leadership) -> None:
        await terms.put(leadership)
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    running = asyncio.create_task(election.run_async(lead))
    first = await asyncio.wait_for(terms.get(), 10)
    await LockTable(dsn).force_release_async(lock_name)
    deleted_at = time.monotonic()
    await asyncio.wait_for(cancelled.wait(), 5)
    assert time.monotonic() - deleted_at < 1.0, "cancelled at once"
    assert first.lost
    second = await asyncio.wait_for(terms.get(), 10)  # it campaigned again, and leads again
    assert second.token is not None
    assert first.token is not None
    assert second.token > first.token
    election.stop()
    await asyncio.wait_for(running, 5)
    assert second.ended.is_set()
    assert not second.lost
    await election.aclose()


async def test_an_async_run_stops_from_the_loop_and_hands_over(
    make_election: Make, admin: psycopg.Connection[Any], lock_name: str
) -> None:
    election = make_election()

    async def lead(leadership: Leadership) -> None:
        assert election.leading
        election.stop()  # from the loop itself
        await asyncio.sleep(60)  # cancelled by the stop

    started = time.monotonic()
    await asyncio.wait_for(election.run_async(lead), 10)
    assert time.monotonic() - started < 5
    assert token_in_table(admin, lock_name) is None, "released once the lead task ended"
    await election.aclose()


async def test_cancelling_run_async_cancels_lead_and_releases(
    make_election: Make, admin: psycopg.Connection[Any], lock_name: str
) -> None:
    election = make_election()
    leading = asyncio.Event()

    async def lead(leadership: Leadership) -> None:
        leading.set()
        await asyncio.sleep(60)

    running = asyncio.create_task(election.run_async(lead))
    await asyncio.wait_for(leading.wait(), 10)
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    assert token_in_table(admin, lock_name) is None
    await election.aclose()


# -- observability -------------------------------------------------------------------------------


def test_metrics_show_who_leads_each_term_and_how_it_ended(
    make_election: Make, candidates: list[Candidate], lock_name: str
) -> None:
    registry = CollectorRegistry()
    hook = PrometheusMetrics(registry)
    candidate = Candidate(make_election(metrics=hook))

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"lock_name": lock_name, **labels})

    candidates.append(candidate.start())
    wait_until(candidate.leading)
    assert value("postgres_mutex_election_leading") == 1
    assert value("postgres_mutex_election_candidates") == 1
    assert value("postgres_mutex_election_terms_total") == 1
    candidate.election.resign()
    wait_until(lambda: len(candidate.terms) == 2)
    candidate.stop()
    assert value("postgres_mutex_election_leading") == 0
    assert value("postgres_mutex_election_candidates") == 0
    assert value("postgres_mutex_election_terms_total") == 2
    assert value("postgres_mutex_election_term_duration_seconds_count", ended="resigned") == 1
    assert value("postgres_mutex_election_term_duration_seconds_count", ended="stopped") == 1


def test_a_hook_written_before_elections_keeps_working(make_election: Make, candidates: list[Candidate]) -> None:
    seen: list[str] = []

    class OldHook:
        def acquired(self, lock_name: str, *, instance_id: str) -> None:
            seen.append(lock_name)

    candidate = Candidate(make_election(metrics=OldHook()))
    candidates.append(candidate.start())
    wait_until(candidate.leading)
    candidate.stop()
    assert seen == [candidate.election.name]


def test_fencing_with_a_term_rejects_a_former_leaders_writes(
    make_election: Make, candidates: list[Candidate], dsn: str, lock_name: str
) -> None:
    candidate = Candidate(make_election())
    candidates.append(candidate.start())
    wait_until(candidate.leading)
    term = candidate.terms[0]
    with psycopg.connect(dsn) as conn, term.fenced(conn) as token:
        assert token == term.token
    LockTable(dsn).force_release(lock_name)
    wait_until(lambda: len(candidate.terms) == 2)
    with psycopg.connect(dsn) as conn, pytest.raises(LockNotHeldError):
        term.fence(conn)  # the old term, though the same Mutex holds the lock again
    candidate.stop()


def test_a_lead_fenced_out_ends_its_term_as_lost_not_as_a_failure(
    make_election: Make, dsn: str, lock_name: str, metrics: RecordingMetrics
) -> None:
    # The row is deleted and the heartbeat is slow to notice: the fenced write is the first to know.
    election = make_election(heartbeat_interval=0.5, alert_threshold=1.0, stale_threshold=3.0, metrics=metrics)

    def lead(leadership: Leadership) -> None:
        LockTable(dsn).force_release(lock_name)
        try:
            with psycopg.connect(dsn) as conn, leadership.fenced(conn):
                pass  # never reached: fenced out
        finally:
            election.stop()  # one term is enough

    election.run(lead)
    (ended,) = metrics.named("election_term_ended")
    assert ended["ended"] == "lost"
    assert metrics.named("election_lead_failed") == [], "no back-off for a lost term"


# -- bad input -----------------------------------------------------------------------------------


def test_bad_arguments_are_refused_naming_them(dsn: str) -> None:
    with pytest.raises(TypeError, match="needs a name"):
        Election(dsn)
    with pytest.raises(ValueError, match="grace_period"):
        Election(dsn, "job", grace_period=-1)
    with pytest.raises(ValueError, match="max_failure_backoff"):
        Election(dsn, "job", failure_backoff=5, max_failure_backoff=1)
    with pytest.raises(ValueError, match="alert_threshold"):
        Election(dsn, "job", heartbeat_interval=10, alert_threshold=5)


def test_misuse_of_run_is_refused(make_election: Make, candidates: list[Candidate]) -> None:
    election = make_election()

    async def async_lead(leadership: Leadership) -> None:
        pass

    with pytest.raises(TypeError, match="run_async"):
        election.run(async_lead)
    with pytest.raises(TypeError, match="callable"):
        election.run("lead")  # type: ignore[arg-type]
    candidate = Candidate(election)
    candidates.append(candidate.start())
    wait_until(candidate.leading)
    with pytest.raises(MutexError, match="running already"):
        election.run(lambda leadership: None)
    candidate.stop()


async def test_a_follower_in_async_code_sees_who_leads_and_each_change(
    make_election: Make, admin: psycopg.Connection[Any], lock_name: str
) -> None:
    follower = make_election()  # never runs: it only asks who leads
    assert await follower.leader_async() is None
    admin.execute(
        "INSERT INTO mutex_lock (lock_name, instance_id, last_heartbeat, acquired_at) "
        "VALUES (%s, 'far-host', now(), now())",
        (lock_name,),
    )
    seen = await follower.leader_async()
    assert seen is not None
    assert seen.instance_id == "far-host"
    sync_seen = follower.leader()
    assert sync_seen is not None
    assert sync_seen.instance_id == seen.instance_id
    changes: list[str | None] = []

    async def watch() -> None:
        async for leader in follower.watch_leader_async(interval=0.05):
            changes.append(None if leader is None else leader.instance_id)
            if len(changes) == 1:
                admin.execute("DELETE FROM mutex_lock WHERE lock_name = %s", (lock_name,))
            if len(changes) == 2:
                return

    await asyncio.wait_for(watch(), timeout=30)
    assert changes == ["far-host", None], "the leader, then its end: each change once"
