"""The tokend server: the one module that knows about websockets.

It serves, on one port, the WebSocket endpoint ``/v1/ws`` (RFC 6455, subprotocol
``tokend.v1``) and a few plain HTTP GET routes answered from the opening
handshake (``/healthz``, ``/readyz``, ``/.well-known/jwks.json``). Every
connection is handed to a :class:`tokend.session.Session` through a
:class:`WebSocketLink`. Beside it runs the admin listener (:mod:`tokend.admin`:
metrics, admin API, dashboard). On SIGTERM the node drains (docs/operations.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import http
import json
import signal
from collections import Counter
from collections.abc import Sequence
from typing import Any

import structlog
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed, NegotiationError
from websockets.http11 import Request, Response
from websockets.typing import Subprotocol

from tokend import health
from tokend import protocol as p
from tokend.admin import AdminServer
from tokend.config import Settings
from tokend.embedded import EmbeddedRedis
from tokend.metrics import Metrics
from tokend.node import Node
from tokend.session import LinkClosed, Session
from tokend.store import connect
from tokend.tokens import KeyRing, TokenService

log = structlog.get_logger("tokend.server")

GOING_AWAY = "server going away"
# Least time between two batches of a drain's closes.
DRAIN_TICK = 0.05


class WebSocketLink:
    """A websockets connection as a :class:`tokend.session.Link`."""

    __slots__ = ("metrics", "ws")

    def __init__(self, ws: ServerConnection, metrics: Metrics) -> None:
        self.ws = ws
        self.metrics = metrics

    async def recv(self) -> bytes | str:
        try:
            return await self.ws.recv()
        except ConnectionClosed:
            raise LinkClosed from None

    async def send(self, data: bytes) -> None:
        try:
            await self.ws.send(data)
        except ConnectionClosed:
            raise LinkClosed from None

    async def close(self, code: int, reason: str) -> None:
        self.metrics.closed(code)
        await self.ws.close(code, reason)


def select_subprotocol(
    connection: ServerConnection, offered: Sequence[Subprotocol]
) -> Subprotocol | None:
    """``tokend.v1`` if offered; no header is accepted; only others is HTTP 400."""
    if not offered:
        return None
    if p.SUBPROTOCOL in offered:
        return Subprotocol(p.SUBPROTOCOL)
    raise NegotiationError(f"unsupported subprotocol; this server speaks {p.SUBPROTOCOL}")


def json_response(status: http.HTTPStatus, body: Any) -> Response:
    data = json.dumps(body).encode()
    headers = Headers(
        [
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(data))),
            ("Cache-Control", "no-store"),
        ]
    )
    return Response(status.value, status.phrase, headers, data)


class App:
    """tokend assembled: keys, store (embedded or configured Redis), node, listener."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.embedded: EmbeddedRedis | None = None
        self.node: Node | None = None
        self.server: Server | None = None
        self.admin: AdminServer | None = None
        self.connections_per_ip: Counter[str] = Counter()
        self.draining = False

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        settings = self.settings
        tokens = TokenService(settings, KeyRing.open(settings.resolved_keys_dir))
        url = settings.redis_url
        if not url:
            self.embedded = EmbeddedRedis(settings.resolved_data_dir)
            await asyncio.to_thread(self.embedded.start)
            url = self.embedded.url
        self.node = Node(settings, connect(url, settings), tokens)
        self.node.metrics.connections = lambda: sum(self.connections_per_ip.values())
        await self.node.start()
        if settings.admin_port >= 0:
            self.admin = AdminServer(self.node, lambda: self.draining)
            await self.admin.start()
        self.server = await serve(
            self._handle,
            settings.host,
            settings.port,
            select_subprotocol=select_subprotocol,
            # None admits handshakes without Origin: only browsers send one.
            origins=[None, *settings.origin_list] if settings.origin_list else None,
            process_request=self._http,
            compression=None,
            max_size=settings.max_message_size,
            open_timeout=settings.hello_timeout,
            # Heartbeats are the liveness check; no second one at the WebSocket layer.
            ping_interval=None,
            close_timeout=2,
            server_header=None,
            backlog=settings.backlog,
        )
        log.info(
            "listening",
            host=settings.host,
            port=self.port,
            node=self.node.name,
            redis="embedded" if self.embedded else "external",
        )

    async def drain(self, hurry: asyncio.Event) -> None:
        """Stop accepting, then close connections with 1001 spread over ``drain_period``.

        Connections are closed in batches, one every :data:`DRAIN_TICK` or so, so that
        their clients do not all reconnect (to other nodes) at once; sessions stay
        resumable. Once ``hurry`` is set, the rest are closed at once.
        """
        assert self.server is not None and self.node is not None
        self.draining = True
        self.server.close(close_connections=False)
        connections = list(self.server.connections)
        period = self.settings.drain_period
        n, closing = len(connections), []
        ticks = max(1, min(n, int(period / DRAIN_TICK)))
        self.node.log.info("draining", connections=n, period=period)
        for tick in range(ticks):
            if hurry.is_set():
                self.node.log.warning("second signal: closing every connection now")
            end = n if hurry.is_set() else (tick + 1) * n // ticks
            batch = connections[tick * n // ticks : end]
            closing += [asyncio.create_task(self._going_away(ws)) for ws in batch]
            if end == n:
                break
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(period / ticks):
                    await hurry.wait()
        if closing:
            await asyncio.wait(closing)

    async def _going_away(self, ws: ServerConnection) -> None:
        assert self.node is not None
        await WebSocketLink(ws, self.node.metrics).close(p.CloseCode.GOING_AWAY, GOING_AWAY)

    async def stop(self) -> None:
        """Stop accepting, close connections with 1001 (sessions stay resumable)."""
        if self.server is not None:
            self.draining = True
            self.server.close(close_connections=False)
            remaining = [self._going_away(ws) for ws in self.server.connections]
            await asyncio.gather(*remaining)
            await self.server.wait_closed()
        if self.admin is not None:
            await self.admin.stop()
        if self.node is not None:
            await self.node.stop()
        if self.embedded is not None:
            await self.embedded.astop()
        log.info("stopped")

    async def _handle(self, ws: ServerConnection) -> None:
        assert self.node is not None
        peer = ws.remote_address
        ip = peer[0] if peer else "?"
        self.connections_per_ip[ip] += 1
        try:
            link = WebSocketLink(ws, self.node.metrics)
            await Session(self.node, link, f"{ip}:{peer[1] if peer else 0}").run()
        finally:
            self.connections_per_ip[ip] -= 1
            if not self.connections_per_ip[ip]:
                del self.connections_per_ip[ip]

    async def _http(self, connection: ServerConnection, request: Request) -> Response | None:
        assert self.node is not None
        path = request.path.partition("?")[0]
        if path == p.WS_PATH:
            cap = self.settings.max_connections_per_ip
            peer = connection.remote_address
            if cap and peer and self.connections_per_ip[peer[0]] >= cap:
                log.warning("handshake refused: connections per IP", peer=peer[0], cap=cap)
                return json_response(
                    http.HTTPStatus.TOO_MANY_REQUESTS, {"error": "too_many_connections"}
                )
            return None
        if path == "/healthz":
            return json_response(*health.liveness(self.node))
        if path == "/readyz":
            return json_response(*await health.readiness(self.node, self.draining))
        if path == "/.well-known/jwks.json":
            return json_response(http.HTTPStatus.OK, self.node.tokens.keys.jwks())
        return json_response(http.HTTPStatus.NOT_FOUND, {"error": "not_found", "path": path})


async def serve_until_signalled(settings: Settings) -> None:
    """Run until SIGTERM or SIGINT, then drain and stop; a second signal hurries the drain."""
    app = App(settings)
    try:
        await app.start()
    except BaseException:
        await app.stop()  # the embedded Redis, if it had started
        raise
    # Start-up objects live as long as the process: keep them out of every GC pass.
    gc.collect()
    gc.freeze()
    stopping, hurry = asyncio.Event(), asyncio.Event()

    def signalled() -> None:
        (hurry if stopping.is_set() else stopping).set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signalled)
    try:
        await stopping.wait()
        log.info("signal received, draining", drain_period=settings.drain_period)
        await app.drain(hurry)
    finally:
        await app.stop()
