"""The tokend server: the listener, its HTTP routes, limits and drain.

It serves, on one port, the WebSocket endpoint ``/v1/ws`` (RFC 6455, subprotocol
``tokend.v1``) and a few plain HTTP GET routes answered from the opening
handshake (``/healthz``, ``/readyz``, ``/.well-known/jwks.json``). Every accepted
socket is a :class:`tokend.connection.Connection` (the one module that knows
websockets) on uvloop. Beside it runs the admin listener (:mod:`tokend.admin`:
metrics, admin API, dashboard). On SIGTERM the node drains (docs/operations.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import http
import ipaddress
import resource
import signal
import ssl
from collections import Counter
from collections.abc import Awaitable

import structlog

from tokend import activation, health
from tokend import protocol as p
from tokend.admin import AdminServer
from tokend.config import Settings
from tokend.connection import CLOSE_TIMEOUT, Connection
from tokend.embedded import EmbeddedRedis
from tokend.http_answer import HttpAnswer
from tokend.logs import redact_url
from tokend.node import Node
from tokend.session import Cadence
from tokend.store.redis_client import open_client
from tokend.tls import ServerCertificate
from tokend.tokens import KeyRing, TokenService

log = structlog.get_logger("tokend.server")

# Least time between two batches of a drain's closes.
DRAIN_TICK = 0.05

# Seconds a client refused with HTTP 503 (too many pending HELLOs) is asked to wait; its
# jittered backoff spreads the retries anyway.
RETRY_AFTER_S = 1
# Descriptors kept free of client connections besides the Redis pool's: the listener,
# pub/sub, key files, logs, the embedded Redis's pipes.
FD_RESERVE = 32

BUSY = HttpAnswer(
    http.HTTPStatus.SERVICE_UNAVAILABLE, {"error": "busy"}, (("Retry-After", str(RETRY_AFTER_S)),)
)


def connection_budget(settings: Settings) -> int:
    """Client connections this process can hold and still open its Redis connections and
    every admin connection the admin listener may hold (``admin_max_connections``)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 62
    admin = settings.admin_max_connections if settings.admin_port >= 0 else 0
    return soft - settings.redis_pool_size - admin - FD_RESERVE


class App:
    """tokend assembled: keys, store (embedded or configured Redis), node, listener.

    It is the :class:`tokend.connection.Gate` of its connections.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.embedded: EmbeddedRedis | None = None
        self.node: Node = None  # type: ignore[assignment]  # set by start()
        self.server: asyncio.Server | None = None
        self.admin: AdminServer | None = None
        self.draining = False
        self.cadence = Cadence(
            settings.ms("heartbeat_interval"),
            settings.ms("warn_after"),
            settings.ms("expire_after"),
            settings.max_frame_rate,
        )
        # None admits handshakes without Origin: only browsers send one.
        self.origins = [None, *settings.origin_list] if settings.origin_list else None
        # TCP connections open now (WebSocket or plain HTTP), in all and per client IP.
        self.connections: set[Connection] = set()
        self.connections_per_ip: Counter[str] = Counter()
        self._all_closed = asyncio.Event()
        # Beyond this many, handshakes get 503: the Redis pool must still find descriptors.
        self.max_open_connections = connection_budget(settings)
        # Load balancers whose connections begin with a PROXY protocol header.
        self.proxy_networks = settings.proxy_networks
        self.certificate: ServerCertificate | None = None  # on a TLS port (start())

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    @property
    def pending_hellos(self) -> int:
        """Open connections that hold no session: handshaking, or before WELCOME."""
        sessions = len(self.node.sessions) if self.node is not None else 0
        return len(self.connections) - sessions

    async def start(self) -> None:
        settings = self.settings
        # First: the LISTEN_* variables must not reach the embedded Redis.
        inherited = activation.take_inherited()
        if settings.tls_cert_file:
            self.certificate = ServerCertificate(settings.tls_cert_file, settings.tls_key_file)
        tokens = TokenService(settings, KeyRing.open(settings.resolved_keys_dir))
        url = settings.redis_url
        if not url:
            self.embedded = EmbeddedRedis(settings.resolved_data_dir)
            await asyncio.to_thread(self.embedded.start)
            url = self.embedded.url
        self.node = Node(settings, open_client(url, settings), tokens)
        self.node.metrics.connections = lambda: len(self.connections)
        await self.node.start()
        if self.certificate is not None:
            self.node.background.spawn(
                self.certificate.watch(settings.tls_reload_interval, self.node.metrics), "tls"
            )
        if settings.admin_port >= 0 or inherited.admin is not None:
            self.admin = AdminServer(self.node, lambda: self.draining, sock=inherited.admin)
            await self.admin.start()
        loop = asyncio.get_running_loop()
        if inherited.main is not None:
            # Socket activation, or a worker of a supervisor: the socket outlives this
            # process, and host and port are whatever it was bound to.
            self.server = await loop.create_server(
                lambda: Connection(self), sock=inherited.main, backlog=settings.backlog
            )
        else:
            self.server = await loop.create_server(
                lambda: Connection(self), settings.host, settings.port, backlog=settings.backlog
            )
        address = self.server.sockets[0].getsockname()
        log.info(
            "listening",
            host=address[0],
            port=address[1],
            inherited=inherited.main is not None,
            scheme="https" if self.certificate is not None else "http",
            proxy_protocol_from=settings.proxy_protocol_from or None,
            redis=redact_url(url),
            max_connections=self.max_open_connections,
        )

    # The connections' gate (tokend.connection.Gate)

    def opened(self, connection: Connection) -> None:
        self.connections.add(connection)

    def addressed(self, connection: Connection) -> None:
        assert connection.ip is not None
        self.connections_per_ip[connection.ip] += 1

    def closed(self, connection: Connection) -> None:
        self.connections.discard(connection)
        ip = connection.ip
        if ip is not None:  # counted (a balancer's connection is not before its header)
            self.connections_per_ip[ip] -= 1
            if not self.connections_per_ip[ip]:
                del self.connections_per_ip[ip]
        if not self.connections:
            self._all_closed.set()

    def expects_proxy_header(self, peer_ip: str) -> bool:
        if not self.proxy_networks:
            return False
        try:
            address = ipaddress.ip_address(peer_ip)
        except ValueError:
            return False
        return any(address in network for network in self.proxy_networks)

    def tls_context(self) -> ssl.SSLContext | None:
        return self.certificate.context if self.certificate is not None else None

    def answer(self, ip: str, path: str) -> HttpAnswer | Awaitable[HttpAnswer] | None:
        if path == p.WS_PATH:
            cap = self.settings.max_connections_per_ip
            # This connection is counted already: beyond the cap means more than it.
            if cap and self.connections_per_ip[ip] > cap:
                log.warning("handshake refused: connections per IP", peer=ip, cap=cap)
                return HttpAnswer(
                    http.HTTPStatus.TOO_MANY_REQUESTS, {"error": "too_many_connections"}
                )
            if self.node.shedder.saturated:
                # Not logged one by one: the node logs its shedding steps.
                self.node.metrics.shed_handshakes += 1
                return BUSY
            if len(self.connections) > self.max_open_connections:
                log.warning(
                    "handshake refused: near the open-file limit",
                    connections=len(self.connections),
                    cap=self.max_open_connections,
                )
                return BUSY
            # Connections without a session yet (this one among them).
            pending_cap = self.settings.max_pending_hellos
            if pending_cap and self.pending_hellos > pending_cap:
                log.warning("handshake refused: too many pending HELLOs", cap=pending_cap)
                return BUSY
            return None
        if path == "/healthz":
            return health.liveness(self.node)
        if path == "/readyz":
            return health.readiness(self.node, self.draining)
        if path == "/.well-known/jwks.json":
            tokens = self.node.tokens
            return HttpAnswer(
                http.HTTPStatus.OK,
                tokens.jwks(),
                (("Cache-Control", tokens.jwks_cache_control),),
            )
        return HttpAnswer(http.HTTPStatus.NOT_FOUND, {"error": "not_found", "path": path})

    # Shutdown

    async def drain(self, hurry: asyncio.Event) -> None:
        """Stop accepting, then close connections with 1001 spread over ``drain_period``.

        Connections are closed in batches, one every :data:`DRAIN_TICK` or so, so that
        their clients do not all reconnect (to other nodes) at once; sessions stay
        resumable, each parked before its client is told (:meth:`tokend.node.Node.going_away`:
        one round trip per batch, none more once Redis failed to answer one). Once
        ``hurry`` is set, the rest are closed at once.
        """
        assert self.server is not None
        self.draining = True
        self.server.close()
        connections = list(self.connections)
        period = self.settings.drain_period
        n = len(connections)
        ticks = max(1, min(n, int(period / DRAIN_TICK)))
        log.info("draining", connections=n, period=period)
        park_first = True
        for tick in range(ticks):
            if hurry.is_set():
                log.warning("second signal: closing every connection now")
            end = n if hurry.is_set() else (tick + 1) * n // ticks
            batch = connections[tick * n // ticks : end]
            if not await self.node.going_away(batch, wait=park_first and not hurry.is_set()):
                park_first = False  # Redis did not answer: the rest close without waiting
            if end == n:
                break
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(period / ticks):
                    await hurry.wait()
        await self._closed_within(CLOSE_TIMEOUT + 1)

    async def _closed_within(self, seconds: float) -> None:
        """Wait until every connection is gone (each closing handshake has its own
        deadline); after ``seconds``, drop what is left."""
        if self.connections:
            self._all_closed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(seconds):
                    await self._all_closed.wait()
        for connection in list(self.connections):
            if connection.transport is not None:
                connection.transport.abort()
        if self.connections:
            # Each aborted connection ends at the loop's next turn (connection_lost), where
            # its node is told to release its session: before the node stops, not after.
            self._all_closed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1):
                    await self._all_closed.wait()

    async def stop(self) -> None:
        """Stop accepting, close connections with 1001 (sessions stay resumable)."""
        if self.server is not None:
            self.draining = True
            self.server.close()
            await self.node.going_away(list(self.connections))
            await self._closed_within(CLOSE_TIMEOUT + 1)
            await self.server.wait_closed()
        if self.admin is not None:
            await self.admin.stop()
        if self.node is not None:
            await self.node.stop()
        if self.embedded is not None:
            await self.embedded.astop()
        log.info("stopped")


async def serve_until_signalled(settings: Settings, *, worker: bool = False) -> None:
    """Run until SIGTERM or SIGINT, then drain and stop; a second signal hurries the drain.

    Whoever started the process and asked for it (``NOTIFY_SOCKET``: systemd with
    ``Type=notify``, or the supervisor of ``--workers``) hears ``READY=1`` once it listens
    and its node is subscribed, ``STOPPING=1`` when the drain begins and
    ``X_TOKEND_DRAINED=1`` when it has closed every connection. A supervisor's ``worker``
    stops accepting on SIGUSR1 (a reload: its slot has a new worker) and keeps serving its
    connections until SIGTERM.
    """
    notifier = activation.Notifier.from_environ()
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
    loop.add_signal_handler(signal.SIGHUP, _cannot_reload)
    if worker:
        loop.add_signal_handler(activation.STOP_ACCEPTING, _stop_accepting, app)
    ready = asyncio.ensure_future(_report_ready(app, notifier))
    try:
        await stopping.wait()
        ready.cancel()
        notifier.notify(STOPPING="1")
        log.info("signal received, draining", drain_period=settings.drain_period)
        await app.drain(hurry)
        notifier.notify(**{activation.DRAINED: "1"})
    finally:
        await app.stop()


async def _report_ready(app: App, notifier: activation.Notifier) -> None:
    """``READY=1`` once the node is subscribed to its control channel (the node starts
    without it when Redis is down, and keeps trying)."""
    await app.node.subscribed.wait()
    notifier.notify(READY="1", STATUS=f"serving on port {app.port}")


def _stop_accepting(app: App) -> None:
    assert app.server is not None
    log.info("stopped accepting: the slot's new worker accepts", connections=len(app.connections))
    app.server.close()  # this process's copy of the socket; the supervisor keeps it


def _cannot_reload() -> None:
    log.warning(
        "SIGHUP ignored",
        reason="one process cannot replace itself: run several under a supervisor "
        "(--workers) and use tokend reload, or restart it under socket activation "
        "(docs/operations.md)",
    )
