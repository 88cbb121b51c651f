"""Every metric postgres-mutex emits, in one table shared by all exporters.

Each metric has an OpenTelemetry name (dotted, with a UCUM unit) chosen so that
an OpenTelemetry SDK exporting to Prometheus produces exactly the series name
`PrometheusMetrics` registers: dots become underscores, the unit ``s`` becomes
a ``_seconds`` suffix, counters gain ``_total``, and annotation units such as
``{lock}`` add nothing. One Grafana dashboard and one set of alert rules
therefore serve both paths. The tests check the mapping with the SDK's own
Prometheus exporter.

Labels stay bounded: ``lock_name`` everywhere, ``outcome`` on acquire
durations (`ACQUIRE_OUTCOMES`), ``reason`` on reclaims (`RECLAIM_REASONS`),
``ended`` on election terms (`TERM_ENDINGS`),
``holder`` only on the watcher's info metric, ``permit`` (a semaphore's permit number,
at most its N) on the watcher's per-holder gauges, ``mode`` (``read`` or ``write`` for a
read/write lock, empty otherwise) on those gauges, the waiters, alerts and reclaims.
A process's random instance_id never labels a counter or a histogram.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["counter", "histogram", "updowncounter", "gauge"]


@dataclass(frozen=True)
class MetricName:
    otel: str
    """The OpenTelemetry instrument name."""
    kind: Kind
    unit: str
    """UCUM unit for OpenTelemetry: ``s`` for seconds, ``{thing}`` for counts."""
    description: str
    labels: tuple[str, ...] = ("lock_name",)
    buckets: tuple[float, ...] = ()
    """A histogram's bucket boundaries (both exporters use them); empty for any other kind."""

    @property
    def prometheus(self) -> str:
        """The series name in Prometheus (histograms add ``_bucket``, ``_sum``, ``_count``)."""
        name = self.otel.replace(".", "_")
        if self.unit == "s":
            name += "_seconds"
        if self.kind == "counter":
            name += "_total"
        return name


HEARTBEAT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Histogram buckets for heartbeat round trips: milliseconds when healthy, seconds when not."""

WAIT_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 600.0, 1800.0, 3600.0)
"""Histogram buckets for acquire durations: an instant when free, up to the stale threshold and beyond."""

TERM_BUCKETS = (0.1, 1.0, 10.0, 60.0, 600.0, 3600.0, 21600.0, 86400.0)
"""Histogram buckets for terms of leadership: a failing ``lead`` lasts an instant, a healthy leader days."""


ACQUISITIONS = MetricName(
    "postgres_mutex.acquisitions", "counter", "{acquisition}", "Locks acquired (reclaims included)."
)
RELEASES = MetricName("postgres_mutex.releases", "counter", "{release}", "Locks released (row deleted).")
CONTENTIONS = MetricName(
    "postgres_mutex.contentions", "counter", "{attempt}", "Acquire attempts that found the lock held elsewhere."
)
STALE_RECLAIMS = MetricName(
    "postgres_mutex.stale_reclaims",
    "counter",
    "{reclaim}",
    "Locks taken over from a silent holder, by reason: stale (past stale_threshold) or disconnected "
    "(its session ended, past its reclaim_disconnected_after).",
    ("lock_name", "mode", "reason"),
)
ALERTS = MetricName(
    "postgres_mutex.alerts",
    "counter",
    "{alert}",
    "Holders silent past alert_threshold, once per episode.",
    ("lock_name", "mode"),
)
LOSSES = MetricName(
    "postgres_mutex.losses", "counter", "{loss}", "Locks a holder lost: its lease ran out or its row was gone."
)
DOUBTS = MetricName(
    "postgres_mutex.doubts",
    "counter",
    "{doubt}",
    "Holds with reclaim_disconnected_after that turned in doubt: not held until a heartbeat confirms them.",
)
LEASES_RUNNING_OUT = MetricName(
    "postgres_mutex.lease.running_out",
    "counter",
    "{hold}",
    "Holds that went two thirds of the time they are trusted without a heartbeat (their lease, or sooner "
    "their reclaim_disconnected_after) without a successful one.",
)
HEARTBEAT_FAILURES = MetricName(
    "postgres_mutex.heartbeat.failures", "counter", "{failure}", "Heartbeats that failed (and were retried)."
)
HEARTBEAT_DURATION = MetricName(
    "postgres_mutex.heartbeat.duration",
    "histogram",
    "s",
    "Round-trip time of successful heartbeats.",
    buckets=HEARTBEAT_BUCKETS,
)
ACQUIRE_DURATION = MetricName(
    "postgres_mutex.acquire.duration",
    "histogram",
    "s",
    "Time an acquire took, waiting included, by outcome.",
    ("lock_name", "outcome"),
    buckets=WAIT_BUCKETS,
)
LOCKS_HELD = MetricName(
    "postgres_mutex.locks.held",
    "updowncounter",
    "{lock}",
    "Locks held by this process; for a semaphore, the permits its holders in this process hold.",
)
WAITERS = MetricName(
    "postgres_mutex.waiters",
    "updowncounter",
    "{waiter}",
    "Blocking acquires of this process waiting for a release of the lock (or of a permit of the semaphore, or "
    "for the read/write lock in the mode they ask for).",
    ("lock_name", "mode"),
)

# The stale-holder watcher's view of the table, computed with the server's clock.
# Per holder: a mutex's one, or each permit's of a semaphore (``lock_name`` is then the
# semaphore's name and ``permit`` its number; ``permit`` is empty for a mutex), or a read/write
# lock's writer and its readers (``mode``; its readers as one, the one silent longest, so that
# the series stay two per read/write lock however many read).
PER_HOLDER = ("lock_name", "permit", "mode")
HEARTBEAT_AGE = MetricName(
    "postgres_mutex.heartbeat.age",
    "gauge",
    "s",
    "Seconds since the holder's last heartbeat (server clock).",
    PER_HOLDER,
)
HELD_DURATION = MetricName(
    "postgres_mutex.held.duration", "gauge", "s", "Seconds the holder has held the lock.", PER_HOLDER
)
HOLDER_INFO = MetricName(
    "postgres_mutex.holder.info",
    "gauge",
    "",
    "The current holder of each lock, or of each permit of a semaphore (value 1).",
    (*PER_HOLDER, "holder"),
)
ALERTING = MetricName(
    "postgres_mutex.alerting", "gauge", "", "1 while the holder is silent past alert_threshold.", PER_HOLDER
)
RECLAIMABLE = MetricName(
    "postgres_mutex.reclaimable",
    "gauge",
    "",
    "1 while the holder may be reclaimed: silent past stale_threshold, or its session ended and it is silent "
    "past its reclaim_disconnected_after.",
    PER_HOLDER,
)
SESSION_ALIVE = MetricName(
    "postgres_mutex.holder.session",
    "gauge",
    "",
    "1 while the holder's database session exists, 0 once it ended; absent for a holder whose row names none.",
    PER_HOLDER,
)
ALERT_THRESHOLD = MetricName(
    "postgres_mutex.threshold.alert",
    "gauge",
    "s",
    "The watcher's alert_threshold, for drawing on graphs.",
    PER_HOLDER,
)
STALE_THRESHOLD = MetricName(
    "postgres_mutex.threshold.stale",
    "gauge",
    "s",
    "The watcher's stale_threshold, for drawing on graphs.",
    PER_HOLDER,
)
PERMITS_IN_USE = MetricName(
    "postgres_mutex.semaphore.permits.in_use",
    "gauge",
    "{permit}",
    "Permits of each semaphore held across the fleet, as the watcher read the table.",
)
RWLOCK_HOLDERS = MetricName(
    "postgres_mutex.rwlock.holders",
    "gauge",
    "{holder}",
    "Holders of each read/write lock across the fleet, by mode (readers, or 1 writer), as the watcher read the table.",
    ("lock_name", "mode"),
)
RWLOCK_WRITER_WAITING = MetricName(
    "postgres_mutex.rwlock.writer_waiting",
    "gauge",
    "",
    "1 while a writer waits for the read/write lock, holding new readers back, as the watcher read the table.",
)
WATCHER_UP = MetricName(
    "postgres_mutex.watcher.up", "gauge", "", "1 if the watcher's last read of the lock table succeeded.", ()
)
WATCHER_ERRORS = MetricName(
    "postgres_mutex.watcher.errors", "counter", "{error}", "Watcher reads of the lock table that failed.", ()
)

# Elections (`postgres_mutex.election`): reported by each candidate's process. The
# election's name is its lock's name, so these carry ``lock_name`` like the rest.
ELECTION_CANDIDATES = MetricName(
    "postgres_mutex.election.candidates",
    "updowncounter",
    "{candidate}",
    "Candidates of this process in each election, campaigning or leading.",
)
ELECTION_LEADING = MetricName(
    "postgres_mutex.election.leading",
    "updowncounter",
    "{leader}",
    "1 while a candidate of this process leads the election, 0 while its candidates only campaign.",
)
ELECTION_TERMS = MetricName(
    "postgres_mutex.election.terms", "counter", "{term}", "Terms of leadership begun: each one a change of leader."
)
ELECTION_TERM_DURATION = MetricName(
    "postgres_mutex.election.term.duration",
    "histogram",
    "s",
    "How long terms lasted, by how they ended.",
    ("lock_name", "ended"),
    buckets=TERM_BUCKETS,
)
ELECTION_LEAD_FAILURES = MetricName(
    "postgres_mutex.election.lead_failures",
    "counter",
    "{failure}",
    "Terms whose lead raised an exception; each is followed by a back-off.",
)
ELECTION_GRACE_OVERRUNS = MetricName(
    "postgres_mutex.election.grace_overruns",
    "counter",
    "{overrun}",
    "Terms whose lead was still running grace_period after it was told to stop leading.",
)

RW_MODES = ("read", "write")
"""Values of the ``mode`` label for a read/write lock; it is empty for a mutex or a semaphore."""

ACQUIRE_OUTCOMES = ("acquired", "reclaimed", "contended", "timeout", "error")
"""Values of the ``outcome`` label of `ACQUIRE_DURATION`."""

RECLAIM_REASONS = ("stale", "disconnected")
"""Values of the ``reason`` label of `STALE_RECLAIMS`: silent past ``stale_threshold``; or a holder with
``reclaim_disconnected_after`` whose database session had ended."""

TERM_ENDINGS = ("returned", "resigned", "stopped", "lost", "failed")
"""Values of the ``ended`` label of `ELECTION_TERM_DURATION`: ``lead`` returned, ``resign()``,
``stop()`` (or the run was interrupted), the lock was lost, ``lead`` raised."""

ALL: tuple[MetricName, ...] = (
    ACQUISITIONS,
    RELEASES,
    CONTENTIONS,
    STALE_RECLAIMS,
    ALERTS,
    LOSSES,
    DOUBTS,
    LEASES_RUNNING_OUT,
    HEARTBEAT_FAILURES,
    HEARTBEAT_DURATION,
    ACQUIRE_DURATION,
    LOCKS_HELD,
    WAITERS,
    HEARTBEAT_AGE,
    HELD_DURATION,
    HOLDER_INFO,
    ALERTING,
    RECLAIMABLE,
    SESSION_ALIVE,
    ALERT_THRESHOLD,
    STALE_THRESHOLD,
    PERMITS_IN_USE,
    RWLOCK_HOLDERS,
    RWLOCK_WRITER_WAITING,
    WATCHER_UP,
    WATCHER_ERRORS,
    ELECTION_CANDIDATES,
    ELECTION_LEADING,
    ELECTION_TERMS,
    ELECTION_TERM_DURATION,
    ELECTION_LEAD_FAILURES,
    ELECTION_GRACE_OVERRUNS,
)


def prometheus_series() -> frozenset[str]:
    """Every series name that can appear in Prometheus, histogram suffixes included."""
    names: set[str] = set()
    for metric in ALL:
        if metric.kind == "histogram":
            names.update(metric.prometheus + suffix for suffix in ("_bucket", "_sum", "_count"))
        else:
            names.add(metric.prometheus)
    return frozenset(names)
