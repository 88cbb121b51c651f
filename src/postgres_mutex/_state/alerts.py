"""When a silent holder is worth an alert: once per stale episode, per lock."""

from __future__ import annotations

import threading


class AlertGate:
    """Decides when a silent holder is worth an alert: once per stale episode.

    An episode starts when a holder's heartbeat age reaches ``threshold`` and
    ends when it heartbeats again (age below threshold) or the holder changes,
    so a waiter polling every half second alerts once, not twice a second.
    """

    def __init__(self, threshold: float) -> None:
        self._threshold = threshold
        self._alerted_holder: str | None = None
        # Shared by a Mutex's contender path and its watcher.
        self._lock = threading.Lock()

    def should_alert(self, holder: str | None, heartbeat_age: float | None) -> bool:
        with self._lock:
            if holder is None or heartbeat_age is None or heartbeat_age < self._threshold:
                self._alerted_holder = None
                return False
            if holder == self._alerted_holder:
                return False
            self._alerted_holder = holder
            return True


class WatchAlerts:
    """One `AlertGate` per watched lock; a lock that turns free starts afresh.

    A Mutex that watches its own lock shares its gate, so a contender's alert
    and the watcher's count as one per episode.
    """

    def __init__(self, threshold: float, shared: dict[str, AlertGate] | None = None) -> None:
        self._threshold = threshold
        self._shared = dict(shared or {})
        self._gates: dict[str, AlertGate] = dict(self._shared)

    def should_alert(self, lock_name: str, holder: str, heartbeat_age: float) -> bool:
        gate = self._gates.get(lock_name)
        if gate is None:
            gate = self._gates[lock_name] = AlertGate(self._threshold)
        return gate.should_alert(holder, heartbeat_age)

    def held_now(self, lock_names: set[str]) -> None:
        """Forget the episodes of locks that are no longer held."""
        for name in list(self._gates):
            if name not in lock_names:
                if name in self._shared:
                    self._gates[name].should_alert(None, None)
                else:
                    del self._gates[name]
