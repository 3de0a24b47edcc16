"""Metrics (tokend/metrics.py) as scraped from a real App's admin listener."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from prometheus_client.parser import text_string_to_metric_families

from testkit.clients import RawClient
from testkit.events import EventLog
from testkit.net import http_request
from testkit.waiting import eventually
from tokend.core import protocol as p
from tokend.core.claims import PRIO_RANGE
from tokend.core.lifecycle import ExpiryReason
from tokend.core.store_messages import Ended
from tokend.metrics import CONTENT_TYPE, ENDED, EXPIRY_REASONS, PRIOS, STAGE_SAMPLE_EVERY, Window
from tokend.ops.app import App
from tokend.tokens.service import TokenService

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(app: App) -> Samples:
    assert app.admin is not None
    reply = await http_request(app.admin.port, "GET", "/metrics")
    assert reply.status == 200
    assert reply.headers["content-type"] == CONTENT_TYPE
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(reply.body.decode())
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


async def test_counters_gauges_and_histograms(
    start_app: Callable[..., Awaitable[App]], tokens: TokenService, events: EventLog
) -> None:
    app = await start_app()
    # A second App in the process: its own registry (the global one would refuse it).
    other = await start_app(key_prefix="other", node_name="node-b")
    async with RawClient.connect(app.port) as client:
        await client.hello(tokens.mint("metered"))
        for _ in range(STAGE_SAMPLE_EVERY):
            await client.heartbeat()
        samples = await scrape(app)
        assert value(samples, "tokend_heartbeats_total") == STAGE_SAMPLE_EVERY
        assert value(samples, "tokend_sessions", state="ACTIVE") == 1
        assert value(samples, "tokend_sessions", state="WARN") == 0
        assert value(samples, "tokend_connections") == 1
        for stage in ("decode", "verify", "store", "send"):
            assert value(samples, "tokend_heartbeat_stage_seconds_count", stage=stage) == 1
        assert value(samples, "tokend_redis_call_seconds_count", script="hello") == 1
        assert value(samples, "tokend_redis_call_seconds_count", script="heartbeat") >= 1
        assert value(samples, "tokend_redis_call_seconds_count", script="sweep") >= 1
        assert value(samples, "process_cpu_seconds_total") > 0
        assert any(name == "python_info" for name, _ in samples)

        # Silent now: WARN, then EXPIRED by this node's sweeper (close 4505).
        await events.wait_for("SESSION_WARN", timeout=5)

        async def warned() -> bool:
            return value(await scrape(app), "tokend_sessions", state="WARN") == 1

        # Counted once the node has read its sweep's reply, which can come after the
        # event has reached this test (the other shards' calls run in between).
        await eventually(warned)
        assert (await client.expect_close()).code == p.CloseCode.SESSION_EXPIRED
    await events.wait_for("TOKEN_EXPIRED", timeout=5)
    samples = await scrape(app)
    assert value(samples, "tokend_expiries_total", reason="heartbeat_timeout") == 1
    assert value(samples, "tokend_close_codes_total", code="4505") == 1
    assert value(samples, "tokend_sessions", state="ACTIVE") == 0
    assert value(await scrape(other), "tokend_heartbeats_total") == 0


async def test_renewals_counted(app: App, tokens: TokenService) -> None:
    async with RawClient.connect(app.port) as client:
        await client.hello(tokens.mint("renewing", ttl_s=2))  # inside renew_window (2 s)
        ack = await client.heartbeat()
        assert ack.renewed
    assert value(await scrape(app), "tokend_renewals_total") == 1


def test_window_percentiles_in_milliseconds() -> None:
    window = Window()
    assert window.summary() == {"p50": 0.0, "p95": 0.0, "count": 0}
    window.samples.extend(n / 1000 for n in range(1, 101))  # 1..100 ms
    assert window.summary() == {"p50": 51.0, "p95": 96.0, "count": 100}


def test_the_labels_exported_from_zero_are_the_cores_values() -> None:
    assert set(EXPIRY_REASONS) == {reason.value for reason in ExpiryReason}
    assert PRIOS == PRIO_RANGE
    assert set(ENDED) == {how.value for how in Ended}
