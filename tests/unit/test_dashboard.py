"""The Grafana dashboard: generated from code, and every query asks for series the library really exports.

``grafana/build_dashboard.py`` builds ``grafana/postgres-mutex.json``. These tests fail
when the committed JSON drifts from the generator, when a query names a series that
`postgres_mutex.metric_names` doesn't define (a panel that would show "No data"
forever), when a panel or query ignores the ``$datasource`` or ``$lock_name``
variables, or when the heartbeat-age panel loses its threshold lines.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from postgres_mutex import metric_names as m
from tests.support.fixtures import required_module

# Part of the dev extra: a missing generator skips this module locally and fails it in CI.
required_module("grafana_foundation_sdk", "the dashboard generator needs grafana-foundation-sdk (the dev extra)")

GRAFANA = Path(__file__).resolve().parents[2] / "grafana"
COMMITTED = GRAFANA / "postgres-mutex.json"

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
LOCK_FILTER = 'lock_name=~"$lock_name"'
SERIES = re.compile(r"\b(postgres_mutex_\w+)(\{[^}]*\})?")

Queries = Callable[[dict[str, Any]], list[tuple[str, str]]]


def _metric_of_series() -> dict[str, m.MetricName]:
    """Each Prometheus series name, histogram suffixes included, mapped to the metric it belongs to."""
    owners: dict[str, m.MetricName] = {}
    for metric in m.ALL:
        suffixes = ("_bucket", "_sum", "_count") if metric.kind == "histogram" else ("",)
        owners.update({metric.prometheus + suffix: metric for suffix in suffixes})
    return owners


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_dashboard", GRAFANA / "build_dashboard.py")
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


@pytest.fixture(scope="module")
def queries(generator: ModuleType, dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    panel_queries: Queries = generator.panel_queries
    found = panel_queries(dashboard)
    assert found, "the dashboard has no queries"
    return found


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel that draws data: rows left out, panels inside collapsed rows included."""
    panels: list[dict[str, Any]] = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            panels.extend(panel.get("panels", []))
        else:
            panels.append(panel)
    return panels


def _variable(dashboard: dict[str, Any], name: str) -> dict[str, Any]:
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert name in variables, f"no ${name} variable"
    variable: dict[str, Any] = variables[name]
    return variable


def _panel(dashboard: dict[str, Any], title: str) -> dict[str, Any]:
    matches = [panel for panel in _panels(dashboard) if panel["title"] == title]
    assert len(matches) == 1, f"expected one panel titled {title!r}, found {len(matches)}"
    return matches[0]


# --- generated, not hand-edited ---------------------------------------------


def test_committed_json_is_what_the_generator_builds(generator: ModuleType) -> None:
    render: Callable[[], str] = generator.render
    build: Callable[[], dict[str, Any]] = generator.build
    assert COMMITTED.read_text(encoding="utf-8") == render(), "run: python grafana/build_dashboard.py"
    assert json.loads(render()) == build()


def test_check_mode_fails_on_a_stale_file_and_passes_after_a_rebuild(
    generator: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    main: Callable[[list[str]], int] = generator.main
    output = tmp_path / "postgres-mutex.json"
    monkeypatch.setattr(generator, "OUTPUT", output)
    assert main(["--check"]) == 1, "a missing file must fail the check"
    output.write_text("{}\n", encoding="utf-8")
    assert main(["--check"]) == 1, "a stale file must fail the check"
    assert main([]) == 0
    assert main(["--check"]) == 0
    render: Callable[[], str] = generator.render
    assert output.read_text(encoding="utf-8") == render()


def test_identity(dashboard: dict[str, Any]) -> None:
    assert dashboard["title"] == "postgres-mutex: lock health"
    assert dashboard["uid"] == "postgres-mutex"


# --- queries ask for real series --------------------------------------------


def test_queries_use_only_series_the_library_exports(dashboard: dict[str, Any], queries: list[tuple[str, str]]) -> None:
    valid = m.prometheus_series()
    texts = list(queries)
    texts.append(("$lock_name variable", str(_variable(dashboard, "lock_name")["query"])))
    for title, text in texts:
        names = {match.group(1) for match in SERIES.finditer(text)}
        assert names, f"{title}: no postgres_mutex series in {text!r}"
        assert names <= valid, f"{title}: unknown series {sorted(names - valid)} in {text!r}"


def test_every_metric_the_library_exports_is_on_the_dashboard(queries: list[tuple[str, str]]) -> None:
    owners = _metric_of_series()
    shown = {owners[match.group(1)].prometheus for _, expr in queries for match in SERIES.finditer(expr)}
    missing = sorted({metric.prometheus for metric in m.ALL} - shown)
    assert not missing, f"metrics without a panel: {missing}"


def test_every_query_filters_on_the_lock_name_variable(queries: list[tuple[str, str]]) -> None:
    owners = _metric_of_series()
    for title, expr in queries:
        for match in SERIES.finditer(expr):
            if "lock_name" in owners[match.group(1)].labels:
                assert LOCK_FILTER in (match.group(2) or ""), f"{title}: {match.group(0)} ignores $lock_name"
            else:
                assert "lock_name" not in (match.group(2) or ""), f"{title}: {match.group(1)} has no lock_name label"


def test_queries_are_plain_promql_once_the_placeholders_are_substituted(queries: list[tuple[str, str]]) -> None:
    for title, expr in queries:
        rest = expr.replace("$lock_name", "").replace("$__rate_interval", "")
        assert "$" not in rest, f"{title}: a Grafana-only placeholder in {expr!r}"
        for window in re.findall(r"\[([^\]]*)\]", expr):
            assert window == "$__rate_interval", f"{title}: range [{window}] instead of [$__rate_interval]"


def test_histograms_are_read_per_bucket_and_aggregated_by_le(queries: list[tuple[str, str]]) -> None:
    quantiles = [(title, expr) for title, expr in queries if "histogram_quantile" in expr]
    assert {title for title, _ in quantiles} == {"Heartbeat latency", "Acquire duration by outcome"}
    for title, expr in quantiles:
        assert re.search(r"sum by \(le, \w+\) \(rate\(postgres_mutex_\w+_bucket\{", expr), f"{title}: {expr}"


# --- datasource and variables -----------------------------------------------


def test_every_panel_and_query_uses_the_datasource_variable(dashboard: dict[str, Any]) -> None:
    panels = _panels(dashboard)
    assert panels
    for panel in panels:
        assert panel.get("datasource") == DATASOURCE, f"{panel['title']}: panel datasource"
        assert panel.get("targets"), f"{panel['title']}: no queries"
        for target in panel["targets"]:
            assert target.get("datasource") == DATASOURCE, f"{panel['title']}: query {target.get('refId')}"


def test_every_query_has_its_own_ref_id(dashboard: dict[str, Any]) -> None:
    for panel in _panels(dashboard):
        ref_ids = [target.get("refId") for target in panel["targets"]]
        assert all(ref_ids), f"{panel['title']}: a query without refId"
        assert len(set(ref_ids)) == len(ref_ids), f"{panel['title']}: duplicate refIds {ref_ids}"


def test_the_datasource_variable_offers_prometheus(dashboard: dict[str, Any]) -> None:
    variable = _variable(dashboard, "datasource")
    assert variable["type"] == "datasource"
    assert variable["query"] == "prometheus"


def test_the_lock_name_variable_lists_locks_and_selects_all(dashboard: dict[str, Any]) -> None:
    variable = _variable(dashboard, "lock_name")
    assert variable["type"] == "query"
    assert variable["datasource"] == DATASOURCE
    assert re.fullmatch(r"label_values\(.+, lock_name\)", variable["query"])
    assert m.HEARTBEAT_AGE.prometheus in variable["query"]
    assert variable["multi"] is True
    assert variable["includeAll"] is True
    assert variable["allValue"] == ".*"


def test_panels_that_draw_numbers_declare_a_unit(dashboard: dict[str, Any]) -> None:
    for panel in _panels(dashboard):
        if panel["type"] in ("timeseries", "table"):
            assert panel["fieldConfig"]["defaults"].get("unit"), f"{panel['title']}: no unit"


# --- the panels that matter most ---------------------------------------------


def test_heartbeat_age_panel_draws_both_thresholds_as_dashed_series(dashboard: dict[str, Any]) -> None:
    panel = _panel(dashboard, "Seconds since heartbeat")
    by_metric = {
        match.group(1): target["refId"] for target in panel["targets"] for match in SERIES.finditer(target["expr"])
    }
    for metric in (m.HEARTBEAT_AGE, m.ALERT_THRESHOLD, m.STALE_THRESHOLD):
        assert metric.prometheus in by_metric, f"{metric.prometheus} is not plotted"
    assert panel["fieldConfig"]["defaults"]["unit"] == "s"
    dashed = {
        override["matcher"]["options"]
        for override in panel["fieldConfig"]["overrides"]
        if override["matcher"]["id"] == "byFrameRefID"
        and {"id": "custom.lineStyle", "value": {"dash": [10, 10], "fill": "dash"}} in override["properties"]
    }
    assert by_metric[m.ALERT_THRESHOLD.prometheus] in dashed
    assert by_metric[m.STALE_THRESHOLD.prometheus] in dashed
    assert by_metric[m.HEARTBEAT_AGE.prometheus] not in dashed


def test_held_locks_panel_shows_holder_and_duration(dashboard: dict[str, Any]) -> None:
    exprs = [target["expr"] for target in _panel(dashboard, "Held locks")["targets"]]
    assert any(m.HOLDER_INFO.prometheus in expr and m.HELD_DURATION.prometheus in expr for expr in exprs)
    assert any("holder" in expr for expr in exprs), "the holder label is aggregated away"


# --- panel_queries, which the end-to-end test uses ----------------------------


def test_panel_queries_finds_targets_in_rows_and_skips_targets_without_expr(generator: ModuleType) -> None:
    panel_queries: Queries = generator.panel_queries
    board = {
        "panels": [
            {"type": "row", "title": "open", "panels": []},
            {"type": "timeseries", "title": "one", "targets": [{"refId": "A", "expr": "a"}, {"refId": "B"}]},
            {
                "type": "row",
                "title": "collapsed",
                "collapsed": True,
                "panels": [{"type": "stat", "title": "two", "targets": [{"refId": "A", "expr": "b"}]}],
            },
            {"type": "text", "title": "three"},
        ]
    }
    assert panel_queries(board) == [("one", "a"), ("two", "b")]


def test_panel_queries_lists_every_target_of_the_dashboard(
    dashboard: dict[str, Any], queries: list[tuple[str, str]]
) -> None:
    expected = [(panel["title"], target["expr"]) for panel in _panels(dashboard) for target in panel["targets"]]
    assert queries == expected
