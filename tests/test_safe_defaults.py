"""The limits tokend applies with no configuration at all: nothing here sets
them, so each test holds a default a deployment keeps."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus
from websockets.typing import Subprotocol

from testkit.clients import RawClient
from testkit.net import LOOPBACK
from testkit.waiting import eventually
from tokend.config import Settings
from tokend.core import protocol as p
from tokend.ops.app import App
from tokend.tokens.service import TokenService

StartApp = Callable[..., Awaitable[App]]


async def test_the_default_caps_one_address_and_admits_another(
    start_app: StartApp, tokens: TokenService
) -> None:
    cap = Settings().max_connections_per_ip
    assert 0 < cap < Settings().max_pending_hellos  # one address cannot take every slot
    # Idle connections held through the test (they never finish a handshake).
    app = await start_app(hello_timeout=60)
    assert app.settings.max_connections_per_ip == cap
    held = [await asyncio.open_connection(LOOPBACK, app.port) for _ in range(cap)]
    try:
        await eventually(lambda: app.connections_per_ip[LOOPBACK] == cap)
        with pytest.raises(InvalidStatus) as refused:
            async with RawClient.connect(app.port):
                pass
        assert refused.value.response.status_code == 429
        url = f"ws://{LOOPBACK}:{app.port}{p.WS_PATH}"
        async with connect(
            url, subprotocols=[Subprotocol(p.SUBPROTOCOL)], local_addr=("127.0.0.2", 0)
        ) as ws:
            await RawClient(ws).hello(tokens.mint("elsewhere"))
    finally:
        for _, writer in held:
            writer.close()


async def test_the_default_caps_the_sessions_of_one_sub(
    start_app: StartApp, tokens: TokenService
) -> None:
    cap = Settings().max_sessions_per_sub
    assert cap > 0
    # Clocks no step outlasts: no session expires while the test holds them.
    app = await start_app(heartbeat_interval=5, warn_after=20, expire_after=30)
    async with contextlib.AsyncExitStack() as stack:
        for _ in range(cap):
            client = await stack.enter_async_context(RawClient.connect(app.port))
            await client.hello(tokens.mint("one-account"))
        extra = await stack.enter_async_context(RawClient.connect(app.port))
        await extra.send(p.encode(p.Hello(tokens.mint("one-account"))))
        closed = await extra.expect_close()
        assert (closed.code, closed.reason) == (p.CloseCode.RATE_LIMITED, "too_many_sessions")
        other = await stack.enter_async_context(RawClient.connect(app.port))
        await other.hello(tokens.mint("another-account"))
