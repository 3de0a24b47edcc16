"""A node's monitor (tokend/ops/monitor.py) through the admin API: its history, the views
of every node sharing the store, and the health gauges of /metrics."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from websockets.exceptions import InvalidStatus

from testkit.clients import RawClient
from testkit.net import admin_json
from testkit.tokend_process import CALM_CLOCKS
from testkit.waiting import eventually
from tests.test_metrics import scrape, value
from tokend.core import protocol as p
from tokend.ops.app import App
from tokend.ops.monitor import merged
from tokend.tokens.service import TokenService

ADMIN_TOKEN = "history-admin-token-of-32-characters"
INTERVAL = 0.2  # history_interval of these tests' nodes
StartApp = Callable[..., Awaitable[App]]


async def get(app: App, path: str) -> Any:
    assert app.admin is not None
    return await admin_json(app.admin.port, ADMIN_TOKEN, path)


async def start(start_app: StartApp, name: str, **settings: Any) -> App:
    """A node whose sessions stay ACTIVE without heartbeats for the test's length."""
    return await start_app(
        admin_token=ADMIN_TOKEN,
        node_name=name,
        history_interval=INTERVAL,
        **{**CALM_CLOCKS, **settings},
    )


async def test_the_history_holds_each_intervals_heartbeats_and_the_cluster_counts(
    start_app: StartApp, tokens: TokenService
) -> None:
    app = await start(start_app, "node-a")
    async with RawClient.connect(app.port) as client:
        await client.hello(tokens.mint("historian"))
        sent = 0

        async def counted() -> list[dict[str, Any]]:
            nonlocal sent
            await client.heartbeat()
            sent += 1
            samples = (await get(app, "/v1/history"))["samples"]
            # Every heartbeat sent before the last sample's end is in some sample.
            return samples if sum(s["heartbeats"] for s in samples) >= 10 else []

        samples = await eventually(counted, 10)
    answer = await get(app, "/v1/history")
    assert answer["node"] == "node-a" and answer["interval"] == INTERVAL
    assert sum(s["heartbeats"] for s in samples) <= sent
    moments = [s["at"] for s in samples]
    # On the clock's multiples of the interval, one per interval.
    assert all(at % round(INTERVAL * 1000) == 0 for at in moments)
    assert moments == sorted(set(moments))
    last = samples[-1]
    assert set(last) == {
        "at",
        "heartbeats",
        "renewals",
        "expiries",
        "closes",
        "refused",
        "connections",
        "held",
        "sessions",
        "ended",
    }
    assert last["sessions"] == {"ACTIVE": 1, "WARN": 0}
    assert last["held"] == {"ACTIVE": 1, "WARN": 0} and last["connections"] == 1
    # after= pages on: nothing before it again.
    later = await get(app, f"/v1/history?after={moments[-1]}")
    assert all(s["at"] > moments[-1] for s in later["samples"])


async def test_two_nodes_see_each_other_and_the_same_cluster_counts(
    start_app: StartApp, tokens: TokenService
) -> None:
    a = await start(start_app, "node-a")
    b = await start(start_app, "node-b")
    async with contextlib.AsyncExitStack() as stack:
        for app, count in ((a, 2), (b, 1)):
            for n in range(count):
                client = await stack.enter_async_context(RawClient.connect(app.port))
                await client.hello(tokens.mint(f"{app.node.name}-{n}"))
        # A sample is the moment it was taken: one taken while the last HELLO was under way
        # counts its connection but not yet its session. The samples after this see all three.
        opened_ms = time.time() * 1000

        async def both_listed() -> list[dict[str, Any]]:
            """Both, b's view published since its session began (a look a second)."""
            views = (await get(a, "/v1/nodes"))["nodes"]
            names = [v["node"] for v in views]
            return views if names == ["node-a", "node-b"] and views[1]["held"]["ACTIVE"] else []

        views = {v["node"]: v for v in await eventually(both_listed, 10)}
        of_b = views["node-b"]
        assert of_b["connections"] == 1 and views["node-a"]["connections"] == 2, views
        assert of_b["held"] == {"ACTIVE": 1, "WARN": 0}, of_b
        assert of_b["ready"] is True and of_b["redis"]["reachable"], of_b
        for app in (a, b):

            async def fresh_cluster(app: Any = app) -> dict[str, Any] | None:
                """The cluster's counts as read now (a read past the store's deadline on a
                busy machine answers the last one, ``fresh`` false)."""
                cluster: dict[str, Any] = (await get(app, "/v1/stats"))["cluster"]
                return cluster if cluster["fresh"] else None

            cluster = await eventually(fresh_cluster, 10)
            assert cluster["sessions"] == {"ACTIVE": 3, "WARN": 0}, cluster

        async def merged_three() -> list[dict[str, Any]]:
            samples = (await get(a, "/v1/history?node=all"))["samples"]
            after = opened_ms + INTERVAL * 1000  # "at" is rounded to the interval
            return [s for s in samples if s["nodes"] == 2 and s["at"] >= after]

        # Each node's samples, b's read from the store by a: added up moment by moment,
        # the cluster's counts (the same in both) taken once.
        merged_samples = await eventually(merged_three, 10)
        assert merged_samples[-1]["connections"] == 3, merged_samples[-1]
        assert merged_samples[-1]["sessions"] == {"ACTIVE": 3, "WARN": 0}, merged_samples[-1]
        b_samples = (await get(a, "/v1/history?node=node-b"))["samples"]
        assert b_samples and b_samples[-1]["connections"] == 1
    await b.stop()

    async def b_gone() -> bool:
        return [v["node"] for v in (await get(a, "/v1/nodes"))["nodes"]] == ["node-a"]

    await eventually(b_gone, 10)


def test_merged_adds_up_the_nodes_and_takes_the_clusters_once() -> None:
    def sample(at: int, heartbeats: int, code: str, active: int) -> dict[str, Any]:
        return {
            "at": at,
            "heartbeats": heartbeats,
            "renewals": 0,
            "expiries": 0,
            "closes": {code: 1},
            "refused": {},
            "connections": 2,
            "held": {"ACTIVE": 2, "WARN": 0},
            "sessions": {"ACTIVE": active, "WARN": 0},
            "ended": {"expired": 1, "revoked": 0, "closed": 0},
        }

    one = [sample(1000, 5, "1000", 4), sample(2000, 6, "1000", 4)]
    other = [sample(2001, 7, "4505", 4), sample(3000, 1, "4505", 3)]
    merged_samples = merged([one, other], 1000)
    assert [s["at"] for s in merged_samples] == [1000, 2000, 3000]
    assert [s["heartbeats"] for s in merged_samples] == [5, 13, 1]
    assert merged_samples[1]["closes"] == {"1000": 1, "4505": 1}
    assert merged_samples[1]["connections"] == 4 and merged_samples[1]["nodes"] == 2
    assert merged_samples[1]["held"] == {"ACTIVE": 4, "WARN": 0}
    assert merged_samples[1]["ended"] == {"expired": 1, "revoked": 0, "closed": 0}
    assert one[1]["closes"] == {"1000": 1}  # the inputs are left as they were


async def test_metrics_report_health_refusals_and_the_cluster_counts(
    start_app: StartApp, tokens: TokenService
) -> None:
    app = await start(start_app, "node-a", max_connections_per_ip=2, max_sessions_per_sub=1)
    async with RawClient.connect(app.port) as first, RawClient.connect(app.port) as second:
        await first.hello(tokens.mint("alice"))
        with pytest.raises(InvalidStatus) as refused:
            async with RawClient.connect(app.port):
                pass
        assert refused.value.response.status_code == 429
        await second.send(p.encode(p.Hello(tokens.mint("alice"))))  # a second of alice's
        closed = await second.expect_close()
        assert (closed.code, closed.reason) == (p.CloseCode.RATE_LIMITED, "too_many_sessions")

        async def looked() -> dict[Any, float]:
            """Once the monitor looked since alice's session began (once a second)."""
            samples = await scrape(app)
            return samples if value(samples, "tokend_cluster_sessions", state="ACTIVE") else {}

        samples = await eventually(looked, 5)
    assert value(samples, "tokend_ready") == 1 and value(samples, "tokend_redis_up") == 1
    assert 0 < value(samples, "tokend_redis_ping_seconds") < 1
    assert value(samples, "tokend_cluster_sessions", state="ACTIVE") == 1
    assert value(samples, "tokend_cluster_sessions", state="WARN") == 0
    assert ("tokend_cluster_ended_total", frozenset({("reason", "expired")})) in samples
    assert value(samples, "tokend_refused_total", code="429", reason="per_ip") == 1
    assert value(samples, "tokend_refused_total", code="4029", reason="too_many_sessions") == 1
    assert ("tokend_refused_total", frozenset({("code", "503"), ("reason", "shedding")})) in samples
    assert value(samples, "tokend_shedding") == 0
    assert ("tokend_event_loop_lag_seconds", frozenset({("stat", "max")})) in samples
