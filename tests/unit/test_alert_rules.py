"""The alerting rules, scrape config and OpenTelemetry Collector example under exporters/.

promtool checks the files and runs the rules' unit tests (alerts_test.yml); the
rest checks what promtool cannot: that the rules use only series the library
emits, that every alert tells on-call what and where, that the unit tests would
notice an alert that never fires or fires too early, and that the Collector
example delivers metrics to Prometheus under the same names.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Literal

import pytest
import yaml

from postgres_mutex import metric_names
from tests.support.prometheus_rules import (
    ALERTS_FILE,
    ALERTS_TEST_FILE,
    OTEL_COLLECTOR_FILE,
    README_FILE,
    SCRAPE_FILE,
    AlertRule,
    alert_rules,
    load_yaml,
    metric_names_in,
    promtool,
    rule_expressions,
)

ALERT_NAMES = [rule.name for rule in alert_rules()]
ALERTS_WITH_FOR = [rule.name for rule in alert_rules() if rule.for_ is not None]


def run_promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=60, cwd=cwd, check=False)


def assert_ok(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, f"{' '.join(result.args)} failed:\n{result.stdout}{result.stderr}"


# -- promtool -----------------------------------------------------------------


def test_promtool_accepts_the_rules() -> None:
    assert_ok(run_promtool("check", "rules", str(ALERTS_FILE)))


def test_rule_unit_tests_pass() -> None:
    assert_ok(run_promtool("test", "rules", str(ALERTS_TEST_FILE)))


def test_promtool_accepts_the_scrape_config() -> None:
    # Also loads the rule_files it names, resolved against the config's directory.
    result = run_promtool("check", "config", str(SCRAPE_FILE))
    assert_ok(result)
    assert "1 rule files found" in result.stdout, result.stdout


def _unit_tests_against(tmp_path: Path, rules: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """Run alerts_test.yml against these rules instead of alerts.yml."""
    (tmp_path / ALERTS_FILE.name).write_text(yaml.safe_dump(rules, sort_keys=False, width=10**6), encoding="utf-8")
    shutil.copy(ALERTS_TEST_FILE, tmp_path / ALERTS_TEST_FILE.name)
    return run_promtool("test", "rules", ALERTS_TEST_FILE.name, cwd=tmp_path)


def _mutated_rules_fail_the_unit_tests(tmp_path: Path, name: str, mutate: Literal["never fires", "has no for"]) -> None:
    """Rewrite one rule in a copy of alerts.yml and require alerts_test.yml to fail against it."""
    data = load_yaml(ALERTS_FILE)
    (rule,) = [rule for group in data["groups"] for rule in group["rules"] if rule.get("alert") == name]
    if mutate == "never fires":
        rule["expr"] = "vector(0) > 1"
    else:
        del rule["for"]
    result = _unit_tests_against(tmp_path, data)
    assert result.returncode != 0, f"alerts_test.yml still passes with {name} changed so it {mutate}"
    assert name in result.stdout + result.stderr


def test_rewritten_rules_pass_unchanged(tmp_path: Path) -> None:
    # The control for the two tests below: rewriting the file alone must not be what fails them.
    assert_ok(_unit_tests_against(tmp_path, load_yaml(ALERTS_FILE)))


@pytest.mark.parametrize("name", ALERT_NAMES)
def test_unit_tests_notice_an_alert_that_never_fires(tmp_path: Path, name: str) -> None:
    _mutated_rules_fail_the_unit_tests(tmp_path, name, "never fires")


@pytest.mark.parametrize("name", ALERTS_WITH_FOR)
def test_unit_tests_notice_an_alert_that_ignores_its_for(tmp_path: Path, name: str) -> None:
    # Some test must look at the alert while its condition holds but `for` has not elapsed.
    _mutated_rules_fail_the_unit_tests(tmp_path, name, "has no for")


def test_unit_tests_check_every_alert_staying_silent() -> None:
    """Each alert has a case where it must not fire (healthy lock, blip, inside `for`, resolved)."""
    cases = [case for test in load_yaml(ALERTS_TEST_FILE)["tests"] for case in test.get("alert_rule_test", [])]
    silent = {case["alertname"] for case in cases if not case.get("exp_alerts")}
    assert set(ALERT_NAMES) <= silent, f"no case expects these not to fire: {set(ALERT_NAMES) - silent}"


# -- what the rules say ---------------------------------------------------------


def test_rule_expressions_cover_every_rule() -> None:
    expressions = rule_expressions()
    assert [name for name, _ in expressions] == ALERT_NAMES
    assert len(set(ALERT_NAMES)) == len(ALERT_NAMES), "duplicate alert names"
    assert all(expr for _, expr in expressions)


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda rule: rule.name)
def test_rules_use_only_series_the_library_emits(rule: AlertRule) -> None:
    # A renamed metric would leave a rule that silently never fires.
    known = metric_names.prometheus_series()
    used = metric_names_in(rule.expr)
    assert used, f"{rule.name} uses no postgres_mutex_ series"
    assert used <= known, f"{rule.name}: unknown series {sorted(used - known)}"
    mentioned = set().union(*(metric_names_in(text) for text in rule.annotations.values()))
    assert mentioned <= known, f"{rule.name}: annotations name unknown series {sorted(mentioned - known)}"


def test_metric_name_extraction_ignores_label_values() -> None:
    expr = 'up{job="postgres_mutex_watcher"} == 0 or postgres_mutex_watcher_up == 0'
    assert metric_names_in(expr) == {"postgres_mutex_watcher_up"}


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda rule: rule.name)
def test_every_alert_says_how_bad_what_and_where_to_look(rule: AlertRule) -> None:
    assert rule.labels.get("severity") in {"warning", "critical"}, rule.name
    for key in ("summary", "description", "runbook_url"):
        assert rule.annotations.get(key, "").strip(), f"{rule.name}: no {key}"
    per_lock = "lock_name" in rule.expr
    if per_lock:
        assert "$labels.lock_name" in rule.annotations["summary"], f"{rule.name}: summary does not name the lock"
    # The runbook link points at this alert's section of exporters/README.md.
    assert rule.annotations["runbook_url"].endswith("exporters/README.md#" + rule.name.lower())
    assert re.search(rf"^#+ {rule.name}$", README_FILE.read_text(encoding="utf-8"), re.MULTILINE), (
        f"exporters/README.md has no section {rule.name}"
    )


def test_watcher_alerts_name_the_holder() -> None:
    for rule in alert_rules():
        if "postgres_mutex_heartbeat_age_seconds" in rule.expr:
            assert "group_left(holder)" in rule.expr, rule.name
            assert "$labels.holder" in rule.annotations["description"], rule.name


def test_job_selectors_match_the_scrape_config() -> None:
    # alerts.yml selects the watcher's `up` by job name: a renamed job would silence it.
    jobs = {job["job_name"] for job in load_yaml(SCRAPE_FILE)["scrape_configs"]}
    selected = {job for _, expr in rule_expressions() for job in re.findall(r'\bjob="([^"]+)"', expr)}
    assert selected, "no rule selects a job"
    assert selected <= jobs, f"jobs missing from scrape.yml: {selected - jobs}"


def test_scrape_config_scrapes_both_jobs_every_15s() -> None:
    config = load_yaml(SCRAPE_FILE)
    assert config["global"]["scrape_interval"] == "15s"
    assert config["rule_files"] == [ALERTS_FILE.name]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert {"postgres_mutex", "postgres_mutex_watcher"} <= set(jobs)
    for name in ("postgres_mutex", "postgres_mutex_watcher"):
        assert jobs[name].get("metrics_path", "/metrics") == "/metrics"
        assert jobs[name]["static_configs"][0]["targets"], name


# -- OpenTelemetry Collector ------------------------------------------------------


def _collector() -> dict[str, Any]:
    return load_yaml(OTEL_COLLECTOR_FILE)


def test_collector_receives_otlp_over_grpc_and_http() -> None:
    protocols = _collector()["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"].endswith(":4317")
    assert protocols["http"]["endpoint"].endswith(":4318")


def test_collector_pipelines_refer_only_to_configured_components() -> None:
    # The Collector refuses to start otherwise; nothing here can start it.
    config = _collector()
    pipelines = config["service"]["pipelines"]
    assert {"metrics", "traces"} <= set(pipelines)
    for name, pipeline in pipelines.items():
        for kind in ("receivers", "processors", "exporters"):
            missing = set(pipeline.get(kind, [])) - set(config.get(kind) or {})
            assert not missing, f"pipeline {name}: undefined {kind} {missing}"
        assert pipeline["receivers"] == ["otlp"], name
        assert pipeline["processors"][-1] == "batch", f"{name}: batch should run last, just before export"
        if "memory_limiter" in pipeline["processors"]:
            assert pipeline["processors"][0] == "memory_limiter", f"{name}: memory_limiter must come first"


def test_collector_serves_metrics_to_prometheus_under_the_same_names() -> None:
    config = _collector()
    assert config["service"]["pipelines"]["metrics"]["exporters"] == ["prometheus"]
    exporter = config["exporters"]["prometheus"]
    assert exporter["endpoint"].endswith(":8889")
    # Each of these would rename every series and leave alerts.yml matching nothing.
    assert "namespace" not in exporter
    assert exporter.get("add_metric_suffixes", True) is True
    assert exporter.get("translation_strategy", "UnderscoreEscapingWithSuffixes") in {
        "UnderscoreEscapingWithSuffixes",
        "NoUTF8EscapingWithSuffixes",
    }


def test_collector_sends_traces_to_a_backend_from_the_environment() -> None:
    config = _collector()
    assert config["service"]["pipelines"]["traces"]["exporters"] == ["otlp/traces"]
    assert re.fullmatch(r"\$\{env:[A-Z_][A-Z0-9_]*\}", config["exporters"]["otlp/traces"]["endpoint"])


def test_collector_name_mapping_examples_match_metric_names() -> None:
    # The comments show how OpenTelemetry names become Prometheus names: they must not drift.
    by_otel = {metric.otel: metric for metric in metric_names.ALL}
    examples = re.findall(
        r"(postgres_mutex\.[a-z_.]+)(?: \([^)]*\))? -> (postgres_mutex_\w+)",
        OTEL_COLLECTOR_FILE.read_text(encoding="utf-8"),
    )
    assert len(examples) >= 4
    for otel, prometheus in examples:
        assert otel in by_otel, f"otel-collector.yaml names an unknown instrument {otel}"
        assert prometheus.startswith(by_otel[otel].prometheus), (otel, prometheus)
        assert prometheus in metric_names.prometheus_series(), prometheus
