"""Build the postgres-mutex lock-history Grafana dashboard from code.

``python grafana/build_history_dashboard.py`` rewrites ``grafana/postgres-mutex-history.json``;
``python grafana/build_history_dashboard.py --check`` exits 1 if the committed file differs
from what this script builds, so CI catches a hand edit or a forgotten rebuild.

Unlike the lock-health dashboard (``build_dashboard.py``, over Prometheus), this one reads
the history table itself (``<table>_history``, see docs/operations/history.md) through a
Grafana **PostgreSQL data source**. Its SQL uses only what Grafana documents for that data
source: the macros ``$__timeFilter(column)``, ``$__timeFrom()``, ``$__timeTo()`` and
``$__timeGroupAlias(column, $__interval, 0)``, the global ``$__interval``, and the variables
``${history_table:raw}`` and ``${lock_name:sqlstring}``. tests/integration/test_history_dashboard.py expands
them as Grafana documents and runs every query against a real history (`panel_queries`
lists them).

Needs ``grafana-foundation-sdk`` (the build for Grafana 11.6, Python >= 3.11). The SDK has no
builder for PostgreSQL queries, so `SqlQuery` writes Grafana's query model for it.
"""

from __future__ import annotations

import argparse
import json
import string
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dashboard_builders
from grafana_foundation_sdk.builders import stat, statetimeline, table, timeseries
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.cog.runtime import UnknownDataquery
from grafana_foundation_sdk.cog.variants import Dataquery
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DataSourceRef,
    DynamicConfigValue,
    FieldColorModeId,
    Threshold,
    ThresholdsMode,
    ValueMap,
    ValueMappingResult,
    VariableOption,
    VariableRefresh,
    VariableSort,
)

OUTPUT = Path(__file__).with_name("postgres-mutex-history.json")

TITLE = "postgres-mutex: lock history"
UID = "postgres-mutex-history"

DATASOURCE_TYPE = "grafana-postgresql-datasource"
DATASOURCE = DataSourceRef(type_val=DATASOURCE_TYPE, uid="${datasource}")
"""Every panel and query points at the dashboard's datasource variable, so one import serves any PostgreSQL."""

DEFAULT_TABLE = "mutex_lock_history"
"""The history of the default lock table, ``mutex_lock``."""

HISTORY = "${history_table:raw}"
"""The history table, as the ``history_table`` variable names it (``raw``: an identifier, never quoted)."""

LOCKS = "lock_name IN (${lock_name:sqlstring})"
"""The filter every panel puts on the selected locks: each value quoted, its quotes doubled."""

Format = Literal["table", "time_series"]

ENDINGS: dict[str, tuple[str, str]] = {
    "released": ("released", "green"),
    "reclaimed": ("reclaimed", "orange"),
    "reclaimed_disconnected": ("reclaimed (session ended)", "light-orange"),
    "replaced": ("replaced", "yellow"),
    "lost": ("lost", "red"),
    "abandoned": ("abandoned", "purple"),
    "force_released": ("force-released", "dark-red"),
}
"""Each ``ended_how`` of the history (``postgres_mutex._sql.HISTORY_ENDINGS``): its display text and colour."""

FREE_AFTER = "free after {}"
"""How the timeline names the time between holds, by how the last hold ended."""

TROUBLE = ("reclaimed", "lost", "force_released")
"""Endings that deserve a look: the stat panel counts them."""

SECONDS = "s"
COUNT = "short"

Panel = timeseries.Panel | stat.Panel | table.Panel | statetimeline.Panel


# --- queries ----------------------------------------------------------------


class SqlQuery(Builder[Dataquery]):
    """A query of Grafana's PostgreSQL data source, in code mode: ``rawSql`` and a result ``format``."""

    def __init__(self, ref_id: str, raw_sql: str, format_: Format) -> None:
        self.ref_id = ref_id
        self.raw_sql = raw_sql
        self.format = format_

    def build(self) -> Dataquery:
        return UnknownDataquery(
            {
                "refId": self.ref_id,
                "datasource": DATASOURCE.to_json(),
                "editorMode": "code",
                "rawQuery": True,
                "format": self.format,
                "rawSql": self.raw_sql,
            }
        )


def _queries(format_: Format, *sqls: str) -> list[Builder[Dataquery]]:
    """Queries for ``sqls`` in ``format_``, refIds A, B, ... in order."""
    return [
        SqlQuery(ref_id, sql, format_) for ref_id, sql in zip(string.ascii_uppercase[: len(sqls)], sqls, strict=True)
    ]


# A hold overlaps the time range if it began before its end and had not ended before its start.
OVERLAPS = "acquired_at <= $__timeTo() AND (ended_at IS NULL OR ended_at >= $__timeFrom())"


def timeline_sql() -> str:
    """One row per change of a lock's state in the range: a hold begins (its holder), a hold ends (how).

    A hold that began before the range starts at the range's start; at a reclaim, the old
    hold's end sorts before the new hold's start, which has the same time.
    """
    return f"""SELECT "time", state
  FROM (
    SELECT greatest(acquired_at, $__timeFrom()) AS "time", 1 AS step, id, holder AS state
      FROM {HISTORY}
     WHERE {LOCKS} AND {OVERLAPS}
    UNION ALL
    SELECT ended_at, 0, id, '{FREE_AFTER.format("")}' || ended_how
      FROM {HISTORY}
     WHERE {LOCKS} AND $__timeFilter(ended_at)
  ) AS changes
 ORDER BY "time", step, id"""  # noqa: S608 (Grafana fills in the variables)


def endings_sql() -> str:
    """Holds ended per interval, one series per way of ending (the ``metric`` column names it)."""
    return f"""SELECT $__timeGroupAlias(ended_at, $__interval, 0), ended_how AS metric, count(*) AS holds
  FROM {HISTORY}
 WHERE {LOCKS} AND $__timeFilter(ended_at)
 GROUP BY 1, 2
 ORDER BY 1, 2"""  # noqa: S608 (Grafana fills in the variables)


STAT_COLUMNS = {
    "began": "Holds begun",
    "reclaimed": "Reclaimed",
    "lost": "Lost",
    "force_released": "Force-released",
    "alerts": "Alert episodes",
}
"""The stat panel's tiles: its query's columns and their titles."""


def counts_sql() -> str:
    """Holds begun, endings that deserve a look, and alert episodes (of holds that ended), in the range."""
    endings = ",\n       ".join(
        f"count(*) FILTER (WHERE ended_how = '{how}' AND $__timeFilter(ended_at)) AS \"{STAT_COLUMNS[how]}\""
        for how in TROUBLE
    )
    return f"""SELECT count(*) FILTER (WHERE $__timeFilter(acquired_at)) AS "{STAT_COLUMNS["began"]}",
       {endings},
       coalesce(sum(alerts) FILTER (WHERE $__timeFilter(ended_at)), 0) AS "{STAT_COLUMNS["alerts"]}"
  FROM {HISTORY}
 WHERE {LOCKS} AND {OVERLAPS}"""  # noqa: S608 (Grafana fills in the variables)


RECENT_LIMIT = 500
"""Rows of the recent-holds table: enough to scroll, few enough for a browser."""

RECENT_COLUMNS = ("Lock", "Token", "Holder", "Acquired", "Ended", "How", "By", "Alerts", "Held for")


def recent_sql() -> str:
    """Every hold that overlaps the range, newest first; ``Held for`` counts an open hold up to now."""
    return f"""SELECT lock_name AS "Lock", token AS "Token", holder AS "Holder",
       acquired_at AS "Acquired", ended_at AS "Ended", ended_how AS "How", ended_by AS "By",
       alerts AS "Alerts",
       EXTRACT(EPOCH FROM coalesce(ended_at, now()) - acquired_at)::float8 AS "Held for"
  FROM {HISTORY}
 WHERE {LOCKS} AND {OVERLAPS}
 ORDER BY acquired_at DESC, id DESC
 LIMIT {RECENT_LIMIT}"""  # noqa: S608 (Grafana fills in the variables)


def lock_names_sql() -> str:
    """Every lock of the history, one index probe each (its ``(lock_name, acquired_at)`` index), not a scan."""
    return f"""WITH RECURSIVE names AS (
  (SELECT lock_name FROM {HISTORY} ORDER BY lock_name LIMIT 1)
  UNION ALL
  SELECT (SELECT lock_name FROM {HISTORY} WHERE lock_name > names.lock_name ORDER BY lock_name LIMIT 1)
    FROM names WHERE names.lock_name IS NOT NULL
)
SELECT lock_name FROM names WHERE lock_name IS NOT NULL"""  # noqa: S608 (Grafana fills in the variables)


# --- panel pieces -----------------------------------------------------------


def _thresholds(*steps: tuple[float | None, str]) -> dashboard_builders.ThresholdsConfig:
    return (
        dashboard_builders.ThresholdsConfig()
        .mode(ThresholdsMode.ABSOLUTE)
        .steps([Threshold(value=value, color=color) for value, color in steps])
    )


def _ending_mapping(text: str = "{}") -> ValueMap:
    """Each ``ended_how`` (or its text in the timeline) shown in words, in its colour."""
    return ValueMap(
        options={
            text.format(how): ValueMappingResult(text=text.format(label), color=color, index=index)
            for index, (how, (label, color)) in enumerate(ENDINGS.items())
        }
    )


def _fixed(color: str) -> list[DynamicConfigValue]:
    return [DynamicConfigValue(id_val="color", value={"mode": FieldColorModeId.FIXED, "fixedColor": color})]


# --- panels -----------------------------------------------------------------


def counts() -> stat.Panel:
    """Holds begun in the range, and how many ended badly: one tile each."""
    panel = (
        stat.Panel()
        .title("Holds and endings in the range")
        .description(
            "Holds begun in the time range; holds reclaimed by another instance after their holder went silent, "
            "lost (the holder's lease ran out) or force-released by an operator; and the alert episodes of the "
            "holds that ended in the range (each silence of a holder past alert_threshold)."
        )
        .datasource(DATASOURCE)
        .targets(_queries("table", counts_sql()))
        .unit(COUNT)
        .decimals(0)
        .thresholds(_thresholds((None, "green"), (1, "red")))
        .color_mode(common.BigValueColorMode.BACKGROUND)
        .graph_mode(common.BigValueGraphMode.NONE)
        .text_mode(common.BigValueTextMode.VALUE_AND_NAME)
        .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .override_by_name(STAT_COLUMNS["began"], _fixed("blue"))
        .override_by_name(STAT_COLUMNS["alerts"], _fixed("orange"))
        .no_value("No history in the range")
        .height(5)
        .span(24)
    )
    return panel


def endings() -> timeseries.Panel:
    """How holds ended, per interval: a release is routine, the others deserve a look."""
    panel = (
        timeseries.Panel()
        .title("Hold endings over time")
        .description(
            "Holds that ended in each interval, by how they ended: released by their holder, reclaimed after "
            "the holder went silent past stale_threshold, replaced by their own instance, lost (lease ran out), "
            "abandoned (an unanswered acquire), force-released by an operator."
        )
        .datasource(DATASOURCE)
        .targets(_queries("time_series", endings_sql()))
        .unit(COUNT)
        .decimals(0)
        .min(0)
        .draw_style(common.GraphDrawStyle.BARS)
        .fill_opacity(80)
        .line_width(1)
        .stacking(common_builders.StackingConfig().mode(common.StackingMode.NORMAL))
        .legend(
            common_builders.VizLegendOptions()
            .display_mode(common.LegendDisplayMode.TABLE)
            .placement(common.LegendPlacement.RIGHT)
            .show_legend(True)
            .calcs(["sum"])
        )
        .tooltip(common_builders.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI))
        .height(8)
        .span(24)
    )
    for how, (_, color) in ENDINGS.items():
        panel.override_by_name(how, _fixed(color))
    return panel


def holders() -> statetimeline.Panel:
    """Who held each lock when, and how each hold ended: one timeline per selected lock."""
    return (
        statetimeline.Panel()
        .title("Holders of $lock_name")
        .description(
            "Each hold as a band named by its holder (the Mutex's instance_id); between holds the lock was free, "
            "and the band says how the last hold ended. One panel per selected lock."
        )
        .datasource(DATASOURCE)
        .targets(_queries("table", timeline_sql()))
        .repeat("lock_name")
        .repeat_direction("v")
        .mappings([_ending_mapping(FREE_AFTER)])
        .color_scheme(dashboard_builders.FieldColor().mode(FieldColorModeId.FIXED).fixed_color("blue"))
        .show_value(common.VisibilityMode.AUTO)
        .merge_values(False)
        .line_width(1)
        .fill_opacity(70)
        .row_height(0.8)
        .legend(common_builders.VizLegendOptions().show_legend(False))
        .no_value("No hold in the range")
        .height(4)
        .span(24)
    )


def recent() -> table.Panel:
    """Every hold in the range, newest first, with how and by whom it ended."""
    return (
        table.Panel()
        .title("Holds in the range")
        .description(
            f"Holds that overlap the time range, newest first (at most {RECENT_LIMIT}). Token: the hold's fencing "
            "token. By: the instance that reclaimed or replaced it. Alerts: silences of its holder past "
            "alert_threshold. Held for: until now for a hold still going on. An empty How: still held, or its end "
            "was not written (a release before 0.2.0 ended it)."
        )
        .datasource(DATASOURCE)
        .targets(_queries("table", recent_sql()))
        .override_by_name("Held for", [DynamicConfigValue(id_val="unit", value=SECONDS)])
        .override_by_name(
            "How",
            [
                DynamicConfigValue(id_val="mappings", value=[_ending_mapping().to_json()]),
                DynamicConfigValue(id_val="custom.cellOptions", value={"type": "color-text"}),
            ],
        )
        .override_by_name("Token", [DynamicConfigValue(id_val="decimals", value=0)])
        .override_by_name("Alerts", [DynamicConfigValue(id_val="decimals", value=0)])
        .sort_by([common_builders.TableSortByFieldState().display_name("Acquired").desc(True)])
        .filterable(True)
        .no_value("No hold in the range")
        .height(12)
        .span(24)
    )


# --- dashboard --------------------------------------------------------------


def _variables() -> list[Builder[Any]]:
    datasource = dashboard_builders.DatasourceVariable("datasource").label("Data source").type(DATASOURCE_TYPE)
    history_table = (
        dashboard_builders.TextBoxVariable("history_table")
        .label("History table")
        .description("The lock table's history: <table>_history, schema-qualified if need be.")
        .default_value(DEFAULT_TABLE)
        .current(VariableOption(text=DEFAULT_TABLE, value=DEFAULT_TABLE, selected=True))
    )
    lock_names = (
        dashboard_builders.QueryVariable("lock_name")
        .label("Lock")
        .datasource(DATASOURCE)
        .query(lock_names_sql())
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .current(VariableOption(text=["All"], value=["$__all"]))
    )
    return [datasource, history_table, lock_names]


def _dashboard() -> dashboard_builders.Dashboard:
    board = (
        dashboard_builders.Dashboard(TITLE)
        .uid(UID)
        .description(
            "Who held each lock when, and how each hold ended, from postgres-mutex's lock history table "
            "(LockTable.create(history=True))."
        )
        .tags(["postgres-mutex", "postgresql", "locks", "history"])
        .editable()
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .time("now-24h", "now")
        .refresh("1m")
        .variables(_variables())
    )
    sections: list[tuple[str, list[Panel]]] = [
        ("Endings", [counts(), endings()]),
        ("Holds", [recent()]),
        ("Holders over time", [holders()]),
    ]
    panel_id = 0
    for title, panels in sections:
        panel_id += 1
        # An expanded row's panels follow it at the top level; Grafana ignores panels nested in an expanded row.
        board.with_row(dashboard_builders.Row(title).id(panel_id))
        for panel in panels:
            panel_id += 1
            board.with_panel(panel.id(panel_id))
    return board


def build() -> dict[str, Any]:
    """The dashboard as Grafana's JSON model, as plain dicts and lists."""
    data: dict[str, Any] = json.loads(json.dumps(_dashboard().build(), cls=JSONEncoder))
    return data


def render() -> str:
    """The exact text of ``postgres-mutex-history.json``: sorted keys, two-space indent, trailing newline."""
    return json.dumps(build(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def panel_queries(dashboard: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Every ``(panel title, format, rawSql)`` in a dashboard's JSON model, panels inside collapsed rows included."""
    found: list[tuple[str, str, str]] = []

    def visit(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            found.extend(
                (panel["title"], target["format"], target["rawSql"])
                for target in panel.get("targets", [])
                if "rawSql" in target
            )
            visit(panel.get("panels", []))

    visit(dashboard.get("panels", []))
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help=f"exit 1 if {OUTPUT.name} differs from the build")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = OUTPUT.read_text(encoding="utf-8") if OUTPUT.exists() else None
        if current != text:
            print(f"{OUTPUT} is out of date: run python grafana/build_history_dashboard.py", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
