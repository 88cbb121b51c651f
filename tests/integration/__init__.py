"""Tests against real servers and processes: PostgreSQL, worker processes, PgBouncer, Patroni, Prometheus."""
