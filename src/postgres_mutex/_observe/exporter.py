"""What the built-in exporters share: two tables from what the library reports to metrics.

`ON_CALL` says, one line per metric a hook call moves, what the call does to
it; `GAUGES` says, one line per watcher gauge, how it is read from what the
watcher last saw (`LockTableView`). `PrometheusMetrics` and `OtelMetrics`
make one instrument per entry of `metric_names.ALL`, by its kind, and supply
three primitives (count, record, move a level): neither names a metric, so
both produce the same series, and a new metric is its event, its entry in
`metric_names` and its line here.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

from .. import metric_names as names
from .hooks import HOOK_METHODS, ExtendedMetricsHook, LockObservation

Call = Mapping[str, object]
"""One hook call's arguments by name, defaults included: ``{"lock_name": ..., "instance_id": ..., ...}``."""


def labels_of(metric: names.MetricName, call: Call) -> dict[str, str]:
    """The metric's labels, each the call's argument of that name (None, or not given: empty)."""
    labels = {}
    for label in metric.labels:
        value = call.get(label)
        labels[label] = "" if value is None else str(value)
    return labels


@dataclass(frozen=True)
class Count:
    """A counter's one more, per call."""

    metric: names.MetricName


@dataclass(frozen=True)
class Record:
    """A histogram's observation of the call's argument ``value``."""

    metric: names.MetricName
    value: str


@dataclass(frozen=True)
class Move:
    """An up-down gauge moved by ``delta`` per call (0 makes its series appear)."""

    metric: names.MetricName
    delta: int


@dataclass(frozen=True)
class Hold:
    """An up-down gauge of what each instance holds: +1 when it begins, -1 when it ends, counted from a set.

    A repeated call cannot count twice: ``released`` after ``lost`` (a lost lock's row cleaned up on
    exit) moves the gauge once.
    """

    metric: names.MetricName
    delta: int


@dataclass(frozen=True)
class Watch:
    """The call is a watcher's: it changes what the watcher gauges (`GAUGES`) read."""


Action = Count | Record | Move | Hold | Watch

ON_CALL: tuple[tuple[str, Action], ...] = (
    ("acquired", Count(names.ACQUISITIONS)),
    ("acquired", Hold(names.LOCKS_HELD, +1)),
    ("released", Count(names.RELEASES)),
    ("released", Hold(names.LOCKS_HELD, -1)),
    ("lost", Count(names.LOSSES)),
    ("lost", Hold(names.LOCKS_HELD, -1)),
    ("release_failed", Hold(names.LOCKS_HELD, -1)),
    ("contended", Count(names.CONTENTIONS)),
    ("stale_reclaimed", Count(names.STALE_RECLAIMS)),
    ("alert", Count(names.ALERTS)),
    ("lease_running_out", Count(names.LEASES_RUNNING_OUT)),
    ("hold_in_doubt", Count(names.DOUBTS)),
    ("heartbeat_latency", Record(names.HEARTBEAT_DURATION, "seconds")),
    ("heartbeat_failed", Count(names.HEARTBEAT_FAILURES)),
    ("acquire_wait", Record(names.ACQUIRE_DURATION, "seconds")),
    ("waiting", Move(names.WAITERS, +1)),
    ("stopped_waiting", Move(names.WAITERS, -1)),
    ("observed", Watch()),
    ("watcher_failed", Count(names.WATCHER_ERRORS)),
    ("watcher_failed", Watch()),
    ("watcher_stopped", Watch()),
    ("election_started", Hold(names.ELECTION_CANDIDATES, +1)),
    ("election_started", Move(names.ELECTION_LEADING, 0)),  # campaigning: the election's series exist, at 0
    ("election_stopped", Hold(names.ELECTION_LEADING, -1)),
    ("election_stopped", Hold(names.ELECTION_CANDIDATES, -1)),
    ("election_term_began", Count(names.ELECTION_TERMS)),
    ("election_term_began", Hold(names.ELECTION_LEADING, +1)),
    ("election_term_ended", Record(names.ELECTION_TERM_DURATION, "seconds")),
    ("election_term_ended", Hold(names.ELECTION_LEADING, -1)),
    ("election_lead_failed", Count(names.ELECTION_LEAD_FAILURES)),
    ("election_grace_overrun", Count(names.ELECTION_GRACE_OVERRUNS)),
)
"""What each hook call does to the metrics, in order: one line per metric it moves."""


class ExporterHook(ExtendedMetricsHook):
    """Every hook call, applied to the metrics by `ON_CALL`; the built-in exporters supply three primitives.

    Subclasses create one instrument per entry of `metric_names.ALL` and
    implement `_add` (a counter), `_record` (a histogram) and `_level` (an
    up-down gauge). The watcher gauges are read from `view` at collection
    time, by `GAUGES`.
    """

    def __init__(self) -> None:
        self.view = LockTableView()
        self._holds: dict[names.MetricName, set[tuple[tuple[str, ...], str]]] = {
            action.metric: set() for _, action in ON_CALL if isinstance(action, Hold)
        }
        """What each instance of this process holds (a lock, a candidacy, a lead), per `Hold` gauge."""
        self._holds_lock = threading.Lock()
        self._on_call: dict[str, list[Action]] = {}
        for method, action in ON_CALL:
            self._on_call.setdefault(method, []).append(action)

    def _add(self, metric: names.MetricName, labels: dict[str, str]) -> None:
        raise NotImplementedError

    def _record(self, metric: names.MetricName, value: float, labels: dict[str, str]) -> None:
        raise NotImplementedError

    def _level(self, metric: names.MetricName, labels: dict[str, str], delta: int) -> None:
        raise NotImplementedError

    def _apply(self, method: str, call: Call) -> None:
        for action in self._on_call.get(method, ()):
            match action:
                case Watch():
                    self.view.tell(call)
                case Count(metric):
                    self._add(metric, labels_of(metric, call))
                case Record(metric, value):
                    self._record(metric, cast(float, call[value]), labels_of(metric, call))
                case Move(metric, delta):
                    self._level(metric, labels_of(metric, call), delta)
                case Hold(metric, delta):
                    labels = labels_of(metric, call)
                    key = (tuple(labels.values()), str(call["instance_id"]))
                    with self._holds_lock:
                        held = self._holds[metric]
                        moved = (key in held) != (delta > 0)
                        if delta > 0:
                            held.add(key)
                        else:
                            held.discard(key)
                    if moved:
                        self._level(metric, labels, delta)


def _applying(method: str) -> Callable[..., None]:
    """The hook method ``method`` of `ExporterHook`: its arguments by name, then `ON_CALL`'s lines for it."""
    declared = getattr(ExtendedMetricsHook, method)
    signature = inspect.signature(declared)
    parameters = list(signature.parameters.values())[1:]  # past self
    positional = [p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD]
    defaults = {p.name: p.default for p in parameters if p.default is not p.empty}

    def apply(self: ExporterHook, *args: object, **kwargs: object) -> None:
        call = dict(defaults)
        call.update(zip(positional, args, strict=False))
        call.update(kwargs)
        self._apply(method, call)

    apply.__name__ = apply.__qualname__ = method
    apply.__doc__ = declared.__doc__
    apply.__signature__ = signature  # type: ignore[attr-defined]
    return apply


for _method in HOOK_METHODS:
    setattr(ExporterHook, _method, _applying(_method))


@dataclass(frozen=True)
class WatchedLock:
    observation: LockObservation
    alert_threshold: float
    stale_threshold: float

    @property
    def name(self) -> str:
        """The name users gave it: the mutex's, the semaphore's or the read/write lock's (not its row's)."""
        return self.observation.name

    @property
    def labels(self) -> dict[str, str]:
        """The per-holder gauges' labels (`metric_names.PER_HOLDER`): the name, the permit of a semaphore's
        holder, the mode of a read/write lock's."""
        permit = self.observation.permit
        return {
            "lock_name": self.name,
            "permit": "" if permit is None else str(permit),
            "mode": self.observation.mode or "",
        }


def per_holder(locks: Sequence[WatchedLock]) -> list[WatchedLock]:
    """The holders the per-holder gauges show: each, but a read/write lock's readers as one.

    Readers come and go without bound, each with a row of its own; one series per reader would grow
    Prometheus without limit. The one shown is the reader silent longest: the one an alert is about.
    """
    shown: dict[tuple[str, str], WatchedLock] = {}
    for lock in locks:
        seen = lock.observation
        key = (lock.name, "read") if seen.mode == "read" else (seen.lock_name, "")  # else: by row, its own
        other = shown.get(key)
        if other is None or seen.seconds_since_heartbeat > other.observation.seconds_since_heartbeat:
            shown[key] = lock
    return list(shown.values())


def rwlock_holders(locks: Sequence[WatchedLock]) -> dict[tuple[str, str], int]:
    """Per read/write lock watched and held, how many hold it in each mode (both modes given, 0 included)."""
    counts: dict[tuple[str, str], int] = {}
    for lock in locks:
        seen = lock.observation
        if seen.rwlock is not None and seen.mode is not None:
            for mode in names.RW_MODES:
                counts.setdefault((seen.rwlock, mode), 0)
            counts[seen.rwlock, seen.mode] += 1
    return counts


def writers_waiting(locks: Sequence[WatchedLock]) -> dict[str, int]:
    """Per read/write lock watched and held: 1 while a writer waits for it, else 0."""
    waiting: dict[str, int] = {}
    for lock in locks:
        seen = lock.observation
        if seen.rwlock is not None and seen.writer_waiting is not None:
            waiting[seen.rwlock] = max(waiting.get(seen.rwlock, 0), int(seen.writer_waiting))
    return waiting


def permits_in_use(locks: Sequence[WatchedLock]) -> dict[str, int]:
    """Per semaphore watched, how many of its rows are held."""
    counts: dict[str, int] = {}
    for lock in locks:
        if lock.observation.semaphore is not None:
            counts[lock.name] = counts.get(lock.name, 0) + 1
    return counts


class LockTableView:
    """What watchers last reported, per lock: read by exporters at scrape time (`GAUGES`)."""

    def __init__(self) -> None:
        self._locks: dict[str, WatchedLock] = {}
        self._up: bool | None = None
        self._lock = threading.Lock()

    def tell(self, call: Call) -> None:
        """A watcher's hook call (`observed`, `watcher_failed`, `watcher_stopped`), by its arguments.

        A stopped watcher's locks are no longer exported, rather than frozen.
        """
        watched = cast("frozenset[str] | None", call.get("watched"))
        with self._lock:
            if "observations" in call:
                self._drop(watched)
                alert, stale = cast(float, call["alert_threshold"]), cast(float, call["stale_threshold"])
                for seen in cast("Sequence[LockObservation]", call["observations"]):
                    self._locks[seen.lock_name] = WatchedLock(seen, alert, stale)
                self._up = True
            elif "error" in call:
                self._up = False
            else:
                self._drop(watched)
                if not self._locks:
                    self._up = None

    def _drop(self, watched: frozenset[str] | None) -> None:
        # Kept by row: a semaphore's holds (a read/write lock's too) are rows of their own, each watched
        # under the semaphore's (read/write lock's) name.
        if watched is None:
            self._locks.clear()
            return
        for row, lock in list(self._locks.items()):
            if lock.name in watched or row in watched:
                del self._locks[row]

    def snapshot(self) -> tuple[list[WatchedLock], bool | None]:
        """The watched locks, and whether the last read succeeded (None: no watcher reported yet)."""
        with self._lock:
            return sorted(self._locks.values(), key=lambda lock: lock.observation.lock_name), self._up


Sample = tuple[dict[str, str], float]
"""One series of a gauge: its labels, its value."""
Read = Callable[[Sequence[WatchedLock], bool | None], Iterable[Sample]]
"""How a watcher gauge is read from `LockTableView.snapshot`: the locks watched, whether the last read succeeded."""


def each_holder(value: Callable[[WatchedLock], float | None]) -> Read:
    """A per-holder gauge (`metric_names.PER_HOLDER`): one series per holder shown (`per_holder`), if it has a value."""

    def read(locks: Sequence[WatchedLock], up: bool | None) -> list[Sample]:
        samples = ((lock.labels, value(lock)) for lock in per_holder(locks))
        return [(labels, found) for labels, found in samples if found is not None]

    return read


def _holder_info(locks: Sequence[WatchedLock], up: bool | None) -> list[Sample]:
    return [({**lock.labels, "holder": lock.observation.holder}, 1) for lock in per_holder(locks)]


def _session(lock: WatchedLock) -> float | None:
    alive = lock.observation.session_alive
    return None if alive is None else int(alive)


GAUGES: dict[names.MetricName, Read] = {
    names.HEARTBEAT_AGE: each_holder(lambda lock: lock.observation.seconds_since_heartbeat),
    names.HELD_DURATION: each_holder(lambda lock: lock.observation.seconds_held),
    names.HOLDER_INFO: _holder_info,
    names.ALERTING: each_holder(lambda lock: float(lock.observation.alerting)),
    names.RECLAIMABLE: each_holder(lambda lock: float(lock.observation.reclaimable)),
    names.SESSION_ALIVE: each_holder(_session),
    names.ALERT_THRESHOLD: each_holder(lambda lock: lock.alert_threshold),
    names.STALE_THRESHOLD: each_holder(lambda lock: lock.stale_threshold),
    names.PERMITS_IN_USE: lambda locks, up: [({"lock_name": n}, c) for n, c in permits_in_use(locks).items()],
    names.RWLOCK_HOLDERS: lambda locks, up: [
        ({"lock_name": n, "mode": mode}, c) for (n, mode), c in rwlock_holders(locks).items()
    ],
    names.RWLOCK_WRITER_WAITING: lambda locks, up: [({"lock_name": n}, w) for n, w in writers_waiting(locks).items()],
    names.WATCHER_UP: lambda locks, up: [] if up is None else [({}, int(up))],
}
"""How each watcher gauge is read, at collection time, from what the watcher last saw: one line per gauge."""
