"""The ``postgres-mutex`` command, callable from Python: for programs that embed it, as ``manage.py postgres_mutex``.

``main(["status", "--dsn", dsn])`` runs one command in this process, as the
shell would (``postgres-mutex status --dsn ...``), and returns its exit code
(see the CLI reference); it prints to stdout and stderr, and configures
logging once. Arguments given as a list never appear in the process's
command line, so a DSN with a password passed this way stays private.

The subcommands are `_cli`'s parts, built on the library's public API only.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence

from ._cli._admin import cmd_history, cmd_init, cmd_migrate, cmd_permits, cmd_release, cmd_status, cmd_watch
from ._cli._common import EXIT_UNAVAILABLE, EXIT_USAGE, UsageError, in_cli_words, say
from ._cli._demo import cmd_demo
from ._cli._parser import parser
from ._cli._run import Interrupted, cmd_run
from ._version import __version__
from .errors import DatabaseError, MutexError

__all__ = ["main"]

_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": cmd_run,
    "status": cmd_status,
    "watch": cmd_watch,
    "init": cmd_init,
    "migrate": cmd_migrate,
    "history": cmd_history,
    "release": cmd_release,
    "permits": cmd_permits,
    "demo": cmd_demo,
}
"""What each subcommand runs; the parser (`_cli._parser`) says what each takes."""


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
    command_line = parser()
    command_line.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    args = command_line.parse_args(argv)
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
        return int(_COMMANDS[args.subcommand](args))
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
