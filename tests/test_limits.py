"""Caps and limits at the handshake and on a live connection."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus
from websockets.frames import Frame, Opcode
from websockets.typing import Origin, Subprotocol

from testkit.clients import RawClient, WireClient
from testkit.net import LOOPBACK
from tokend.core import protocol as p
from tokend.tokens.service import TokenService

URL = "ws://{}:{}/v1/ws"
OFFERED = [Subprotocol("tokend.v1")]


async def test_origin_allow_list(start_app, tokens: TokenService):
    app = await start_app(allowed_origins="https://app.example, https://admin.example")
    url = URL.format(LOOPBACK, app.port)
    with pytest.raises(InvalidStatus) as refused:
        async with connect(url, origin=Origin("https://evil.example"), subprotocols=OFFERED):
            pass
    assert refused.value.response.status_code == 403
    async with connect(url, origin=Origin("https://admin.example"), subprotocols=OFFERED) as ws:
        await RawClient(ws).hello(tokens.mint("browser"))
    # Non-browser clients send no Origin and are not affected.
    async with RawClient.connect(app.port) as client:
        await client.hello(tokens.mint("service"))


async def test_connections_per_ip_cap(start_app):
    app = await start_app(max_connections_per_ip=2)
    async with contextlib.AsyncExitStack() as stack:
        for _ in range(2):
            await stack.enter_async_context(RawClient.connect(app.port))
        with pytest.raises(InvalidStatus) as refused:
            async with RawClient.connect(app.port):
                pass
        assert refused.value.response.status_code == 429
    # Once those are closed the address may connect again.
    async with RawClient.connect(app.port) as client:
        assert client.ws.subprotocol == p.SUBPROTOCOL


async def test_sessions_per_sub_cap_allows_resume(start_app, tokens: TokenService):
    app = await start_app(max_sessions_per_sub=1)
    first = tokens.mint("carl")
    async with RawClient.connect(app.port) as one:
        welcome = await one.hello(first)
        async with RawClient.connect(app.port) as two:
            await two.send(p.encode(p.Hello(tokens.mint("carl"))))
            assert (await two.expect_close()).code == p.CloseCode.RATE_LIMITED
        # Taking over one's own session (with the proof of its key) is not a second session.
        async with RawClient.connect(app.port) as again:
            proof = p.resume_proof(welcome.session_key, welcome.tid)
            assert (await again.hello(first, proof)).resumed
        async with RawClient.connect(app.port) as other_sub:
            await other_sub.hello(tokens.mint("dora"))


async def test_frame_flood_is_rate_limited(start_app, tokens: TokenService):
    app = await start_app(max_frame_rate=5)
    async with RawClient.connect(app.port) as client:
        await client.hello(tokens.mint("flood"))
        for _ in range(200):  # far beyond the burst of 50
            try:
                await client.send(client.heartbeat_bytes())
            except Exception:
                break
        assert (await client.expect_close()).code == p.CloseCode.RATE_LIMITED


# A cadence of 4 heartbeats a second against a limit of 5 frames a second (burst 50).
CADENCE_S, FRAME_RATE = 0.25, 5


async def test_normal_cadence_is_not_limited(start_app, tokens: TokenService):
    """A client on cadence is never limited, even with its burst spent first (as after
    catching up): each interval refills more than its heartbeat takes. Sent on a schedule
    of the loop's clock, each acknowledged; at a cadence faster than the rate (or with a
    bucket that does not refill) the connection is closed 4029 within the cadence part."""
    app = await start_app(max_frame_rate=FRAME_RATE, heartbeat_interval=CADENCE_S)
    async with RawClient.connect(app.port) as client:
        await client.hello(tokens.mint("calm"))
        for _ in range(10 * FRAME_RATE - 1):  # the burst spent, but one frame
            assert isinstance(await client.heartbeat(), p.HeartbeatAck)
        loop = asyncio.get_running_loop()
        start = loop.time()
        for n in range(1, 21):  # 5 s of cadence
            await asyncio.sleep(max(0.0, start + n * CADENCE_S - loop.time()))
            assert isinstance(await client.heartbeat(), p.HeartbeatAck)


# 256 KiB of empty masked pings (6 bytes each): what one read of a flooder may carry.
FLOOD_PINGS = 256 * 1024 // 6


async def test_a_flood_in_one_read_is_not_parsed_past_its_close(start_app, tokens: TokenService):
    """A read of 43,000 pings past max_frame_rate: the server stops parsing at its 4029
    (every ping parsed would get a pong, RFC 6455 5.5.2, even after the close) and ends
    the connection, so one flooder cannot hold the loop from everyone's ACKs."""
    app = await start_app(max_frame_rate=5)
    flooder = await WireClient.open(app.port)
    try:
        await flooder.send(Frame(Opcode.BINARY, p.encode(p.Hello(tokens.mint("flooder")))))
        await flooder.welcome()
        pongs = 0
        ping = Frame(Opcode.PING, b"").serialize(mask=True)
        loop = asyncio.get_running_loop()

        async def read_to_the_end() -> None:  # answering nothing, not even the close
            nonlocal pongs
            while True:
                try:
                    data = await loop.sock_recv(flooder.sock, 65536)
                except OSError:
                    return
                if not data:
                    return
                flooder.protocol.receive_data(data)
                events = flooder.protocol.events_received()
                pongs += sum(isinstance(e, Frame) and e.opcode is Opcode.PONG for e in events)

        async def send_flood() -> None:
            with contextlib.suppress(OSError):  # the server may end it first
                await flooder.send_raw(ping * FLOOD_PINGS)

        async with asyncio.timeout(30):
            await asyncio.gather(read_to_the_end(), send_flood())
        closed = flooder.protocol.close_rcvd
        assert closed is not None and closed.code == p.CloseCode.RATE_LIMITED
        assert pongs < FLOOD_PINGS // 10, f"{pongs} of {FLOOD_PINGS} pings parsed"
    finally:
        flooder.close()
