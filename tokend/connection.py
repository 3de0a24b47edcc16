"""One client connection: websockets' Sans-I/O server protocol driven by an asyncio.Protocol.

The only module of the server that knows about websockets. A :class:`Connection`
feeds the bytes of its socket to a ``websockets.server.ServerProtocol`` (RFC 6455:
opening handshake, framing, control frames, the closing handshake, message size),
hands the binary messages that come out, decoded, to its :class:`tokend.session.Session`,
and carries out what the session answers: frames to send, a request for the node's
batchers, a close.

No task and no coroutine waits for an idle connection: it is this object, its
websockets protocol, its session and its socket. Heartbeats are answered from the
node's batch flush, which calls :meth:`Connection.heartbeats_stored` (one write per
connection per flush).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import struct
import sys
import time
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

import structlog
from websockets.datastructures import Headers
from websockets.exceptions import NegotiationError
from websockets.frames import Frame, Opcode, apply_mask
from websockets.http11 import Request, Response
from websockets.protocol import State
from websockets.server import ServerProtocol
from websockets.streams import StreamReader
from websockets.typing import Subprotocol

from tokend import protocol as p
from tokend import proxy_protocol, tls
from tokend.answers import Ended, HeartbeatAnswer, HelloAnswer
from tokend.handshake import Head, hand_over
from tokend.http_answer import HttpAnswer
from tokend.session import OVERLOADED, Ask, Close, Phase, Session, TokenBucket
from tokend.store.sessions import Known
from tokend.store.unavailable import NotConfirmed, StoreUnavailable

if TYPE_CHECKING:
    from tokend.config import Settings
    from tokend.node import Node
    from tokend.session import Cadence
    from tokend.store.sessions import HeartbeatRequest

_log = structlog.get_logger("tokend.connection")
# websockets logs each connection opened and closed at info through the standard library.
_ws_logger = logging.getLogger("websockets.server")

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
# Heartbeats of one connection verified and not yet answered at which its reading
# pauses until the store answers: a client keeps one out at a time, and one that sends
# faster than the store answers is held back as TCP holds back a slow reader.
READ_PAUSE_AT = 16


class Gate(Protocol):
    """What a connection asks of the server that accepted it."""

    settings: Settings
    node: Node
    cadence: Cadence
    # Acceptable Origin headers (None among them: no header), or None for any.
    origins: Sequence[str | None] | None

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


class TokendProtocol(ServerProtocol):
    """websockets' server protocol, offering subprotocol ``tokend.v1`` only."""

    def select_subprotocol(self, subprotocols: Sequence[Subprotocol]) -> Subprotocol | None:
        """``tokend.v1`` if offered; no header is accepted; only others is HTTP 400."""
        if not subprotocols:
            return None
        if p.SUBPROTOCOL in subprotocols:
            return Subprotocol(p.SUBPROTOCOL)
        raise NegotiationError(f"unsupported subprotocol; this server speaks {p.SUBPROTOCOL}")


class Connection(asyncio.Protocol):
    """A client's TCP connection, from accept to close.

    Invariants: ``session`` is set once the handshake succeeded; the session's phase
    CLOSED means a close frame was sent (or the protocol failed the connection),
    after which nothing but the closing handshake is written.
    """

    __slots__ = (
        "address",
        "aligned",
        "closing",
        "deadline",
        "fragments",
        "gate",
        "head",
        "heartbeat_request",
        "ip",
        "marks",
        "paused",
        "pings",
        "preface",
        "session",
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
        self.session: Session | None = None
        self.heartbeat_request: HeartbeatRequest | None = None  # the store's, once WELCOMEd
        # The client's address (the per-IP counts key), once known: at accept, or from
        # the PROXY header of a trusted balancer's connection (None until then).
        self.ip: str | None = None
        # The connection's first bytes while it is undecided what they are (see
        # _preface): b"" from accept until they went on to TLS or websockets.
        self.preface: bytes | None = None
        # The request's head while it is gathered for tokend.handshake (see _head): from
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
        # perf_counter() readings of a heartbeat sampled for the stage histogram.
        self.marks: tuple[float, float, float] | None = None

    @property
    def log(self) -> structlog.typing.FilteringBoundLogger:
        """This connection's logger, built per line rather than kept: an idle session
        should cost little more than its socket (docs/performance.md, idle memory)."""
        session = self.session
        fields = {"peer": self.peer}
        if session is not None:
            fields["conn"] = session.conn
            if session.claims is not None:
                fields |= {"tid": str(session.claims.tid), "sub": session.claims.sub}
        return _log.bind(**fields)

    @property
    def peer(self) -> str:
        """The client's address and port, for logs: a PROXY header's, else the TCP
        peer's (not kept: see ``log``)."""
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
        would be to return to the same waiting state). tests/test_connection.py holds
        this path equal, byte for byte and event for event, to the parser's on split,
        coalesced, fragmented and interleaved-control input.
        """
        if (
            self.aligned
            and len(data) == HEARTBEAT_FRAME_LENGTH
            and data[0] == HEARTBEAT_FRAME_HEAD[0]
            and data[1] == HEARTBEAT_FRAME_HEAD[1]
        ):
            try:
                self._message(apply_mask(data[6:], data[2:6]))
            except Exception:
                self._internal_error()
            self._write()
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
            ws.receive_data(data)
            for event in ws.events_received():
                if isinstance(event, Frame):
                    self._frame(event)
                else:
                    self._request(event)  # type: ignore[arg-type]
            session = self.session
            if ws.close_sent is not None and session is not None:
                self._failed(session)
        except Exception:
            self._internal_error()
        self.aligned = self.fast_path and at_frame_start(ws)
        self._write()

    def _preface(self, data: bytes) -> bytes:
        """The connection's first bytes, below TLS and HTTP: a PROXY protocol header
        (the HAProxy specification, tokend/proxy_protocol.py) from a trusted balancer,
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
        """The upgrade request, parsed by tokend.handshake when it can be (else by
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
        if self.session is not None:
            self._close(self.session.close(p.CloseCode.INTERNAL_ERROR, "internal_error"))

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
        session = self.session
        if session is not None:
            if session.abandon():
                self.log.info("connection dropped")
            self.gate.node.detach(self)
        self.gate.closed(self)

    def pause_writing(self) -> None:
        """The client reads slower than we write: read nothing more from it (no more
        ACKs or pongs to write) and drop it if this lasts ``send_timeout``."""
        self._pause_reading()
        self.stall = asyncio.get_running_loop().call_later(
            self.gate.settings.send_timeout, self._stalled
        )

    def resume_writing(self) -> None:
        if self.stall is not None:
            self.stall.cancel()
            self.stall = None
        if self.paused:
            self._resume_reading()

    # Incoming

    def _request(self, request: Request) -> None:
        path = request.path.partition("?")[0]
        assert self.ip is not None  # addressed before any byte reaches websockets
        answer = self.gate.answer(self.ip, path)
        if answer is None:
            response = self.ws.accept(request)
            self.ws.send_response(response)
            if response.status_code == 101:
                self._opened()
            else:
                self.log.info("handshake refused", status=response.status_code, path=path)
        elif isinstance(answer, HttpAnswer):
            self.ws.send_response(_response(answer))
        else:
            self.gate.node.background.spawn(self._answer_later(answer))

    async def _answer_later(self, answer: Awaitable[HttpAnswer]) -> None:
        response = _response(await answer)
        if self.ws.state is State.CONNECTING and self.transport is not None:
            self.ws.send_response(response)
            self._write()

    def _opened(self) -> None:
        node = self.gate.node
        self.session = Session(node, self.gate.cadence, node.new_conn_id(), time.monotonic)
        self._arm(self.gate.settings.hello_timeout, self._hello_timed_out)

    def _frame(self, frame: Frame) -> None:
        opcode = frame.opcode
        if opcode in _DATA and self.session is not None and self.session.phase is Phase.CLOSED:
            return  # data after our close frame (RFC 6455 5.5.1: the closing handshake)
        if opcode is Opcode.BINARY:
            if frame.fin:
                self._message(frame.data)
            else:
                self.fragments = bytearray(frame.data)
        elif opcode is Opcode.CONT:
            # websockets has checked the order of fragments and their total size.
            assert self.fragments is not None
            self.fragments += frame.data
            if frame.fin:
                message, self.fragments = bytes(self.fragments), None
                self._message(message)
        elif opcode is Opcode.TEXT:
            assert self.session is not None
            self._outcome(self.session.text_message())
        elif opcode is Opcode.PING:
            self._ping()
        elif opcode is Opcode.CLOSE:
            session = self.session
            if session is not None and session.abandon():
                rcvd = self.ws.close_rcvd
                self.log.info("connection closed by client", code=rcvd.code if rcvd else None)

    def _ping(self) -> None:
        """websockets answers each ping; they count against ``max_frame_rate``.

        The pong is written without flow control, so an unlimited ping flood from a
        client that reads nothing would grow the write buffer without bound.
        """
        rate = self.gate.settings.max_frame_rate
        if not rate:
            return
        if self.pings is None:
            self.pings = TokenBucket(rate, time.monotonic)
        if not self.pings.take() and self.session is not None:
            self._outcome(self.session.close(p.CloseCode.RATE_LIMITED, "too_many_pings"))

    def _message(self, data: bytes | bytearray | memoryview) -> None:
        session = self.session
        assert session is not None
        metrics = self.gate.node.metrics
        received = time.perf_counter() if metrics.sampling() else 0.0
        try:
            frame = p.decode(data)  # type: ignore[arg-type]
        except p.ProtocolError as exc:
            self.log.info("malformed message", error=str(exc))
            self._outcome(session.malformed())
            return
        shed_from = self.gate.node.shedder.shed_from
        if received:
            decoded = time.perf_counter()
            outcome = session.receive(frame, shed_from)
            if outcome is Ask.HEARTBEAT:
                self.marks = (received, decoded, time.perf_counter())
        else:
            outcome = session.receive(frame, shed_from)
        self._outcome(outcome)

    def _outcome(self, outcome: Ask | Close | None) -> None:
        if outcome is Ask.HEARTBEAT:
            self.gate.node.heartbeat_batcher.submit(self)
            if len(self.session.unanswered) >= READ_PAUSE_AT:  # type: ignore[union-attr]
                self._pause_reading()
        elif outcome is Ask.START:
            self.gate.node.hello_batcher.submit(self)
            # The store must answer within hello_timeout, or 1013 (Session.hello_timed_out).
            self._arm(self.gate.settings.hello_timeout, self._hello_timed_out)
        elif outcome is Ask.BYE:
            self.gate.node.background.spawn(self._bye())
        elif outcome is not None:
            self._close(outcome)

    # The store's answers (called by the node's batchers)

    def hello_answered(self, answer: HelloAnswer) -> None:
        session = self.session
        assert session is not None
        welcome = session.started(answer)
        if welcome is Ask.START:  # the store asks for the token verified first
            self._outcome(welcome)
            self._write()
            return
        if not isinstance(welcome, bytes):
            self._close(welcome)
            # Closed before the answer came, which gave it the session: released at once.
            self.gate.node.release(self)
        elif self.transport is not None and not self.transport.is_closing():
            self._disarm()
            node = self.gate.node
            assert session.claims is not None
            self.heartbeat_request = node.store.heartbeat_request(session.claims.tid, session.conn)
            node.attach(self)
            self.send([welcome])
            # debug: in a connect storm an info line per session costs a tenth of the
            # work; SESSION_STARTED / SESSION_RESUMED on the event stream are the record.
            self.log.debug(
                "session resumed" if session.resumed else "session started", exp=session.exp_ms
            )
        self._write()

    def hello_failed(self, error: Exception) -> None:
        assert self.session is not None
        if isinstance(error, StoreUnavailable):
            self._close(self.session.store_unavailable())
        else:
            self._close(self.session.close(p.CloseCode.INTERNAL_ERROR, "internal_error"))
        self._write()

    def heartbeats_stored(self, answer: HeartbeatAnswer) -> None:
        """The batch flush stored this connection's heartbeats: send their ACKs."""
        session = self.session
        assert session is not None
        stored = time.perf_counter() if self.marks is not None else 0.0
        out = session.stored(answer)
        if self.paused:
            self._resume_reading()
        if isinstance(out, list):
            if answer.was_warn:
                self.log.info("session recovered")
            self.send(out)
            metrics = self.gate.node.metrics
            metrics.acked(len(out), answer.renewed)
            if stored:
                assert self.marks is not None
                metrics.stages((*self.marks, stored, time.perf_counter()))
                self.marks = None
        elif out is not None:
            self._close(out)
            self._write()

    def heartbeats_held(self) -> None:
        """The store is unavailable: ACK from what the session knows (replayed later)."""
        assert self.session is not None
        acks = self.session.held_back()
        if self.paused:
            self._resume_reading()
        if acks:
            self.send(acks)

    def _pause_reading(self) -> None:
        if self.transport is not None and not self.paused:
            self.paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        """Read again, unless writes are paused or too many heartbeats wait for the store."""
        transport, session = self.transport, self.session
        if (
            transport is None
            or transport.is_closing()
            or self.stall is not None
            or (session is not None and len(session.unanswered) >= READ_PAUSE_AT)
        ):
            return
        self.paused = False
        transport.resume_reading()

    def known(self) -> Known | None:
        """What this connection knows of its session, to restore it with should Redis have
        lost it (tokend.store.sessions.Known); None before WELCOME."""
        session = self.session
        if session is None or session.claims is None or not session.since_ms:
            return None
        claims = session.claims
        return Known(
            claims.sub,
            claims.prio,
            session.iat_s,
            session.exp_ms,
            session.since_ms,
            session.next_proof,
        )

    def replayed(self, answer: HeartbeatAnswer) -> None:
        """A heartbeat held through an outage was stored at last."""
        assert self.session is not None
        close = self.session.replayed(answer)
        if close is not None:
            self._close(close)
            self._write()

    async def _bye(self) -> None:
        session = self.session
        assert session is not None and session.claims is not None
        node = self.gate.node
        try:
            await node.store.end(
                session.claims.tid,
                conn=session.conn,
                event="SESSION_CLOSED",
                tomb=Ended.CLOSED,
                code=None,
            )
        except NotConfirmed:
            close = session.bye_unconfirmed()
        except StoreUnavailable:
            close = session.store_unavailable()
        else:
            close = session.ended()
        self._close(close)
        self._write()

    # Other nodes, the sweeper, the drain

    def warn(self) -> None:
        """The session entered WARN: NOTICE."""
        assert self.session is not None
        notice = self.session.warn()
        if notice is not None:
            self.log.info("notice sent: session in WARN")
            self.send([notice])

    def told_to_close(self, code: int | None) -> None:
        """The store (another node's script, a sweep) ends this session."""
        assert self.session is not None
        self._close(self.session.told_to_close(code))
        self._write()

    def close(self, code: p.CloseCode, reason: str) -> None:
        """Close from outside the client's messages: a drain, a failed flush."""
        if self.session is None:  # still in the opening handshake
            if self.transport is not None:
                self.transport.close()
            return
        self.send_close(self.session.close(code, reason))

    def send_close(self, close: Close | None) -> None:
        """Carry out a close the session decided (the node's planned close sends it once
        the session's release is recorded: Node.going_away)."""
        self._close(close)
        self._write()

    # Outgoing

    def send(self, messages: Sequence[bytes]) -> None:
        """Send binary messages, in one write to the socket.

        Framed by :func:`binary_frame` rather than through ``ServerProtocol.send_binary``
        (a frame object per message): an ACK is a few bytes, and this is half of what
        sending it costs in Python. The protocol's rule for sending, OPEN and no
        fragmented message of ours under way (tokend sends none), is kept here.
        """
        transport = self.transport
        if self.ws.state is not State.OPEN or transport is None or transport.is_closing():
            return
        pending = self.ws.data_to_send()  # none outside data_received; kept in order
        if len(messages) == 1 and not pending:
            transport.write(binary_frame(messages[0]))
        else:
            transport.write(b"".join([*pending, *map(binary_frame, messages)]))

    def _close(self, close: Close | None) -> None:
        """Start the closing handshake (RFC 6455 7.1.2) with the session's close."""
        if close is None:
            return
        if close.reason == OVERLOADED:
            # Counted, not logged one by one: the node logs its shedding steps.
            assert self.session is not None and self.session.claims is not None
            self.gate.node.metrics.shed[self.session.claims.prio] += 1
        elif close.routine:
            self.log.info("closing", code=int(close.code), reason=close.reason)
        else:
            self.log.warning("closing", code=int(close.code), reason=close.reason)
        self.gate.node.metrics.closed(close.code)
        if self.ws.state is State.OPEN:
            self.ws.send_close(close.code, close.reason)

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
        self._disarm()
        self.deadline = asyncio.get_running_loop().call_later(delay, callback)

    def _disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _hello_timed_out(self) -> None:
        self.deadline = None
        if self.session is None:  # the opening did not finish in time
            if self.ip is None:
                self.log.warning(
                    "closed: no PROXY protocol header within hello_timeout",
                    hello_timeout=self.gate.settings.hello_timeout,
                )
            self._abort()
            return
        close = self.session.hello_timed_out()
        if close is not None:
            self.gate.node.hello_batcher.forget(self)  # not stored if not yet sent
        self._close(close)
        self._write()

    def _abort(self) -> None:
        self.deadline = None
        if self.transport is not None:
            self.transport.abort()

    def _stalled(self) -> None:
        self.stall = None
        node = self.gate.node
        node.metrics.dropped["not_reading"] += 1
        assert self.transport is not None
        self.log.warning(
            "dropping connection: client not reading",
            send_timeout=self.gate.settings.send_timeout,
            unsent=self.transport.get_write_buffer_size(),
        )
        if self.session is not None:
            self.session.abandon()
        self.transport.abort()


def binary_frame(payload: bytes) -> bytes:
    """A server's unfragmented binary frame (RFC 6455 5.2: FIN, opcode 2, unmasked, the
    shortest payload length encoding), as ``Frame(BINARY, payload).serialize(mask=False)``
    makes it; tests/test_connection.py holds the two equal."""
    n = len(payload)
    if n < 126:
        return bytes((0x82, n)) + payload
    if n < 0x10000:
        return _HEAD_16.pack(0x82, 126, n) + payload
    return _HEAD_64.pack(0x82, 127, n) + payload


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
_DATA = frozenset({Opcode.BINARY, Opcode.CONT, Opcode.TEXT})


def _response(answer: HttpAnswer) -> Response:
    headers, body = answer.encoded()
    return Response(answer.status.value, answer.status.phrase, Headers(headers), body)
