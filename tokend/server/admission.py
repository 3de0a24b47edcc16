"""Admission: which connections a node lets in, and the plain HTTP routes of its port.

The :class:`tokend.server.connection.Gate` of every connection the listener accepts: it
counts the open connections (in all and per client address), refuses handshakes beyond
the per-address cap (429), near the open-file limit, beyond the pending-HELLO budget or
while the node sheds every class but its best (503 with Retry-After), refuses a client
shed a moment ago before its handshake or its token check
(:class:`tokend.server.shedding.Penalties`), and answers ``/healthz``, ``/readyz`` and
``/.well-known/jwks.json`` (docs/protocol.md, "Tokens and HTTP routes"; docs/security.md
for the limits).
"""

from __future__ import annotations

import asyncio
import http
import ipaddress
import resource
import ssl
from collections import Counter
from collections.abc import Awaitable

import structlog

from tokend.config import Settings
from tokend.core import protocol as p
from tokend.core.session import Cadence
from tokend.edge.http_responses import HttpAnswer
from tokend.edge.tls import ServerCertificate
from tokend.logs import Sampled
from tokend.server import health
from tokend.server.connection import Connection
from tokend.server.node import Node
from tokend.server.shedding import Penalties

log = structlog.get_logger("tokend.admission")

# Seconds a client refused with HTTP 503 (too many pending HELLOs) is asked to wait; its
# jittered backoff spreads the retries anyway.
RETRY_AFTER_S = 1
# Descriptors kept free of client connections besides the Redis pool's: the listener,
# pub/sub, key files, logs, the embedded Redis's pipes.
FD_RESERVE = 32


def busy(retry_after: int = RETRY_AFTER_S) -> HttpAnswer:
    """HTTP 503 asking the client to come back after ``retry_after`` seconds."""
    return HttpAnswer(
        http.HTTPStatus.SERVICE_UNAVAILABLE,
        {"error": "busy"},
        (("Retry-After", str(retry_after)),),
    )


BUSY = busy()


def connection_budget(settings: Settings) -> int:
    """Client connections this process can hold and still open its Redis connections and
    every admin connection the admin listener may hold (``admin_max_connections``)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 62
    admin = settings.admin_max_connections if settings.admin_port >= 0 else 0
    return soft - settings.redis_pool_size - admin - FD_RESERVE


class Admission:
    """The connections of one listener: who gets in, and the HTTP routes of the port.

    ``draining`` is set by the drain (:class:`tokend.server.drain.Drain`): ``/readyz`` then
    answers 503.
    """

    def __init__(
        self, settings: Settings, node: Node, certificate: ServerCertificate | None
    ) -> None:
        self.settings = settings
        self.node = node
        self.certificate = certificate
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
        self.all_closed = asyncio.Event()  # set whenever the last connection closes
        # Beyond this many, handshakes get 503: the Redis pool must still find descriptors.
        self.max_open_connections = connection_budget(settings)
        # Load balancers whose connections begin with a PROXY protocol header.
        self.proxy_networks = settings.proxy_networks
        self.penalties = Penalties(settings.shed_penalty, node.shedder)
        self.overload_log = Sampled(log)  # refusals that come by the thousand

    @property
    def pending_hellos(self) -> int:
        """Open connections that hold no session: handshaking, or before WELCOME."""
        return len(self.connections) - len(self.node.sessions)

    # tokend.server.connection.Gate

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
            self.all_closed.set()

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

    def shed(self, connection: Connection) -> None:
        """The node shed this connection's session (close 1013): its client is refused
        for ``shed_penalty`` by address, and by ``sub`` if its token's signature was
        checked (a HELLO shed before it was is not: a forgery naming another's ``sub``
        must not get that client refused; its own address is the forger's)."""
        session = connection.session
        assert session is not None and session.claims is not None
        sub = session.claims.sub if session.verified else None
        self.penalties.add(connection.ip, sub, session.claims.prio)

    def refuses_hello(self, token: str) -> bool:
        """Whether a HELLO is refused (1013) before its token is checked: its ``sub`` was
        shed a moment ago."""
        if self.penalties.refuses(token):
            self.node.metrics.shed_handshakes += 1
            return True
        return False

    def answer(self, ip: str, path: str) -> HttpAnswer | Awaitable[HttpAnswer] | None:
        if path == p.WS_PATH:
            return self._admit(ip)
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

    def _admit(self, ip: str) -> HttpAnswer | None:
        """None to go on with the WebSocket handshake, else the refusal."""
        cap = self.settings.max_connections_per_ip
        # This connection is counted already: beyond the cap means more than it.
        if cap and self.connections_per_ip[ip] > cap:
            log.warning("handshake refused: connections per IP", peer=ip, cap=cap)
            self.node.metrics.refused(429, "per_ip")
            return HttpAnswer(http.HTTPStatus.TOO_MANY_REQUESTS, {"error": "too_many_connections"})
        if self.node.shedder.saturated:
            # Not logged one by one: the node logs its shedding steps.
            self.node.metrics.shed_handshakes += 1
            self.node.metrics.refused(503, "shedding")
            return BUSY
        if self.penalties.by_ip and (wait := self.penalties.retry_after(ip)) is not None:
            # Shed a moment ago: counted, not logged one by one, as the shedding itself.
            self.node.metrics.shed_handshakes += 1
            self.node.metrics.refused(503, "penalty")
            return busy(wait)
        if len(self.connections) > self.max_open_connections:
            self.overload_log.warning(
                "handshake refused: near the open-file limit",
                connections=len(self.connections),
                cap=self.max_open_connections,
            )
            self.node.metrics.refused(503, "open_files")
            return BUSY
        # Connections without a session yet (this one among them).
        pending_cap = self.settings.max_pending_hellos
        if pending_cap and self.pending_hellos > pending_cap:
            self.overload_log.warning("handshake refused: too many pending HELLOs", cap=pending_cap)
            self.node.metrics.refused(503, "pending_hellos")
            return BUSY
        return None
