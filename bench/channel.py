"""The worker's side of the line channel to the parent: JSON objects on stdin and stdout.

A module of its own, so that the scenario modules, whose ``work`` functions take a
`Channel`, need not import `bench.worker`, which imports them. The parent's side is
`bench.processes.Worker`.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


class Channel:
    """The worker's side of the line channel: JSON objects on stdin and stdout."""

    def send(self, **message: Any) -> None:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()

    def receive(self) -> dict[str, Any]:
        line = sys.stdin.readline()
        if not line:
            raise SystemExit(0)  # the parent is gone
        message: dict[str, Any] = json.loads(line)
        if message.get("cmd") == "quit":
            raise SystemExit(0)
        return message

    def window(self) -> tuple[float, float]:
        """Wait for ``go``; sleep until its start; return (start, end) on `time.monotonic`."""
        message = self.receive()
        assert message.get("cmd") == "go", message
        start, end = float(message["start"]), float(message["end"])
        time.sleep(max(0.0, start - time.monotonic()))
        return start, end
