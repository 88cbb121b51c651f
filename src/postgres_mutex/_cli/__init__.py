"""The ``postgres-mutex`` command's parts; `postgres_mutex.cli` runs it.

Built on the library's public API only: `_run` (``run`` and ``run --restart``),
`_admin` (the operator's subcommands and ``watch``), `_demo` with `_embedded`
(the demo and its throwaway server), `_parser` (every flag), `_common` (exit
codes, the flags' words for the library's errors).
"""
