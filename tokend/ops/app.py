"""The tokend server: its parts assembled, and the process's signals.

It serves, on one port, the WebSocket endpoint ``/v1/ws`` (RFC 6455, subprotocol
``tokend.v1``) and a few plain HTTP GET routes answered from the opening handshake
(:mod:`tokend.server.admission`: limits and routes). Every accepted socket is a
:class:`tokend.server.connection.Connection` (its bytes through the edge's Sans-I/O layers:
PROXY header, TLS, handshake, RFC 6455 frames) on uvloop. Beside it runs the admin
listener (:mod:`tokend.ops.admin`: metrics, admin API, dashboard). On SIGTERM the node
drains (:mod:`tokend.server.drain`, docs/operations.md).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
from collections import Counter

import structlog

from tokend.config import Settings
from tokend.edge.tls import ServerCertificate
from tokend.logs import redact_url
from tokend.ops import activation
from tokend.ops.admin import AdminServer
from tokend.ops.collector import Collector
from tokend.ops.embedded import EmbeddedRedis
from tokend.ops.monitor import Monitor
from tokend.server.admission import Admission
from tokend.server.connection import Connection
from tokend.server.drain import AcceptQueue, Drain
from tokend.server.handoff import Giver, Taker
from tokend.server.node import Node
from tokend.store.redis_client import open_client
from tokend.tokens.keys import KeyRing
from tokend.tokens.service import TokenService

log = structlog.get_logger("tokend.server")


class App:
    """tokend assembled: keys, store (embedded or configured Redis), node, admin
    listener, the listener with its :class:`tokend.server.admission.Admission` (the connections'
    gate) and the :class:`tokend.server.drain.Drain` that closes them."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.embedded: EmbeddedRedis | None = None
        self._node: Node | None = None  # set by start()
        self.admission: Admission | None = None  # set by start()
        self.server: asyncio.Server | None = None
        self.admin: AdminServer | None = None
        self.monitor: Monitor | None = None  # set by start()
        # Set when this worker stopped accepting for a reload (its slot has a new one).
        self.accept_queue: AcceptQueue | None = None
        self.replaced = False
        # A copy of the listening socket kept when it stopped accepting: a reload whose
        # new worker failed during the handoff accepts on it again.
        self.listener_copy: socket.socket | None = None
        # The share of its connections an old worker still held after its handoff (what
        # fell back): its drain spreads their 1001s over that share of reload_drain_period.
        self.left_share = 1.0
        self.channel: socket.socket | None = None  # a worker's, to its supervisor
        self.handoffs: set[asyncio.Task[None]] = set()

    @property
    def node(self) -> Node:
        """The node, made by :meth:`start`."""
        assert self._node is not None, "not started"
        return self._node

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    @property
    def connections(self) -> set[Connection]:
        """The connections open now (the admission's)."""
        return self.admission.connections if self.admission is not None else set()

    @property
    def connections_per_ip(self) -> Counter[str]:
        return self.admission.connections_per_ip if self.admission is not None else Counter()

    async def start(self) -> None:
        settings = self.settings
        # First: the LISTEN_* variables must not reach the embedded Redis.
        inherited = activation.take_inherited()
        self.channel = inherited.supervisor
        certificate = None
        if settings.tls_cert_file:
            certificate = ServerCertificate(settings.tls_cert_file, settings.tls_key_file)
        tokens = TokenService(settings, KeyRing.open(settings.resolved_keys_dir))
        url = settings.redis_url
        if not url:
            self.embedded = EmbeddedRedis(settings.resolved_data_dir)
            await asyncio.to_thread(self.embedded.start)
            url = self.embedded.url
        node = self._node = Node(settings, open_client(url, settings), tokens)
        admission = self.admission = Admission(settings, node, certificate)
        node.metrics.connections = lambda: len(admission.connections)
        await node.start()
        # The node's look at itself and its history: the dashboard's, /metrics' health.
        self.monitor = Monitor(node, admission)
        node.background.spawn(self.monitor.run(lambda: node.running), "monitor")
        if certificate is not None:
            node.background.spawn(
                certificate.watch(settings.tls_reload_interval, node.metrics), "tls"
            )
        if settings.admin_port >= 0 or inherited.admin is not None:
            self.admin = AdminServer(self.monitor, sock=inherited.admin)
            await self.admin.start()
        loop = asyncio.get_running_loop()
        if inherited.main is not None:
            # Socket activation, or a worker of a supervisor: the socket outlives this
            # process, and host and port are whatever it was bound to.
            self.server = await loop.create_server(
                lambda: Connection(admission), sock=inherited.main, backlog=settings.backlog
            )
        else:
            self.server = await loop.create_server(
                lambda: Connection(admission),
                settings.host,
                settings.port,
                backlog=settings.backlog,
            )
        address = self.server.sockets[0].getsockname()
        log.info(
            "listening",
            host=address[0],
            port=address[1],
            inherited=inherited.main is not None,
            scheme="https" if certificate is not None else "http",
            proxy_protocol_from=settings.proxy_protocol_from or None,
            redis=redact_url(url),
            max_connections=admission.max_open_connections,
        )

    async def drain(self, hurry: asyncio.Event) -> None:
        """Stop accepting, then close connections with 1001 spread over ``drain_period``
        (``reload_drain_period`` for an old worker of a reload: one that was told to stop
        accepting first); once ``hurry`` is set, the rest at once
        (:class:`tokend.server.drain.Drain`)."""
        await self._drain(self.drain_period, hurry)

    @property
    def drain_period(self) -> float:
        settings = self.settings
        if self.replaced:
            return settings.reload_drain_period * self.left_share
        return settings.drain_period

    def stop_accepting(self) -> None:
        """A reload's new worker accepts for this one's slot: stop accepting, keep serving
        the connections open until the drain, and watch the new workers' accept queue."""
        assert self.server is not None
        if self.replaced:  # SIGUSR1 and the handoff's message both ask it
            return
        connections = len(self.connections)
        log.info("stopped accepting: the slot's new worker accepts", connections=connections)
        self.replaced = True
        self.listener_copy = socket.socket(fileno=os.dup(self.server.sockets[0].fileno()))
        if self.settings.reload_accept_queue:
            self.accept_queue = AcceptQueue(
                self.server.sockets[0].fileno(), self.settings.reload_accept_queue
            )
        self.server.close()  # this process's copy of the socket; the supervisor keeps it

    async def accept_again(self) -> None:
        """The reload's new worker failed: this worker serves its slot again."""
        if not self.replaced or self.listener_copy is None or self.admission is None:
            return
        admission = self.admission
        self.server = await asyncio.get_running_loop().create_server(
            lambda: Connection(admission), sock=self.listener_copy, backlog=self.settings.backlog
        )
        self.listener_copy = None
        self.replaced = False
        if self.accept_queue is not None:
            self.accept_queue.close()
            self.accept_queue = None
        log.info("accepting again: the slot's new worker failed")

    # The supervisor's channel (a worker's)

    def listen_to_supervisor(self) -> None:
        if self.channel is not None:
            asyncio.get_running_loop().add_reader(self.channel, self._supervisor_said)

    def _supervisor_said(self) -> None:
        assert self.channel is not None
        while (received := activation.receive_message(self.channel)) is not None:
            fields, fds = received
            if not fields:  # the supervisor is gone: PR_SET_PDEATHSIG stops this process
                asyncio.get_running_loop().remove_reader(self.channel)
                return
            if fields.get(activation.ACCEPT) == "1":
                self.node.spawn(self.accept_again())
            if not fds:
                continue
            sock = socket.socket(fileno=fds[0])
            for fd in fds[1:]:
                os.close(fd)
            op = fields.get(activation.HANDOFF)
            if op == "take" and self.admission is not None:
                Taker(self.admission, self.node, sock, self._taking).start()
            elif op == "give":
                task = asyncio.ensure_future(self._give(sock, fields.get("TO", "")))
                self.handoffs.add(task)
                task.add_done_callback(self.handoffs.discard)
            else:
                sock.close()

    def _taking(self) -> bool:
        """Whether this worker takes handed-over connections: not once it drains."""
        return self.admission is not None and not self.admission.draining

    async def _give(self, sock: socket.socket, new_node: str) -> None:
        """Hand every connection over to the slot's new worker (tokend.server.handoff), then
        tell the supervisor what moved and what fell back."""
        assert self.admission is not None
        if not self.replaced:
            self.stop_accepting()
        connections = self.admission.connections
        before = len(connections)
        report = await Giver(connections, self.node, sock, new_node).run()
        self.left_share = (before - report.moved) / before if before else 0.0
        if report.fell_back.get("new_worker_failed"):
            # It may have died: serve the slot again (harmless if it lives: both accept,
            # and the reload's drain stops this one).
            await self.accept_again()
        if self.channel is not None:
            activation.send_message(
                self.channel, {activation.HANDED: json.dumps(report.as_fields())}
            )

    async def _drain(self, period: float, hurry: asyncio.Event) -> None:
        assert self.server is not None and self.admission is not None
        drain = Drain(self.admission, self.node, self.server, self.accept_queue)
        await drain.run(period, hurry)

    async def stop(self) -> None:
        """Stop accepting, close connections with 1001 at once (sessions stay resumable),
        stop the node and the embedded Redis."""
        if self.server is not None:
            await self._drain(0.0, asyncio.Event())
            await self.server.wait_closed()
        if self.admin is not None:
            await self.admin.stop()
        if self._node is not None:
            await self._node.stop()
        if self.embedded is not None:
            await self.embedded.astop()
        if self.accept_queue is not None:
            self.accept_queue.close()
        if self.listener_copy is not None:
            self.listener_copy.close()
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
    stopping, hurry = asyncio.Event(), asyncio.Event()

    def signalled() -> None:
        (hurry if stopping.is_set() else stopping).set()

    # Before the start, so that a signal during it stops the process cleanly once started
    # (uncaught, SIGTERM would kill it with the start half done).
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signalled)
    loop.add_signal_handler(signal.SIGHUP, _cannot_reload)
    try:
        await app.start()
    except BaseException:
        await app.stop()  # the embedded Redis, if it had started
        raise
    # Garbage collected on the node's schedule, start-up objects out of every pass.
    collector = Collector(
        settings.gc_interval, settings.gc_full_interval, app.node.metrics.gc_seconds
    )
    collector.start()
    app.node.background.spawn(collector.run(lambda: app.node.running), "collector")
    if worker:
        loop.add_signal_handler(activation.STOP_ACCEPTING, app.stop_accepting)
        app.listen_to_supervisor()
    ready = asyncio.ensure_future(_report_ready(app, notifier))
    try:
        await stopping.wait()
        ready.cancel()
        notifier.notify(STOPPING="1")
        for handoff in list(app.handoffs):
            await handoff  # bounded: its replies time out
        log.info("signal received, draining", drain_period=app.drain_period)
        await app.drain(hurry)
        notifier.notify(**{activation.DRAINED: "1"})
    finally:
        await app.stop()


async def _report_ready(app: App, notifier: activation.Notifier) -> None:
    """``READY=1`` once the node is subscribed to its control channel (the node starts
    without it when Redis is down, and keeps trying)."""
    await app.node.subscribed.wait()
    notifier.notify(READY="1", STATUS=f"serving on port {app.port}")


def _cannot_reload() -> None:
    log.warning(
        "SIGHUP ignored",
        reason="one process cannot replace itself: run several under a supervisor "
        "(--workers) and use tokend reload, or restart it under socket activation "
        "(docs/operations.md)",
    )
