"""WebSocket servers that misbehave, as a test writes them (websockets' asyncio server on
loopback), and the frames they send: for the SDK tests (Python and browser)."""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import jwt
from websockets.asyncio.server import ServerConnection, serve
from websockets.typing import Subprotocol

from testkit.net import LOOPBACK, url_of
from tokend.core import protocol as p


def unsigned_token() -> str:
    """A JWT-shaped token for servers that do not verify it (or are not there)."""
    claims = {"jti": str(uuid.uuid4()), "sub": "nobody", "exp": int(time.time()) + 60}
    return jwt.encode(claims, "k" * 32, algorithm="HS256")


@contextlib.asynccontextmanager
async def fake_server(
    handler: Callable[[ServerConnection], Awaitable[None]],
) -> AsyncIterator[str]:
    async with serve(
        handler,
        LOOPBACK,
        0,
        select_subprotocol=lambda _conn, _offered: Subprotocol(p.SUBPROTOCOL),
        compression=None,
        ping_interval=None,
    ) as server:
        yield url_of(server.sockets[0].getsockname()[1])


def welcome_for(
    hello: bytes, heartbeat_ms: int, warn_ms: int, key: bytes | None = None, resumed: bool = False
) -> bytes:
    """The WELCOME a server would answer ``hello`` with (its token read unverified): the
    token's tid and exp, the cadence given, expiry at twice ``warn_ms``."""
    frame = p.decode(hello)
    assert isinstance(frame, p.Hello)
    claims = jwt.decode(frame.token, options={"verify_signature": False})
    exp_ms = claims["exp"] * 1000
    key = key or os.urandom(p.SESSION_KEY_LENGTH)
    tid = uuid.UUID(claims["jti"]).bytes
    return p.encode(p.Welcome(tid, exp_ms, heartbeat_ms, warn_ms, 2 * warn_ms, key, resumed))
