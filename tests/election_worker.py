"""A candidate in an election, run by the tests as a separate process.

    python -m tests.election_worker DSN NAME OUT OPTIONS_JSON

It campaigns with `Election.run` (or `run_async`, ``"mode": "async"``) and,
during each term, appends two lines to OUT on CLOCK_MONOTONIC, which every
process on the machine shares::

    begin PID TOKEN T
    end PID TOKEN T

``begin`` is written once the term has started, ``end`` just before ``lead``
returns: if two processes ever led at once, their intervals overlap. ``lead``
returns after a random time in ``"hold": [low, high]`` seconds, or, without
``hold``, once leadership ends. SIGTERM stops the election (the graceful
hand-over); SIGKILL is the crash. The other options are the Election's
(thresholds, ``grace_period`` ...). It prints "ready" once the Election exists.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import time
from typing import Any, TextIO

from postgres_mutex import Election, Leadership


def main(dsn: str, name: str, out: str, options: dict[str, Any]) -> None:
    mode = options.pop("mode", "sync")
    hold = options.pop("hold", None)
    rng = random.Random(os.getpid())
    election = Election(dsn, name, **options)
    signal.signal(signal.SIGTERM, lambda *_: election.stop())
    with open(out, "a", buffering=1) as log:

        def record(what: str, leadership: Leadership) -> None:
            log.write(f"{what} {os.getpid()} {leadership.token} {time.monotonic()!r}\n")

        def term_length() -> float:
            return 3600.0 if hold is None else rng.uniform(*hold)

        def lead(leadership: Leadership) -> None:
            record("begin", leadership)
            leadership.ended.wait(term_length())
            record("end", leadership)

        async def lead_async(leadership: Leadership) -> None:
            record("begin", leadership)
            try:
                await asyncio.sleep(term_length())
            finally:
                record("end", leadership)

        print("ready", flush=True)
        if mode == "async":
            asyncio.run(_run_async(election, lead_async))
        else:
            election.run(lead)
            election.close()
    _report(sys.stdout)


async def _run_async(election: Election, lead: Any) -> None:
    await election.run_async(lead)
    await election.aclose()


def _report(stream: TextIO) -> None:
    print("stopped", file=stream, flush=True)


if __name__ == "__main__":
    dsn_, name_, out_, options_ = sys.argv[1:]
    main(dsn_, name_, out_, json.loads(options_))
