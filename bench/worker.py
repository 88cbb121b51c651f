"""Entry point of the bench's worker processes: ``python -m bench.worker MODE CONFIG_JSON``.

Each mode is the ``work`` function of the module that measures with it; it
gets its config and a `Channel` to the parent (see `bench.channel`, and
`bench.processes` for the parent's side).
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from typing import Any

from .channel import Channel


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
