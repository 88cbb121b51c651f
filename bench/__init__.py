"""What postgres-mutex costs, measured against baselines taken in the same run.

Run ``python -m bench`` from the repository root (``--quick`` for a run of
under a minute, ``--dsn`` for your own server, ``--pgbouncer`` to add
PgBouncer, ``--skip-peers`` or ``--only-peers`` for the other locks,
``--only-rwlocks`` for the read/write locks alone, ``--only-waiters`` for many
waiters on one lock alone, ``--only-table-load`` for the table under long
heartbeat load alone);
docs/performance.md says what each section measures and shows a full run.

Modules are named for what they measure: `latency` (one connection, from
``SELECT 1`` to a Mutex cycle), `handoff`, `waiters` (many waiters on one lock:
statements and hand-off latency per release), `contention` (one lock, several
processes), `rwlocks` (read/write locks beside the Mutex, and a writer
behind a stream of readers), `ceiling` (distinct locks), `many_locks` (one process holding
many), `table_load` (the lock table under long heartbeat load: HOT updates and
its size), `pgbouncer`, `peers` (the locks a user would pick instead: `peer_locks`
is their workers' side, `peer_servers` starts what they run on, `peers_report`
writes their table). `statements` sends the library's own statements raw,
`proxy` counts round trips, `processes` and `worker` run the worker processes
(`channel` is a worker's side of their line channel), `report` writes the
tables and the JSON.
"""
