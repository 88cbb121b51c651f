"""A candidate in an election, run by the tests as a separate process.

    python -m tests.support.election_worker DSN NAME OUT OPTIONS_JSON

It campaigns with `Election.run` (or `run_async`, ``"mode": "async"``) and,
during each term, appends two lines to OUT on CLOCK_MONOTONIC, which every
process on the machine shares::

    begin PID TOKEN T
    end PID TOKEN T

``begin`` is written once the term has started, ``end`` just before ``lead``
returns: if two processes ever led at once, their intervals overlap. ``lead``
returns after a random time in ``"hold": [low, high]`` seconds, or, without
``hold``, once leadership ends. SIGTERM stops the election (the graceful
hand-over); SIGUSR1 resigns the current term; SIGKILL is the crash. With
``"sample": true`` a thread reads the candidate's own ``leading`` and the
term's ``held`` every few milliseconds and writes each stretch of belief,
as it starts and once it has ended::

    believes PID FROM
    believed PID FROM TO

where it saw True throughout, FROM after the first such read and TO before
the last (so a stretch is never longer than what was seen). Each term's end
that the Election reports to its metrics hook is written as
``reported PID TOKEN ENDED``. The other options are the Election's
(thresholds, ``grace_period`` ...). It prints "ready" once the Election exists.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import threading
import time
from typing import Any, TextIO

from postgres_mutex import Election, Leadership


class _Reports:
    """The metrics hook: every term end the Election reports, written to the log."""

    def __init__(self, log: TextIO) -> None:
        self.log = log

    def election_term_ended(
        self, lock_name: str, *, instance_id: str, ended: str, seconds: float, token: int | None = None
    ) -> None:
        self.log.write(f"reported {os.getpid()} {token} {ended}\n")


def _sample(election: Election, log: TextIO, done: threading.Event) -> None:
    since: float | None = None
    last = 0.0
    while True:
        before = time.monotonic()
        term = election.leadership
        believes = election.leading or (term is not None and term.held)
        after = time.monotonic()
        if believes:
            if since is None:
                since = after
                log.write(f"believes {os.getpid()} {since!r}\n")
            last = before
        if since is not None and (not believes or done.is_set()):
            log.write(f"believed {os.getpid()} {since!r} {last!r}\n")
            since = None
        if done.is_set():
            return
        time.sleep(0.002)


def main(dsn: str, name: str, out: str, options: dict[str, Any]) -> None:
    mode = options.pop("mode", "sync")
    hold = options.pop("hold", None)
    sample = options.pop("sample", False)
    rng = random.Random(os.getpid())
    with open(out, "a", buffering=1) as log:
        election = Election(dsn, name, metrics=_Reports(log), **options)
        signal.signal(signal.SIGTERM, lambda *_: election.stop())
        signal.signal(signal.SIGUSR1, lambda *_: election.resign())
        done = threading.Event()
        sampler = threading.Thread(target=_sample, args=(election, log, done), daemon=True)
        if sample:
            sampler.start()

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
        done.set()
        if sample:
            sampler.join(5)
    _report(sys.stdout)


async def _run_async(election: Election, lead: Any) -> None:
    await election.run_async(lead)
    await election.aclose()


def _report(stream: TextIO) -> None:
    print("stopped", file=stream, flush=True)


if __name__ == "__main__":
    dsn_, name_, out_, options_ = sys.argv[1:]
    main(dsn_, name_, out_, json.loads(options_))
