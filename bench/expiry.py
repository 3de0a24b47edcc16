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

Paced deadlines (``--rate``, 20,000/s by default; 0 skips it; ``--storm-sessions 0``
runs them alone): a second's worth of
sessions (at least ``--storm-sessions``) whose WARN deadlines, and then their EXPIRED
deadlines, fall at that rate, evenly, one millisecond's share per millisecond. They are
written straight into Redis (hello.lua through a :class:`tokend.store.sessions.Store`,
then each ``hb`` and deadline set), with no client holding them: the figure is the
sweeper's alone, whether it keeps up with deadlines falling that fast, each session
warned once and expired once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections import Counter
from typing import Any, TypedDict

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
from testkit.procs import CpuMeter, proc_cpu
from tokend import config
from tokend.store.keyspace import Keyspace
from tokend.store.redis_client import open_client
from tokend.store.sessions import HelloRequest, Store

LAG_TARGET_MS = 100
EXTRA_WAIT_S = 30
# Paced deadlines: how long after the HELLOs the first deadline falls (the rest of the
# seeding must fit in it: 2 s, and 0.4 ms a session, ample on a busy machine), and the
# gap between the WARN and the EXPIRED deadlines.
PACED_LEAD_MS = 2_000
PACED_LEAD_MS_PER_SESSION = 0.4
PACED_GAP_S = 5.0


class Clocks(TypedDict):
    """The clock settings of a run."""

    heartbeat_interval: float
    warn_after: float
    expire_after: float


def paced_clocks(count: int) -> tuple[int, Clocks]:
    """The lead (ms) and the clocks for ``count`` paced sessions: warn_after beyond the
    whole seeding, so that no session warns by hello.lua's own deadline."""
    lead_ms = PACED_LEAD_MS + round(PACED_LEAD_MS_PER_SESSION * count)
    warn_after = lead_ms / 1000 + PACED_GAP_S
    return lead_ms, {
        "heartbeat_interval": 1.0,
        "warn_after": warn_after,
        "expire_after": warn_after + PACED_GAP_S,
    }


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


async def stream_counts(client: aioredis.Redis, kind: str = "TOKEN_EXPIRED") -> Counter[str]:
    """Events of ``kind`` per tid in the durable stream shards."""
    events = await read_events(client, KEY_PREFIX)
    return Counter(e["tid"] for e in events if e["type"] == kind)


def once(events: list[dict[str, Any]], streams: Counter[str], expected: set[str]) -> dict[str, int]:
    """How far ``events`` (the channel's) and ``streams`` are from each of ``expected``
    exactly once."""
    published = Counter(e["tid"] for e in events)
    return {
        "missing": len(expected - published.keys()),
        "duplicates": sum(n - 1 for n in published.values() if n > 1),
        "stream_missing": len(expected - streams.keys()),
        "stream_duplicates": sum(n - 1 for n in streams.values() if n > 1),
    }


def lags(events: list[dict[str, Any]], deadlines: dict[str, int]) -> list[int]:
    return sorted(e["at"] - deadlines[e["tid"]] for e in events if e["tid"] in deadlines)


async def storm(ctx: Context) -> dict[str, Any]:
    sizes = ctx.sizes
    clocks: Clocks = {
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
        **once(events.expired, streams, expected),
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


async def seed_paced(url: str, count: int, rate: float) -> dict[str, int]:
    """``count`` sessions, no connection holding them, whose WARN deadlines fall at
    ``rate`` a second from the lead (:func:`paced_clocks`) after now (Redis time);
    returns each one's hb."""
    lead_ms, clocks = paced_clocks(count)
    values = {"redis_url": url, "key_prefix": KEY_PREFIX, "redis_timeout": 10, **clocks}
    settings = config.load(values, environ={})  # redis_timeout: seeding, not the figure
    store = Store(open_client(url, settings), settings, "bench-seed")
    try:
        now_s = int(time.time())
        tids = [uuid.uuid4() for _ in range(count)]
        requests = [
            HelloRequest(tid, f"paced-{n}", 5, now_s, now_s + 600, "gone/1")
            for n, tid in enumerate(tids)
        ]
        for first in range(0, count, 500):  # one hello.lua call per chunk
            await store.hellos(requests[first : first + 500])
        seconds, micros = await store.redis.time()
        first_due = seconds * 1000 + micros // 1000 + lead_ms
        warn_ms = settings.ms("warn_after")
        heartbeats = {
            str(tid): first_due - warn_ms + int(n * 1000 / rate) for n, tid in enumerate(tids)
        }
        pipe = store.redis.pipeline(transaction=False)
        for tid, hb in heartbeats.items():
            due, session = store.keys.script_keys(uuid.UUID(tid))[0::2]
            # As after the storm's drop: released, no connection holds it (release.lua).
            pipe.hdel(session, "conn")
            pipe.hset(session, mapping={"hb": hb, "left": "gone/1"})
            pipe.zadd(due, {tid: hb + warn_ms})
        await pipe.execute()
        seconds, micros = await store.redis.time()
        if seconds * 1000 + micros // 1000 >= first_due:
            raise BenchError(f"seeding {count:,} sessions took longer than {lead_ms} ms")
        return heartbeats
    finally:
        await store.redis.aclose()


async def paced(ctx: Context) -> dict[str, Any]:
    """Deadlines falling at ``ctx.sizes.expiry_rate`` a second, one tokend sweeping."""
    rate = ctx.sizes.expiry_rate
    count = max(ctx.sizes.storm_sessions, int(rate))
    lead_ms, clocks = paced_clocks(count)
    warn_ms, expire_ms = round(clocks["warn_after"] * 1000), round(clocks["expire_after"] * 1000)
    with redis_server(ctx) as store, tokend_server(ctx, store.url, **clocks) as server:
        client = aioredis.from_url(store.url, decode_responses=True)
        events = Events(client, f"{KEY_PREFIX}:events", count)
        try:
            await events.start()
            pids = {"tokend": server.pid, "redis": redis_pid(store)}
            meter = CpuMeter(pids)
            heartbeats = await seed_paced(store.url, count, rate)
            meter.start()
            used = {name: proc_cpu(pid) for name, pid in pids.items()}
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(lead_ms / 1000 + expire_ms / 1000 + 30):
                    await events.all_expired.wait()
            await asyncio.sleep(1)  # any duplicate would come now
            cpu = meter.stop()
            used = {name: proc_cpu(pid) - used[name] for name, pid in pids.items()}
            expired_streams = await stream_counts(client)
            warned_streams = await stream_counts(client, "SESSION_WARN")
        finally:
            await events.stop()
            await client.aclose()
    expected = set(heartbeats)
    return {
        "sessions": count,
        "rate": rate,
        "clocks": clocks,
        "expired": once(events.expired, expired_streams, expected),
        "warned": once(events.warned, warned_streams, expected),
        "lag_ms": summary(
            lags(events.expired, {t: hb + expire_ms for t, hb in heartbeats.items()})
        ),
        "warn_lag_ms": summary(
            lags(events.warned, {t: hb + warn_ms for t, hb in heartbeats.items()})
        ),
        "cpu_pct": cpu,
        # Over the whole window (idle sweeps too), per WARN or EXPIRED made.
        "cpu_us_per_transition": {n: round(1e6 * t / (2 * count), 1) for n, t in used.items()},
    }


def spread_of(lag: dict[str, float]) -> str:
    """:func:`summary`'s p50, p99 and max, short."""
    return f"p50 {lag['p50']:.0f} / p99 {lag['p99']:.0f} / max {lag['max']:.0f} ms"


def shortfall(counts: dict[str, int]) -> str:
    """:func:`once`'s counts, short."""
    return (
        f"missing {counts['missing']}, doubled {counts['duplicates']}, streams: missing "
        f"{counts['stream_missing']}, doubled {counts['stream_duplicates']}"
    )


def lag_row(scenario: str, metric: str, result: dict[str, Any], once: bool, note: str) -> Row:
    """A row of TOKEN_EXPIRED lag p99 against the target, met only with each once."""
    p99 = result["lag_ms"]["p99"]
    target = f"<= {LAG_TARGET_MS} ms, each once"
    met = p99 <= LAG_TARGET_MS and once
    return Row(scenario, metric, p99, "ms", target, met, note=note, details=result)


def paced_row(result: dict[str, Any]) -> Row:
    lag, warn = result["lag_ms"], result["warn_lag_ms"]
    exactly_once = not any(result["expired"].values()) and not any(result["warned"].values())
    per = result["cpu_us_per_transition"]
    note = (
        f"{result['sessions']:,} sessions; EXPIRED lag {spread_of(lag)}; WARN lag "
        f"{spread_of(warn)}; each once: "
        f"{'yes' if exactly_once else 'NO'} (EXPIRED {shortfall(result['expired'])}; "
        f"WARN {shortfall(result['warned'])}); CPU "
        f"{', '.join(f'{k} {v:.0f}%' for k, v in result['cpu_pct'].items())}, per "
        f"transition {', '.join(f'{k} {v:.0f} us' for k, v in per.items())}"
    )
    metric = f"TOKEN_EXPIRED lag p99, deadlines at {result['rate']:,.0f}/s"
    return lag_row("expiry paced", metric, result, exactly_once, note)


async def run(ctx: Context) -> list[Row]:
    rows = [storm_row(await storm(ctx))] if ctx.sizes.storm_sessions else []
    if ctx.sizes.expiry_rate:
        rows.append(paced_row(await paced(ctx)))
    return rows


def storm_row(result: dict[str, Any]) -> Row:
    lag = result["lag_ms"]
    exactly_once = not (
        result["missing"]
        or result["duplicates"]
        or result["stream_missing"]
        or result["stream_duplicates"]
    )
    warn = result["warn_lag_ms"]
    note = (
        f"lag {spread_of(lag)} (min {lag['min']:.0f}); events {result['expired_events']:,}, "
        f"missing {result['missing']}, doubled {result['duplicates']} (streams: missing "
        f"{result['stream_missing']}, doubled {result['stream_duplicates']}); "
        f"WARN lag {spread_of(warn)}; deadlines spread over {result['heartbeat_spread_ms']} "
        f"ms; CPU {', '.join(f'{k} {v:.0f}%' for k, v in result['cpu_pct'].items())}"
    )
    metric = f"TOKEN_EXPIRED lag p99, {result['sessions']:,} sessions"
    return lag_row("expiry storm", metric, result, exactly_once, note)
