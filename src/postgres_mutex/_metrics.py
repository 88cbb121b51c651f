"""The metrics hook: what a Mutex reports, and the guard that keeps it harmless.

A hook is any object with any subset of `MetricsHook`'s methods. Subclass
`MetricsHook` to get no-op defaults, or write a plain class: missing methods
are skipped. Every call goes through `MetricsDispatch`, which swallows (and
logs, once per method) whatever a hook raises: a broken metrics backend must
never cost a lock or a heartbeat.
"""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger("postgres_mutex")


class MetricsHook:
    """No-op base class documenting every call a Mutex makes.

    Calls are made from the thread or task that observed the event (the
    heartbeat thread for heartbeat calls), so they should be quick and must not
    block. ``instance_id`` is this Mutex's id; ``holder`` and
    ``previous_holder`` are other instances' ids.
    """

    def acquired(self, lock_name: str, *, instance_id: str) -> None:
        """The lock was acquired (fresh, or by reclaiming a stale row)."""

    def released(self, lock_name: str, *, instance_id: str) -> None:
        """The lock was released and its row deleted."""

    def contended(self, lock_name: str, *, instance_id: str) -> None:
        """An acquire attempt found the lock held by another instance."""

    def stale_reclaimed(self, lock_name: str, *, instance_id: str, previous_holder: str) -> None:
        """The lock was taken over from ``previous_holder``, silent past ``stale_threshold``."""

    def alert(self, lock_name: str, *, holder: str, seconds_since_heartbeat: float) -> None:
        """The holder has not heartbeated for ``alert_threshold``: slow, or dead?

        Fired once per stale episode per Mutex: again only after the holder
        heartbeats or changes.
        """

    def heartbeat_latency(self, lock_name: str, *, instance_id: str, seconds: float) -> None:
        """A heartbeat succeeded after ``seconds`` (one round trip)."""

    def heartbeat_failed(self, lock_name: str, *, instance_id: str, error: BaseException) -> None:
        """A heartbeat failed (it is retried until the local lease runs out)."""

    def lost(self, lock_name: str, *, instance_id: str, reason: str) -> None:
        """This Mutex lost a lock it held: its lease ran out, or its row was gone."""


class MetricsDispatch:
    """Calls a user's hook best-effort: never raises, never lets a hook break the lock."""

    def __init__(self, hook: object | None) -> None:
        self._hook = hook
        self._complained: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, method: str, lock_name: str, **kwargs: object) -> None:
        if self._hook is None:
            return
        try:
            func = getattr(self._hook, method, None)
            if callable(func):
                func(lock_name, **kwargs)
        except Exception:
            with self._lock:
                first = method not in self._complained
                self._complained.add(method)
            if first:
                logger.warning(
                    "metrics hook %s.%s raised; ignoring it (further errors from it are logged at debug level)",
                    type(self._hook).__name__,
                    method,
                    exc_info=True,
                )
            else:
                logger.debug("metrics hook %s.%s raised", type(self._hook).__name__, method, exc_info=True)
