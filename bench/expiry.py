"""Scenario 4, expiry storm: thousands of sessions go silent at the same moment.

Every session is opened, then all heartbeat once at the same time; the harness reads
each session's last heartbeat (``hb``, Redis time) from its hash, and all clients
drop their connections at once. Each session's deadline is ``hb + expire_after``; the
lag is ``TOKEN_EXPIRED.at - deadline`` (both Redis time), taken from the events
channel, and every session must expire exactly once, on the channel and in the
durable event streams.

``expire_after`` (60 s by default, ``warn_after`` at 3/4 of it) is long enough for
every session to be opened before the first one could warn; the lag does not depend
on its length.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections import Counter
from typing import Any

from redis import asyncio as aioredis

from bench.common import (
    KEY_PREFIX,
    BenchError,
    Context,
    Row,
    open_all,
    percentile,
    redis_pid,
    redis_server,
    storm_pool,
    tokend_server,
)
from testkit.events import read_events
from testkit.procs import CpuMeter
from tokend.store.keyspace import Keyspace

LAG_TARGET_MS = 100
EXTRA_WAIT_S = 30


class Events:
    """Collects TOKEN_EXPIRED and SESSION_WARN events from the events channel."""

    def __init__(self, client: aioredis.Redis, channel: str, expected: int) -> None:
        self.client = client
        self.channel = channel
        self.expected = expected
        self.all_expired = asyncio.Event()
        self.expired: list[dict[str, Any]] = []
        self.warned: list[dict[str, Any]] = []
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        await pubsub.subscribe(self.channel)
        self._task = asyncio.create_task(self._collect(pubsub))

    async def _collect(self, pubsub: Any) -> None:
        async for message in pubsub.listen():
            event = json.loads(message["data"])
            if event["type"] == "TOKEN_EXPIRED":
                self.expired.append(event)
                if len(self.expired) >= self.expected:
                    self.all_expired.set()
            elif event["type"] == "SESSION_WARN":
                self.warned.append(event)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


async def last_heartbeats(client: aioredis.Redis, tids: list[uuid.UUID]) -> dict[str, int]:
    keys = Keyspace("bench")
    pipe = client.pipeline(transaction=False)
    for tid in tids:
        pipe.hget(keys.session_keys(tid)[0], "hb")
    values = await pipe.execute()
    missing = [str(t) for t, v in zip(tids, values, strict=True) if v is None]
    if missing:
        raise BenchError(f"{len(missing)} sessions had no hash before the silence")
    return {str(t): int(v) for t, v in zip(tids, values, strict=True)}


async def stream_counts(client: aioredis.Redis) -> Counter[str]:
    """TOKEN_EXPIRED events per tid in the durable stream shards."""
    events = await read_events(client, KEY_PREFIX)
    return Counter(e["tid"] for e in events if e["type"] == "TOKEN_EXPIRED")


def lags(events: list[dict[str, Any]], deadlines: dict[str, int]) -> list[int]:
    return sorted(e["at"] - deadlines[e["tid"]] for e in events if e["tid"] in deadlines)


async def storm(ctx: Context) -> dict[str, Any]:
    sizes = ctx.sizes
    clocks = {
        "heartbeat_interval": sizes.expire_after / 4,
        "warn_after": sizes.expire_after * 3 / 4,
        "expire_after": sizes.expire_after,
    }
    expire_ms, warn_ms = round(clocks["expire_after"] * 1000), round(clocks["warn_after"] * 1000)
    tokens = ctx.tokens(sizes.storm_sessions)
    tids = tokens.tids[: sizes.storm_sessions]
    with redis_server(ctx) as store, tokend_server(ctx, store.url, **clocks) as server:
        client = aioredis.from_url(store.url, decode_responses=True)
        events = Events(client, "bench:events", len(tids))
        try:
            await events.start()
            async with storm_pool(ctx, server, tokens) as pool:
                opened = await open_all(pool, sizes.concurrency)
                if opened["seconds"] >= clocks["warn_after"]:
                    raise BenchError(
                        f"opening took {opened['seconds']:.0f} s, longer than warn_after: "
                        "raise --expire-after"
                    )
                replies = await pool.ask("burst", timeout=120)
                acks = sum(r["acks"] for r in replies)
                if acks != sizes.storm_sessions:
                    raise BenchError(f"only {acks} of {sizes.storm_sessions} heartbeats ACKed")
                heartbeats = await last_heartbeats(client, tids)
            # Leaving the pool dropped every connection at once.
            meter = CpuMeter({"tokend": server.pid, "redis": redis_pid(store)})
            meter.start()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(clocks["expire_after"] + EXTRA_WAIT_S):
                    await events.all_expired.wait()
            await asyncio.sleep(1)  # any duplicate would come now
            cpu = meter.stop()
            streams = await stream_counts(client)
        finally:
            await events.stop()
            await client.aclose()
    published = Counter(e["tid"] for e in events.expired)
    expected = {str(t) for t in tids}
    expiry_deadlines = {t: hb + expire_ms for t, hb in heartbeats.items()}
    warn_deadlines = {t: hb + warn_ms for t, hb in heartbeats.items()}
    expired = lags(events.expired, expiry_deadlines)
    warned = lags(events.warned, warn_deadlines)
    spread = max(heartbeats.values()) - min(heartbeats.values())
    return {
        "sessions": len(tids),
        "open_rate": opened["rate"],
        "clocks": clocks,
        "heartbeat_spread_ms": spread,
        "expired_events": len(events.expired),
        "missing": len(expected - published.keys()),
        "duplicates": sum(n - 1 for n in published.values() if n > 1),
        "stream_missing": len(expected - streams.keys()),
        "stream_duplicates": sum(n - 1 for n in streams.values() if n > 1),
        "lag_ms": summary(expired),
        "warn_lag_ms": summary(warned),
        "cpu_pct": cpu,
        "reasons": dict(Counter(e.get("reason") for e in events.expired)),
    }


def summary(values: list[int]) -> dict[str, float]:
    return {
        "p50": percentile(values, 50),
        "p99": percentile(values, 99),
        "max": float(values[-1]) if values else 0.0,
        "min": float(values[0]) if values else 0.0,
    }


async def run(ctx: Context) -> list[Row]:
    result = await storm(ctx)
    lag = result["lag_ms"]
    exactly_once = not (
        result["missing"]
        or result["duplicates"]
        or result["stream_missing"]
        or result["stream_duplicates"]
    )
    warn = result["warn_lag_ms"]
    return [
        Row(
            "expiry storm",
            f"TOKEN_EXPIRED lag p99, {result['sessions']:,} sessions",
            lag["p99"],
            "ms",
            f"<= {LAG_TARGET_MS} ms, each once",
            lag["p99"] <= LAG_TARGET_MS and exactly_once,
            note=(
                f"lag p50 {lag['p50']:.0f} / p99 {lag['p99']:.0f} / max {lag['max']:.0f} ms "
                f"(min {lag['min']:.0f}); events {result['expired_events']:,}, missing "
                f"{result['missing']}, doubled {result['duplicates']} (streams: missing "
                f"{result['stream_missing']}, doubled {result['stream_duplicates']}); "
                f"WARN lag p50 {warn['p50']:.0f} / p99 {warn['p99']:.0f} / max "
                f"{warn['max']:.0f} ms; deadlines spread over {result['heartbeat_spread_ms']} "
                f"ms; CPU {', '.join(f'{k} {v:.0f}%' for k, v in result['cpu_pct'].items())}"
            ),
            details=result,
        )
    ]
