"""The lock-history dashboard: generated from code, and every query runs on a real history.

``grafana/build_history_dashboard.py`` builds ``grafana/postgres-mutex-history.json``, a
dashboard over a Grafana PostgreSQL data source. No Grafana server runs here, so these tests
do what its PostgreSQL data source does to a query before sending it: the dashboard's
variables are interpolated (``${history_table:raw}``, ``${lock_name:sqlstring}``,
``$__interval``), then its macros are expanded (``$__timeFilter``, ``$__timeFrom``,
``$__timeTo``, ``$__timeGroupAlias``), as Grafana documents them; see `expand`. Each query
then runs against the suite's PostgreSQL, on a history written by real lock activity (holds
released, force-released, reclaimed from a frozen holder, lost, and one still held), and
must return what its panel needs.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import psycopg
import pytest

from postgres_mutex import HoldRecord, LockNotHeldError, LockTable, Mutex
from postgres_mutex._sql import HISTORY_ENDINGS
from tests.support.fixtures import FAST, freeze, wait_until

pytest.importorskip(
    "grafana_foundation_sdk", reason="the dashboard generator needs grafana-foundation-sdk (Python 3.11+)"
)

GRAFANA = Path(__file__).resolve().parents[2] / "grafana"
COMMITTED = GRAFANA / "postgres-mutex-history.json"

DATASOURCE = {"type": "grafana-postgresql-datasource", "uid": "${datasource}"}

# The locks of the history below; one name has a quote, which ${lock_name:sqlstring} must escape.
LEDGER = "ledger'sync"
REPORTS = "reports"
NIGHTLY = "nightly"
LOCKS = (LEDGER, NIGHTLY, REPORTS)


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_history_dashboard", GRAFANA / "build_history_dashboard.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generator() -> ModuleType:
    return _load_generator()


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    """The committed JSON, which `test_committed_json_is_what_the_generator_builds` ties to the generator."""
    data: dict[str, Any] = json.loads(COMMITTED.read_text(encoding="utf-8"))
    return data


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel that draws data: rows left out, panels inside collapsed rows included."""
    panels: list[dict[str, Any]] = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            panels.extend(panel.get("panels", []))
        else:
            panels.append(panel)
    return panels


def _panel(dashboard: dict[str, Any], panel_type: str) -> dict[str, Any]:
    matches = [panel for panel in _panels(dashboard) if panel["type"] == panel_type]
    assert len(matches) == 1, f"expected one {panel_type} panel, found {len(matches)}"
    return matches[0]


def _sql(panel: dict[str, Any]) -> tuple[str, str]:
    """The one query of a panel: (format, rawSql)."""
    [target] = panel["targets"]
    return target["format"], target["rawSql"]


def _variable(dashboard: dict[str, Any], name: str) -> dict[str, Any]:
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert name in variables, f"no ${name} variable"
    variable: dict[str, Any] = variables[name]
    return variable


# --- what Grafana does to a query before PostgreSQL sees it ---------------------------------


def _grafana_time(moment: datetime) -> str:
    """A moment as Grafana's PostgreSQL macros write it: UTC, RFC 3339 with nanoseconds, trailing zeros dropped."""
    utc = moment.astimezone(UTC)
    fraction = f".{utc.microsecond:06d}".rstrip("0") if utc.microsecond else ""
    return utc.strftime("%Y-%m-%dT%H:%M:%S") + fraction.rstrip(".") + "Z"


_INTERVAL = re.compile(r"(\d+)(ms|s|m|h|d|w)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def _interval_seconds(text: str) -> float:
    found = _INTERVAL.fullmatch(text.strip().strip("'"))
    assert found, f"not an interval Grafana parses: {text!r}"
    return int(found.group(1)) * _UNIT_SECONDS[found.group(2)]


def _format(name: str, value: str | list[str], how: str | None) -> str:
    """A variable's value in one of Grafana's documented formats (only those the dashboard may use)."""
    values = [value] if isinstance(value, str) else value
    if how == "sqlstring":
        # Each value quoted, its quotes doubled, the values joined by commas.
        return ",".join("'" + item.replace("'", "''") + "'" for item in values)
    if how == "raw":
        assert len(values) == 1, f"${{{name}:raw}} of several values"
        return values[0]
    raise AssertionError(f"${name} used with format {how!r}: the dashboard uses only :raw and :sqlstring")


_VARIABLE = re.compile(r"\$\{(\w+)(?::(\w+))?\}|\$(\w+)\b(?!\()")
_MACRO = re.compile(r"\$(\w+)\(([^)]*)\)")


def expand(
    sql: str, *, start: datetime, end: datetime, variables: dict[str, str | list[str]], interval: str = "1s"
) -> str:
    """``sql`` as Grafana's PostgreSQL data source sends it, for the time range ``start`` .. ``end``.

    First the variables (the dashboard's, and the global ``$__interval``), then the data
    source's macros, as its documentation and source describe them:
    ``$__timeFilter(c)`` -> ``c BETWEEN 'from' AND 'to'``; ``$__timeFrom()`` / ``$__timeTo()``
    -> ``'from'`` / ``'to'``; ``$__timeGroupAlias(c, interval[, fill])`` ->
    ``floor(extract(epoch from c)/s)*s AS "time"`` (the fill is applied by Grafana to the
    result, not in SQL). Anything else starting with ``$`` fails the test.
    """
    scope: dict[str, str | list[str]] = {**variables, "__interval": interval}

    def variable(found: re.Match[str]) -> str:
        name = found.group(1) or found.group(3)
        assert name in scope, f"unknown variable ${name}"
        if found.group(3) is not None:
            assert name.startswith("__"), f"${name} without a format: use ${{{name}:<format>}}"
            value = scope[name]
            assert isinstance(value, str)
            return value
        return _format(name, scope[name], found.group(2))

    frm, to = _grafana_time(start), _grafana_time(end)

    def macro(found: re.Match[str]) -> str:
        name, args = found.group(1), [arg.strip() for arg in found.group(2).split(",")]
        if name == "__timeFilter":
            return f"{args[0]} BETWEEN '{frm}' AND '{to}'"
        if name == "__timeFrom":
            return f"'{frm}'"
        if name == "__timeTo":
            return f"'{to}'"
        if name == "__timeGroupAlias":
            assert 2 <= len(args) <= 3, f"$__timeGroupAlias({found.group(2)})"
            seconds = f"{_interval_seconds(args[1]):g}"
            return f'floor(extract(epoch from {args[0]})/{seconds})*{seconds} AS "time"'
        raise AssertionError(f"${name}() is not a macro this dashboard may use")

    text = _MACRO.sub(macro, _VARIABLE.sub(variable, sql))
    assert "$" not in text, f"something Grafana would not expand is left: {text}"
    return text


def test_the_expander_follows_grafanas_documented_formats_and_macros() -> None:
    start = datetime(2026, 12, 2, 3, 0, tzinfo=UTC)
    end = start + timedelta(hours=1, microseconds=250_000)
    variables: dict[str, str | list[str]] = {"history_table": "s.h", "lock_name": ["a", "it's"]}
    assert expand(
        "SELECT $__timeGroupAlias(t, $__interval, 0) FROM ${history_table:raw} "
        "WHERE l IN (${lock_name:sqlstring}) AND $__timeFilter(t) AND t > $__timeFrom() AND t < $__timeTo()",
        start=start,
        end=end,
        variables=variables,
        interval="5m",
    ) == (
        'SELECT floor(extract(epoch from t)/300)*300 AS "time" FROM s.h '
        "WHERE l IN ('a','it''s') AND t BETWEEN '2026-12-02T03:00:00Z' AND '2026-12-02T04:00:00.25Z' "
        "AND t > '2026-12-02T03:00:00Z' AND t < '2026-12-02T04:00:00.25Z'"
    )
    for undocumented in ("$__timeGroup(t, '1m')", "$lock_name", "${lock_name:csv}", "$__unknown()"):
        with pytest.raises(AssertionError):
            expand(undocumented, start=start, end=end, variables=variables)


# --- a history written by real lock activity ----------------------------------------------------


@dataclass
class History:
    dsn: str
    table: str
    start: datetime
    """The server's clock before the first hold."""
    end: datetime
    """The server's clock after the last hold ended (one is still held)."""
    holds: list[HoldRecord]
    """Every hold, newest first, as `LockTable.history` reads them."""

    @property
    def variables(self) -> dict[str, str | list[str]]:
        return {"history_table": f"{self.table}_history", "lock_name": list(LOCKS)}

    def run(
        self, sql: str, *, start: datetime | None = None, end: datetime | None = None, **overrides: Any
    ) -> tuple[list[str], list[tuple[Any, ...]]]:
        """Expand ``sql`` for this history (the whole activity, every lock, unless overridden) and run it."""
        text = expand(
            sql,
            start=start or self.start,
            end=end or self.end,
            variables={**self.variables, **overrides.pop("variables", {})},
            **overrides,
        )
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            cursor = conn.execute(text)
            assert cursor.description is not None
            return [column.name for column in cursor.description], cursor.fetchall()


def _server_now(dsn: str) -> datetime:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT now()").fetchone()
    assert row is not None
    moment: datetime = row[0]
    return moment


@pytest.fixture(scope="module")
def history(dsn: str) -> Iterator[History]:
    """A history table of this module's own: every way a hold ends that a test can cause, and one open hold."""
    table = f"histdash_{uuid.uuid4().hex[:10]}"
    lock_table = LockTable(dsn, table=table)
    assert lock_table.create(history=True)
    made: list[Mutex] = []

    def mutex(lock_name: str, instance_id: str) -> Mutex:
        made.append(Mutex(dsn, lock_name, table=table, instance_id=instance_id, **FAST))  # type: ignore[arg-type]
        return made[-1]

    try:
        start = _server_now(dsn)
        worker = mutex(LEDGER, "worker-a")
        with worker.acquire() as acquired:
            assert acquired
        with pytest.raises(LockNotHeldError), worker.acquire():
            assert lock_table.force_release(LEDGER) is not None
            wait_until(lambda: not worker.held)

        # A frozen holder, reclaimed by a waiter once it has been silent past stale_threshold.
        frozen, rescuer = mutex(REPORTS, "frozen"), mutex(REPORTS, "rescuer")
        with pytest.raises(LockNotHeldError), frozen.acquire():
            freeze(frozen)
            with rescuer.acquire(blocking=True, timeout=15) as acquired:
                assert acquired

        # A frozen holder nobody takes over: its lease runs out and it deletes its own row.
        sleepy = mutex(NIGHTLY, "sleepy")
        with pytest.raises(LockNotHeldError), sleepy.acquire():
            freeze(sleepy)
            wait_until(lambda: not sleepy.held, timeout=10)
        wait_until(lambda: all(r.ended_how for r in lock_table.history(NIGHTLY)), timeout=10)

        with worker.acquire() as acquired:  # held while the tests run
            assert acquired
            end = _server_now(dsn)
            holds = lock_table.history(limit=1000)
            endings = Counter(hold.ended_how for hold in holds)
            assert endings == {"released": 2, "force_released": 1, "reclaimed": 1, "lost": 1, None: 1}, endings
            yield History(dsn, table, start, end, holds)
    finally:
        for made_mutex in made:
            with contextlib.suppress(Exception):
                made_mutex.close()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {table}, {table}_history")
            conn.execute(f"DROP SEQUENCE IF EXISTS {table}_token_seq")


# --- generated, not hand-edited ---------------------------------------------


def test_committed_json_is_what_the_generator_builds(generator: ModuleType) -> None:
    render: Callable[[], str] = generator.render
    build: Callable[[], dict[str, Any]] = generator.build
    assert COMMITTED.read_text(encoding="utf-8") == render(), "run: python grafana/build_history_dashboard.py"
    assert json.loads(render()) == build()


def test_check_mode_fails_on_a_stale_file_and_passes_after_a_rebuild(
    generator: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    main: Callable[[list[str]], int] = generator.main
    output = tmp_path / "postgres-mutex-history.json"
    monkeypatch.setattr(generator, "OUTPUT", output)
    assert main(["--check"]) == 1, "a missing file must fail the check"
    output.write_text("{}\n", encoding="utf-8")
    assert main(["--check"]) == 1, "a stale file must fail the check"
    assert main([]) == 0
    assert main(["--check"]) == 0
    assert output.read_text(encoding="utf-8") == generator.render()


def test_identity_is_its_own(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] == "postgres-mutex-history"
    assert dashboard["uid"] != json.loads((GRAFANA / "postgres-mutex.json").read_text())["uid"]


# --- datasource and variables -----------------------------------------------


def test_every_panel_and_query_uses_the_postgresql_datasource_variable(dashboard: dict[str, Any]) -> None:
    panels = _panels(dashboard)
    assert {panel["type"] for panel in panels} >= {"stat", "timeseries", "table", "state-timeline"}
    for panel in panels:
        assert panel.get("datasource") == DATASOURCE, f"{panel['title']}: panel datasource"
        assert panel.get("targets"), f"{panel['title']}: no queries"
        for target in panel["targets"]:
            assert target.get("datasource") == DATASOURCE, f"{panel['title']}: query {target.get('refId')}"
            assert target.get("refId"), f"{panel['title']}: a query without refId"
            assert target["format"] in ("table", "time_series")
            assert target["rawQuery"] is True
            assert target["editorMode"] == "code"


def test_the_variables_pick_a_postgresql_source_a_history_table_and_locks(dashboard: dict[str, Any]) -> None:
    datasource = _variable(dashboard, "datasource")
    assert (datasource["type"], datasource["query"]) == ("datasource", DATASOURCE["type"])
    table = _variable(dashboard, "history_table")
    assert table["type"] == "textbox"
    assert table["query"] == table["current"]["value"] == "mutex_lock_history"
    locks = _variable(dashboard, "lock_name")
    assert locks["type"] == "query"
    assert locks["datasource"] == DATASOURCE
    assert locks["multi"] is True
    assert locks["includeAll"] is True
    # No custom "All" value: All then stands for every listed lock, each quoted by :sqlstring.
    assert not locks.get("allValue")


def test_every_query_filters_on_the_selected_locks_and_reads_the_history_variable(generator: ModuleType) -> None:
    queries = generator.panel_queries(generator.build())
    assert len(queries) == 4
    for title, _, sql in queries:
        assert "FROM ${history_table:raw}" in sql, title
        assert sql.count("FROM ${history_table:raw}") == sql.count("lock_name IN (${lock_name:sqlstring})"), title
        assert "$__timeFrom()" in sql or "$__timeFilter(" in sql, f"{title} ignores the time range"


# --- every query runs on a real history ------------------------------------------------------


def test_the_lock_variable_lists_the_locks_of_the_history(dashboard: dict[str, Any], history: History) -> None:
    columns, rows = history.run(_variable(dashboard, "lock_name")["query"])
    assert len(columns) == 1
    assert [row[0] for row in rows] == sorted(LOCKS)


def test_the_counts_tally_holds_begun_and_every_bad_ending(
    generator: ModuleType, dashboard: dict[str, Any], history: History
) -> None:
    fmt, sql = _sql(_panel(dashboard, "stat"))
    assert fmt == "table"
    titles = generator.STAT_COLUMNS
    columns, [row] = history.run(sql)
    counts = dict(zip(columns, row, strict=True))
    alerts = sum(hold.alerts for hold in history.holds if hold.ended_at is not None)
    assert alerts >= 2, "the reclaimed and the lost hold were each silent past alert_threshold"
    assert counts == {
        titles["began"]: 6,
        titles["reclaimed"]: 1,
        titles["lost"]: 1,
        titles["force_released"]: 1,
        titles["alerts"]: alerts,
    }
    # One lock only: the filter applies.
    _, [row] = history.run(sql, variables={"lock_name": [REPORTS]})
    assert dict(zip(columns, row, strict=True))[titles["reclaimed"]] == 1
    assert dict(zip(columns, row, strict=True))[titles["began"]] == 2
    # A range that ends while the frozen hold lasts: it began in the range, its reclaim came after.
    frozen = next(hold for hold in history.holds if hold.holder == "frozen")
    assert frozen.ended_at is not None
    _, [row] = history.run(sql, variables={"lock_name": [REPORTS]}, end=frozen.ended_at - timedelta(milliseconds=1))
    assert dict(zip(columns, row, strict=True)) == {
        titles["began"]: 1,
        titles["reclaimed"]: 0,
        titles["lost"]: 0,
        titles["force_released"]: 0,
        titles["alerts"]: 0,
    }
    # A later range: nothing began or ended in it, though a hold is still going on.
    later = history.end + timedelta(seconds=1)
    _, [row] = history.run(sql, start=later, end=later + timedelta(hours=1))
    assert set(row) == {0}


def test_the_endings_series_has_a_time_column_and_one_series_per_ending(
    dashboard: dict[str, Any], history: History
) -> None:
    fmt, sql = _sql(_panel(dashboard, "timeseries"))
    assert fmt == "time_series"
    columns, rows = history.run(sql, interval="1s")
    # Grafana's time series format: a column named time, rows sorted by it; "metric" names each series.
    assert columns == ["time", "metric", "holds"]
    times = [float(row[0]) for row in rows]
    assert times == sorted(times)
    assert all(t == int(t) for t in times), "bucketed to whole seconds"
    assert history.start.timestamp() - 1 <= times[0]
    assert times[-1] <= history.end.timestamp()
    totals: Counter[str] = Counter()
    for _, metric, holds in rows:
        totals[metric] += holds
    assert totals == {"released": 2, "force_released": 1, "reclaimed": 1, "lost": 1}
    _, wide = history.run(sql, interval="1h")
    assert len({row[0] for row in wide}) <= 2, "one or two hourly buckets"
    _, reports = history.run(sql, variables={"lock_name": [REPORTS]})
    assert Counter(metric for _, metric, _ in reports) == {"reclaimed": 1, "released": 1}


def test_the_holds_table_lists_every_hold_newest_first(
    generator: ModuleType, dashboard: dict[str, Any], history: History
) -> None:
    fmt, sql = _sql(_panel(dashboard, "table"))
    assert fmt == "table"
    columns, rows = history.run(sql)
    assert columns == list(generator.RECENT_COLUMNS)
    table = [dict(zip(columns, row, strict=True)) for row in rows]
    assert [
        (r["Lock"], r["Token"], r["Holder"], r["Acquired"], r["Ended"], r["How"], r["By"], r["Alerts"]) for r in table
    ] == [
        (h.lock_name, h.token, h.holder, h.acquired_at, h.ended_at, h.ended_how, h.ended_by, h.alerts)
        for h in history.holds
    ]
    reclaimed = next(r for r in table if r["How"] == "reclaimed")
    assert (reclaimed["Holder"], reclaimed["By"]) == ("frozen", "rescuer")
    for row in table:
        if row["Ended"] is not None:
            assert row["Held for"] == pytest.approx((row["Ended"] - row["Acquired"]).total_seconds(), abs=1e-3)
    # A range after the activity: only the hold still going on overlaps it.
    later = history.end + timedelta(seconds=1)
    _, rows = history.run(sql, start=later, end=later + timedelta(hours=1))
    assert [(row[0], row[2], row[5]) for row in rows] == [(LEDGER, "worker-a", None)]


def test_the_timeline_shows_each_holder_then_how_the_hold_ended(
    generator: ModuleType, dashboard: dict[str, Any], history: History
) -> None:
    panel = _panel(dashboard, "state-timeline")
    assert panel["repeat"] == "lock_name", "one timeline per selected lock"
    fmt, sql = _sql(panel)
    assert fmt == "table"

    def states(lock_name: str, **kwargs: Any) -> list[tuple[datetime, str]]:
        # A repeated panel gets one value of the variable.
        columns, rows = history.run(sql, variables={"lock_name": [lock_name]}, **kwargs)
        assert columns == ["time", "state"]
        assert [row[0] for row in rows] == sorted(row[0] for row in rows)
        return [(row[0], row[1]) for row in rows]

    free = generator.FREE_AFTER.format
    ledger = states(LEDGER)
    assert [state for _, state in ledger] == [
        "worker-a",
        free("released"),
        "worker-a",
        free("force_released"),
        "worker-a",
    ]
    reports = states(REPORTS)
    assert [state for _, state in reports] == ["frozen", free("reclaimed"), "rescuer", free("released")]
    assert reports[1][0] == reports[2][0], "reclaimed at the moment the rescuer's hold began"
    assert [state for _, state in states(NIGHTLY)] == ["sleepy", free("lost")]
    # A range starting during a hold: the hold is drawn from the range's start.
    open_hold = history.holds[0]
    assert open_hold.ended_at is None
    middle = open_hold.acquired_at + (history.end - open_hold.acquired_at) / 2
    [(moment, state)] = states(LEDGER, start=middle)
    assert (moment, state) == (middle, "worker-a")


def test_every_ending_has_a_name_and_colour_in_the_timeline_and_the_table(
    generator: ModuleType, dashboard: dict[str, Any]
) -> None:
    assert set(generator.ENDINGS) == set(HISTORY_ENDINGS)
    [mapping] = _panel(dashboard, "state-timeline")["fieldConfig"]["defaults"]["mappings"]
    assert set(mapping["options"]) == {generator.FREE_AFTER.format(how) for how in HISTORY_ENDINGS}
    [how] = [
        override
        for override in _panel(dashboard, "table")["fieldConfig"]["overrides"]
        if override["matcher"]["options"] == "How"
    ]
    [mappings] = [prop["value"] for prop in how["properties"] if prop["id"] == "mappings"]
    assert set(mappings[0]["options"]) == set(HISTORY_ENDINGS)
