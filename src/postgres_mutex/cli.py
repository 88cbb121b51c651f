"""The ``postgres-mutex`` command, callable from Python: for programs that embed it, as ``manage.py postgres_mutex``.

``main(["status", "--dsn", dsn])`` runs one command in this process, as the
shell would (``postgres-mutex status --dsn ...``), and returns its exit code
(see the CLI reference); it prints to stdout and stderr, and configures
logging once. Arguments given as a list never appear in the process's
command line, so a DSN with a password passed this way stays private.
"""

from ._cli import main

__all__ = ["main"]
