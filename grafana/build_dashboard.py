"""Build the postgres-mutex Grafana dashboard from code.

``python grafana/build_dashboard.py`` rewrites ``grafana/postgres-mutex.json``;
``python grafana/build_dashboard.py --check`` exits 1 if the committed file differs
from what this script builds, so CI catches a hand edit or a forgotten rebuild.

Every series name comes from `postgres_mutex.metric_names`, the table the
exporters register from, so a renamed metric breaks the build rather than
leaving a panel that silently shows "No data". Every query aggregates with
``by (lock_name)`` (or ``le``/``outcome``) because series carry extra labels
(job, instance, otel_scope_*), and stays plain PromQL: the only Grafana
placeholders are ``$lock_name`` and ``$__rate_interval``, which an end-to-end
test substitutes before asking a real Prometheus to evaluate each query
(`panel_queries` lists them).

Needs ``grafana-foundation-sdk`` (the build for Grafana 11.6, Python >= 3.11).
"""

from __future__ import annotations

import argparse
import json
import string
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dashboard_builders
from grafana_foundation_sdk.builders import prometheus, stat, statetimeline, table, timeseries
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.cog.variants import Dataquery
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DataSourceRef,
    DataTransformerConfig,
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
from grafana_foundation_sdk.models.prometheus import PromQueryFormat, QueryEditorMode

from postgres_mutex import metric_names as m

OUTPUT = Path(__file__).with_name("postgres-mutex.json")

TITLE = "postgres-mutex: lock health"
UID = "postgres-mutex"

DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
"""Every panel and query points at the dashboard's datasource variable, so one import serves any Prometheus."""

LOCK_FILTER = 'lock_name=~"$lock_name"'
"""The matcher every query puts on a metric that has a ``lock_name`` label."""

SECONDS = "s"
PER_SECOND = "ops"
COUNT = "short"

STATE_MAPPING = ValueMap(
    options={
        "0": ValueMappingResult(text="OK", color="green", index=0),
        "1": ValueMappingResult(text="ALERTING", color="orange", index=1),
        "2": ValueMappingResult(text="RECLAIMABLE", color="red", index=2),
    }
)
"""Display of `_state_expr`: alerting and reclaimable are 0/1 each and reclaimable implies alerting."""

QUANTILES = (0.5, 0.95, 0.99)
"""The latency percentiles drawn for each histogram."""

LEADERS_MAPPING = ValueMap(
    options={
        "0": ValueMappingResult(text="NO LEADER", color="red", index=0),
        "1": ValueMappingResult(text="LEADER", color="green", index=1),
        "2": ValueMappingResult(text="TWO LEADERS", color="purple", index=2),
    }
)
"""Display of the number of leaders an election reports: one is right, none is an outage."""

WRITER_WAITING_MAPPING = ValueMap(
    options={
        "0": ValueMappingResult(text="NO WRITER WAITS", color="green", index=0),
        "1": ValueMappingResult(text="WRITER WAITS", color="orange", index=1),
    }
)
"""Display of whether a writer waits for a read/write lock (new readers then wait behind it)."""

UP_MAPPING = ValueMap(
    options={
        "0": ValueMappingResult(text="DOWN", color="red", index=0),
        "1": ValueMappingResult(text="UP", color="green", index=1),
    }
)


Panel = timeseries.Panel | stat.Panel | table.Panel | statetimeline.Panel


# --- PromQL -----------------------------------------------------------------


def selector(metric: m.MetricName, suffix: str = "") -> str:
    """The selector for ``metric`` (plus a histogram ``suffix``), filtered on ``$lock_name`` if it has that label."""
    name = metric.prometheus + suffix
    return f"{name}{{{LOCK_FILTER}}}" if "lock_name" in metric.labels else name


def _rate(metric: m.MetricName, suffix: str = "") -> str:
    return f"rate({selector(metric, suffix)}[$__rate_interval])"


def rate_by_lock(metric: m.MetricName) -> str:
    """Per-second rate of a counter per lock, summed over every process that reports it."""
    return f"sum by (lock_name) ({_rate(metric)})"


def quantile(q: float, histogram: m.MetricName, by: str) -> str:
    """The ``q`` quantile of ``histogram`` over ``$__rate_interval``, per value of the ``by`` label."""
    return f"histogram_quantile({q}, sum by (le, {by}) ({_rate(histogram, '_bucket')}))"


def max_by_lock(gauge: m.MetricName) -> str:
    """A watcher gauge per lock; ``max`` collapses duplicate watchers (HA pairs, OTel scope labels) into one series."""
    return f"max by (lock_name) ({selector(gauge)})"


def _state_expr() -> str:
    """0 = OK, 1 = alerting, 2 = reclaimable: one number per lock for the stat and state-timeline panels."""
    return f"{max_by_lock(m.ALERTING)} + {max_by_lock(m.RECLAIMABLE)}"


def _holder_expr() -> str:
    """Seconds each lock has been held, labelled with its holder.

    ``holder_info`` (value 1) carries the holder; multiplying by ``held_duration``
    on ``lock_name`` moves the duration onto that series, so one instant query
    gives a table row per lock with holder and duration side by side.
    """
    holders = f"max by (lock_name, permit, mode, holder) ({selector(m.HOLDER_INFO)})"
    # Per holder: a semaphore's holders are one row each, told apart by their permit (none for a mutex);
    # a read/write lock's by their mode.
    return f"{holders} * on (lock_name, permit, mode) group_left {max_by_holder(m.HELD_DURATION)}"


def max_by_holder(gauge: m.MetricName) -> str:
    """A watcher gauge per holder: per lock, per permit of a semaphore, per mode of a read/write lock."""
    return f"max by (lock_name, permit, mode) ({selector(gauge)})"


# --- panel pieces -----------------------------------------------------------


def _queries(*exprs: tuple[str, str]) -> list[Builder[Dataquery]]:
    """Range queries for ``(expr, legend)`` pairs, refIds A, B, ... in order (the SDK leaves refId empty otherwise)."""
    return [
        prometheus.Dataquery()
        .ref_id(ref_id)
        .expr(expr)
        .legend_format(legend)
        .range()
        .editor_mode(QueryEditorMode.CODE)
        .datasource(DATASOURCE)
        for ref_id, (expr, legend) in zip(string.ascii_uppercase[: len(exprs)], exprs, strict=True)
    ]


def _table_queries(*exprs: str) -> list[Builder[Dataquery]]:
    """Instant queries in table format, refIds A, B, ... in order."""
    return [
        prometheus.Dataquery()
        .ref_id(ref_id)
        .expr(expr)
        .instant()
        .format(PromQueryFormat.TABLE)
        .editor_mode(QueryEditorMode.CODE)
        .datasource(DATASOURCE)
        for ref_id, expr in zip(string.ascii_uppercase[: len(exprs)], exprs, strict=True)
    ]


def _thresholds(*steps: tuple[float | None, str]) -> dashboard_builders.ThresholdsConfig:
    return (
        dashboard_builders.ThresholdsConfig()
        .mode(ThresholdsMode.ABSOLUTE)
        .steps([Threshold(value=value, color=color) for value, color in steps])
    )


def _legend() -> common_builders.VizLegendOptions:
    return (
        common_builders.VizLegendOptions()
        .display_mode(common.LegendDisplayMode.TABLE)
        .placement(common.LegendPlacement.BOTTOM)
        .show_legend(True)
        .calcs(["lastNotNull", "max"])
    )


def _graph(title: str, description: str, unit: str, *exprs: tuple[str, str]) -> timeseries.Panel:
    """A time series panel with the conventions every graph here shares."""
    return (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .targets(_queries(*exprs))
        .unit(unit)
        .min(0)
        .line_width(1)
        .fill_opacity(10)
        .show_points(common.VisibilityMode.NEVER)
        .legend(_legend())
        .tooltip(
            common_builders.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI).sort(common.SortOrder.DESCENDING)
        )
        .height(8)
        .span(12)
    )


def _dashed(color: str) -> list[DynamicConfigValue]:
    """Field overrides that draw a series as a fixed-colour dashed line with no fill, as reference lines are drawn."""
    return [
        DynamicConfigValue(id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]}),
        DynamicConfigValue(id_val="custom.fillOpacity", value=0),
        DynamicConfigValue(id_val="color", value={"mode": FieldColorModeId.FIXED, "fixedColor": color}),
    ]


# --- panels -----------------------------------------------------------------


def held_locks() -> table.Panel:
    """Who holds each lock, for how long, and how long since its last heartbeat."""
    return (
        table.Panel()
        .title("Held locks")
        .description(
            "Each held lock, its holder (the Mutex's instance_id), how long it has been held "
            "(a semaphore's holders one row each, with their permit; a read/write lock's writer, or the reader "
            "silent longest, with their mode), "
            "and seconds since its last heartbeat, as the stale-holder watcher reads them with the server's clock."
        )
        .datasource(DATASOURCE)
        .targets(_table_queries(_holder_expr(), max_by_holder(m.HEARTBEAT_AGE)))
        .with_transformation(DataTransformerConfig(id_val="merge", options={}))
        .with_transformation(
            DataTransformerConfig(
                id_val="organize",
                options={
                    "excludeByName": {"Time": True},
                    "indexByName": {
                        "lock_name": 0,
                        "permit": 1,
                        "mode": 2,
                        "holder": 3,
                        "Value #A": 4,
                        "Value #B": 5,
                    },
                    "renameByName": {
                        "lock_name": "Lock",
                        "permit": "Permit",
                        "mode": "Mode",
                        "holder": "Holder",
                        "Value #A": "Held for",
                        "Value #B": "Since last heartbeat",
                    },
                },
            )
        )
        .unit(SECONDS)
        .decimals(1)
        .sort_by([common_builders.TableSortByFieldState().display_name("Since last heartbeat").desc(True)])
        .no_value("No lock is held")
        .height(8)
        .span(12)
    )


def lock_state() -> stat.Panel:
    """The current alerting / reclaimable state of every lock, one tile per lock."""
    return (
        stat.Panel()
        .title("Lock state")
        .description(
            "OK; ALERTING: the holder has been silent past alert_threshold; "
            "RECLAIMABLE: silent past stale_threshold, so any instance may take the lock over."
        )
        .datasource(DATASOURCE)
        .targets(_queries((_state_expr(), "{{lock_name}}")))
        .mappings([STATE_MAPPING])
        .thresholds(_thresholds((None, "green")))
        .color_mode(common.BigValueColorMode.BACKGROUND)
        .graph_mode(common.BigValueGraphMode.NONE)
        .text_mode(common.BigValueTextMode.VALUE_AND_NAME)
        .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .no_value("No lock is held")
        .height(8)
        .span(12)
    )


def lock_state_history() -> statetimeline.Panel:
    """The same state over the time range: when each lock went silent and for how long."""
    return (
        statetimeline.Panel()
        .title("Lock state over time")
        .description(
            "When each lock's holder went silent past alert_threshold (ALERTING) or stale_threshold (RECLAIMABLE)."
        )
        .datasource(DATASOURCE)
        .targets(_queries((_state_expr(), "{{lock_name}}")))
        .mappings([STATE_MAPPING])
        .thresholds(_thresholds((None, "green")))
        .show_value(common.VisibilityMode.NEVER)
        .merge_values(True)
        .fill_opacity(80)
        .height(6)
        .span(24)
    )


def heartbeat_age() -> timeseries.Panel:
    """Seconds since each holder's last heartbeat, with the two thresholds that matter drawn as dashed lines."""
    return (
        _graph(
            "Seconds since heartbeat",
            "Seconds since each holder's last heartbeat (server clock). Crossing the orange dashed line raises an "
            "alert; crossing the red one lets any instance reclaim the lock.",
            SECONDS,
            (max_by_lock(m.HEARTBEAT_AGE), "{{lock_name}}"),
            (max_by_lock(m.ALERT_THRESHOLD), "alert threshold {{lock_name}}"),
            (max_by_lock(m.STALE_THRESHOLD), "reclaim threshold {{lock_name}}"),
        )
        .override_by_query("B", _dashed("orange"))
        .override_by_query("C", _dashed("red"))
    )


def heartbeat_latency() -> timeseries.Panel:
    """How long heartbeats take: a slow database eats into the margin before alert_threshold."""
    return _graph(
        "Heartbeat latency",
        "Round-trip time of successful heartbeats, p50 / p95 / p99 per lock.",
        SECONDS,
        *((quantile(q, m.HEARTBEAT_DURATION, "lock_name"), f"p{round(q * 100)} {{{{lock_name}}}}") for q in QUANTILES),
    )


def acquisitions() -> timeseries.Panel:
    """The normal traffic: locks taken, given back, and attempts that found the lock busy."""
    return _graph(
        "Acquisitions, releases and contentions",
        "Per second, per lock, summed over all processes. Contentions are acquire attempts that found "
        "the lock held by another instance.",
        PER_SECOND,
        (rate_by_lock(m.ACQUISITIONS), "acquired {{lock_name}}"),
        (rate_by_lock(m.RELEASES), "released {{lock_name}}"),
        (rate_by_lock(m.CONTENTIONS), "contended {{lock_name}}"),
    )


def trouble() -> timeseries.Panel:
    """Events that should be rare; any of them deserves a look."""
    return _graph(
        "Reclaims, alerts, losses and heartbeat failures",
        "Per second, per lock. Stale reclaims: a lock taken over from a silent holder. Alerts: stale episodes "
        "(once each). Losses: a holder whose lease ran out or whose row was gone. Heartbeat failures are retried.",
        PER_SECOND,
        (f"sum by (lock_name, reason) ({_rate(m.STALE_RECLAIMS)})", "reclaimed ({{reason}}) {{lock_name}}"),
        (rate_by_lock(m.ALERTS), "alert {{lock_name}}"),
        (rate_by_lock(m.LOSSES), "lost {{lock_name}}"),
        (rate_by_lock(m.HEARTBEAT_FAILURES), "heartbeat failed {{lock_name}}"),
    )


def disconnected_holders() -> timeseries.Panel:
    """Holders with reclaim_disconnected_after: reclaims by reason, holds in doubt, leases running out."""
    return _graph(
        "Reclaims by reason, holds in doubt",
        "Per second, per lock. A stale reclaim took over a holder silent past stale_threshold; a disconnected "
        "one, a holder with reclaim_disconnected_after whose database session had ended (it died): expected "
        "after a crash or a deploy, and fast. Holds in doubt: a holder that went reclaim_disconnected_after - "
        "heartbeat_interval without a heartbeat, or whose heartbeat failed (not held until one confirms it). "
        "Leases running out: two thirds of a hold's lease went by without a heartbeat.",
        PER_SECOND,
        (f"sum by (lock_name, reason) ({_rate(m.STALE_RECLAIMS)})", "reclaimed ({{reason}}) {{lock_name}}"),
        (rate_by_lock(m.DOUBTS), "in doubt {{lock_name}}"),
        (rate_by_lock(m.LEASES_RUNNING_OUT), "lease running out {{lock_name}}"),
    )


def holder_sessions() -> timeseries.Panel:
    """Whether each holder's database session exists, as the watcher reads it (holders that name one)."""
    return _graph(
        "Holder's database session",
        "1 while the holder's database session exists, 0 once it ended (the process died or its connection was "
        "cut): a holder at 0 is reclaimed once its heartbeat is older than its reclaim_disconnected_after. "
        "Only holders with reclaim_disconnected_after appear.",
        COUNT,
        (max_by_lock(m.SESSION_ALIVE), "session {{lock_name}}"),
    )


def acquire_duration() -> timeseries.Panel:
    """How long acquires take, waiting included, split by how they ended."""
    return _graph(
        "Acquire duration by outcome",
        "Time an acquire took, waiting included: p50 / p95 / p99 per outcome "
        f"({', '.join(m.ACQUIRE_OUTCOMES)}) over the selected locks.",
        SECONDS,
        *((quantile(q, m.ACQUIRE_DURATION, "outcome"), f"p{round(q * 100)} {{{{outcome}}}}") for q in QUANTILES),
    )


def locks_held() -> timeseries.Panel:
    """How many processes believe they hold each lock: 1 while held, 0 when free."""
    return (
        _graph(
            "Locks held",
            "Processes that report holding each lock, from the processes themselves. "
            "Above 1 means two processes believe they hold the same lock.",
            COUNT,
            (f"sum by (lock_name) ({selector(m.LOCKS_HELD)})", "{{lock_name}}"),
        )
        .decimals(0)
        .line_interpolation(common.LineInterpolation.STEP_AFTER)
        .thresholds(_thresholds((None, "green"), (2, "red")))
        .thresholds_style(common_builders.GraphThresholdsStyleConfig().mode(common.GraphThresholdsStyleMode.DASHED))
        .color_scheme(dashboard_builders.FieldColor().mode(FieldColorModeId.PALETTE_CLASSIC))
    )


def permits_in_use() -> timeseries.Panel:
    """Each semaphore's permits held across the fleet, and this fleet's waiters for them."""
    return (
        _graph(
            "Semaphore permits in use and waiters",
            "Per semaphore: permits held across the fleet, as the stale-holder watcher reads the table, and "
            "blocking acquires waiting for a permit, from the processes themselves. Waiters that never fall to "
            "0 while every permit is in use: the semaphore is too small for the work, or holders hold too long.",
            COUNT,
            (f"max by (lock_name) ({selector(m.PERMITS_IN_USE)})", "in use {{lock_name}}"),
            (
                f"sum by (lock_name) ({selector(m.WAITERS)}) and on (lock_name) {selector(m.PERMITS_IN_USE)}",
                "waiting {{lock_name}}",
            ),
        )
        .decimals(0)
        .line_interpolation(common.LineInterpolation.STEP_AFTER)
    )


def permit_heartbeat_age() -> timeseries.Panel:
    """Seconds since each semaphore holder's last heartbeat, one line per permit."""
    return _graph(
        "Seconds since heartbeat, per permit",
        "Per semaphore and permit: seconds since its holder's last heartbeat (server clock). Each holder of a "
        "semaphore is alerted on and reclaimed on its own, as a mutex's holder is.",
        SECONDS,
        (
            f'max by (lock_name, permit) ({m.HEARTBEAT_AGE.prometheus}{{{LOCK_FILTER}, permit!=""}})',
            "{{lock_name}} permit {{permit}}",
        ),
    )


def waiters() -> timeseries.Panel:
    """Blocking acquires waiting, per lock or semaphore."""
    return (
        _graph(
            "Waiters",
            "Blocking acquires waiting for a release, per lock or semaphore, summed over the processes. "
            "A release wakes one waiter per process.",
            COUNT,
            (f"sum by (lock_name) ({selector(m.WAITERS)})", "{{lock_name}}"),
        )
        .decimals(0)
        .line_interpolation(common.LineInterpolation.STEP_AFTER)
    )


RW_FILTER = f'{LOCK_FILTER}, mode!=""'
"""A read/write lock's series: those with a mode (a mutex's and a semaphore's have none)."""


def _rw_rate(metric: m.MetricName) -> str:
    return f"rate({metric.prometheus}{{{RW_FILTER}}}[$__rate_interval])"


def rwlock_holders() -> timeseries.Panel:
    """Each read/write lock's holders per mode across the fleet, and the fleet's waiters per mode."""
    return (
        _graph(
            "Read/write lock holders and waiters",
            "Per read/write lock and mode: holders across the fleet (readers, or 1 writer), as the stale-holder "
            "watcher reads the table, and blocking acquires waiting to read or to write, from the processes "
            "themselves. Readers waiting while no writer holds: a writer waits, and new readers queue behind it.",
            COUNT,
            (f"max by (lock_name, mode) ({selector(m.RWLOCK_HOLDERS)})", "{{mode}} held {{lock_name}}"),
            (f"sum by (lock_name, mode) ({m.WAITERS.prometheus}{{{RW_FILTER}}})", "{{mode}} waiting {{lock_name}}"),
        )
        .decimals(0)
        .line_interpolation(common.LineInterpolation.STEP_AFTER)
    )


def writer_waiting() -> statetimeline.Panel:
    """Whether a writer waits for each read/write lock: while one does, new readers are held back."""
    return (
        statetimeline.Panel()
        .title("Writer waiting")
        .description(
            "Per read/write lock: whether a writer waits, as the stale-holder watcher reads the lock's gate. "
            "While one does, no new reader is let in, so that a stream of readers cannot starve it; writers "
            "that wait without a break for long are PostgresMutexWriterKeptWaiting."
        )
        .datasource(DATASOURCE)
        .targets(_queries((max_by_lock(m.RWLOCK_WRITER_WAITING), "{{lock_name}}")))
        .mappings([WRITER_WAITING_MAPPING])
        .thresholds(_thresholds((None, "green")))
        .show_value(common.VisibilityMode.NEVER)
        .merge_values(True)
        .fill_opacity(80)
        .height(8)
        .span(12)
    )


def rwlock_heartbeat_age() -> timeseries.Panel:
    """Seconds since the heartbeat of each read/write lock's writer, and of its reader silent longest."""
    return _graph(
        "Seconds since heartbeat, per mode",
        "Per read/write lock: seconds since its writer's last heartbeat, or since that of its reader silent "
        "longest (server clock). Each holder is alerted on and reclaimed on its own, as a mutex's holder is.",
        SECONDS,
        (f"max by (lock_name, mode) ({m.HEARTBEAT_AGE.prometheus}{{{RW_FILTER}}})", "{{lock_name}} {{mode}}"),
    )


def rwlock_alerts() -> timeseries.Panel:
    """Alerts and reclaims of read/write locks' holders, per mode."""
    return _graph(
        "Read/write lock alerts and reclaims",
        "Per read/write lock and mode of the holder: holders found silent past alert_threshold (once per "
        "episode), and holds taken over from a silent holder, summed over the processes.",
        PER_SECOND,
        (f"sum by (lock_name, mode) ({_rw_rate(m.ALERTS)})", "alert {{lock_name}} {{mode}}"),
        (f"sum by (lock_name, mode) ({_rw_rate(m.STALE_RECLAIMS)})", "reclaimed {{lock_name}} {{mode}}"),
    )


def watcher_up() -> stat.Panel:
    """Whether the stale-holder watcher can read the lock table; without it the holder panels go blank."""
    return (
        stat.Panel()
        .title("Watcher up")
        .description(
            "1 if the stale-holder watcher's last read of the lock table succeeded (the worst of all watchers). "
            "The holder, heartbeat-age and state panels come from the watcher."
        )
        .datasource(DATASOURCE)
        .targets(_queries((f"min({selector(m.WATCHER_UP)})", "watcher")))
        .mappings([UP_MAPPING])
        .thresholds(_thresholds((None, "red"), (1, "green")))
        .color_mode(common.BigValueColorMode.BACKGROUND)
        .graph_mode(common.BigValueGraphMode.NONE)
        .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .no_value("No watcher reporting")
        .height(6)
        .span(6)
    )


def watcher_errors() -> timeseries.Panel:
    """Failed watcher reads per second."""
    return (
        _graph(
            "Watcher read errors",
            "Reads of the lock table by the watcher that failed, per second, over all watchers.",
            PER_SECOND,
            (f"sum({_rate(m.WATCHER_ERRORS)})", "errors"),
        )
        .height(6)
        .span(18)
    )


def _leaders_expr() -> str:
    """How many processes report leading each election (0 while its candidates only campaign)."""
    return f"sum by (lock_name) ({selector(m.ELECTION_LEADING)})"


def election_leaders() -> timeseries.Panel:
    """Leaders and candidates per election: one leader is right; none while candidates wait is an outage."""
    return (
        _graph(
            "Leaders and candidates",
            "Per election (its lock's name): processes that report leading it, and candidates campaigning or "
            "leading. One leader is right. None while there are candidates: no term is running (a failover "
            "waiting out stale_threshold, or every lead failing). Above 1 only for a scrape or two around a "
            "hand-over, since processes are scraped at different moments.",
            COUNT,
            (_leaders_expr(), "leaders {{lock_name}}"),
            (f"sum by (lock_name) ({selector(m.ELECTION_CANDIDATES)})", "candidates {{lock_name}}"),
        )
        .decimals(0)
        .line_interpolation(common.LineInterpolation.STEP_AFTER)
    )


def election_state_history() -> statetimeline.Panel:
    """When each election had a leader, and for how long it had none (at the resolution of the scrapes)."""
    return (
        statetimeline.Panel()
        .title("Leadership over time")
        .description(
            "LEADER while one process reports leading the election; NO LEADER while none does, measured at "
            "the scrape interval: no process can see that gap itself, since a candidate cannot tell when its "
            "predecessor stopped."
        )
        .datasource(DATASOURCE)
        .targets(_queries((_leaders_expr(), "{{lock_name}}")))
        .mappings([LEADERS_MAPPING])
        .thresholds(_thresholds((None, "green")))
        .show_value(common.VisibilityMode.NEVER)
        .merge_values(True)
        .fill_opacity(80)
        .height(6)
        .span(24)
    )


def election_events() -> timeseries.Panel:
    """Terms begun, leads that failed, and leads that ran past their grace period."""
    return _graph(
        "Leadership changes and failures",
        "Per second, per election. Terms: a candidate became leader. Lead failures: lead raised, and its "
        "candidate backs off before campaigning again. Grace overruns: a lead still running grace_period "
        "after it was told to stop leading (a loss, stop() or resign()); see that process's ERROR log.",
        PER_SECOND,
        (rate_by_lock(m.ELECTION_TERMS), "terms {{lock_name}}"),
        (rate_by_lock(m.ELECTION_LEAD_FAILURES), "lead failed {{lock_name}}"),
        (rate_by_lock(m.ELECTION_GRACE_OVERRUNS), "grace overrun {{lock_name}}"),
    )


def election_endings() -> timeseries.Panel:
    """How terms ended: returned, resigned, stopped, lost or failed."""
    return _graph(
        "How terms ended",
        f"Terms ended per second, per election and way of ending ({', '.join(m.TERM_ENDINGS)}). Lost terms "
        "are leaders that lost their lock; failed ones, leads that raised.",
        PER_SECOND,
        (
            f"sum by (lock_name, ended) ({_rate(m.ELECTION_TERM_DURATION, '_count')})",
            "{{ended}} {{lock_name}}",
        ),
    )


# --- dashboard --------------------------------------------------------------


def _variables() -> list[Builder[Any]]:
    datasource = dashboard_builders.DatasourceVariable("datasource").label("Data source").type("prometheus")
    # Locks seen by the watcher or acquired by any process, so a fleet without a watcher still gets the list.
    lock_names = (
        dashboard_builders.QueryVariable("lock_name")
        .label("Lock")
        .datasource(DATASOURCE)
        .query(f'label_values({{__name__=~"{m.HEARTBEAT_AGE.prometheus}|{m.ACQUISITIONS.prometheus}"}}, lock_name)')
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(VariableOption(text=["All"], value=["$__all"]))
    )
    return [datasource, lock_names]


def _dashboard() -> dashboard_builders.Dashboard:
    board = (
        dashboard_builders.Dashboard(TITLE)
        .uid(UID)
        .description(
            "Holders, heartbeat age against the alert and reclaim thresholds, lock traffic and elections "
            "for postgres-mutex."
        )
        .tags(["postgres-mutex", "postgresql", "locks"])
        .editable()
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .time("now-3h", "now")
        .refresh("30s")
        .variables(_variables())
    )
    sections: list[tuple[str, list[Panel]]] = [
        ("Holders", [held_locks(), lock_state(), lock_state_history()]),
        ("Heartbeats", [heartbeat_age(), heartbeat_latency()]),
        ("Traffic", [acquisitions(), trouble(), acquire_duration(), locks_held()]),
        ("Crashed holders", [disconnected_holders(), holder_sessions()]),
        ("Watcher", [watcher_up(), watcher_errors()]),
        ("Elections", [election_leaders(), election_events(), election_state_history(), election_endings()]),
        ("Semaphores", [permits_in_use(), permit_heartbeat_age(), waiters()]),
        ("Read/write locks", [rwlock_holders(), writer_waiting(), rwlock_heartbeat_age(), rwlock_alerts()]),
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
    """The exact text of ``postgres-mutex.json``: sorted keys, two-space indent, trailing newline (small diffs)."""
    return json.dumps(build(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def panel_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """Every ``(panel title, PromQL expr)`` in a dashboard's JSON model, panels inside collapsed rows included."""
    found: list[tuple[str, str]] = []

    def visit(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            found.extend((panel["title"], target["expr"]) for target in panel.get("targets", []) if "expr" in target)
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
            print(f"{OUTPUT} is out of date: run python grafana/build_dashboard.py", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
