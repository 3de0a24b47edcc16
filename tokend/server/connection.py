"""One client connection: websockets' Sans-I/O server protocol driven by an asyncio.Protocol.

The module of the server that drives websockets' protocol (tokend.edge.handshake parses
the upgrade request for it, tokend.edge.http_responses writes the gate's plain HTTP answers
through it). A :class:`Connection` feeds the bytes of its socket to a
``websockets.server.ServerProtocol`` (RFC 6455: opening handshake, framing, control
frames, the closing handshake, message size) and hands the binary messages that come
out to its :class:`SessionLink`, which decodes them for its
:class:`tokend.core.session.Session` and carries out what the session answers: frames to
send, a round trip of the node (:class:`tokend.server.seams.Hub`), a close. A sampled
heartbeat's stages are timed by its :class:`tokend.server.stage_sample.StageSample`.

No task and no coroutine waits for an idle connection: it is this object, its
websockets protocol, its link, its session and its socket. Heartbeats are answered from
the node's batch flush, which calls :meth:`SessionLink.heartbeats_stored` (one write
per connection per flush). The node sees the link as a :class:`tokend.server.seams.Peer`;
this module imports neither the node nor the store.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import ssl
import struct
import sys
import time
import uuid
from collections.abc import Awaitable, Generator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

import structlog
from websockets.exceptions import NegotiationError
from websockets.frames import Frame, Opcode, apply_mask
from websockets.http11 import Request
from websockets.protocol import Protocol as WebSocketProtocol
from websockets.protocol import Side, State
from websockets.server import ServerProtocol
from websockets.streams import StreamReader
from websockets.typing import Origin, Subprotocol

from tokend.core import protocol as p
from tokend.core.session import OVERLOADED, Ask, Close, Phase, Session, TokenBucket
from tokend.core.store_messages import HeartbeatReply, HeartbeatRequest, HelloAnswer, Known
from tokend.edge import http_responses, proxy_protocol, tls
from tokend.edge.handshake import Head, hand_over, switch_protocols
from tokend.edge.http_responses import HttpAnswer
from tokend.metrics import STAGE_SAMPLE_EVERY
from tokend.server.seams import Hub
from tokend.server.stage_sample import StageSample

if TYPE_CHECKING:
    from tokend.config import Settings
    from tokend.core.session import Cadence

_log = structlog.get_logger("tokend.connection")
# websockets logs each connection opened and closed at info through the standard library.
_ws_logger = logging.getLogger("websockets.server")

# Write buffer limits (bytes): above HIGH the client is not reading (see pause_writing).
WRITE_HIGH = 32 * 1024
WRITE_LOW = 8 * 1024
# Seconds to wait for the client's part of the closing handshake before dropping it.
CLOSE_TIMEOUT = 2.0
_HEARTBEAT_TYPE = p.FrameType.HEARTBEAT.value
# As a module global: on Python 3.11 an Enum class's attribute is read through
# EnumType.__getattr__'s hook (~1,100 instructions), once per heartbeat here.
_ASK_HEARTBEAT = Ask.HEARTBEAT
# The first two bytes of a client's heartbeat as one whole WebSocket frame (RFC 6455
# 5.2): FIN and opcode 2 (binary); MASK set and payload length 50. Then the 4-byte
# masking key and the 50 masked bytes: 56 in all. See Connection.data_received.
HEARTBEAT_FRAME_HEAD = (0x82, 0x80 | p.HEARTBEAT_LENGTH)
HEARTBEAT_FRAME_LENGTH = 2 + 4 + p.HEARTBEAT_LENGTH
_HEARTBEAT_BYTE_0, _HEARTBEAT_BYTE_1 = HEARTBEAT_FRAME_HEAD
# Heartbeats of one connection verified and not yet answered at which its reading
# pauses until the store answers: a client keeps one out at a time, and one that sends
# faster than the store answers is held back as TCP holds back a slow reader.
READ_PAUSE_AT = 16
# Bytes of one read handed to websockets' parser at a time (see data_received).
READ_SLICE = 4096


class Gate(Protocol):
    """What a connection asks of the server that accepted it."""

    settings: Settings
    cadence: Cadence

    @property
    def node(self) -> Hub:
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


class TokendProtocol(ServerProtocol):
    """websockets' server protocol, offering subprotocol ``tokend.v1`` only."""

    def __init__(
        self,
        *,
        origins: Sequence[str | None] | None = None,
        max_size: int | None = 2**20,
        logger: logging.Logger | logging.LoggerAdapter[Any] | None = None,
    ) -> None:
        """``ServerProtocol.__init__`` for these arguments (no extensions, state
        CONNECTING), its attributes set here but for ``id``, a UUID4 for websockets'
        own logs, a fifth of what the constructor cost (made when read: :attr:`id`).
        tests/test_handshake.py holds the attributes equal to the constructor's."""
        if logger is None:
            logger = _ws_logger
        self.logger = logger
        self.debug = logger.isEnabledFor(logging.DEBUG)
        self.side = Side.SERVER
        self._state = State.CONNECTING
        self.max_message_size, self.max_fragment_size = max_size, None
        self.current_size = None
        self.expect_continuation_frame = False
        self.origin = None
        self.extensions = []
        self.subprotocol = None
        self.close_rcvd = None
        self.close_sent = None
        self.close_rcvd_then_sent = None
        self.handshake_exc = None
        self.eof_sent = False
        self.reader = StreamReader()
        self.events = []
        self.writes = []
        self.parser = self.parse()
        next(self.parser)
        self.parser_exc = None
        self.origins = cast("Sequence[Origin | None] | None", origins)
        self.available_extensions = None
        self.available_subprotocols = None
        self.accept_called = False

    @functools.cached_property
    def id(self) -> uuid.UUID:
        """websockets' identifier of the connection, for its logs."""
        return uuid.uuid4()

    def parse(self) -> Generator[None]:
        """websockets' parser (the request, then frames), entered at the first bytes
        rather than at once: ``Protocol.__init__`` starts it, and most connections' requests
        are parsed by tokend.edge.handshake, whose ``hand_over`` drops it for the frame
        parser. Dropped here it has one level to unwind, not websockets' four."""
        yield
        yield from super().parse()

    def select_subprotocol(self, subprotocols: Sequence[Subprotocol]) -> Subprotocol | None:
        """``tokend.v1`` if offered; no header is accepted; only others is HTTP 400."""
        if not subprotocols:
            return None
        if p.SUBPROTOCOL in subprotocols:
            return Subprotocol(p.SUBPROTOCOL)
        raise NegotiationError(f"unsupported subprotocol; this server speaks {p.SUBPROTOCOL}")


class Connection(asyncio.Protocol):
    """A client's TCP connection, from accept to close: its socket and its WebSocket.

    Invariants: ``link`` is set once the handshake succeeded; its session's phase
    CLOSED means a close frame was sent (or the protocol failed the connection),
    after which nothing but the closing handshake is written. Outside
    :meth:`data_received`, websockets has nothing left to send: whatever it is given
    to send (a close) is written at once.
    """

    __slots__ = (
        "address",
        "aligned",
        "closing",
        "deadline",
        "fragments",
        "gate",
        "head",
        "ip",
        "link",
        "paused",
        "pings",
        "preface",
        "stall",
        "transport",
        "ws",
    )

    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        settings = gate.settings
        self.ws = TokendProtocol(
            origins=gate.origins,
            max_size=settings.max_message_size,
            logger=_ws_logger,
        )
        self.transport: asyncio.Transport | None = None
        self.link: SessionLink | None = None  # once the WebSocket handshake succeeded
        # The client's address (the per-IP counts key), once known: at accept, or from
        # the PROXY header of a trusted balancer's connection (None until then).
        self.ip: str | None = None
        # The connection's first bytes while it is undecided what they are (see
        # _preface): b"" from accept until they went on to TLS or websockets.
        self.preface: bytes | None = None
        # The request's head while it is gathered for tokend.edge.handshake (see _head): from
        # accept until it was parsed there, or handed to websockets' parser.
        self.head: Head | None = None
        # The client's (host, port) where the transport cannot tell it: from a PROXY
        # header, or kept when TLS begins (its transport forgets the peer once closed,
        # before the last log line). None: read the TCP peer's from the transport.
        self.address: tuple[str, int] | None = None
        # The hello timer until WELCOME, then the closing handshake's deadline.
        self.deadline: asyncio.TimerHandle | None = None
        self.closing = False  # the deadline is the closing handshake's
        self.stall: asyncio.TimerHandle | None = None  # armed while writes are paused
        self.fragments: bytearray | None = None  # a fragmented binary message so far
        self.pings: TokenBucket | None = None  # made at the first ping
        self.paused = False  # reading paused by us (see pause_writing and READ_PAUSE_AT)
        # websockets' parser waits for the first byte of a frame: see data_received.
        self.aligned = False

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
        return _bound(self.peer, link.session if link is not None else None)

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
        self.preface = b""
        self.head = Head()
        self.gate.opened(self)
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
        """Bytes from the client, through websockets' parser (RFC 6455 5.2, 5.4, 5.5).

        Fast path: a read that is exactly one whole, unfragmented, masked binary frame of
        a heartbeat's size, while the parser waits for the start of a frame, is unmasked
        here and handed on as the parser would hand it (its only effect on the parser
        would be to return to the same waiting state; a close it leads to is written
        by :meth:`close_with`). tests/test_connection.py holds this path equal, byte for
        byte and event for event, to the parser's on split, coalesced, fragmented and
        interleaved-control input.
        """
        link = self.link
        if (
            self.aligned
            and link is not None
            and len(data) == HEARTBEAT_FRAME_LENGTH
            and data[0] == _HEARTBEAT_BYTE_0
            and data[1] == _HEARTBEAT_BYTE_1
        ):
            try:
                link.message(apply_mask(data[6:], data[2:6]))
            except Exception:
                self._internal_error()
            return
        if self.preface is not None:
            data = self._preface(data)
            if not data:
                return
        if self.head is not None:
            rest = self._head(data)
            if rest is None:
                return
            data = rest
        ws = self.ws
        try:
            # A slice at a time: once closed (max_frame_rate, a bad frame), what is left of a
            # read bigger than a client's close reply is not parsed (nor answered: a ping
            # gets a pong even after the close), and the closing handshake's deadline ends
            # the connection. One read may hold 40,000 pings. Once at least, even with no
            # bytes left: a request tokend.edge.handshake handed over waits in events_received.
            for offset in range(0, len(data) or 1, READ_SLICE):
                if ws.close_sent is not None and len(data) > READ_SLICE:
                    break
                ws.receive_data(data[offset : offset + READ_SLICE])
                for event in ws.events_received():
                    if isinstance(event, Frame):
                        self._frame(event)
                    else:
                        self._request(event)  # type: ignore[arg-type]
                link = self.link
                if ws.close_sent is not None and link is not None:
                    self._failed(link.session)
        except Exception:
            self._internal_error()
        self.aligned = self.fast_path and at_frame_start(ws)
        self._write()

    def _preface(self, data: bytes) -> bytes:
        """The connection's first bytes, below TLS and HTTP: a PROXY protocol header
        (the HAProxy specification, tokend/edge/proxy_protocol.py) from a trusted balancer,
        who must send one, and none from anyone else.

        Returns what follows for websockets; b"" while undecided, once refused, or when
        the bytes went on to TLS. A header's client address becomes the connection's.
        Anyone else's connection that begins with a header's signature is closed here,
        never parsed (section 5 of the specification: a client that could send one
        would choose its own address).
        """
        received = self.preface + data if self.preface else data
        if self.ip is None:  # a trusted balancer's connection (see connection_made)
            try:
                header = proxy_protocol.parse(received)
            except proxy_protocol.ProxyHeaderError as exc:
                return self._refuse("closed: bad PROXY protocol header", error=str(exc))
            if header is None:
                self.preface = received
                return b""
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
                return b""
            if begins:
                return self._refuse(
                    "closed: PROXY protocol header from an address not in proxy_protocol_from"
                )
        self.preface = None
        context = self.gate.tls_context()
        if context is None:
            return received
        raw = self.transport
        assert raw is not None
        self.address = self.address or self._tcp_peer()
        handshake = tls.begin(raw, self, context, received, self.gate.settings.hello_timeout)
        handshake.add_done_callback(lambda _: self._tls_ended(raw, handshake))
        return b""

    def _head(self, data: bytes) -> bytes | None:
        """The upgrade request, parsed by tokend.edge.handshake when it can be (else by
        websockets): what goes on to websockets' parser, None while the head is not whole."""
        assert self.head is not None
        parsed = self.head.feed(data)
        if parsed is None:
            return None
        self.head = None
        request, rest = parsed
        if request is not None:
            hand_over(self.ws, request)
        return rest

    def _refuse(self, event: str, **fields: Any) -> bytes:
        """Close a connection whose first bytes are not what its source must send."""
        self.log.warning(event, **fields)
        self.preface = None
        if self.transport is not None:
            self.transport.close()
        return b""

    def _tls_ended(self, raw: asyncio.Transport, handshake: asyncio.Future[None]) -> None:
        """The TLS handshake ended. Done, the TLS layer has handed over its transport;
        failed or cut short, it ends the connection without telling us: end ours."""
        if self.transport is not raw:
            return
        error = None if handshake.cancelled() else handshake.exception()
        if error is not None:
            self.log.info("TLS handshake failed", error=tls.error_text(error))
        self.connection_lost(error)

    def _internal_error(self) -> None:
        """A bug met while serving this connection: log it, close 1011, serve the rest."""
        self.log.exception("connection failed")
        if self.link is not None:
            self.close_with(self.link.session.close(p.CloseCode.INTERNAL_ERROR, "internal_error"))

    @property
    def fast_path(self) -> bool:
        """Whether heartbeat frames may take the fast path at all on this connection."""
        return not self.ws.debug and self.gate.settings.max_message_size >= p.HEARTBEAT_LENGTH

    def _failed(self, session: Session) -> None:
        """websockets failed the connection itself (RFC 6455 7.1.7): a protocol error of
        the framing (1002), a message over ``max_message_size`` (1009)."""
        sent = self.ws.close_sent
        assert sent is not None
        if session.abandon():
            self.log.warning("closing", code=sent.code, reason=sent.reason)
            self.gate.node.metrics.closed(sent.code)

    def eof_received(self) -> None:
        self.ws.receive_eof()
        self._write()
        # None: the transport closes itself; a WebSocket never writes after the peer's EOF.

    def connection_lost(self, exc: Exception | None) -> None:
        self.ws.receive_eof()  # idempotent; the protocol is CLOSED after it
        for timer in (self.deadline, self.stall):
            if timer is not None:
                timer.cancel()
        self.deadline = self.stall = None
        link = self.link
        if link is not None:
            if link.session.abandon():
                self.log.info("connection dropped")
            self.gate.node.detach(link)
        self.gate.closed(self)
        # No cycle outlives the connection: with the link's way back to it, the parser's
        # frame and the parser's error (whose traceback holds the frame of the parser
        # that raised it) gone, each holding websockets' protocol, its objects are freed
        # as soon as the last reference goes, not by the cyclic collector, whose whole
        # passes stall a busy node's loop (bench/results/2026-12-04-garbage-collector.md).
        # Whatever the node still asks of the link (an answer in flight) finds the session
        # closed and writes nothing.
        self.link = None
        self.ws.parser.close()
        self.ws.parser_exc = None

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

    def _request(self, request: Request) -> None:
        """The opening handshake's request: the gate's own answer to its path if it has
        one (tokend.edge.http_responses), else the handshake's 101 (tokend.edge.handshake's where
        it is certain to be websockets') or websockets' refusal."""
        path = request.path.partition("?")[0]
        assert self.ip is not None  # addressed before any byte reaches websockets
        answer = self.gate.answer(self.ip, path)
        if answer is not None:
            http_responses.give(self.ws, answer, self.gate.node.spawn, self._write)
            return
        if switch_protocols(self.ws, request):
            self._opened()
            return
        response = self.ws.accept(request)
        self.ws.send_response(response)
        if response.status_code == 101:
            self._opened()
        else:
            self.log.info("handshake refused", status=response.status_code, path=path)

    def _opened(self) -> None:
        hub = self.gate.node
        session = Session(hub, self.gate.cadence, hub.new_conn_id(), time.monotonic)
        self.link = SessionLink(self, hub, session)
        self._arm(self.gate.settings.hello_timeout, self._hello_timed_out)

    def _frame(self, frame: Frame) -> None:
        link = self.link
        assert link is not None  # frames come after the handshake
        opcode = frame.opcode
        if opcode in _DATA and link.session.phase is Phase.CLOSED:
            return  # data after our close frame (RFC 6455 5.5.1: the closing handshake)
        if opcode is Opcode.BINARY:
            if frame.fin:
                link.message(bytes(frame.data))  # as it is when it is bytes already
            else:
                self.fragments = bytearray(frame.data)
        elif opcode is Opcode.CONT:
            # websockets has checked the order of fragments and their total size.
            assert self.fragments is not None
            self.fragments += frame.data
            if frame.fin:
                message, self.fragments = bytes(self.fragments), None
                link.message(message)
        elif opcode is Opcode.TEXT:
            link.outcome(link.session.text_message())
        elif opcode is Opcode.PING:
            self._ping(link)
        elif opcode is Opcode.CLOSE and link.session.abandon():
            rcvd = self.ws.close_rcvd
            self.log.info("connection closed by client", code=rcvd.code if rcvd else None)

    def _ping(self, link: SessionLink) -> None:
        """websockets answers each ping; they count against ``max_frame_rate``.

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

    def resume_reading(self) -> None:
        """Read again, unless writes are paused or too many heartbeats wait for the store."""
        transport, link = self.transport, self.link
        if (
            transport is None
            or transport.is_closing()
            or self.stall is not None
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

        Framed by :func:`binary_frame` rather than through ``ServerProtocol.send_binary``
        (a frame object per message): an ACK is a few bytes, and this is half of what
        sending it costs in Python. The protocol's rule for sending, OPEN and no
        fragmented message of ours under way (tokend sends none), is kept by the
        session: it answers nothing once closed, and the connection is not OPEN only
        after a close (sent, received, or failed: the session is CLOSED then) or the
        client's EOF (the transport is closing then). websockets has nothing of its own
        waiting to be sent here (see the class).
        """
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if len(messages) == 1:
            message = messages[0]
            # binary_frame's common case inlined: an ACK without a token.
            size = len(message)
            transport.write(_SHORT_HEADS[size] + message if size < 126 else binary_frame(message))
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
        if self.ws.state is State.OPEN:
            self.ws.send_close(close.code, close.reason)
        self._write()

    def _write(self) -> None:
        """Write what the protocol has to send; half-close after its EOF (RFC 6455 7.1.1)."""
        transport = self.transport
        data = self.ws.data_to_send()
        if not data or transport is None or transport.is_closing():
            return
        for chunk in data:
            if chunk:
                transport.write(chunk)
            elif transport.can_write_eof():
                transport.write_eof()
            else:
                transport.close()
        if not self.closing and self.ws.close_expected():
            self.closing = True
            self._arm(CLOSE_TIMEOUT, self._abort)

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


class SessionLink:
    """The session of one WebSocket connection, linked to the node: the node's
    :class:`tokend.server.seams.Peer`.

    Hands the client's binary messages, decoded, to its :class:`Session`, and the node's
    answers (the store's) too; carries out what the session decides through its
    connection (frames to send, a close) and through the node (:class:`tokend.server.seams.Hub`:
    a HELLO, heartbeats or a BYE to store).
    """

    __slots__ = ("connection", "heartbeat_request", "hub", "log", "sample", "session")

    def __init__(self, connection: Connection, hub: Hub, session: Session) -> None:
        self.connection = connection
        self.hub = hub
        self.session = session
        self.heartbeat_request: HeartbeatRequest | None = None  # the store's, once WELCOMEd
        # The session's logger (peer, conn, tid, sub), bound once at WELCOME.
        self.log: structlog.typing.FilteringBoundLogger | None = None
        # A heartbeat sampled for the stage histogram, from its verification to its ACK.
        self.sample: StageSample | None = None

    # The client's messages

    def message(self, data: bytes) -> None:
        """A binary message from the client (docs/protocol.md §3). A heartbeat is handed
        to the session as it came (Session.receive_heartbeat); any other, decoded."""
        session = self.session
        hub = self.hub
        # One message in STAGE_SAMPLE_EVERY has its stages timed (counted down in place).
        metrics = hub.metrics
        metrics.until_sample -= 1
        if metrics.until_sample:
            sample = None
        else:
            metrics.until_sample = STAGE_SAMPLE_EVERY
            sample = StageSample()
        # p.is_heartbeat(data), inlined: one call less per heartbeat.
        if len(data) == p.HEARTBEAT_LENGTH and data[0] == _HEARTBEAT_TYPE and not data[1]:
            if sample is not None:
                sample.decode_ended()
            outcome = session.receive_heartbeat(data, hub.shedder.shed_from)
            if sample is not None and outcome is _ASK_HEARTBEAT:
                sample.verify_ended()
                self.sample = sample
        else:
            try:
                frame = p.decode(data)
            except p.ProtocolError as exc:
                self.connection.log.info("malformed message", error=str(exc))
                self.connection.close_with(session.malformed())
                return
            if (
                type(frame) is p.Hello
                and session.claims is None
                and self.connection.gate.refuses_hello(frame.token)
            ):
                self.connection.close_with(session.close(p.CloseCode.TRY_AGAIN_LATER, OVERLOADED))
                return
            outcome = session.receive(frame, hub.shedder.shed_from)
        if outcome is _ASK_HEARTBEAT:
            hub.submit_heartbeat(self)
            if len(session.unanswered) >= READ_PAUSE_AT:
                self.connection.pause_reading()
        else:
            self.outcome(outcome)

    def outcome(self, outcome: Ask | Close | None) -> None:
        """Carry out what the session answered a message."""
        if outcome is Ask.HEARTBEAT:
            self.hub.submit_heartbeat(self)
            if len(self.session.unanswered) >= READ_PAUSE_AT:
                self.connection.pause_reading()
        elif outcome is Ask.START:
            self.hub.submit_hello(self)
            self.connection.arm_hello_timer()
        elif outcome is Ask.BYE:
            self.hub.end(self)
        elif outcome is not None:
            self.connection.close_with(outcome)

    # The store's answers (tokend.server.seams.Peer, called by the node)

    def hello_answered(self, answer: HelloAnswer) -> None:
        session = self.session
        connection = self.connection
        welcome = session.started(answer)
        if welcome is Ask.START:  # the store asks for the token verified first
            self.outcome(welcome)
            return
        if not isinstance(welcome, bytes):
            connection.close_with(welcome)
            # Closed before the answer came, which gave it the session: released at once.
            self.hub.release(self)
            return
        transport = connection.transport
        if transport is not None and not transport.is_closing():
            connection.disarm()
            self.log = _bound(connection.peer, session)
            self.hub.attach(self)
            connection.send([welcome])
            if connection.aligned:  # the session goes idle: drop what the handshake left
                restart_parser(connection.ws)
            # debug: in a connect storm an info line per session costs a tenth of the
            # work; SESSION_STARTED / SESSION_RESUMED on the event stream are the record.
            connection.log.debug(
                "session resumed" if session.resumed else "session started", exp=session.exp_ms
            )

    def hello_failed(self, unavailable: bool) -> None:
        if unavailable:
            self.connection.close_with(self.session.hello_lost())
            self.hub.release(self)  # Redis may have run the HELLO all the same
        else:
            self.connection.close_with(
                self.session.close(p.CloseCode.INTERNAL_ERROR, "internal_error")
            )

    def heartbeats_stored(self, answer: HeartbeatReply) -> None:
        """The batch flush stored this connection's heartbeats: send their ACKs."""
        connection = self.connection
        sample = self.sample
        if sample is not None:
            sample.store_ended()
        session = self.session
        out = session.stored(answer)
        if connection.paused:
            connection.resume_reading()
        if type(out) is list:
            connection.send(out)
            request = self.heartbeat_request
            if session.signed_digest or (request is not None and request.token):
                self._record_signed_token()
            renewed = False
            if not isinstance(answer, int):  # not a plain OK
                if answer.was_warn:
                    connection.log.info("session recovered")
                renewed = answer.renewed
            metrics = self.hub.metrics
            metrics.acked_heartbeats += len(out)
            if renewed:
                metrics.renewals += 1
            if sample is not None:
                sample.send_ended(metrics)
                self.sample = None
        elif out is not None:
            connection.close_with(out)

    def _record_signed_token(self) -> None:
        """Keep the store's copy of the token this connection was last given: the flight
        after the ACK that gave a token carries its digest, that flight only (stored
        now: this one did, if it carried it)."""
        request = self.heartbeat_request
        assert request is not None
        self.heartbeat_request = request._replace(token=self.session.take_signed_digest())

    def heartbeats_held(self) -> None:
        """The store is unavailable: ACK from what the session knows (replayed later)."""
        acks = self.session.held_back()
        connection = self.connection
        if connection.paused:
            connection.resume_reading()
        if acks:
            connection.send(acks)

    def replayed(self, answer: HeartbeatReply) -> None:
        """A heartbeat held through an outage was stored at last."""
        self.connection.close_with(self.session.replayed(answer))

    def known(self) -> Known | None:
        """What this connection knows of its session, to restore it with should Redis have
        lost it (tokend.core.store_messages.Known); None before WELCOME."""
        session = self.session
        claims = session.claims
        if claims is None or not session.since_ms:
            return None
        return Known(
            claims.sub,
            claims.prio,
            session.iat_s,
            session.exp_ms,
            session.since_ms,
            session.next_proof,
        )

    def bye_answered(self, confirmed: bool) -> None:
        session = self.session
        self.connection.close_with(session.ended() if confirmed else session.bye_unconfirmed())

    def bye_failed(self) -> None:
        self.connection.close_with(self.session.store_unavailable())

    # Other nodes, the sweeper, the drain

    def warn(self) -> None:
        """The session entered WARN: NOTICE."""
        notice = self.session.warn()
        if notice is not None:
            self.connection.log.info("notice sent: session in WARN")
            self.connection.send([notice])

    def told_to_close(self, code: int | None) -> None:
        """The store (another node's script, a sweep) ends this session."""
        self.connection.close_with(self.session.told_to_close(code))

    def close(self, code: p.CloseCode, reason: str) -> None:
        """Close from outside the client's messages: a drain, a failed flush."""
        self.connection.close_with(self.session.close(code, reason))

    def send_close(self, close: Close | None) -> None:
        """Carry out a close the session decided (the node's planned close sends it once
        the session's release is recorded: Node.going_away)."""
        self.connection.close_with(close)


def _bound(peer: str, session: Session | None) -> structlog.typing.FilteringBoundLogger:
    """A logger with a connection's fields: its peer, and its session's conn, tid and sub
    as far as they are known."""
    fields = {"peer": peer}
    if session is not None:
        fields["conn"] = session.conn
        if session.claims is not None:
            fields |= {"tid": str(session.claims.tid), "sub": session.claims.sub}
    return _log.bind(**fields)


def binary_frame(payload: bytes) -> bytes:
    """A server's unfragmented binary frame (RFC 6455 5.2: FIN, opcode 2, unmasked, the
    shortest payload length encoding), as ``Frame(BINARY, payload).serialize(mask=False)``
    makes it; tests/test_connection.py holds the two equal."""
    n = len(payload)
    if n < 126:  # every ACK without a token: one allocation
        return _SHORT_HEADS[n] + payload
    if n < 0x10000:
        return _HEAD_16.pack(0x82, 126, n) + payload
    return _HEAD_64.pack(0x82, 127, n) + payload


# The two-byte heads of the frames of 0..125 bytes, made once.
_SHORT_HEADS = [bytes((0x82, n)) for n in range(126)]
_HEAD_16 = struct.Struct("!BBH")
_HEAD_64 = struct.Struct("!BBQ")


def at_frame_start(ws: ServerProtocol) -> bool:
    """True when websockets' parser has nothing buffered and waits for a frame's first byte.

    That is: the connection is OPEN, no fragmented message is under way, and the
    innermost generator of the parser is the reader's ``at_eof`` (the wait between two
    frames of ``Protocol.parse``; inside a frame it would be ``read_exact``). Should a
    future websockets change this, the answer is False and every frame takes the parser.
    """
    if ws.state is not State.OPEN or ws.current_size is not None or ws.reader.buffer:
        return False
    generator: Any = ws.parser
    while (inner := getattr(generator, "gi_yieldfrom", None)) is not None:
        generator = inner
    return getattr(generator, "gi_code", None) is _AT_EOF


_AT_EOF = StreamReader.at_eof.__code__


def restart_parser(ws: ServerProtocol) -> None:
    """Restart websockets' frame parser where :func:`at_frame_start` says it waits between
    two frames: the same state (``Protocol.parse`` at its first wait), without what its
    suspended generators held, the opening handshake's request (its headers: ~3 KB) and
    the last frame parsed (the HELLO). The heartbeats that follow take the fast path, so
    an idle session would keep those for its whole life (docs/performance.md, "Current figures").
    """
    ws.parser = WebSocketProtocol.parse(ws)
    next(ws.parser)


_DATA = frozenset({Opcode.BINARY, Opcode.CONT, Opcode.TEXT})
