"""The Prometheus and OpenTelemetry Collector examples under exporters/, as data for tests.

`rule_expressions()` gives each alert's PromQL, so an end-to-end test can run
every rule against a real Prometheus; `promtool()` finds the binary or skips
(failing in CI, where a missing tool must not pass as a skip).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.support.fixtures import required_tool

EXPORTERS = Path(__file__).resolve().parents[2] / "exporters"
ALERTS_FILE = EXPORTERS / "prometheus" / "alerts.yml"
ALERTS_TEST_FILE = EXPORTERS / "prometheus" / "alerts_test.yml"
SCRAPE_FILE = EXPORTERS / "prometheus" / "scrape.yml"
OTEL_COLLECTOR_FILE = EXPORTERS / "otel-collector.yaml"
README_FILE = EXPORTERS / "README.md"

GROUP_NAME = "postgres-mutex"

# Quoted strings in PromQL are label values or regexes (job="postgres_mutex_watcher"),
# never metric names: they are blanked before looking for names.
_PROMQL_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_OUR_NAME = re.compile(r"\bpostgres_mutex_[A-Za-z0-9_]*")


@dataclass(frozen=True)
class AlertRule:
    name: str
    expr: str
    for_: str | None
    labels: dict[str, str]
    annotations: dict[str, str]


def load_yaml(path: Path) -> dict[str, Any]:
    """Parse a YAML file whose top level must be a mapping."""
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert isinstance(data, dict), f"{path}: top level is not a mapping"
    return data


def _str_map(value: object, where: str) -> dict[str, str]:
    if value is None:
        return {}
    assert isinstance(value, dict), f"{where}: not a mapping"
    return {str(key): str(item) for key, item in value.items()}


def alert_rules() -> list[AlertRule]:
    """Every alerting rule of the postgres-mutex group in alerts.yml, in file order."""
    groups = load_yaml(ALERTS_FILE).get("groups")
    assert isinstance(groups, list), "alerts.yml: no groups"
    ours = [group for group in groups if isinstance(group, dict) and group.get("name") == GROUP_NAME]
    assert len(ours) == 1, f"alerts.yml: expected one group named {GROUP_NAME}"
    rules = ours[0].get("rules")
    assert isinstance(rules, list), "alerts.yml: the group has no rules"
    result = []
    for rule in rules:
        assert isinstance(rule, dict), "alerts.yml: a rule is not a mapping"
        name, expr, for_ = rule.get("alert"), rule.get("expr"), rule.get("for")
        assert isinstance(name, str), f"alerts.yml: not an alerting rule: {rule}"
        assert isinstance(expr, str), f"{name}: expr is not a string"
        result.append(
            AlertRule(
                name=name,
                expr=expr.strip(),
                for_=None if for_ is None else str(for_),
                labels=_str_map(rule.get("labels"), f"{name}.labels"),
                annotations=_str_map(rule.get("annotations"), f"{name}.annotations"),
            )
        )
    return result


def rule_expressions() -> list[tuple[str, str]]:
    """(alert name, PromQL expression) for every rule in alerts.yml.

    Each expression is one PromQL query, so it can be sent as is to
    Prometheus's /api/v1/query.
    """
    return [(rule.name, rule.expr) for rule in alert_rules()]


def metric_names_in(text: str) -> set[str]:
    """The postgres_mutex_* identifiers in a PromQL expression or an annotation, quoted strings excepted."""
    return set(_OUR_NAME.findall(_PROMQL_STRING.sub('""', text)))


def promtool() -> str:
    """Path of the promtool binary; skips the test without it, or fails it in CI."""
    return required_tool("promtool", "prometheus")
