"""Validation of everything a user passes in, done once at construction.

Bad input raises `TypeError` (wrong type) or `ValueError` (wrong value) naming
the argument, so a misconfigured job fails at start-up rather than at 3 a.m.
when it first contends.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._sql.names import Names
from ..errors import InvalidArgument
from .rows import SEPARATOR

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

    from .events import LostCallback

# VARCHAR(64) in the table: PostgreSQL counts characters, not bytes.
MAX_NAME_LENGTH = 64

MAX_SECONDS = 1e9
"""Longest threshold, interval or timeout accepted (about 31 years): far inside
what PostgreSQL's intervals and Python's waits can represent."""

MAX_OPERATION_TIMEOUT = 2_147_483.0
"""``statement_timeout`` and libpq's ``tcp_user_timeout`` are milliseconds in a
32-bit integer: about 24.8 days."""

DEFAULT_OPERATION_TIMEOUT = 5.0
"""The longest default deadline of one statement."""


def check_name(value: object, argument: str) -> str:
    """Return ``value`` if it fits a VARCHAR(64) name column, else raise naming ``argument``."""
    if not isinstance(value, str):
        raise TypeError(f"{argument} must be a str, not {type(value).__name__}")
    if not 1 <= len(value) <= MAX_NAME_LENGTH:
        raise _invalid(
            argument, "must be 1 to {most} characters long, got {length}", most=MAX_NAME_LENGTH, length=len(value)
        )
    if "\x00" in value:
        # PostgreSQL text cannot hold NUL; the server would reject it mid-flight.
        raise _invalid(argument, "must not contain a NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        # A lone surrogate (say, from a mis-decoded file name) cannot be sent at all.
        raise _invalid(argument, "must be valid text; it contains a lone surrogate: {value!r}", value=value) from None
    return value


def check_lock_name(value: object, argument: str) -> str:
    """A mutex's (or an election's) name: `check_name`, and without the unit separator.

    The rows of semaphores' permits and of read/write locks' holders are
    named after their lock and that character (`_state.rows`): a mutex of such
    a name could share a row with one of them, and hold it or take it over.
    """
    name = check_name(value, argument)
    if SEPARATOR in name:
        raise _invalid(
            argument,
            "must not contain the unit separator character (\\x1f): the rows of semaphores and read/write locks "
            "are named with it, got {value!r}",
            value=name,
        )
    return name


def check_permit_count(name: object, count: object) -> int:
    """A Semaphore's number of permits, and its name checked to fit its permits' rows.

    A permit's row is named after the semaphore, the unit separator and the
    permit's number, in the table's 64 characters: the name must leave room.
    """
    if isinstance(count, bool) or not isinstance(count, int):
        raise TypeError(f"permits must be an int, not {type(count).__name__}")
    if not 1 <= count <= 1_000_000:
        raise InvalidArgument("{permits} must be from 1 to 1000000, got {value!r}", value=count)
    if name is not None:
        check_name(name, "name")
        room = MAX_NAME_LENGTH - 1 - len(str(count - 1))
        if len(name) > room:  # type: ignore[arg-type]
            raise InvalidArgument(
                "a semaphore's name must be at most {room} characters long with {permits}={n} (its permits' rows "
                "add a separator and the permit's number to it in a 64-character column), got {length}",
                room=room,
                n=count,
                length=len(name),  # type: ignore[arg-type]
            )
        if SEPARATOR in name:  # type: ignore[operator]
            raise InvalidArgument("a semaphore's name must not contain the unit separator character (\\x1f)")
    return count


def check_names(value: object, argument: str) -> frozenset[str] | None:
    """A collection of lock names (or None), each checked; a bare str is refused, not iterated."""
    if value is None:
        return None
    if isinstance(value, str | bytes):
        raise TypeError(
            f"{argument} must be a list of lock names, not a single {type(value).__name__}: {argument}=[{value!r}]"
        )
    try:
        items = list(value)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(f"{argument} must be a list of lock names, not {type(value).__name__}") from None
    return frozenset(check_name(item, argument) for item in items)


MIN_HEARTBEAT_INTERVAL = 0.05
"""The shortest heartbeat_interval: 20 statements a second per group of holds is plenty for
any lease, and a shorter one would only hammer the server (1e-9 gave 2,500 a second)."""

MIN_POLL_INTERVAL = 0.01
"""The shortest poll_interval: a waiter polling faster would load the server, not wake sooner
(a release wakes a listening waiter at once)."""


def check_seconds(
    value: object,
    argument: str,
    *,
    allow_zero: bool = False,
    minimum: float = 0.0,
    maximum: float = MAX_SECONDS,
) -> float:
    """Return ``value`` as a float number of seconds, or raise naming ``argument``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{argument} must be a number of seconds, not {type(value).__name__}")
    seconds = float(value)
    if math.isnan(seconds) or math.isinf(seconds):
        raise _invalid(argument, "must be a finite number of seconds, got {value!r}", value=value)
    if seconds < 0 or (seconds == 0 and not allow_zero):
        bound = "zero or more" if allow_zero else "greater than zero"
        raise _invalid(argument, "must be {bound}, got {value!r}", bound=bound, value=value)
    if seconds > maximum:
        raise _invalid(argument, "must be at most {maximum:g} seconds, got {value!r}", maximum=maximum, value=value)
    if 0 < seconds < minimum:
        raise _invalid(
            argument,
            "must be at least {minimum:g} seconds, got {value!r}: a shorter one would hammer the server",
            minimum=minimum,
            value=value,
        )
    return seconds


def at_least(value: float, bound: float) -> bool:
    """``value >= bound``, where a value the docs allow stays allowed: ``0.6`` is three times ``0.2``, though
    ``3 * 0.2`` is ``0.6000000000000001`` in binary floating point."""
    return value >= bound or math.isclose(value, bound, rel_tol=1e-9)


def _invalid(argument: str, problem: str, /, **values: object) -> InvalidArgument:
    """A bad value of ``argument``: the message names it as a term, said in each interface's words."""
    return InvalidArgument("{" + argument + "} " + problem, **values)


def check_operation_timeout(value: object) -> float:
    return check_seconds(value, "operation_timeout", maximum=MAX_OPERATION_TIMEOUT)


def check_thresholds(alert_threshold: object, stale_threshold: object) -> tuple[float, float]:
    """``alert_threshold`` and ``stale_threshold`` in seconds: the alert must come before the reclaim."""
    alert = check_seconds(alert_threshold, "alert_threshold")
    stale = check_seconds(stale_threshold, "stale_threshold")
    if not alert < stale:
        raise InvalidArgument(
            "{alert_threshold} ({alert:g}s) must be shorter than "
            "{stale_threshold} ({stale:g}s), so on-call hears before a reclaim",
            alert=alert,
            stale=stale,
        )
    return alert, stale


class MissingLockName(TypeError, ValueError):
    """``Mutex()`` without a lock name: a `TypeError` as Python says it, and a `ValueError` as 0.1.0 did."""


def check_mutex_name(lock_name: object) -> str:
    """A Mutex's ``lock_name``, which it cannot do without (see `check_lock_name`)."""
    if lock_name is None:
        raise MissingLockName("Mutex() needs a lock_name: Mutex(dsn, 'nightly-report')")
    return check_lock_name(lock_name, "lock_name")


def default_instance_id() -> str:
    """``<hostname>-<random>``: unique per Mutex, readable by a DBA in the table."""
    suffix = secrets.token_hex(4)
    host = socket.gethostname() or "host"
    return f"{host[: MAX_NAME_LENGTH - len(suffix) - 1]}-{suffix}"


@dataclass(frozen=True, slots=True)
class Timing:
    """The validated thresholds of one lock, in seconds.

    ``lease`` is how long a holder trusts its lock after the last heartbeat it
    *sent*: one heartbeat interval short of ``stale_threshold``. The server
    stamps a heartbeat no earlier than it was sent, so the holder's lease always
    runs out before any other instance may reclaim the row.

    ``reclaim_disconnected_after`` (None: not opted in) is how old a heartbeat
    may be before a contender reclaims the row of a holder whose session
    ended; ``doubt``, one heartbeat interval short of it, is how long a holder
    trusts its lock without a successful heartbeat before its hold is in doubt.
    """

    heartbeat_interval: float
    alert_threshold: float
    stale_threshold: float
    poll_interval: float
    operation_timeout: float
    reclaim_disconnected_after: float | None = None

    @classmethod
    def validate(
        cls,
        *,
        heartbeat_interval: object,
        alert_threshold: object,
        stale_threshold: object,
        poll_interval: object,
        operation_timeout: object | None,
        reclaim_disconnected_after: object | None = None,
    ) -> Timing:
        heartbeat = check_seconds(heartbeat_interval, "heartbeat_interval", minimum=MIN_HEARTBEAT_INTERVAL)
        alert, stale = check_thresholds(alert_threshold, stale_threshold)
        poll = check_seconds(poll_interval, "poll_interval", minimum=MIN_POLL_INTERVAL)
        if not heartbeat < alert:
            raise InvalidArgument(
                "{heartbeat_interval} ({heartbeat:g}s) must be shorter than "
                "{alert_threshold} ({alert:g}s), or every heartbeat would alert",
                heartbeat=heartbeat,
                alert=alert,
            )
        if not at_least(stale, 3 * heartbeat):
            raise InvalidArgument(
                "{stale_threshold} ({stale:g}s) must be at least three times {heartbeat_interval} "
                "({heartbeat:g}s): the holder's lease ({stale_threshold} - {heartbeat_interval}) "
                "must leave room to retry a failed heartbeat",
                stale=stale,
                heartbeat=heartbeat,
            )
        reclaim = None
        if reclaim_disconnected_after is not None:
            reclaim = _check_reclaim(reclaim_disconnected_after, heartbeat, stale)
        timeout = (
            default_operation_timeout(heartbeat, stale if reclaim is None else reclaim)
            if operation_timeout is None
            else check_operation_timeout(operation_timeout)
        )
        if reclaim is not None and not at_least(reclaim, 2 * heartbeat + timeout):
            raise InvalidArgument(
                "{reclaim_disconnected_after} ({reclaim:g}s) must be at least two {heartbeat_interval}s plus "
                "{operation_timeout} (2 x {heartbeat:g}s + {timeout:g}s): a holder whose heartbeat failed must be "
                "able to try again within it",
                reclaim=reclaim,
                heartbeat=heartbeat,
                timeout=timeout,
            )
        return cls(heartbeat, alert, stale, poll, timeout, reclaim)

    @property
    def lease(self) -> float:
        return self.stale_threshold - self.heartbeat_interval

    @property
    def doubt(self) -> float | None:
        """How long a hold is trusted after the last heartbeat sent that succeeded, if its holder opted in."""
        if self.reclaim_disconnected_after is None:
            return None
        return self.reclaim_disconnected_after - self.heartbeat_interval


@dataclass(frozen=True, eq=False)
class Settings:
    """A holder's options, checked once: every keyword of `Mutex` but its name and how it reaches PostgreSQL.

    Its fields are those keywords, with their defaults. `Mutex`, `Semaphore`,
    `RWLock` and `Election` write them out in their signatures (the API
    reference and IDEs read them there) and hand them here at once
    (`from_arguments`); a unit test holds each signature to these fields, so
    neither can drift. Inside the library this object is passed whole: a
    holder's siblings and an RWLock's two modes are made of it, and what the
    lock state, the engine and the heartbeat read is its `timing`.

    ``instance_id`` stays as given (None: the holder picks a default one),
    except that an empty one means None, as an unset environment variable did
    in 0.1.0. A bad value raises `TypeError` or `ValueError` naming its
    keyword, in the order the constructors check their arguments.
    """

    instance_id: str | None = None
    table: str = "mutex_lock"
    heartbeat_interval: float = 10.0
    alert_threshold: float = 30.0
    stale_threshold: float = 600.0
    poll_interval: float = 0.5
    metrics: object | None = None
    on_lost: LostCallback | None = None
    operation_timeout: float | None = None
    watch: bool = False
    tracer_provider: TracerProvider | None = None
    reclaim_disconnected_after: float | None = None
    hold_at_least: float | None = None
    timing: Timing = dataclasses.field(init=False, repr=False)
    """The thresholds, checked against each other, with the default ``operation_timeout`` filled in."""
    names: Names = dataclasses.field(init=False, repr=False)
    """The lock table's name, checked, and the identifiers made of it."""

    def __post_init__(self) -> None:
        if self.instance_id == "":
            object.__setattr__(self, "instance_id", None)
        if self.instance_id is not None:
            check_name(self.instance_id, "instance_id")
        if self.on_lost is not None and not callable(self.on_lost):
            raise TypeError(f"on_lost must be callable, not {type(self.on_lost).__name__}")
        if not isinstance(self.watch, bool):
            raise TypeError(f"watch must be a bool, not {type(self.watch).__name__}")
        timing = Timing.validate(**{name: getattr(self, name) for name in _TIMING_FIELDS})
        object.__setattr__(self, "hold_at_least", check_hold_at_least(self.hold_at_least, timing))
        object.__setattr__(self, "timing", timing)
        object.__setattr__(self, "names", Names(self.table))

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, object]) -> Settings:
        """The settings among a constructor's arguments (its ``locals()``), checked; the others are its own."""
        return cls(**{name: arguments[name] for name in KEYWORDS if name in arguments})  # type: ignore[arg-type]

    def replace(self, **changes: object) -> Settings:
        """These settings with some changed, checked again."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


KEYWORDS = tuple(field.name for field in dataclasses.fields(Settings) if field.init)
"""The keywords a `Settings` is made of, in the order the public constructors list them."""

_TIMING_FIELDS = tuple(field.name for field in dataclasses.fields(Timing))


@dataclass(frozen=True)
class MutexConfig:
    """A Mutex's settings, read-only: what 0.1.0 exposed as ``mutex.config``."""

    lock_name: str
    instance_id: str
    table: str
    heartbeat_interval: float
    alert_threshold: float
    stale_threshold: float
    poll_interval: float
    operation_timeout: float
    reclaim_disconnected_after: float | None = None
    hold_at_least: float | None = None
    """Each acquire's minimum hold by default, in seconds (None: none)."""


def _check_reclaim(value: object, heartbeat: float, stale: float) -> float:
    """``reclaim_disconnected_after``: shorter than ``stale_threshold``, and three heartbeats at least.

    A holder whose session is gone learns it is in doubt one heartbeat interval
    before anyone may reclaim it, and until then retries its heartbeat: as for
    ``stale_threshold``, that needs three intervals.
    """
    reclaim = check_seconds(value, "reclaim_disconnected_after")
    if not reclaim < stale:
        raise InvalidArgument(
            "{reclaim_disconnected_after} ({reclaim:g}s) must be shorter than {stale_threshold} ({stale:g}s): "
            "it is the early reclaim of a holder whose session ended",
            reclaim=reclaim,
            stale=stale,
        )
    if not at_least(reclaim, 3 * heartbeat):
        raise InvalidArgument(
            "{reclaim_disconnected_after} ({reclaim:g}s) must be at least three times {heartbeat_interval} "
            "({heartbeat:g}s): a holder must be able to miss a heartbeat, retry it, and still hear of a doubt "
            "before anyone may reclaim its lock",
            reclaim=reclaim,
            heartbeat=heartbeat,
        )
    return reclaim


def retry_pause(heartbeat_interval: float) -> float:
    return min(heartbeat_interval, 1.0)


def default_operation_timeout(heartbeat_interval: float, stale_threshold: float) -> float:
    """The deadline of one statement when the user gives none.

    After its last successful heartbeat, a holder tries again one interval
    later and has until its lease ends (``stale_threshold - heartbeat_interval``;
    for a holder that opted in, ``reclaim_disconnected_after`` is passed instead):
    a window of ``stale_threshold - 2 * heartbeat_interval``. The default fits
    the heartbeat and two retries, with their pauses, in that window (or, when
    the thresholds are too tight for that, a quarter of it), and is never more
    than 5 s: with the defaults (10 s, 600 s) it is 5 s; with heartbeat 0.2 s and
    stale 3 s it is about 0.73 s.
    """
    window = stale_threshold - 2 * heartbeat_interval
    with_retries = (window - 2 * retry_pause(heartbeat_interval)) / 3
    return min(DEFAULT_OPERATION_TIMEOUT, max(with_retries, window / 4))


def check_hold_at_least(value: object, timing: Timing) -> float | None:
    """A minimum hold (``hold_at_least``), checked: None, or seconds up to ``stale_threshold``.

    The bound is 0.1.0's: a 0.1.0 process reads a holder's row by its heartbeat
    alone, and takes the lock once the heartbeat is ``stale_threshold`` old. A
    holder killed at once after it acquired leaves its heartbeat at the acquire:
    a minimum past ``stale_threshold`` would end early for such a process.
    """
    if value is None:
        return None
    seconds = check_seconds(value, "hold_at_least")
    if seconds > timing.stale_threshold:
        raise InvalidArgument(
            "{hold_at_least} ({value:g}s) must be at most {stale_threshold} ({stale:g}s): a holder killed after "
            "acquiring is reclaimed once its heartbeat is that old, by processes of postgres-mutex 0.1.0; "
            "raise {stale_threshold} for a longer minimum",
            value=seconds,
            stale=timing.stale_threshold,
        )
    return seconds


def check_wait(blocking: object, timeout: object) -> tuple[bool, float | None]:
    """An acquire's ``blocking`` and ``timeout``, checked: whether to wait, and for how long (None: no limit).

    ``blocking=None`` (the synchronous default) waits only when a ``timeout`` is
    given: ``acquire(timeout=5)`` means "wait up to 5 s", as it reads. A
    non-blocking call given a timeout is refused, as ``threading.Lock.acquire``
    refuses it: the caller asked for two things that cannot both hold.
    """
    if blocking is not None and not isinstance(blocking, bool):
        raise TypeError(f"blocking must be a bool, not {type(blocking).__name__}")
    if timeout is None:
        return bool(blocking), None
    if blocking is False:
        raise InvalidArgument(
            "can't specify a timeout for a non-blocking acquire (timeout={value!r}): "
            "drop blocking=False to wait up to the timeout, or drop the timeout to try once",
            value=timeout,
        )
    if isinstance(timeout, int | float) and not isinstance(timeout, bool) and -math.inf < timeout < 0:
        # A deadline already past (timeout=deadline - now()): one attempt, as in 0.1.0.
        return True, float(timeout)
    return True, check_seconds(timeout, "timeout", allow_zero=True)
