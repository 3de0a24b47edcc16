"""Hardening with real sockets: a client that stops reading, descriptors running out,
a reconnect storm after a restart (docs/security.md)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from typing import Any

from redis import asyncio as aioredis
from structlog.testing import CapturingLogger
from websockets.exceptions import InvalidStatus
from websockets.frames import Frame, Opcode

import tokend_client
from testkit.clients import RawClient, WireClient
from testkit.events import EventLog
from testkit.net import LOOPBACK, http_get
from testkit.procs import proc_running
from testkit.redis_servers import RedisProcess
from testkit.tokend_process import CALM_CLOCKS, TokendProcess, node_env
from testkit.waiting import eventually
from tokend.config import Settings
from tokend.core import protocol as p
from tokend.ops.app import App
from tokend.server import connection, link
from tokend.store.keyspace import Keyspace
from tokend.store.redis_client import open_client
from tokend.tokens.service import TokenService

SEND_TIMEOUT = 1.0
PINGS = [Frame(Opcode.PING, bytes(125))] * 20


class BindCapturingLogger(CapturingLogger):
    """structlog's CapturingLogger that also takes bind(): bound fields join each call."""

    def bind(self, **fields: Any) -> Any:
        return _Bound(self, fields)


class _Bound:
    def __init__(self, logger: CapturingLogger, fields: dict[str, Any]) -> None:
        self.logger, self.fields = logger, fields

    def __getattr__(self, name: str) -> Callable[..., None]:
        method = getattr(self.logger, name)
        return lambda *args, **kwargs: method(*args, **self.fields, **kwargs)


async def test_a_client_that_stops_reading_is_dropped(
    start_app, tokens: TokenService, redis, monkeypatch
):
    # No frame limit, so that the client can make the server write faster than it reads;
    # clocks long enough that only the stall, never expiry, can end the connection.
    app: App = await start_app(
        max_frame_rate=0, send_timeout=SEND_TIMEOUT, warn_after=30, expire_after=40
    )
    assert app.node is not None
    server_log = BindCapturingLogger()
    monkeypatch.setattr(link, "_log", server_log)
    token = tokens.mint("sloth")
    client = await WireClient.open(app.port, rcvbuf=4096)
    await client.send(Frame(Opcode.BINARY, p.encode(p.Hello(token))))
    welcome = await client.welcome()
    tid = str(uuid.UUID(bytes=welcome.tid))
    async with EventLog(redis, f"{app.settings.key_prefix}:events") as events:
        # Heartbeats whose exp is wrong: every ACK re-sends the token (~330 bytes). The
        # client never reads another byte.
        seq = 0
        with contextlib.suppress(OSError, TimeoutError):
            async with asyncio.timeout(15):
                while app.node.sessions:
                    seq += 1
                    hb = p.make_heartbeat(welcome.session_key, welcome.tid, seq, 1)
                    # Pings of the largest size, answered by pongs: more to write.
                    await client.send(Frame(Opcode.BINARY, p.encode(hb)), *PINGS)
        await eventually(lambda: not app.node.sessions, 5)
        client.close()
        # The session is not ended: the client may come back and resume it.
        async with RawClient.connect(app.port) as again:
            assert (await again.hello(token)).resumed
            await again.send(p.encode(p.Bye()))
            await again.expect_close()
        # A session's events come in order: an expiry of it would have come before its close.
        await events.wait_for("SESSION_CLOSED", tid)
        assert not events.of("TOKEN_EXPIRED", tid)
    assert app.node.metrics.dropped == {"not_reading": 1}
    [dropped] = [
        call.kwargs
        for call in server_log.calls
        if call.args == ("dropping connection: client not reading",)
    ]
    # What the server held for it: the write limit (32 KiB), the ACKs (token re-sent,
    # < 400 bytes each) of the heartbeats in the store's hands when reading paused, and
    # the pongs of the pings in the last read (no larger than that read).
    held = connection.WRITE_HIGH + link.READ_PAUSE_AT * 400 + LARGEST_READ
    assert dropped["unsent"] <= held


# The most one read hands a protocol: uvloop reads up to 256,000 bytes at once, asyncio's
# selector loop 256 KiB (a clean-clone run met 147,916 bytes unsent: a read over 64 KiB).
LARGEST_READ = 256 * 1024


MAX_OPEN_FILES = 64
# Looks at the server while every descriptor is in use, 10 ms apart: an event loop that
# spins on accept() is running (or waiting for a CPU) at every look (100 of 100 when made
# to spin); this one, doing its timers' work on a busy machine, at 10 to 25.
LOOKS = 100


async def test_descriptors_exhausted(make_settings, tokens: TokenService, tmp_path):
    # The admin listener's share of the 64 descriptors kept small (admin_max_connections).
    env = node_env(make_settings(**CALM_CLOCKS, redis_pool_size=4, admin_max_connections=2))
    node = TokendProcess(env, max_open_files=MAX_OPEN_FILES)
    await asyncio.to_thread(node.start)
    assert node.process is not None
    try:
        async with contextlib.AsyncExitStack() as stack:
            held: list[RawClient] = []
            # Sessions until the server refuses one: 503 at its connection budget.
            for i in range(MAX_OPEN_FILES):
                try:
                    client = await stack.enter_async_context(RawClient.connect(node.port))
                except InvalidStatus as refused:
                    assert refused.response.status_code == 503
                    assert refused.response.headers["Retry-After"]
                    break
                await client.hello(tokens.mint(f"fd-{i}"))
                held.append(client)
            else:
                raise AssertionError("no connection was refused")
            # Now take every descriptor: bare TCP connections that never say anything.
            idle = [
                await asyncio.open_connection(LOOPBACK, node.port) for _ in range(MAX_OPEN_FILES)
            ]
            # Some of them found no descriptor left: accepted and closed at once (uvloop,
            # libuv's reserved-descriptor trick), not left hanging in the backlog.
            await eventually(lambda: any(reader.at_eof() for reader, _ in idle))
            # Nothing spins on accept(): the server sleeps until it has work.
            running = 0
            for _ in range(LOOKS):
                await asyncio.sleep(0.01)
                running += proc_running(node.process.pid)
            assert running < LOOKS * 3 // 4, running
            # The sessions it holds are served throughout (the Redis pool kept its sockets).
            for client in held:
                assert isinstance(await client.heartbeat(), p.HeartbeatAck)
            for _, writer in idle:
                writer.close()
        # Everything closed: the server accepts and serves new sessions again.
        async with RawClient.connect(node.port) as client:
            await client.hello(tokens.mint("after"))
            assert isinstance(await client.heartbeat(), p.HeartbeatAck)
    finally:
        assert node.stop() == 0  # its log read to the end
    events = [line["event"] for line in node.log_lines]
    assert "handshake refused: near the open-file limit" in events


STORM_CLIENTS = 300
STORM_SPREAD = 2.0  # the SDK's backoff base and cap: first retries spread over 0..2 s
STORM_PENDING_CAP = 40  # max_pending_hellos: the storm must run into it


async def resumed_at(session: tokend_client.ClientSession) -> float:
    """Loop time of the session's first RESUMED change (it reconnected)."""
    async for change in session.changes():
        if change.kind is tokend_client.Change.RESUMED:
            return asyncio.get_running_loop().time()
        assert change.kind is not tokend_client.Change.ENDED, change
    raise AssertionError("changes ended")


async def test_reconnect_storm_after_a_restart(start_app, make_settings, tokens: TokenService):
    clocks = {"heartbeat_interval": 2.0, "warn_after": 10.0, "expire_after": 15.0}
    # The storm must run into the pending cap; its 300 clients come from 127.0.0.1.
    limits = {"max_pending_hellos": STORM_PENDING_CAP, "max_connections_per_ip": 0}
    app = await start_app(**limits, **clocks)
    port = app.port
    url = f"ws://{LOOPBACK}:{port}{p.WS_PATH}"
    backoff = tokend_client.Backoff(base=STORM_SPREAD, cap=STORM_SPREAD)
    sessions = [
        tokend_client.ClientSession(url, tokens.mint(f"storm-{i}"), backoff=backoff)
        for i in range(STORM_CLIENTS)
    ]
    loop = asyncio.get_running_loop()
    watchers: list[asyncio.Task[float]] = []
    try:
        async with asyncio.timeout(20):
            await asyncio.gather(*(s.start() for s in sessions))
        watchers = [asyncio.create_task(resumed_at(s)) for s in sessions]
        await app.stop()  # every connection closed with 1001: all reconnect at once
        restarted_at = loop.time()
        app = await start_app(port=port, **limits, **clocks)
        # The node keeps answering other requests through the storm (how fast is the
        # benchmarks' business: bench connect).
        async with asyncio.timeout(30):
            while not all(w.done() for w in watchers):
                status, _ = await http_get(app.port, "/healthz")
                assert status == 200
        times = sorted(w.result() - restarted_at for w in watchers)
    finally:
        for watcher in watchers:
            watcher.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        await asyncio.gather(*(s.close() for s in sessions), return_exceptions=True)
    # Full jitter: the reconnects are spread over most of the backoff, not bunched.
    p10, p90 = times[len(times) // 10], times[9 * len(times) // 10]
    assert p90 - p10 > 0.5 * STORM_SPREAD, (p10, p90)
    # Some clients met the HELLO cap (503) and came back later; none was lost.
    assert sum(s.stats.reconnects for s in sessions) > STORM_CLIENTS
    assert all(s.error is None for s in sessions)


def skewed_clock(offset: float) -> Callable[[], float]:
    """The wall clock of a node ``offset`` seconds off Redis's."""
    return lambda: time.time() + offset


def redis_ms(reply: tuple[int, int]) -> int:
    seconds, micros = reply
    return seconds * 1000 + micros // 1000


async def test_clocks_run_on_redis_time(app, tokens: TokenService, redis, events):
    """Session clocks and event times are Redis TIME (the scripts' now_ms), not the node's.

    The node's own wall clock only dates its requests (the prelude's deadline), and a skew
    within ``leeway`` does not matter; beyond it, requests are refused with 1013.
    """
    app.node.store.wall_clock = skewed_clock(-(app.settings.leeway - 1))
    before = redis_ms(await redis.time())
    async with RawClient.connect(app.port) as client:
        welcome = await client.hello(tokens.mint("skewed"))
        await client.heartbeat()
    tid = uuid.UUID(bytes=welcome.tid)
    [started] = await events.wait_for("SESSION_STARTED", str(tid))
    hb = int(await redis.hget(Keyspace(app.settings.key_prefix).session_keys(tid)[0], "hb"))
    after = redis_ms(await redis.time())
    assert before <= started["at"] <= hb <= after

    too_far = app.settings.leeway + app.settings.redis_timeout + 1
    app.node.store.wall_clock = skewed_clock(-too_far)
    async with RawClient.connect(app.port) as client:
        await client.send(p.encode(p.Hello(tokens.mint("too-skewed"))))
        assert (await client.expect_close()).code == p.CloseCode.TRY_AGAIN_LATER


async def test_slow_loris_handshake_is_dropped(start_app):
    """An opening handshake never finished is dropped after hello_timeout (open_timeout)."""
    app = await start_app(hello_timeout=0.5)
    reader, writer = await asyncio.open_connection(LOOPBACK, app.port)
    writer.write(b"GET /v1/ws HTTP/1.1\r\nHost: tokend\r\nUpgrade: websocket\r\n")
    try:
        async with asyncio.timeout(app.settings.hello_timeout + 2):
            assert await reader.read() == b""  # closed without an answer
    finally:
        writer.close()


async def test_a_client_that_never_answers_the_close_is_dropped(app: App):
    """The closing handshake has a deadline (RFC 6455 7.1.1: the server closes the TCP
    connection): a client that neither answers our close frame nor closes is dropped."""
    reader, writer = await asyncio.open_connection(LOOPBACK, app.port)
    try:
        writer.write(
            b"GET /v1/ws HTTP/1.1\r\nHost: tokend\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: tokend.v1\r\n\r\n"
        )
        writer.write(
            Frame(Opcode.BINARY, p.encode(p.Hello("x.y.z"))).serialize(mask=True, extensions=[])
        )
        received = b""
        async with asyncio.timeout(connection.CLOSE_TIMEOUT + 3):
            while True:
                try:
                    chunk = await reader.read(4096)
                except ConnectionResetError:
                    break
                if not chunk:
                    break
                received += chunk  # the 101 response, then the close frame (4501)
        close_frame = Frame(Opcode.CLOSE, b"").serialize(mask=False, extensions=[])[:1]
        assert b" 101 " in received and close_frame in received.partition(b"\r\n\r\n")[2]
    finally:
        writer.close()


async def test_pooled_connections_outlive_a_redis_restart(
    own_redis: RedisProcess, settings: Settings
):
    """A Redis restart closes every connection in the pool; each is replaced before it
    carries a command, so no caller sees the restart once Redis is back (a node's first
    BYE after a restart failed so: 1013, the logout not recorded)."""
    client = open_client(own_redis.url, settings)
    assert isinstance(client, aioredis.Redis)
    try:
        pool = client.connection_pool
        opened = [await pool.get_connection() for _ in range(settings.redis_pool_size)]
        for connection in opened:
            await pool.release(connection)
        own_redis.kill()
        await asyncio.to_thread(own_redis.start)
        # All at once: each takes a connection of its own from the pool.
        pongs = await asyncio.gather(*(client.ping() for _ in opened))
        assert pongs == [True] * len(opened)
    finally:
        await client.aclose()
