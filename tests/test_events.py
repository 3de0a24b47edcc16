"""tokend.store.events: live pub/sub, stream replay, and the consumer-group reader."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import sys
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from redis import asyncio as aioredis
from websockets.exceptions import ConnectionClosed

from testkit import replies
from testkit.clients import Closed, RawClient, tid_of
from testkit.events import EventLog, next_event, one_session
from testkit.redis_servers import RedisProcess
from testkit.tokend_process import node_env
from testkit.waiting import eventually
from tokend.config import Settings
from tokend.core import protocol as p
from tokend.ops.app import App
from tokend.store import events
from tokend.store.keyspace import Keyspace
from tokend.tokens.service import TokenService

Event = dict[str, Any]
StartApp = Callable[..., Awaitable[App]]


async def pending(redis: aioredis.Redis, keys: Keyspace, group: str) -> list[str]:
    """The consumer of every entry delivered to ``group`` and not acknowledged."""
    owners = []
    for stream in keys.streams():
        owners += [
            row["consumer"]
            for row in replies.rows(await redis.xpending_range(stream, group, "-", "+", 100))
        ]
    return owners


async def group_created(redis: aioredis.Redis, keys: Keyspace, group: str) -> None:
    async def created() -> bool:
        for stream in keys.streams():
            if not any(g["name"] == group for g in await redis.xinfo_groups(stream)):
                return False
        return True

    await eventually(created)


async def test_live_yields_events_published_while_subscribed(
    app: App, tokens: TokenService, redis: aioredis.Redis, keys: Keyspace
):
    subscribers = (await redis.pubsub_numsub(keys.events_channel))[0][1]
    stream = events.live(redis, keys)
    first = asyncio.create_task(next_event(stream))

    async def subscribed() -> bool:
        return (await redis.pubsub_numsub(keys.events_channel))[0][1] > subscribers

    await eventually(subscribed)
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
    """The reader's reads fail while Redis is down (seen: its connection attempts are
    refused, more than once), yet it goes on, and reads again once Redis is back."""
    app = await start_app(redis_url=own_redis.url)
    refused = 0

    class Counted(aioredis.Connection):
        """A real connection that counts the attempts Redis refused."""

        async def connect(self) -> None:
            nonlocal refused
            try:
                await super().connect()
            except aioredis.ConnectionError:
                refused += 1
                raise

    pool = aioredis.ConnectionPool.from_url(
        own_redis.url, connection_class=Counted, decode_responses=True
    )
    client = aioredis.Redis(connection_pool=pool)
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
        await eventually(lambda: refused >= 2, what="reads refused while Redis is down")
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


# What the scripts emit, against docs/events.md

EVENTS_DOC = Path(__file__).resolve().parent.parent / "docs" / "events.md"


def documented_event_fields() -> list[tuple[str, frozenset[str]]]:
    """(type, fields) of each row of the table in docs/events.md, "Event types ..."."""
    section = EVENTS_DOC.read_text().split("## Event types and their fields", 1)[1]
    rows = re.findall(r"^\| `([A-Z_]+)` \|[^|]*\| ((?:`\w+` ?)+) \|$", section, re.M)
    return [(kind, frozenset(re.findall(r"`(\w+)`", fields))) for kind, fields in rows]


async def test_every_event_type_has_the_fields_documented(
    start_app: StartApp, tokens: TokenService, events: EventLog
):
    """Drive every kind of event, each variant of it, through real sessions; each event
    has exactly the fields of a row of its type, and every row is met."""
    # expire_after well past warn_after: room to recover and resume after each WARN.
    app = await start_app(expire_after=3)
    assert app.node is not None
    tids: list[str] = []
    async with RawClient.connect(app.port) as client:
        token = tokens.mint("walker", ttl_s=2)  # inside renew_window: renewed at once
        tids.append(tid := tid_of(await client.hello(token)))
        assert (await client.heartbeat()).renewed  # TOKEN_RENEWED
        await events.wait_for("SESSION_WARN", tid)  # silent past warn_after
        await client.heartbeat()  # SESSION_RECOVERED
        await events.wait_for("SESSION_WARN", tid, count=2)
    async with RawClient.connect(app.port) as client:
        assert (await client.hello(token)).resumed  # RESUMED, then RECOVERED
        await client.send(p.encode(p.Bye()))  # SESSION_CLOSED
        assert (await client.expect_close()).code == p.CloseCode.NORMAL
    async with RawClient.connect(app.port) as client:
        tids.append(silent := tid_of(await client.hello(tokens.mint("silent"))))
        short = tokens.mint("short", ttl_s=2)  # its exp comes before expire_after
        async with RawClient.connect(app.port) as other:
            tids.append(brief := tid_of(await other.hello(short)))
            (expired,) = await events.wait_for("TOKEN_EXPIRED", brief, timeout=5)
            assert expired["reason"] == "token_expired"
        (expired,) = await events.wait_for("TOKEN_EXPIRED", silent, timeout=5)
        assert expired["reason"] == "heartbeat_timeout"
    async with RawClient.connect(app.port) as client:
        tids.append(live := tid_of(await client.hello(tokens.mint("revoked"))))
        assert await app.node.store.revoke(uuid.UUID(live), by="cli:test") == 1
    tids.append(barred := str(uuid.uuid4()))
    assert await app.node.store.revoke(uuid.UUID(barred), by="admin:test") == 2
    await events.wait_for("TOKEN_REVOKED", barred)
    async with RawClient.connect(app.port) as client:
        # As if a Redis failover lost the session: the node holding it writes it again.
        tids.append(lost := tid_of(await client.hello(tokens.mint("lost"))))
        await app.node.store.redis.delete(app.node.store.keys.session_keys(uuid.UUID(lost))[0])
        await client.heartbeat()
        await events.wait_for("SESSION_RESTORED", lost)
    parker = await start_app(node_name="parker")
    async with RawClient.connect(parker.port) as client:
        tids.append(parked := tid_of(await client.hello(tokens.mint("parked"))))
        await parker.stop()  # closes it with 1001: a planned close
    (parking,) = await events.wait_for("SESSION_PARKED", parked)
    assert (parking["reason"], parking["node"]) == ("going_away", "parker")

    rows = documented_event_fields()
    emitted = [event for event in events.events if event["tid"] in tids]
    for event in emitted:
        assert (event["type"], frozenset(event)) in rows, event
    met = {(event["type"], frozenset(event)) for event in emitted}
    assert set(rows) == met
    assert {kind for kind, _ in rows} == {
        "SESSION_STARTED",
        "SESSION_RESUMED",
        "TOKEN_RENEWED",
        "SESSION_WARN",
        "SESSION_RECOVERED",
        "SESSION_CLOSED",
        "TOKEN_EXPIRED",
        "TOKEN_REVOKED",
        "SESSION_RESTORED",
        "SESSION_PARKED",
    }
    (closed,) = [e for e in emitted if e["type"] == "SESSION_CLOSED"]
    assert closed["reason"] == "bye"


async def test_node_is_the_node_holding_the_session_and_by_who_revoked(
    start_app: StartApp, tokens: TokenService, events: EventLog, settings: Settings
):
    """A sweep by another node, and a revocation from the command line, name the node
    that held the session, not the one that ran the script."""
    holder = await start_app(node_name="holder")
    sweeper = await start_app(node_name="sweeper")
    async with RawClient.connect(holder.port) as client:
        tid = tid_of(await client.hello(tokens.mint("left")))
    await holder.stop()  # closes with 1001: the session stays for the sweeper alone
    warned, expired = (
        await events.wait_for("SESSION_WARN", tid),
        await events.wait_for("TOKEN_EXPIRED", tid),
    )
    assert warned[0]["node"] == expired[0]["node"] == "holder"
    async with RawClient.connect(sweeper.port) as client:
        tid = tid_of(await client.hello(tokens.mint("revoked")))
        revoke = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tokend", "revoke", tid,
            env={**os.environ, **node_env(settings), "TOKEND_NODE_NAME": "operator"},
            stdout=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        # Heartbeating, so that only the revocation can end it.
        with contextlib.suppress(Closed, ConnectionClosed):
            async with asyncio.timeout(30):
                while True:
                    await client.heartbeat()
                    await asyncio.sleep(settings.heartbeat_interval)
        assert client.ws.close_code == p.CloseCode.TOKEN_REVOKED
        assert await asyncio.wait_for(revoke.wait(), 30) == 0
    (revoked,) = await events.wait_for("TOKEN_REVOKED", tid)
    assert (revoked["node"], revoked["by"]) == ("sweeper", f"cli:{socket.gethostname()}")
