"""Entry point of the bench's worker processes: ``python -m bench.worker MODE CONFIG_JSON``.

Each mode is the ``work`` function of the module that measures with it; it
gets its config and a `Channel` to the parent (see `bench.processes`).
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from collections.abc import Callable
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


def _modes() -> dict[str, Callable[[dict[str, Any], Channel], None]]:
    from . import ceiling, contention, handoff, many_locks

    return {
        "ceiling": ceiling.work,
        "contention": contention.work,
        "handoff": handoff.work,
        "many-locks": many_locks.work,
    }


def main(argv: list[str]) -> int:
    mode, config = argv[0], json.loads(argv[1])
    channel = Channel()
    try:
        _modes()[mode](config, channel)
    except SystemExit:
        raise
    except BaseException as exc:
        channel.send(error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
