"""Entry point of the bench's worker processes: ``python -m bench.worker MODE CONFIG_JSON``.

Each mode is the ``work`` function of the module that measures with it; it
gets its config and a `Channel` to the parent (see `bench.channel`, and
`bench.processes` for the parent's side).
"""

from __future__ import annotations

import importlib
import json
import sys
import traceback
from collections.abc import Callable
from typing import Any

from .channel import Channel

MODES = {
    "arrival": "bench.arrival",
    "ceiling": "bench.ceiling",
    "contention": "bench.contention",
    "handoff": "bench.handoff",
    "many-locks": "bench.many_locks",
    "peer": "bench.peer_locks",
    "rwlocks": "bench.rwlocks",
    "waiters": "bench.waiters",
}
"""Each mode's module, imported alone: a peer worker may run under another release of the library,
where the other modules' imports of this version's names would fail."""


def _mode(name: str) -> Callable[[dict[str, Any], Channel], None]:
    work: Callable[[dict[str, Any], Channel], None] = importlib.import_module(MODES[name]).work
    return work


def main(argv: list[str]) -> int:
    mode, config = argv[0], json.loads(argv[1])
    channel = Channel()
    try:
        _mode(mode)(config, channel)
    except SystemExit:
        raise
    except BaseException as exc:
        channel.send(error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
