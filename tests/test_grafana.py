"""The Grafana dashboard (config/grafana/tokend.json) queries only what a node exports.

Every PromQL expression of the dashboard (its panels' and its variables') is read for the
metric names it names and the labels it matches or groups by; a live ``tokend serve``,
after some traffic, must export each of those metrics with each of those labels (and each
label value matched exactly), so that the dashboard and /metrics cannot drift apart.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from testkit.clients import RawClient
from testkit.net import http_request
from testkit.tokend_process import TokendProcess, node_env
from testkit.waiting import eventually
from tokend.config import Settings
from tokend.core import protocol as p
from tokend.tokens.service import TokenService

DASHBOARD = Path(__file__).resolve().parent.parent / "config" / "grafana" / "tokend.json"
# The metrics of a tokend node, and of the process collector that /metrics carries too.
METRIC = re.compile(r"\b(?:tokend|process|python)_[a-z_]+\b")
MATCHERS = re.compile(r"\{([^}]*)\}")
MATCHER = re.compile(r'\s*([a-zA-Z_]\w*)\s*(=~|!~|!=|=)\s*"([^"]*)"\s*')
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
LABEL_VALUES = re.compile(r"label_values\(\s*(\w+)\s*,\s*(\w+)\s*\)")
# Labels Prometheus adds to every series it scrapes.
TARGET_LABELS = {"instance", "job"}
# Series : labels -> values
Exported = dict[str, dict[str, set[str]]]


def expressions(dashboard: dict[str, Any]) -> Iterator[str]:
    """Every PromQL expression of the dashboard: its panels' targets (rows' too) and its
    query variables."""

    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for panel in items:
            yield panel
            yield from panels(panel.get("panels", []))

    for panel in panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            yield target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            yield variable["query"]["query"]


def wants(expr: str) -> tuple[set[str], set[str], set[tuple[str, str]]]:
    """What ``expr`` needs of the metrics it names: their names, the labels it matches or
    groups by, and the (label, value) pairs it matches exactly."""
    text = re.sub(r"\$\w+", "", expr)  # Grafana's variables
    names = set(METRIC.findall(re.sub(r'"[^"]*"', '""', text)))
    labels, values = set(), set()
    for body in MATCHERS.findall(text):
        for matcher in filter(str.strip, body.split(",")):
            match = MATCHER.fullmatch(matcher)
            assert match, f"{expr}: cannot read the matcher {matcher!r}"
            labels.add(match[1])
            if match[2] == "=":
                values.add((match[1], match[3]))
    for body in GROUPING.findall(text):
        labels |= {label.strip() for label in body.split(",") if label.strip()}
    for metric, label in LABEL_VALUES.findall(text):
        names.add(metric)
        labels.add(label)
    return names, labels - TARGET_LABELS, values


def exported(metrics_text: str) -> Exported:
    """Each series name a node exports, with the values each of its labels takes."""
    found: Exported = defaultdict(lambda: defaultdict(set))
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            labels = found[sample.name]
            for label, value in sample.labels.items():
                labels[label].add(value)
    return found


def missing(expr: str, export: Exported) -> list[str]:
    """What ``expr`` asks for that ``export`` lacks."""
    names, labels, values = wants(expr)
    lacking = [f"metric {name}" for name in sorted(names) if name not in export]
    present = [export[name] for name in names if name in export]
    for label in sorted(labels):
        if not any(label in series for series in present):
            lacking.append(f"label {label}")
    for label, value in sorted(values):
        if not any(value in series.get(label, ()) for series in present):
            lacking.append(f'{label}="{value}"')
    return lacking


def test_reading_an_expression() -> None:
    expr = (
        "histogram_quantile(0.95, sum by (le, stage) "
        '(rate(tokend_heartbeat_stage_seconds_bucket{instance=~"$instance",stage="store"}'
        "[$__rate_interval])))"
    )
    assert wants(expr) == (
        {"tokend_heartbeat_stage_seconds_bucket"},
        {"le", "stage"},
        {("stage", "store")},
    )
    export = exported(
        'tokend_heartbeat_stage_seconds_bucket{le="0.1",stage="decode"} 1.0\n'
        "tokend_connections 2.0\n"
    )
    assert missing(expr, export) == ['stage="store"']
    assert missing("sum by (state) (tokend_sessions)", export) == [
        "metric tokend_sessions",
        "label state",
    ]
    assert missing("label_values(tokend_connections, instance)", export) == []


@pytest.fixture
def dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def test_the_dashboard_is_grafanas_and_every_panel_queries(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] == "tokend" and dashboard["title"] == "tokend"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}", panel
            assert all(t["expr"] for t in panel["targets"]), panel


async def test_every_metric_and_label_the_dashboard_queries_is_exported(
    make_settings: Callable[..., Settings], tokens: TokenService, dashboard: dict[str, Any]
) -> None:
    settings = make_settings(history_interval=0.5)
    node = TokendProcess(node_env(settings))
    node.start()
    try:
        # Traffic for the series that come with it: heartbeats (one in 16 timed), a
        # session left silent until it expires (4505), a HELLO, a sweep.
        async with RawClient.connect(node.port) as beating, RawClient.connect(node.port) as quiet:
            await beating.hello(tokens.mint("beating"))
            await quiet.hello(tokens.mint("quiet"))
            for _ in range(16):
                await beating.heartbeat()
            assert (await quiet.expect_close()).code == p.CloseCode.SESSION_EXPIRED

        async def scraped() -> Exported:
            text = (await http_request(node.admin_port, "GET", "/metrics")).body.decode()
            export = exported(text)
            # The monitor has looked, and the garbage collector has made a pass.
            looked = "tokend_cluster_sessions" in export
            return export if looked and "tokend_gc_pass_seconds_bucket" in export else {}

        export = await eventually(scraped, 10)
    finally:
        node.stop()
    problems = {
        expr: lacking for expr in expressions(dashboard) if (lacking := missing(expr, export))
    }
    assert not problems, json.dumps(problems, indent=2)
    queried = set().union(*(wants(expr)[0] for expr in expressions(dashboard)))
    assert {"tokend_cluster_sessions", "tokend_refused_total", "tokend_ready"} <= queried
