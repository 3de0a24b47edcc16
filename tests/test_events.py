"""tokend.events: live pub/sub, stream replay, and the consumer-group reader."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from redis import asyncio as aioredis

from tests.support import LOOPBACK, RedisProcess
from tokend import events
from tokend import protocol as p
from tokend.client import Backoff, connect
from tokend.config import Settings
from tokend.server import App
from tokend.store import Keyspace
from tokend.tokens import TokenService

Event = dict[str, Any]


async def one_session(app: App, tokens: TokenService, sub: str) -> str:
    """Start a session and log it out: SESSION_STARTED then SESSION_CLOSED. Returns its tid."""
    url = f"ws://{LOOPBACK}:{app.port}{p.WS_PATH}"
    async with connect(url, tokens.mint(sub), backoff=Backoff(0.05, 0.5)) as session:
        pass
    return str(session.tid)


async def next_event(stream: AsyncIterator[Event], timeout: float = 5.0) -> Event:
    return await asyncio.wait_for(anext(stream), timeout)


async def pending(redis: aioredis.Redis, keys: Keyspace, group: str) -> list[str]:
    """The consumer of every entry delivered to ``group`` and not acknowledged."""
    owners = []
    for stream in keys.streams():
        owners += [
            row["consumer"] for row in await redis.xpending_range(stream, group, "-", "+", 100)
        ]
    return owners


async def poll(check: Callable[[], Awaitable[bool]], timeout: float = 5.0) -> None:
    """Until ``check()`` holds: for Redis state, which has no event to await."""
    async with asyncio.timeout(timeout):
        while not await check():  # noqa: ASYNC110
            await asyncio.sleep(0.01)


async def group_created(redis: aioredis.Redis, keys: Keyspace, group: str) -> None:
    async def created() -> bool:
        for stream in keys.streams():
            if not any(g["name"] == group for g in await redis.xinfo_groups(stream)):
                return False
        return True

    await poll(created)


@pytest.fixture
def keys(settings: Settings) -> Keyspace:
    return Keyspace(settings.key_prefix)


async def test_live_yields_events_published_while_subscribed(
    app: App, tokens: TokenService, redis: aioredis.Redis, keys: Keyspace
):
    subscribers = (await redis.pubsub_numsub(keys.events_channel))[0][1]
    stream = events.live(redis, keys)
    first = asyncio.create_task(next_event(stream))

    async def subscribed() -> bool:
        return (await redis.pubsub_numsub(keys.events_channel))[0][1] > subscribers

    await poll(subscribed)
    tid = await one_session(app, tokens, "watched")
    started = await first
    assert (started["type"], started["tid"], started["sub"]) == ("SESSION_STARTED", tid, "watched")
    closed = await next_event(stream)
    assert (closed["type"], closed["tid"]) == ("SESSION_CLOSED", tid)
    await stream.aclose()


async def test_from_start_replays_what_the_streams_hold(
    app: App, tokens: TokenService, redis: aioredis.Redis, keys: Keyspace
):
    tids = [await one_session(app, tokens, f"u{n}") for n in range(3)]
    replayed = [e async for e in events.from_start(redis, keys, follow=False)]
    assert [(e["type"], e["tid"]) for e in replayed] == [
        (kind, tid) for tid in tids for kind in ("SESSION_STARTED", "SESSION_CLOSED")
    ]


async def test_durable_acks_after_the_body_and_claims_what_a_crashed_consumer_left(
    app: App, tokens: TokenService, redis: aioredis.Redis, keys: Keyspace
):
    tid = await one_session(app, tokens, "audited")
    crashed = events.durable(redis, keys, "audit", "crashed", block_ms=100, count=1)
    started = await next_event(crashed)
    assert (started["type"], started["tid"]) == ("SESSION_STARTED", tid)
    assert await pending(redis, keys, "audit") == ["crashed"]  # delivered, not acknowledged
    closed = await next_event(crashed)  # asking for the next acknowledged the first
    assert closed["type"] == "SESSION_CLOSED"
    assert await pending(redis, keys, "audit") == ["crashed"]
    await crashed.aclose()  # dies while "handling" SESSION_CLOSED

    survivor = events.durable(redis, keys, "audit", "survivor", claim_idle_ms=300, block_ms=100)
    claimed = await next_event(survivor)
    assert claimed == closed
    assert await pending(redis, keys, "audit") == ["survivor"]
    with contextlib.suppress(TimeoutError):
        await next_event(survivor, timeout=0.3)  # acknowledges, then finds nothing new
    assert await pending(redis, keys, "audit") == []


async def test_durable_redelivers_own_pending_after_a_restart_and_can_start_at_the_end(
    app: App, tokens: TokenService, redis: aioredis.Redis, keys: Keyspace
):
    old = await one_session(app, tokens, "before")
    first_run = events.durable(redis, keys, "billing", "worker-1", block_ms=100)
    delivered = await next_event(first_run)
    await first_run.aclose()  # restarted before finishing with it
    second_run = events.durable(redis, keys, "billing", "worker-1", block_ms=100)
    assert await next_event(second_run) == delivered
    await second_run.aclose()

    tail = events.durable(redis, keys, "new-only", "w", start="$", block_ms=100)
    reader = asyncio.create_task(next_event(tail))
    await group_created(redis, keys, "new-only")
    new = await one_session(app, tokens, "after")
    first = await reader
    assert first["tid"] == new != old
    await tail.aclose()


async def test_durable_waits_out_a_redis_outage(
    start_app: Callable[..., Awaitable[App]],
    tokens: TokenService,
    own_redis: RedisProcess,
    keys: Keyspace,
):
    app = await start_app(redis_url=own_redis.url)
    client = aioredis.from_url(own_redis.url, decode_responses=True)
    seen: list[Event] = []
    arrived = asyncio.Event()

    async def consume() -> None:
        async for event in events.durable(client, keys, "ops", "c", block_ms=100):
            seen.append(event)
            arrived.set()

    consumer = asyncio.create_task(consume())
    try:
        await one_session(app, tokens, "before-outage")
        await asyncio.wait_for(arrived.wait(), 5)
        own_redis.kill()
        await asyncio.sleep(0.3)  # several of its 100 ms blocking reads fail meanwhile
        assert not consumer.done()
        await asyncio.to_thread(own_redis.start)
        tid = await one_session(app, tokens, "after-outage")
        async with asyncio.timeout(10):
            while not any(e["tid"] == tid and e["type"] == "SESSION_CLOSED" for e in seen):
                arrived.clear()
                await arrived.wait()
    finally:
        consumer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await consumer
        await client.aclose()
