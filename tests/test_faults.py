"""Faults with real processes: Redis killed and restarted, two tokend nodes on one Redis."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import uuid
from functools import partial
from pathlib import Path

from redis import asyncio as aioredis
from websockets.exceptions import ConnectionClosed

from testkit.clients import Closed, RawClient, proof_of, resumes
from testkit.events import EventLog, after_a_full_sweep, left_to_judge, read_events
from testkit.net import http_get, is_ready
from testkit.proxies import LatencyProxy
from testkit.redis_servers import RedisProcess
from testkit.tokend_process import TokendProcess, node_env
from testkit.waiting import eventually
from tokend.core import protocol as p
from tokend.store.keyspace import Keyspace
from tokend.tokens.service import TokenService

# Redis unavailable for 30 s. The held session's clocks are far shorter, so
# a node that judged silence by Redis's clock across the outage would expire it.
OUTAGE_S = 30.0
OUTAGE_CLOCKS = {"heartbeat_interval": 1.0, "warn_after": 3.0, "expire_after": 6.0}


async def test_redis_outage_and_restart(start_app, tokens: TokenService, own_redis: RedisProcess):
    redis_proc = own_redis
    # Clocks long enough that a short outage must not warn or expire anyone.
    app = await start_app(
        redis_url=redis_proc.url, warn_after=4, expire_after=6, redis_timeout=0.5, off_redis="hold"
    )
    client_redis = aioredis.from_url(redis_proc.url, decode_responses=True)
    async with (
        EventLog(client_redis, f"{app.settings.key_prefix}:events") as events,
        RawClient.connect(app.port) as held,
    ):
        welcome = await held.hello(tokens.mint("olga"))
        tid = str(uuid.UUID(bytes=welcome.tid))
        await events.wait_for("SESSION_STARTED", tid)
        assert (await http_get(app.port, "/readyz"))[0] == 200

        redis_proc.kill()
        status, body = await http_get(app.port, "/readyz")
        assert status == 503 and "redis" in body

        # New clients are told to come back later, never left hanging.
        async with RawClient.connect(app.port) as newcomer:
            await newcomer.send(p.encode(p.Hello(tokens.mint("pete"))))
            assert (await newcomer.expect_close()).code == p.CloseCode.TRY_AGAIN_LATER

        # The open connection is neither closed nor expired: its heartbeats are
        # acknowledged from what the node knows.
        for _ in range(3):
            ack = await held.heartbeat()
            assert ack.exp_ms == welcome.exp_ms

        redis_proc.start()  # same port, same AOF
        # readyz is what an operator polls; poll it the same way, bounded.
        await eventually(lambda: is_ready(app.port), 10, interval=0.1)
        ack = await held.heartbeat()
        assert ack.exp_ms == welcome.exp_ms
    # The session survived in the AOF and is still live: a new connection resumes it.
    async with RawClient.connect(app.port) as again:
        assert (await again.hello(tokens.mint("olga", tid=uuid.UUID(tid)))).resumed
    history = [
        e["type"]
        for e in await read_events(client_redis, app.settings.key_prefix)
        if e["tid"] == tid
    ]
    await client_redis.aclose()
    assert history == ["SESSION_STARTED", "SESSION_RESUMED"]


async def test_two_nodes_emit_each_event_once(
    make_settings, tokens: TokenService, redis, tmp_path: Path
):
    base = make_settings()  # the short clocks of the tests
    env = node_env(base)
    nodes = [TokendProcess({**env, "TOKEND_NODE_NAME": f"node-{n}"}) for n in "ab"]
    for node in nodes:
        node.start()
    sessions = 20
    try:
        async with EventLog(redis, f"{base.key_prefix}:events") as events:
            tids = []
            for i in range(sessions):
                port = nodes[i % 2].port
                async with RawClient.connect(port) as client:
                    welcome = await client.hello(tokens.mint(f"user-{i}"))
                    await client.heartbeat()
                    tids.append(str(uuid.UUID(bytes=welcome.tid)))
            # Every connection dropped: both nodes sweep, each session expires once.
            await events.wait_for("TOKEN_EXPIRED", count=sessions, timeout=10)
            await after_a_full_sweep(*(node.admin_port for node in nodes))
            assert await left_to_judge(redis, base.key_prefix, tids) == []
            history = await read_events(redis, base.key_prefix)
            for kind in ("SESSION_STARTED", "SESSION_WARN", "TOKEN_EXPIRED"):
                assert sorted(e["tid"] for e in history if e["type"] == kind) == sorted(tids), kind
            assert {e["node"] for e in events.of("SESSION_STARTED")} == {"node-a", "node-b"}
    finally:
        for node in nodes:
            assert node.stop(signal.SIGTERM) == 0


async def test_scripts_flushed_mid_session(app, tokens: TokenService, redis, events: EventLog):
    """NOSCRIPT (Redis restarted empty or SCRIPT FLUSH) costs a reload, never a request."""
    async with RawClient.connect(app.port) as client:
        await client.hello(tokens.mint("quinn"))
        await redis.script_flush()
        assert isinstance(await client.heartbeat(), p.HeartbeatAck)
        await redis.script_flush()
        async with RawClient.connect(app.port) as other:
            welcome = await other.hello(tokens.mint("rita"))
        await events.wait_for("SESSION_STARTED", str(uuid.UUID(bytes=welcome.tid)))
        await redis.script_flush()
        # The sweeper reloads too: the dropped session still expires.
        await events.wait_for("TOKEN_EXPIRED", str(uuid.UUID(bytes=welcome.tid)), timeout=5)


async def test_readyz_reports_a_dead_background_task(app):
    assert app.node is not None
    # The app runs in this loop: its node's sweeper is found by name (tests/test_node_core.py
    # holds Node.failed_task to naming it).
    [sweeper] = [t for t in asyncio.all_tasks() if t.get_name() == "sweeper"]
    sweeper.cancel()  # stands in for a task that crashed
    with contextlib.suppress(asyncio.CancelledError):
        await sweeper
    status, body = await http_get(app.port, "/readyz")
    assert status == 503 and "sweeper" in body["node"]


async def test_redis_unavailable_for_30_s(start_app, tokens: TokenService, own_redis: RedisProcess):
    """Redis frozen (SIGSTOP: connections hang, nothing is refused) for OUTAGE_S; the node
    holds its connections (off_redis hold)."""
    app = await start_app(
        redis_url=own_redis.url, redis_timeout=0.5, off_redis="hold", **OUTAGE_CLOCKS
    )
    assert own_redis.process is not None
    loop = asyncio.get_running_loop()
    async with RawClient.connect(app.port) as held:
        welcome = await held.hello(tokens.mint("patient"))
        tid = str(uuid.UUID(bytes=welcome.tid))
        acks: list[p.HeartbeatAck] = []

        async def heartbeat_until(deadline: float) -> None:
            while loop.time() < deadline:
                acks.append(await held.heartbeat())
                await asyncio.sleep(OUTAGE_CLOCKS["heartbeat_interval"])

        own_redis.process.send_signal(signal.SIGSTOP)
        try:
            stopped_at = loop.time()
            heartbeats = asyncio.create_task(heartbeat_until(stopped_at + OUTAGE_S))
            status, body = await http_get(app.port, "/readyz")
            assert status == 503 and "redis" in body, body
            async with RawClient.connect(app.port) as newcomer:
                await newcomer.send(p.encode(p.Hello(tokens.mint("early"))))
                assert (await newcomer.expect_close()).code == p.CloseCode.TRY_AGAIN_LATER
            await heartbeats  # the whole outage, one heartbeat a second, each ACKed
        finally:
            own_redis.process.send_signal(signal.SIGCONT)
        assert len(acks) >= OUTAGE_S / OUTAGE_CLOCKS["heartbeat_interval"] / 2
        assert all(ack.exp_ms == welcome.exp_ms for ack in acks)
        # The node recovers by itself; readyz is what an operator polls.
        await eventually(lambda: is_ready(app.port), 10, interval=0.1)
        # Held past expire_after after recovery: the session goes on, never expired.
        await heartbeat_until(loop.time() + OUTAGE_CLOCKS["expire_after"] + 1)
        async with RawClient.connect(app.port) as later:
            await later.hello(tokens.mint("later"))
    history = await events_of(own_redis, app.settings.key_prefix, tid)
    assert history == ["SESSION_STARTED"], history


async def events_of(server: RedisProcess, prefix: str, tid: str) -> list[str]:
    """The types of the session's events in the stream, in order."""
    client = aioredis.from_url(server.url, decode_responses=True)
    try:
        return [e["type"] for e in await read_events(client, prefix) if e["tid"] == tid]
    finally:
        await client.aclose()


async def heartbeats_until_closed(client: RawClient, timeout: float) -> Closed:
    """Heartbeats at the cadence until the server closes (within ``timeout`` s)."""
    async with asyncio.timeout(timeout):
        try:
            while True:
                await client.heartbeat()
                await asyncio.sleep(OUTAGE_CLOCKS["heartbeat_interval"])
        except Closed as closed:  # the close came while awaiting an ACK
            return closed
        except ConnectionClosed:  # or before a heartbeat was sent
            return await client.expect_close()


async def test_a_node_off_redis_sends_its_clients_to_resume_and_keeps_their_sessions(
    start_app, tokens: TokenService, own_redis: RedisProcess
):
    """off_redis leave: a connection whose heartbeats went unstored until halfway from
    WARN to EXPIRED is closed 1013; its last heartbeat is stored once Redis is back, so
    that its client resumes though the outage outlasted expire_after."""
    app = await start_app(redis_url=own_redis.url, redis_timeout=0.5, **OUTAGE_CLOCKS)
    assert app.settings.off_redis == "leave"
    assert own_redis.process is not None
    loop = asyncio.get_running_loop()
    async with RawClient.connect(app.port) as held:
        welcome = await held.hello(tokens.mint("mover"))
        tid = str(uuid.UUID(bytes=welcome.tid))
        own_redis.process.send_signal(signal.SIGSTOP)
        try:
            stopped_at = loop.time()
            close = await heartbeats_until_closed(held, OUTAGE_CLOCKS["expire_after"])
            closed_after = loop.time() - stopped_at
            # The outage outlasts expire_after: only the replay keeps the session.
            await asyncio.sleep(
                max(0.0, stopped_at + OUTAGE_CLOCKS["expire_after"] + 2 - loop.time())
            )
        finally:
            own_redis.process.send_signal(signal.SIGCONT)
    assert close.code == p.CloseCode.TRY_AGAIN_LATER and close.reason == "store_unavailable"
    assert closed_after < OUTAGE_CLOCKS["expire_after"], closed_after
    await eventually(lambda: is_ready(app.port), 10, interval=0.1)
    async with RawClient.connect(app.port) as again:
        resumed = await again.hello(tokens.mint("mover", tid=uuid.UUID(tid)), proof_of(welcome))
        assert resumed.resumed
    history = await events_of(own_redis, app.settings.key_prefix, tid)
    assert "TOKEN_EXPIRED" not in history, history


SLOW_REDIS_S = 1.5  # latency the proxy adds, above the redis_timeout below
SLOW_TIMEOUT = 0.5
SLOW_ATTEMPTS = 60  # HELLOs sent while Redis is slow, in waves of SLOW_WAVE
SLOW_WAVE = 20


def server_tasks() -> int:
    """Tasks of this event loop but the proxy's own."""
    return sum(
        not getattr(t.get_coro(), "__qualname__", "").startswith(LatencyProxy.__name__)
        for t in asyncio.all_tasks()
    )


async def test_slow_redis_fails_fast(start_app, tokens: TokenService, redis_server: RedisProcess):
    """Redis slower than redis_timeout: 1013 in time, nothing piles up, then recovery."""
    async with LatencyProxy(redis_server.port) as proxy:
        app = await start_app(
            redis_url=proxy.url, redis_timeout=SLOW_TIMEOUT, warn_after=20, expire_after=30
        )
        assert app.node is not None
        async with RawClient.connect(app.port) as held:
            welcome = await held.hello(tokens.mint("steady"))
            baseline_tasks = server_tasks()
            proxy.delay = SLOW_REDIS_S

            async def refused() -> None:
                async with RawClient.connect(app.port) as newcomer:
                    await newcomer.send(p.encode(p.Hello(tokens.mint("hasty"))))
                    assert (await newcomer.expect_close()).code == p.CloseCode.TRY_AGAIN_LATER

            most_waiting = 0
            for _ in range(SLOW_ATTEMPTS // SLOW_WAVE):
                sent_before = proxy.received
                wave = asyncio.gather(*(refused() for _ in range(SLOW_WAVE)))
                ack = await held.heartbeat()  # answered from what the node knows
                assert ack.exp_ms == welcome.exp_ms
                await wave
                # Each HELLO waited one redis_timeout, not behind the others: all were
                # refused before the slow link had passed on any request of the wave
                # (it holds each SLOW_REDIS_S, three redis_timeouts).
                assert proxy.forwarded <= sent_before, (proxy.forwarded, sent_before)
                most_waiting = max(
                    most_waiting,
                    len(app.node.heartbeat_batcher.waiting)
                    + len(app.node.heartbeat_batcher.unstored),
                )
            # Nothing accumulates: one heartbeat entry per connection, tasks back to before.
            assert most_waiting <= 1
            # The last closes finish.
            await eventually(
                lambda: server_tasks() <= baseline_tasks, SLOW_TIMEOUT * 2, interval=0.05
            )
            proxy.delay = 0.0
            await eventually(lambda: is_ready(app.port), 10, interval=0.1)
            await held.heartbeat()
            async with RawClient.connect(app.port) as newcomer:
                await newcomer.hello(tokens.mint("patient"))


async def test_a_hello_answered_too_late_is_released_once_redis_answers_again(
    start_app, tokens: TokenService, redis_server: RedisProcess
):
    """A HELLO Redis ran but answered after redis_timeout (1013) gave the session to a
    connection whose client never got its WELCOME. Its release, lost too while Redis was
    slow, is owed and sent again until Redis takes it: the client's next HELLO resumes
    at once, not refused 4509 while that connection looks live (heartbeat_interval + 15 s)."""
    async with LatencyProxy(redis_server.port) as proxy:
        app = await start_app(
            redis_url=proxy.url, redis_timeout=SLOW_TIMEOUT, warn_after=20, expire_after=30
        )
        assert app.node is not None
        tid = uuid.uuid4()
        token = tokens.mint("unlucky", tid=tid)
        session_key = Keyspace(app.settings.key_prefix).session_keys(tid)[0]
        direct = aioredis.from_url(redis_server.url, decode_responses=True)
        # A session its client left (released): the token is known, so its resume is one
        # script call, which Redis runs however late it comes (within its deadline).
        async with RawClient.connect(app.port) as first:
            await first.hello(token)
        await eventually(lambda: direct.hexists(session_key, "left"), 5)
        proxy.delay = SLOW_REDIS_S
        async with RawClient.connect(app.port) as second:
            await second.send(p.encode(p.Hello(token)))
            assert (await second.expect_close()).code == p.CloseCode.TRY_AGAIN_LATER
        releases = app.node.release_batcher
        await eventually(lambda: bool(releases.owed), SLOW_REDIS_S * 4, interval=0.05)
        # The resume ran in Redis all the same; then Redis is quick again.
        await eventually(lambda: direct.hget(session_key, "conn"), SLOW_REDIS_S * 4)
        await direct.aclose()
        proxy.delay = 0.0
        # Well inside the window in which the connection it never saw looks live.
        await eventually(partial(resumes, app.port, token), 5, interval=0.2, what="a resume")
