"""One client connection, an asyncio.Protocol: its bytes through the stages of a
connection, in order, each a layer of its own, then its session.

1. The PROXY protocol header (:mod:`tokend.edge.proxy_protocol`) of a trusted balancer's
   connection, and none from anyone else.
2. TLS (:mod:`tokend.edge.tls`) on a TLS port: the TLS layer takes the transport and
   hands this protocol the decrypted bytes.
3. The opening handshake (:class:`tokend.edge.handshake.Handshake`): the request's head,
   the gate's own HTTP answer (:mod:`tokend.edge.http_responses`) or the 101.
4. WebSocket frames (:class:`tokend.edge.websocket.WebSocket`, RFC 6455): whole binary
   messages, pings, the closing handshake. A read that is one whole heartbeat frame at a
   frame boundary is unmasked here (see :meth:`Connection.data_received`).
5. The session: each message goes to the connection's
   :class:`tokend.server.link.SessionLink`, which decodes it for its
   :class:`tokend.core.session.Session` and carries out what the session answers: frames
   to send, a round trip of the node (:class:`tokend.server.seams.Node`), a close.

``Connection.stage`` is where the next bytes go; each stage hands what follows its part
to the next. No task and no coroutine waits for an idle connection: it is this object,
its WebSocket, its link, its session and its socket. Heartbeats are answered from the
node's batch flush, which calls
:meth:`tokend.server.link.SessionLink.heartbeats_stored` (one write per connection per
flush). The node sees the link as a :class:`tokend.server.seams.SessionLink`; this module
imports neither the node nor the store.

A connection may be handed to another process between two frames, its socket and
session going on there without the client seeing anything: :attr:`Connection.quiet`,
:meth:`Connection.hand_off` here, :meth:`Connection.adopt` there.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, cast

import structlog
from websockets.http11 import Response

from tokend.core import protocol as p
from tokend.core.session import OVERLOADED, Close, Phase, Session, TokenBucket
from tokend.edge import http_responses, proxy_protocol, tls
from tokend.edge.handshake import Handshake
from tokend.edge.http_responses import HttpAnswer
from tokend.edge.websocket import (
    PING,
    SHORT_BINARY_HEADS,
    TEXT,
    State,
    WebSocket,
    binary_frame,
    unmask,
)
from tokend.edge.websocket import (
    Close as ClientClose,
)
from tokend.server import seams
from tokend.server.link import READ_PAUSE_AT, SessionLink, bound_logger

if TYPE_CHECKING:
    from tokend.config import Settings
    from tokend.core.session import Cadence

# Write buffer limits (bytes): above HIGH the client is not reading (see pause_writing).
WRITE_HIGH = 32 * 1024
WRITE_LOW = 8 * 1024
# Seconds to wait for the client's part of the closing handshake before dropping it.
CLOSE_TIMEOUT = 2.0
# The first two bytes of a client's heartbeat as one whole WebSocket frame (RFC 6455
# 5.2): FIN and opcode 2 (binary); MASK set and payload length 50. Then the 4-byte
# masking key and the 50 masked bytes: 56 in all. See Connection.data_received.
HEARTBEAT_FRAME_HEAD = (0x82, 0x80 | p.HEARTBEAT_LENGTH)
HEARTBEAT_FRAME_LENGTH = 2 + 4 + p.HEARTBEAT_LENGTH
_HEARTBEAT_BYTE_0, _HEARTBEAT_BYTE_1 = HEARTBEAT_FRAME_HEAD
# Bytes of one read handed to the frame layer at a time (see Connection._frames).
READ_SLICE = 4096
_OPEN, _CLOSED = State.OPEN, Phase.CLOSED


class Gate(Protocol):
    """What a connection asks of the server that accepted it."""

    settings: Settings
    cadence: Cadence

    @property
    def node(self) -> seams.Node:
        """The node the connection's session is served by."""
        ...

    @property
    def origins(self) -> Sequence[str | None] | None:
        """Acceptable Origin headers (None among them: no header), or None for any."""
        ...

    def opened(self, connection: Connection) -> None:
        """A TCP connection was accepted (its client address may not be known yet)."""
        ...

    def addressed(self, connection: Connection) -> None:
        """The connection's client address, ``connection.ip``, is known."""
        ...

    def closed(self, connection: Connection) -> None: ...

    def expects_proxy_header(self, peer_ip: str) -> bool:
        """Whether a connection from this TCP peer must begin with a PROXY header."""
        ...

    def tls_context(self) -> ssl.SSLContext | None:
        """The TLS context new connections begin with; None on a plain port."""
        ...

    def answer(self, ip: str, path: str) -> HttpAnswer | Awaitable[HttpAnswer] | None:
        """None to go on with the WebSocket handshake, else the HTTP answer to give."""
        ...

    def shed(self, connection: Connection) -> None:
        """The node shed the connection's verified session (close 1013, overloaded)."""
        ...

    def refuses_hello(self, token: str) -> bool:
        """Whether a HELLO is refused (1013) before its token is checked."""
        ...


class Handed(NamedTuple):
    """What a connection handed to another process takes along (:meth:`Connection.hand_off`,
    :meth:`Connection.adopt`)."""

    socket: socket.socket
    session: Session  # WELCOMEd, OPEN, no heartbeat waiting for the store
    unparsed: bytes  # the beginning of the WebSocket's next frame
    address: tuple[str, int] | None  # the client's from a PROXY header; None: the TCP peer


class Connection(asyncio.Protocol):
    """A client's TCP connection, from accept to close: its socket and its WebSocket.

    Invariants: ``link`` and ``websocket`` are set once the handshake succeeded (by
    :meth:`adopt` for a connection handed over); its session's phase CLOSED means a
    close frame was sent (or the WebSocket failed), after which nothing but the closing
    handshake is written. Outside :meth:`data_received` the current stage has nothing
    left to send: whatever it is given to send (a close) is written at once.
    """

    __slots__ = (
        "address",
        "closing",
        "deadline",
        "fast_path",
        "gate",
        "handshake",
        "held",
        "ip",
        "link",
        "moving",
        "paused",
        "pings",
        "preface",
        "stage",
        "stall",
        "transport",
        "websocket",
    )

    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        # Where the next bytes go: a function of this class (a bound method would make
        # a cycle through the connection), the stages in order.
        self.stage: Callable[[Connection, bytes], None] = Connection._preface
        self.transport: asyncio.Transport | None = None
        self.handshake: Handshake | None = Handshake(gate.origins)  # until the 101
        self.websocket: WebSocket | None = None  # once the WebSocket handshake succeeded
        self.link: SessionLink | None = None  # with the WebSocket
        # A read of one whole heartbeat frame is unmasked by data_received itself (off
        # in tests, to compare with the frame layer's general path).
        self.fast_path = gate.settings.max_message_size >= p.HEARTBEAT_LENGTH
        # The client's address (the per-IP counts key), once known: at accept, or from
        # the PROXY header of a trusted balancer's connection (None until then).
        self.ip: str | None = None
        # The connection's first bytes while it is undecided what they are (see
        # _preface).
        self.preface = b""
        # The client's (host, port) where the transport cannot tell it: from a PROXY
        # header, or kept when TLS begins (its transport forgets the peer once closed,
        # before the last log line). None: read the TCP peer's from the transport.
        self.address: tuple[str, int] | None = None
        # The hello timer until WELCOME, then the closing handshake's deadline.
        self.deadline: asyncio.TimerHandle | None = None
        self.closing = False  # the deadline is the closing handshake's
        self.stall: asyncio.TimerHandle | None = None  # armed while writes are paused
        self.pings: TokenBucket | None = None  # made at the first ping
        self.paused = False  # reading paused by us (see pause_writing and READ_PAUSE_AT)
        # Reading held while the node sheds (hold_reading): the timer that resumes it.
        self.held: asyncio.TimerHandle | None = None
        # Being handed to a reload's new worker: reading held (tokend.server.handoff).
        self.moving = False

    @classmethod
    def adopt(
        cls,
        gate: Gate,
        session: Session,
        unparsed: bytes = b"",
        address: tuple[str, int] | None = None,
    ) -> Connection:
        """A connection another process handed over (:meth:`hand_off`), to be given its
        socket: ``loop.connect_accepted_socket(lambda: connection, sock)``.

        It begins at its WebSocket's frames with ``session`` (WELCOMEd, its phase OPEN:
        the new node holds it once the connection is made), ``unparsed`` the bytes of a
        frame begun (read first), ``address`` the client's as a PROXY header gave it.
        """
        connection = cls(gate)
        connection.stage = Connection._adopted
        connection.handshake = None
        connection.address = address
        connection.preface = unparsed
        connection.link = SessionLink(connection, gate.node, session)
        return connection

    @property
    def session(self) -> Session | None:
        """The connection's session core, once the WebSocket handshake succeeded."""
        return self.link.session if self.link is not None else None

    @property
    def log(self) -> structlog.typing.FilteringBoundLogger:
        """This connection's logger: its session's, bound once at WELCOME; before that
        (the opening, HELLO: few lines) bound per line with what is known."""
        link = self.link
        if link is not None and link.log is not None:
            return link.log
        return bound_logger(self.peer, link.session if link is not None else None)

    @property
    def peer(self) -> str:
        """The client's address and port, for logs: a PROXY header's, else the TCP
        peer's."""
        peer = self.address or self._tcp_peer()
        return f"{peer[0]}:{peer[1]}" if peer else "?"

    def _tcp_peer(self) -> tuple[str, int] | None:
        return self.transport.get_extra_info("peername") if self.transport else None

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Called by the listener with the accepted TCP connection; on a TLS port, called
        again by the TLS layer with the decrypted transport once its handshake is done."""
        transport = cast(asyncio.Transport, transport)
        transport.set_write_buffer_limits(WRITE_HIGH, WRITE_LOW)
        if self.transport is not None:
            self.transport = transport  # TLS: from here on, write through it
            return
        self.transport = transport
        self.gate.opened(self)
        if self.stage is Connection._adopted:
            self._adopted(b"")
            return
        peer = self._tcp_peer()
        if not peer:
            self._addressed("?")
        elif not self.gate.expects_proxy_header(peer[0]):
            self._addressed(peer[0])
        # The opening (PROXY header, TLS and WebSocket handshakes) and then HELLO must
        # each come within hello_timeout.
        self._arm(self.gate.settings.hello_timeout, self._hello_timed_out)

    def _addressed(self, ip: str) -> None:
        # One string per client address, not per connection (the per-IP counts key).
        self.ip = sys.intern(ip)
        self.gate.addressed(self)

    def data_received(self, data: bytes) -> None:
        """Bytes from the client, to the connection's current stage.

        Fast path: a read that is exactly one whole, unfragmented, masked binary frame of
        a heartbeat's size, while the WebSocket is at a frame boundary, is unmasked here
        and handed on as the frame layer would hand it (its only effect on the frame
        layer would be to leave it at a frame boundary; a close it leads to is written
        by :meth:`close_with`). tests/test_connection.py holds this path equal, byte for
        byte and event for event, to the frame layer's on split, coalesced, fragmented
        and interleaved-control input.
        """
        if (
            len(data) == HEARTBEAT_FRAME_LENGTH
            and data[0] == _HEARTBEAT_BYTE_0
            and data[1] == _HEARTBEAT_BYTE_1
            and (websocket := self.websocket) is not None
            and websocket.at_frame_boundary
            and self.fast_path
            and (link := self.link) is not None
        ):
            try:
                link.message(unmask(data[6:], data[2:6]))
            except Exception:
                self._internal_error()
            return
        self.stage(self, data)

    # The stages, in order

    def _preface(self, data: bytes) -> None:
        """The connection's first bytes, below TLS and HTTP: a PROXY protocol header
        (the HAProxy specification, tokend/edge/proxy_protocol.py) from a trusted balancer,
        who must send one, and none from anyone else.

        What follows goes to TLS, or to the handshake; nothing while undecided, or once
        refused. A header's client address becomes the connection's. Anyone else's
        connection that begins with a header's signature is closed here, never parsed
        (section 5 of the specification: a client that could send one would choose its
        own address).
        """
        received = self.preface + data if self.preface else data
        if self.ip is None:  # a trusted balancer's connection (see connection_made)
            try:
                header = proxy_protocol.parse(received)
            except proxy_protocol.ProxyHeaderError as exc:
                self._refuse("closed: bad PROXY protocol header", error=str(exc))
                return
            if header is None:
                self.preface = received
                return
            if header.source is None:  # a health check (LOCAL), or UNKNOWN: as is
                peer = self._tcp_peer()
                self._addressed(peer[0] if peer else "?")
            else:
                self.address = header.source
                self._addressed(header.source[0])
            received = header.rest
        else:
            begins = proxy_protocol.starts_header(received)
            if begins is None:
                self.preface = received
                return
            if begins:
                self._refuse(
                    "closed: PROXY protocol header from an address not in proxy_protocol_from"
                )
                return
        self.preface = b""
        self.stage = Connection._request
        context = self.gate.tls_context()
        if context is None:
            if received:
                self._request(received)
            return
        raw = self.transport
        assert raw is not None
        self.address = self.address or self._tcp_peer()
        handshake = tls.begin(raw, self, context, received, self.gate.settings.hello_timeout)
        handshake.add_done_callback(lambda _: self._tls_ended(raw, handshake))

    def _refuse(self, event: str, **fields: Any) -> None:
        """Close a connection whose first bytes are not what its source must send."""
        self.log.warning(event, **fields)
        self.preface = b""
        self.stage = Connection._discard
        if self.transport is not None:
            self.transport.close()

    def _discard(self, data: bytes) -> None:
        """Bytes of a connection refused before its handshake: not read."""

    def _tls_ended(self, raw: asyncio.Transport, handshake: asyncio.Future[None]) -> None:
        """The TLS handshake ended. Done, the TLS layer has handed over its transport;
        failed or cut short, it ends the connection without telling us: end ours."""
        if self.transport is not raw:
            return
        error = None if handshake.cancelled() else handshake.exception()
        if error is not None:
            self.log.info("TLS handshake failed", error=tls.error_text(error))
        # What a handshake fails with (its cancellation is not a failure here).
        assert error is None or isinstance(error, Exception)
        self.connection_lost(error)

    def _request(self, data: bytes) -> None:
        """The opening handshake's request (RFC 6455 4.1): the gate's own answer to its
        path if it has one (tokend.edge.http_responses), else the 101 or the refusal
        (tokend.edge.handshake)."""
        handshake = self.handshake
        assert handshake is not None
        try:
            if not handshake.receive_data(data):
                self._write()
                return
            path = handshake.path.partition("?")[0]
            assert self.ip is not None  # addressed before the handshake's bytes
            answer = self.gate.answer(self.ip, path)
            if answer is not None:
                http_responses.give(answer, self._respond, self.gate.node.spawn)
                return
            status = handshake.switch()
        except Exception:
            self._internal_error()
            self._write()
            return
        if status != 101:
            self.log.info("handshake refused", status=status, path=path)
            self._write()
            return
        self._write()  # the 101, before anything the frames after the head lead to
        self.handshake = None
        node = self.gate.node
        session = Session(node, self.gate.cadence, node.new_conn_id(), time.monotonic)
        self.link = SessionLink(self, node, session)
        self.websocket = WebSocket(self.gate.settings.max_message_size)
        self.stage = Connection._frames
        self._arm(self.gate.settings.hello_timeout, self._hello_timed_out)
        if handshake.rest:
            self._frames(handshake.rest)

    def _respond(self, response: Response) -> None:
        """The gate's HTTP answer to the request, now or once ready (an answer it waits
        for), unless the connection has ended by then."""
        handshake = self.handshake
        transport = self.transport
        if handshake is None or transport is None or transport.is_closing():
            return
        if not handshake.close_expected():
            handshake.answer(response)
        self._write()

    def _adopted(self, data: bytes) -> None:
        """A connection handed over (see :meth:`adopt`), once its socket is given: its
        WebSocket begins at the handed bytes, its session is held by this node."""
        link = self.link
        assert link is not None
        peer = self.address or self._tcp_peer()
        self._addressed(peer[0] if peer else "?")
        self.websocket = WebSocket(self.gate.settings.max_message_size)
        self.stage = Connection._frames
        link.node.attach(link)
        # Its logger is bound when it first logs (Connection.log): most never do.
        unparsed, self.preface = self.preface + data, b""
        if unparsed:
            self._frames(unparsed)

    def _frames(self, data: bytes) -> None:
        """WebSocket frames (RFC 6455 5), their messages to the session link.

        A slice at a time: once closed (max_frame_rate, a bad frame), what is left of a
        read bigger than a client's close reply is not parsed (nor answered: a ping gets
        a pong even after the close), and the closing handshake's deadline ends the
        connection. One read may hold 40,000 pings.
        """
        websocket, link = self.websocket, self.link
        assert websocket is not None and link is not None
        try:
            for offset in range(0, len(data), READ_SLICE):
                if websocket.close_sent is not None and len(data) > READ_SLICE:
                    break
                websocket.receive_data(data[offset : offset + READ_SLICE])
                for event in websocket.events_received():
                    if type(event) is bytes:
                        if link.session.phase is not _CLOSED:
                            link.message(event)
                    elif event is PING:
                        self._ping(link)
                    elif event is TEXT:
                        link.outcome(link.session.text_message())
                    elif link.session.abandon():
                        code = cast(ClientClose, event).code
                        self.log.info("connection closed by client", code=code)
                if websocket.close_sent is not None:
                    self._failed(link.session)
        except Exception:
            self._internal_error()
        self._write()

    def _internal_error(self) -> None:
        """A bug met while serving this connection: log it, close 1011, serve the rest."""
        self.log.exception("connection failed")
        if self.link is not None:
            self.close_with(self.link.session.close(p.CloseCode.INTERNAL_ERROR, "internal_error"))

    def _failed(self, session: Session) -> None:
        """The frame layer failed the connection itself (RFC 6455 7.1.7): a protocol
        error of the framing (1002), a message over ``max_message_size`` (1009)."""
        assert self.websocket is not None
        sent = self.websocket.close_sent
        assert sent is not None
        if session.abandon():
            self.log.warning("closing", code=sent.code, reason=sent.reason)
            self.gate.node.metrics.closed(sent.code, sent.reason)

    def eof_received(self) -> None:
        if self.websocket is not None:
            self.websocket.receive_eof()
        elif self.handshake is not None:
            self.handshake.receive_eof()
        self._write()
        # None: the transport closes itself; a WebSocket never writes after the peer's EOF.

    def connection_lost(self, exc: Exception | None) -> None:
        if self.websocket is not None:
            self.websocket.receive_eof()  # idempotent; the WebSocket is CLOSED after it
        for timer in (self.deadline, self.stall, self.held):
            if timer is not None:
                timer.cancel()
        self.deadline = self.stall = self.held = None
        link = self.link
        if link is not None:
            if link.session.abandon():
                self.log.info("connection dropped")
            self.gate.node.detach(link)
        self.gate.closed(self)
        # No cycle outlives the connection: with the link's way back to it gone, its
        # objects are freed as soon as the last reference goes, not by the cyclic
        # collector, whose whole passes stall a busy node's loop
        # (bench/results/2026-12-04-garbage-collector.md). Whatever the node still asks of
        # the link (an answer in flight) finds the session closed and writes nothing.
        self.link = None

    def pause_writing(self) -> None:
        """The client reads slower than we write: read nothing more from it (no more
        ACKs or pongs to write) and drop it if this lasts ``send_timeout``."""
        self.pause_reading()
        self.stall = asyncio.get_running_loop().call_later(
            self.gate.settings.send_timeout, self._stalled
        )

    def resume_writing(self) -> None:
        if self.stall is not None:
            self.stall.cancel()
            self.stall = None
        if self.paused:
            self.resume_reading()

    # Incoming

    def _ping(self, link: SessionLink) -> None:
        """The frame layer answers each ping; they count against ``max_frame_rate``.

        The pong is written without flow control, so an unlimited ping flood from a
        client that reads nothing would grow the write buffer without bound.
        """
        rate = self.gate.settings.max_frame_rate
        if not rate:
            return
        now = time.monotonic()
        if self.pings is None:
            self.pings = TokenBucket(rate, now)
        if not self.pings.take(now):
            link.outcome(link.session.close(p.CloseCode.RATE_LIMITED, "too_many_pings"))

    def pause_reading(self) -> None:
        if self.transport is not None and not self.paused:
            self.paused = True
            self.transport.pause_reading()

    def hold_reading(self, seconds: float) -> bool:
        """Read nothing from the client for ``seconds`` (the node sheds its heartbeats and
        reading them costs too much: TCP holds the client back); False when held already."""
        if self.held is not None or self.transport is None:
            return False
        self.pause_reading()
        self.held = asyncio.get_running_loop().call_later(seconds, self._hold_ended)
        return True

    def _hold_ended(self) -> None:
        self.held = None
        if self.paused:
            self.resume_reading()

    def resume_reading(self) -> None:
        """Read again, unless writes are paused, the node holds its reading or too many
        heartbeats wait for the store."""
        transport, link = self.transport, self.link
        if (
            transport is None
            or transport.is_closing()
            or self.stall is not None
            or self.held is not None
            or self.moving
            or (link is not None and len(link.session.unanswered) >= READ_PAUSE_AT)
        ):
            return
        self.paused = False
        transport.resume_reading()

    def close(self, code: p.CloseCode, reason: str) -> None:
        """Close from outside the client's messages: a drain, a failed flush."""
        if self.link is None:  # still in the opening handshake
            if self.transport is not None:
                self.transport.close()
            return
        self.link.close(code, reason)

    # Outgoing

    def send(self, messages: Sequence[bytes]) -> None:
        """Send binary messages, in one write to the socket.

        Framed here (:func:`tokend.edge.websocket.binary_frame`) rather than through
        the frame layer: an ACK is a few bytes, and a call less is a fair share of what
        sending it costs in Python. The rule for sending, OPEN and no fragmented message
        of ours under way (tokend sends none), is kept by the session: it answers
        nothing once closed, and the WebSocket is not OPEN only after a close (sent,
        received, or failed: the session is CLOSED then) or the client's EOF (the
        transport is closing then). The frame layer has nothing of its own waiting to
        be sent here (see the class).
        """
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if len(messages) == 1:
            message = messages[0]
            # binary_frame's common case inlined: an ACK without a token.
            size = len(message)
            transport.write(
                SHORT_BINARY_HEADS[size] + message if size < 126 else binary_frame(message)
            )
        else:
            transport.write(b"".join(map(binary_frame, messages)))

    def close_with(self, close: Close | None) -> None:
        """Start the closing handshake (RFC 6455 7.1.2) with the session's close, and
        write the close frame."""
        if close is None:
            return
        metrics = self.gate.node.metrics
        if close.reason == OVERLOADED:
            # Counted, not logged one by one: the node logs its shedding steps.
            session = self.session
            assert session is not None
            claims = session.claims
            if claims is not None:  # None: refused by a shed penalty, token not checked
                metrics.shed[claims.prio] += 1
                self.gate.shed(self)
        elif close.routine:
            if close.code is not p.CloseCode.GOING_AWAY:  # the drain logs one line a batch
                self.log.info("closing", code=int(close.code), reason=close.reason)
        else:
            self.log.warning("closing", code=int(close.code), reason=close.reason)
        metrics.closed(close.code, close.reason)
        websocket = self.websocket
        if websocket is not None and websocket.state is _OPEN:
            websocket.send_close(close.code, close.reason)
        self._write()

    def _write(self) -> None:
        """Write what the current stage has to send; half-close after its end of the
        stream (RFC 6455 7.1.1)."""
        transport = self.transport
        stage = self.websocket or self.handshake
        if stage is None:
            return
        data = stage.data_to_send()
        if not data or transport is None or transport.is_closing():
            return
        for chunk in data:
            if chunk:
                transport.write(chunk)
            elif transport.can_write_eof():
                transport.write_eof()
            else:
                transport.close()
        if not self.closing and stage.close_expected():
            self.closing = True
            self._arm(CLOSE_TIMEOUT, self._abort)

    # Handing the connection to another process

    @property
    def quiet(self) -> bool:
        """Whether the connection may be handed to another process now: WELCOMEd, its
        WebSocket OPEN with no message under way (the bytes of a frame begun go along:
        :meth:`unparsed`), its session OPEN with no heartbeat waiting for the store,
        nothing unsent. Pause its reading first (:meth:`pause_reading`), then wait for
        the store's answers and the socket's writes."""
        websocket, link, transport = self.websocket, self.link, self.transport
        return (
            websocket is not None
            and link is not None
            and transport is not None
            and websocket.state is _OPEN
            and websocket.current_size is None
            and link.session.phase is Phase.OPEN
            and not link.session.unanswered
            and not transport.is_closing()
            and transport.get_write_buffer_size() == 0
            and transport.get_extra_info("sslcontext") is None
        )

    def unparsed(self) -> bytes:
        """The bytes read and not yet parsed: the beginning of the WebSocket's next frame."""
        return self.websocket.unparsed() if self.websocket is not None else b""

    def hand_off(self) -> Handed:
        """Let go of a :attr:`quiet` connection without closing it, for another process to
        :meth:`adopt`: a duplicate of its socket, its session (OPEN: the node forgets the
        link without releasing it), the bytes of a frame begun, the client's address as a
        PROXY header gave it. This process's descriptor is closed; the client sees
        nothing."""
        assert self.quiet
        transport = self.transport
        assert transport is not None
        kept = transport.get_extra_info("socket")
        link = self.link
        assert link is not None
        handed = Handed(
            socket.socket(fileno=socket.dup(kept.fileno())),
            link.session,
            self.unparsed(),
            self.address,
        )
        self.let_go()
        return handed

    def let_go(self) -> None:
        """Let go of the connection without closing it, another process holding it now:
        the node forgets it without releasing its session, this process's descriptor is
        closed (the client sees nothing)."""
        transport, link = self.transport, self.link
        assert transport is not None
        self.link = None  # nothing more reaches the session here: it is the other's
        if link is not None:
            self.gate.node.detach(link)  # its session OPEN: not released
        transport.abort()

    # Timers

    def _arm(self, delay: float, callback: Any) -> None:
        self.disarm()
        self.deadline = asyncio.get_running_loop().call_later(delay, callback)

    def disarm(self) -> None:
        """Cancel the hello timer (WELCOME came) or the closing handshake's deadline."""
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def arm_hello_timer(self) -> None:
        """The store must answer the HELLO within hello_timeout, or 1013
        (Session.hello_timed_out)."""
        self._arm(self.gate.settings.hello_timeout, self._hello_timed_out)

    def _hello_timed_out(self) -> None:
        self.deadline = None
        link = self.link
        if link is None:  # the opening did not finish in time
            if self.ip is None:
                self.log.warning(
                    "closed: no PROXY protocol header within hello_timeout",
                    hello_timeout=self.gate.settings.hello_timeout,
                )
            self._abort()
            return
        close = link.session.hello_timed_out()
        if close is not None:
            self.gate.node.forget_hello(link)  # not stored if not yet sent
        self.close_with(close)

    def _abort(self) -> None:
        self.deadline = None
        if self.transport is not None:
            self.transport.abort()

    def _stalled(self) -> None:
        self.stall = None
        self.gate.node.metrics.dropped["not_reading"] += 1
        assert self.transport is not None
        self.log.warning(
            "dropping connection: client not reading",
            send_timeout=self.gate.settings.send_timeout,
            unsent=self.transport.get_write_buffer_size(),
        )
        if self.link is not None:
            self.link.session.abandon()
        self.transport.abort()
