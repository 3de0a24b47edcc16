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
import resource
import signal
from collections import Counter
from collections.abc import Awaitable, Sequence
from typing import Any

import structlog
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed, NegotiationError
from websockets.frames import Frame, Opcode
from websockets.http11 import Request, Response
from websockets.protocol import Event, State
from websockets.typing import Subprotocol

from tokend import health
from tokend import protocol as p
from tokend.admin import AdminServer
from tokend.config import Settings
from tokend.embedded import EmbeddedRedis
from tokend.logs import redact_url
from tokend.metrics import Metrics
from tokend.node import Node
from tokend.session import Session, TokenBucket
from tokend.store import connect
from tokend.tokens import KeyRing, TokenService

log = structlog.get_logger("tokend.server")

GOING_AWAY = "going_away"
# Least time between two batches of a drain's closes.
DRAIN_TICK = 0.05

# Seconds a client refused with HTTP 503 (too many pending HELLOs) is asked to wait; its
# jittered backoff spreads the retries anyway.
RETRY_AFTER_S = 1
# Descriptors kept free of client connections besides the Redis pool's: the listener,
# pub/sub, key files, logs, the embedded Redis's pipes.
FD_RESERVE = 32


class TokendConnection(ServerConnection):
    """A websockets server connection with the limits the library lacks (docs/security.md).

    * Pings count against ``max_frame_rate`` in a bucket of their own; beyond it the
      connection is closed with 4029. The library answers every ping with a pong written
      without flow control, so an unlimited ping flood from a client that reads nothing
      would grow the write buffer without bound.
    * Writes stalled for ``send_timeout`` (the buffer above its high-water mark because
      the client reads nothing) drop the connection: no close frame can reach a client
      that does not read, and until then a send, and even a close, waits for it.

    :meth:`for_app` makes the subclass that :func:`websockets.asyncio.server.serve`
    instantiates, bound to one :class:`App`.
    """

    app: App
    # Class-level defaults: an idle connection stores none of them (docs/performance.md).
    pings: TokenBucket | None = None  # made at the first ping
    stall: asyncio.TimerHandle | None = None
    closing: asyncio.Task[None] | None = None

    @classmethod
    def for_app(cls, app: App) -> type[TokendConnection]:
        return type(cls.__name__, (cls,), {"app": app})

    @staticmethod
    def ip(transport: asyncio.BaseTransport) -> str:
        peer = transport.get_extra_info("peername")
        return str(peer[0]) if peer else "?"

    @property
    def peer(self) -> str:
        address = self.remote_address
        return f"{address[0]}:{address[1]}" if address else "?"

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.app.open_connections += 1
        self.app.connections_per_ip[self.ip(transport)] += 1
        super().connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.app.open_connections -= 1
        ip = self.ip(self.transport)
        self.app.connections_per_ip[ip] -= 1
        if not self.app.connections_per_ip[ip]:
            del self.app.connections_per_ip[ip]
        if self.stall is not None:
            self.stall.cancel()
        super().connection_lost(exc)

    def process_event(self, event: Event) -> None:
        rate = self.app.settings.max_frame_rate
        if isinstance(event, Frame) and event.opcode is Opcode.PING and rate:
            if self.pings is None:
                self.pings = TokenBucket(rate)
            if not self.pings.take() and self.closing is None and self.state is State.OPEN:
                log.warning("closing", peer=self.peer, code=4029, reason="too_many_pings")
                self.closing = self.loop.create_task(
                    self.close(p.CloseCode.RATE_LIMITED, "too_many_pings")
                )
        super().process_event(event)

    def pause_writing(self) -> None:
        super().pause_writing()
        self.stall = self.loop.call_later(self.app.settings.send_timeout, self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.stall is not None:
            self.stall.cancel()
            self.stall = None

    def _stalled(self) -> None:
        assert self.app.node is not None
        self.app.node.metrics.dropped["not_reading"] += 1
        log.warning(
            "dropping connection: client not reading",
            peer=self.peer,
            send_timeout=self.app.settings.send_timeout,
            unsent=self.transport.get_write_buffer_size(),
        )
        self.transport.abort()


class WebSocketLink:
    """A websockets connection as a :class:`tokend.session.Link`.

    ``recv`` and ``send`` hand back the library's own coroutines rather than wrapping
    them: an idle session then waits one coroutine frame less (docs/performance.md,
    idle memory), and websockets' ConnectionClosed is the link's ``closed`` error.
    """

    __slots__ = ("metrics", "ws")
    closed = ConnectionClosed

    def __init__(self, ws: ServerConnection, metrics: Metrics) -> None:
        self.ws = ws
        self.metrics = metrics

    def recv(self) -> Awaitable[bytes | str]:
        return self.ws.recv()

    def send(self, data: bytes) -> Awaitable[None]:
        return self.ws.send(data)

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


def json_response(status: http.HTTPStatus, body: Any, cache_control: str = "no-store") -> Response:
    data = json.dumps(body).encode()
    headers = Headers(
        [
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(data))),
            ("Cache-Control", cache_control),
        ]
    )
    return Response(status.value, status.phrase, headers, data)


def busy() -> Response:
    """HTTP 503 with Retry-After: the SDK and well-behaved clients back off and retry."""
    response = json_response(http.HTTPStatus.SERVICE_UNAVAILABLE, {"error": "busy"})
    response.headers["Retry-After"] = str(RETRY_AFTER_S)
    return response


def connection_budget(settings: Settings) -> int:
    """Client connections this process can hold and still open its Redis connections."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 62
    return soft - settings.redis_pool_size - FD_RESERVE


class App:
    """tokend assembled: keys, store (embedded or configured Redis), node, listener."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.embedded: EmbeddedRedis | None = None
        self.node: Node | None = None
        self.server: Server | None = None
        self.admin: AdminServer | None = None
        self.draining = False
        # TCP connections open now (WebSocket or plain HTTP), in all and per client IP,
        # kept by TokendConnection.
        self.open_connections = 0
        self.connections_per_ip: Counter[str] = Counter()
        # Beyond this many, handshakes get 503: the Redis pool must still find descriptors.
        self.max_open_connections = connection_budget(settings)

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    @property
    def pending_hellos(self) -> int:
        """Open connections that hold no session: handshaking, or before WELCOME."""
        sessions = len(self.node.sessions) if self.node is not None else 0
        return self.open_connections - sessions

    async def start(self) -> None:
        settings = self.settings
        tokens = TokenService(settings, KeyRing.open(settings.resolved_keys_dir))
        url = settings.redis_url
        if not url:
            self.embedded = EmbeddedRedis(settings.resolved_data_dir)
            await asyncio.to_thread(self.embedded.start)
            url = self.embedded.url
        self.node = Node(settings, connect(url, settings), tokens)
        self.node.metrics.connections = lambda: len(self.server.connections) if self.server else 0
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
            # Workers of one supervisor share the port; the kernel spreads connections.
            reuse_port=settings.workers > 1,
            create_connection=TokendConnection.for_app(self),
        )
        log.info(
            "listening",
            host=settings.host,
            port=self.port,
            node=self.node.name,
            redis=redact_url(url),
            max_connections=self.max_open_connections,
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

    def _handle(self, ws: ServerConnection) -> Awaitable[None]:
        """The connection's session: websockets awaits it as the handler.

        A plain function returning the session's coroutine, so that an idle
        connection waits in no frame of ours above it (the per-IP count is kept by
        :class:`TokendConnection`).
        """
        assert self.node is not None
        peer = ws.remote_address
        name = f"{peer[0]}:{peer[1]}" if peer else "?"
        return Session(self.node, WebSocketLink(ws, self.node.metrics), name).run()

    async def _http(self, connection: ServerConnection, request: Request) -> Response | None:
        assert self.node is not None
        path = request.path.partition("?")[0]
        if path == p.WS_PATH:
            cap = self.settings.max_connections_per_ip
            ip = TokendConnection.ip(connection.transport)
            # This connection is counted already: beyond the cap means more than it.
            if cap and self.connections_per_ip[ip] > cap:
                log.warning("handshake refused: connections per IP", peer=ip, cap=cap)
                return json_response(
                    http.HTTPStatus.TOO_MANY_REQUESTS, {"error": "too_many_connections"}
                )
            if self.open_connections > self.max_open_connections:
                log.warning(
                    "handshake refused: near the open-file limit",
                    connections=self.open_connections,
                    cap=self.max_open_connections,
                )
                return busy()
            # Connections without a session yet (this one among them).
            pending_cap = self.settings.max_pending_hellos
            if pending_cap and self.pending_hellos > pending_cap:
                log.warning("handshake refused: too many pending HELLOs", cap=pending_cap)
                return busy()
            return None
        if path == "/healthz":
            return json_response(*health.liveness(self.node))
        if path == "/readyz":
            return json_response(*await health.readiness(self.node, self.draining))
        if path == "/.well-known/jwks.json":
            tokens = self.node.tokens
            return json_response(http.HTTPStatus.OK, tokens.jwks(), tokens.jwks_cache_control)
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
