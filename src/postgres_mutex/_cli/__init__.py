"""The ``postgres-mutex`` command: what flock(1) gives one machine, for a fleet.

Every subcommand reaches PostgreSQL through ``--dsn``, else the environment
variable ``POSTGRES_MUTEX_DSN``, else libpq's own ``PG*`` variables and
``.pgpass``. Errors a user can cause end in one line on stderr and a non-zero
exit, never a traceback, and nothing printed ever contains a password.

Built on the library's public API only, in parts: `_run` (``run`` and
``run --restart``), `_admin` (the operator's subcommands and ``watch``),
`_demo` with `_embedded` (the demo and its throwaway server), `_parser`
(every flag), `_common` (exit codes, the flags' words for the library's
errors).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Sequence

from ..errors import DatabaseError, MutexError
from ._common import EXIT_UNAVAILABLE, EXIT_USAGE, UsageError, in_cli_words, say
from ._parser import parser
from ._run import Interrupted

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``postgres-mutex`` command; returns the exit code.

    A reader that stops reading (``postgres-mutex history --json | head``) ends
    the command quietly, as SIGPIPE ends a Unix tool: exit 141, no traceback.
    """
    try:
        try:
            return _main(argv)
        finally:
            if sys.stdout is not None:
                sys.stdout.flush()  # a reader gone shows here, not in a message at the interpreter's exit
    except BrokenPipeError:
        # Nothing more can reach the reader: the interpreter's own flush at exit must not try again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


def _main(argv: Sequence[str] | None) -> int:
    args = parser().parse_args(argv)
    # Commands that run on (run, watch) report retries and alerts as they happen;
    # one-shot commands end in one error line, which those warnings would only repeat.
    quiet = logging.WARNING if args.subcommand in ("run", "watch") else logging.ERROR
    logging.basicConfig(
        level=logging.INFO if args.verbose else quiet,
        format="postgres-mutex: %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    started = time.monotonic()
    try:
        return int(args.handler(args))
    except UsageError as exc:
        say(f"error: {exc}")
        return EXIT_USAGE
    except (ValueError, TypeError) as exc:
        # The library's own validation: it names the argument, which is a flag here.
        say(f"error: {in_cli_words(exc)}")
        return EXIT_USAGE
    except DatabaseError as exc:
        say(f"error: {in_cli_words(exc)}")
        return EXIT_UNAVAILABLE
    except MutexError as exc:
        say(f"error: {in_cli_words(exc)}")
        return 1
    except KeyboardInterrupt:
        say(f"interrupted after {time.monotonic() - started:.1f}s")
        return 128 + signal.SIGINT
    except Interrupted as exc:
        say(f"stopped by signal {signal.Signals(exc.signum).name} after {time.monotonic() - started:.1f}s")
        return 128 + exc.signum
