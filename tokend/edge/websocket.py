"""A WebSocket connection after its opening handshake, server side (RFC 6455), Sans-I/O.

Bytes from the client go in (:meth:`WebSocket.receive_data`, :meth:`WebSocket.receive_eof`);
what tokend acts on comes out (:meth:`WebSocket.events_received`): whole binary messages
(``bytes``, their fragments joined), the start of a text message (:data:`TEXT`, which
the session closes with 4503), a ping (:data:`PING`, already answered) and the client's
close (:class:`Close`). What is to be written comes out of
:meth:`WebSocket.data_to_send`, ``b""`` standing for the end of the stream (half-close).

The client's bytes wait in an explicit buffer until a frame is whole: what was read and
not yet parsed is :meth:`WebSocket.unparsed`, and :attr:`WebSocket.at_frame_boundary`
says that nothing is (nor a fragmented message under way), so that a read holding one
whole frame may be taken as one, and a connection moved between processes between
frames.

It does what websockets' Sans-I/O ``ServerProtocol`` does once OPEN, byte for byte (the
same frames, the same close codes and reasons, at the same moment, the same state):
``tests/test_websocket.py`` holds the two equal on any input, cut anywhere. Like it, it
does not check the minimal length encoding nor the most significant bit of a 64-bit
length (5.2), and discards whatever follows a close (1.4). It sends only unfragmented,
unmasked frames; tokend negotiates no extension.
"""

from __future__ import annotations

import enum
import struct
from typing import Final, NamedTuple

__all__ = [
    "PING",
    "TEXT",
    "Close",
    "Event",
    "Ping",
    "State",
    "TextMessage",
    "WebSocket",
    "binary_frame",
    "unmask",
    "unmask_in_python",
]


class State(enum.Enum):
    """RFC 6455 4.1, 7.1.3, 7.1.4: OPEN until a close frame was sent or the connection
    failed (CLOSING), CLOSED once the client's end of the stream came after that."""

    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


# Read once: on Python 3.11 an Enum class's attribute costs a __getattr__ hook.
_OPEN, _CLOSING, _CLOSED = State.OPEN, State.CLOSING, State.CLOSED


class Close(NamedTuple):
    """A close frame's status code and reason (RFC 6455 5.5.1, 7.1.5, 7.1.6)."""

    code: int
    reason: str


class TextMessage:
    """A text message began (RFC 6455 5.6): tokend's protocol is binary, so its content
    is never read."""

    __slots__ = ()


class Ping:
    """A ping came; its pong is already among the data to send (RFC 6455 5.5.2)."""

    __slots__ = ()


TEXT: Final = TextMessage()
PING: Final = Ping()
Event = bytes | TextMessage | Ping | Close

# RFC 6455 5.2: opcodes.
CONT, TEXT_OPCODE, BINARY, CLOSE, PING_OPCODE, PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
_OPCODES = frozenset({CONT, TEXT_OPCODE, BINARY, CLOSE, PING_OPCODE, PONG})
# RFC 6455 7.4.1 and the IANA registry: the codes a close frame may carry; and 7.4.2,
# 3000-4999 for libraries, frameworks and applications.
_SENDABLE_CODES = frozenset(
    {1000, 1001, 1002, 1003, 1007, 1008, 1009, 1010, 1011, 1012, 1013, 1014}
)
NO_STATUS_RCVD = 1005
PROTOCOL_ERROR = 1002
INVALID_DATA = 1007
MESSAGE_TOO_BIG = 1009
_U16 = struct.Struct("!H")
_U64 = struct.Struct("!Q")
_FRAME_HEAD_16 = struct.Struct("!BBH")
_FRAME_HEAD_64 = struct.Struct("!BBQ")


class ProtocolError(Exception):
    """The client broke RFC 6455: the connection fails with 1002 and this reason."""


def unmask_in_python(data: bytes | bytearray | memoryview, mask: bytes | bytearray) -> bytes:
    """A client's payload unmasked (RFC 6455 5.3): each byte XORed with the masking key's
    byte at its position modulo 4, done as one XOR of two integers. (The signature of
    websockets' apply_mask, which stands in its place.)"""
    n = len(data)
    key = (mask * (n // 4 + 1))[:n]
    return (int.from_bytes(data) ^ int.from_bytes(key)).to_bytes(n)


# The XOR loop websockets' frames module masks with: its C one where its wheel has it,
# which spares a heartbeat unmask_in_python's two integer conversions
# (bench/results/2026-12-04-websocket-layer.md), else its pure-Python one. The name is
# not in websockets' documented API: tests/test_websocket.py holds it to the documented
# websockets.utils.apply_mask, and tokend's own serves if it goes.
try:
    from websockets.frames import apply_mask as unmask
except ImportError:  # pragma: no cover
    unmask = unmask_in_python


def frame(opcode: int, payload: bytes) -> bytes:
    """A server's unfragmented, unmasked frame (RFC 6455 5.2), the shortest length
    encoding."""
    n = len(payload)
    head = 0x80 | opcode
    if n < 126:
        return bytes((head, n)) + payload
    if n < 0x10000:
        return _FRAME_HEAD_16.pack(head, 126, n) + payload
    return _FRAME_HEAD_64.pack(head, 127, n) + payload


def binary_frame(payload: bytes) -> bytes:
    """A server's unfragmented binary frame (RFC 6455 5.2, 5.6): FIN, opcode 2, unmasked."""
    n = len(payload)
    if n < 126:  # every ACK without a token: one allocation
        return SHORT_BINARY_HEADS[n] + payload
    return frame(BINARY, payload)


# The two-byte heads of the binary frames of 0..125 bytes, made once.
SHORT_BINARY_HEADS = [bytes((0x80 | BINARY, n)) for n in range(126)]


def close_payload(code: int, reason: str) -> bytes:
    """The body of a close frame (RFC 6455 5.5.1): the code, then the reason in UTF-8;
    ValueError for a code no close frame may carry (7.4) or a body over 125 bytes."""
    if code not in _SENDABLE_CODES and not 3000 <= code < 5000:
        raise ValueError(f"close code {code} may not be sent")
    payload = _U16.pack(code) + reason.encode()
    if len(payload) > 125:
        raise ValueError("close reason too long")
    return payload


def parse_close(payload: bytes) -> Close:
    """The code and reason of a client's close frame (RFC 6455 5.5.1, 7.1.5, 7.1.6): no
    body is 1005; one byte, or a code no close frame may carry (7.4), is a ProtocolError;
    a reason that is not UTF-8 raises UnicodeDecodeError (8.1)."""
    if len(payload) >= 2:
        (code,) = _U16.unpack(payload[:2])
        reason = payload[2:].decode()
        if code not in _SENDABLE_CODES and not 3000 <= code < 5000:
            raise ProtocolError("invalid status code")
        return Close(code, reason)
    if not payload:
        return Close(NO_STATUS_RCVD, "")
    raise ProtocolError("close frame too short")


class MessageTooBig(Exception):
    """A frame would take a message over the size limit: the connection fails with 1009."""


class WebSocket:
    """One WebSocket connection, OPEN after its handshake, as its server (RFC 6455).

    ``max_size`` bounds a message (all its fragments) in bytes; None for no bound.
    Invariants: :attr:`buffer` holds the beginning of one frame, never a whole one;
    ``current_size`` is the size of the fragmented message under way (None between
    messages), whose fragments so far ``fragments`` holds when it is binary; once a
    close frame was sent or received, or the connection failed, every byte that comes
    is discarded (``discarding``).
    """

    __slots__ = (
        "at_frame_boundary",
        "buffer",
        "close_rcvd",
        "close_sent",
        "current_size",
        "discarding",
        "eof",
        "eof_sent",
        "events",
        "fragments",
        "max_size",
        "state",
        "writes",
    )

    def __init__(self, max_size: int | None = 2**20) -> None:
        self.max_size = max_size
        self.state = _OPEN
        self.buffer = b""
        self.current_size: int | None = None
        self.fragments: bytearray | None = None
        self.close_rcvd: Close | None = None
        self.close_sent: Close | None = None
        self.discarding = False
        self.eof = False  # the client's end of the stream came
        self.eof_sent = False
        self.events: list[Event] = []
        self.writes: list[bytes] = []
        # OPEN, nothing buffered, no fragmented message under way: the next byte begins
        # a frame, and a read of one whole frame holds all of it.
        self.at_frame_boundary = True

    # Bytes in

    def receive_data(self, data: bytes) -> None:
        """Bytes from the client: every whole frame among them is acted on (5.2-5.5):
        its events queued for :meth:`events_received`, a pong or a close to send queued
        for :meth:`data_to_send`; the beginning of a frame waits for the rest."""
        if self.eof:
            raise EOFError("stream ended")
        if self.discarding:
            return
        buffer = self.buffer + data if self.buffer else data
        try:
            self.buffer = self._frames(buffer)
        except ProtocolError as exc:
            self._fail(PROTOCOL_ERROR, str(exc))
        except UnicodeDecodeError as exc:
            self._fail(INVALID_DATA, f"{exc.reason} at position {exc.start}")
        except MessageTooBig as exc:
            self._fail(MESSAGE_TOO_BIG, str(exc))
        self.at_frame_boundary = (
            self.state is _OPEN and not self.buffer and self.current_size is None
        )

    def _frames(self, buffer: bytes) -> bytes:
        """Act on every whole frame at the start of ``buffer``; what is left of it."""
        offset, end = 0, len(buffer)
        while not self.discarding and end - offset >= 2:
            head1, head2 = buffer[offset], buffer[offset + 1]
            opcode = head1 & 0x0F
            if opcode not in _OPCODES:
                raise ProtocolError("invalid opcode")
            if not head2 & 0x80:  # 5.1: a client masks every frame it sends
                raise ProtocolError("incorrect masking")
            length = head2 & 0x7F
            start = offset + 2
            if length == 126:
                if end - start < 2:
                    break
                (length,) = _U16.unpack_from(buffer, start)
                start += 2
            elif length == 127:
                if end - start < 8:
                    break
                (length,) = _U64.unpack_from(buffer, start)
                start += 8
            self._check_size(length)
            stop = start + 4 + length
            if stop > end:
                break
            payload = unmask(buffer[start + 4 : stop], buffer[start : start + 4])
            offset = stop
            if head1 & 0x70:
                raise ProtocolError("reserved bits must be 0")
            if opcode >= CLOSE:  # 5.5: control frames
                if length > 125:
                    raise ProtocolError("control frame too long")
                if not head1 & 0x80:
                    raise ProtocolError("fragmented control frame")
                self._control(opcode, payload)
            else:
                self._data(opcode, bool(head1 & 0x80), payload)
        return b"" if self.discarding or offset == end else buffer[offset:]

    def _check_size(self, length: int) -> None:
        """A frame of ``length`` bytes may not take its message over ``max_size``."""
        limit = self.max_size
        if limit is None:
            return
        current = self.current_size
        if current is None:
            if length > limit:
                raise MessageTooBig(f"frame with {length} bytes exceeds limit of {limit} bytes")
        elif length > limit - current:
            raise MessageTooBig(
                f"frame with {length} bytes after reading {current} bytes "
                f"exceeds limit of {limit} bytes"
            )

    def _data(self, opcode: int, fin: bool, payload: bytes) -> None:
        """A data frame (5.4, 5.6): a whole binary message is an event; a text message's
        first frame is :data:`TEXT`; nothing after our close frame is handed up."""
        open_ = self.state is _OPEN
        if opcode == CONT:
            if self.current_size is None:
                raise ProtocolError("unexpected continuation frame")
            fragments = self.fragments
            if fin:
                self.current_size = self.fragments = None
                if fragments is not None and open_:
                    fragments += payload
                    self.events.append(bytes(fragments))
            else:
                self.current_size += len(payload)
                if fragments is not None:
                    fragments += payload
            return
        if self.current_size is not None:
            raise ProtocolError("expected a continuation frame")
        if not fin:
            self.current_size = len(payload)
            # A text message's fragments are not kept: its first frame closes the session.
            self.fragments = bytearray(payload) if opcode == BINARY and open_ else None
        if not open_:
            return
        if opcode == BINARY:
            if fin:
                self.events.append(payload)
        else:
            self.events.append(TEXT)

    def _control(self, opcode: int, payload: bytes) -> None:
        """A control frame (5.5): a ping is answered with a pong of its payload (5.5.2),
        even after our close frame; a pong is no event (5.5.3); a close (5.5.1) is
        answered with a close of its payload, then the stream ends (7.1.1: the server
        closes the TCP connection first) and whatever follows is discarded (1.4)."""
        if opcode == PING_OPCODE:
            self.writes.append(frame(PONG, payload))
            if self.state is _OPEN:
                self.events.append(PING)
        elif opcode == CLOSE:
            self.close_rcvd = close = parse_close(payload)
            if self.current_size is not None:
                raise ProtocolError("incomplete fragmented message")
            if self.state is _OPEN:
                self.writes.append(frame(CLOSE, payload))
                self.close_sent = close
                self.state = _CLOSING
                self.events.append(close)
            self._send_eof()
            self.discarding = True

    def receive_eof(self) -> None:
        """The client's end of the stream (idempotent). Before a closing handshake it
        fails the connection without a close frame (7.1.5: 1006); the stream is ended in
        turn, and the connection is CLOSED (7.1.4)."""
        if self.eof:
            return
        self.eof = True
        self.buffer = b""
        if not self.eof_sent:
            self._send_eof()
        self.discarding = True
        self.state = _CLOSED
        self.at_frame_boundary = False

    # Bytes out

    def send_close(self, code: int, reason: str) -> None:
        """Start the closing handshake (7.1.2): a close frame with ``code`` and ``reason``;
        the stream ends once the client's close frame comes (or the caller's timer)."""
        if self.state is not _OPEN:
            raise RuntimeError(f"connection is {self.state.value}")
        self.writes.append(frame(CLOSE, close_payload(code, reason)))
        self.close_sent = Close(code, reason)
        self.state = _CLOSING
        self.at_frame_boundary = False

    def _fail(self, code: int, reason: str) -> None:
        """Fail the WebSocket connection (7.1.7): a close frame with ``code`` unless one
        was sent already, then the end of the stream; nothing more is read."""
        self.buffer = b""
        if self.state is _OPEN:
            self.writes.append(frame(CLOSE, close_payload(code, reason)))
            self.close_sent = Close(code, reason)
            self.state = _CLOSING
        if not self.eof_sent:
            self._send_eof()
        self.discarding = True

    def _send_eof(self) -> None:
        self.eof_sent = True
        self.writes.append(b"")

    def events_received(self) -> list[Event]:
        """The events of the bytes received since the last call, in order."""
        events, self.events = self.events, []
        return events

    def data_to_send(self) -> list[bytes]:
        """The bytes to write since the last call, in order; ``b""``: half-close now."""
        writes, self.writes = self.writes, []
        return writes

    def close_expected(self) -> bool:
        """Whether the client is to end the connection soon: a close frame was sent (or
        the connection failed) and the client's end of the stream has not come."""
        return self.state is _CLOSING

    def unparsed(self) -> bytes:
        """The bytes read and not yet parsed: the beginning of the next frame."""
        return self.buffer
