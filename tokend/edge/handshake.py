"""The opening handshake of a connection, server side (RFC 6455 4.1, 4.2), Sans-I/O.

:class:`Handshake` takes a connection's bytes until its request's head is whole (the
path then says whether the gate answers it itself: :meth:`Handshake.answer`), then
switches protocols (:meth:`Handshake.switch`) or refuses, and hands on the bytes that
came after the head (:attr:`Handshake.rest`: frames for :mod:`tokend.edge.websocket`).

The common requests never reach websockets: the parser both listeners read with
(:class:`tokend.edge.http_request.RequestParser`: httptools, llhttp as uvicorn uses it)
splits the head, and :func:`switch_protocols` writes the 101 of the shapes clients send
(one ``Connection: Upgrade``, ``Upgrade: websocket``, a key of 16 bytes, version 13, an
allowed Origin, ``tokend.v1`` or no subprotocol) as websockets' ``ServerProtocol.accept``
and ``send_response`` write it. Everything else goes to websockets' public Sans-I/O API
(``ServerProtocol.receive_data``, ``accept``, ``send_response``): a head the shared
parser does not take, or takes in a way websockets might not (see :func:`parse`), is
handed to websockets' parser byte for byte, up to its end and no further; a request
:func:`switch_protocols` is not certain of, to ``accept``; the gate's own answers, to
``send_response``. tests/test_handshake.py holds the outcome equal to websockets' own
(the request, the response, the bytes after the head) on any input.

A resume storm's requests differ only in their Sec-WebSocket-Key: a head parsed once is
remembered (:class:`_Known`) with what :func:`_switchable` found of it, and the same head
with another client's key is neither parsed nor checked again.
"""

from __future__ import annotations

import base64
import binascii
import email.utils
import hashlib
import logging
import re
import time
from collections.abc import Sequence
from typing import NamedTuple, cast

from websockets.datastructures import Headers
from websockets.exceptions import NegotiationError
from websockets.http11 import MAX_LINE_LENGTH, MAX_NUM_HEADERS, Request, Response
from websockets.server import ServerProtocol
from websockets.typing import Origin, Subprotocol

from tokend.core import protocol as p
from tokend.edge.http_request import HTTPError, RequestParser

HEAD_END = b"\r\n\r\n"
# A head longer than this goes to websockets' parser (which takes longer lines one by
# one, up to MAX_LINE_LENGTH each): no common client sends one. Below the shared
# parser's MAX_HEAD, so that every line taken here is one websockets takes too.
MAX_HEAD_LENGTH = MAX_LINE_LENGTH
# What websockets' header value check refuses (its value pattern's complement), and a
# CR or LF anywhere but at a line's end (checked by counts, see Head.feed).
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
# RFC 6455 1.3: the GUID of the Sec-WebSocket-Accept computation.
_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
# websockets logs each handshake at info through the standard library.
_ws_logger = logging.getLogger("websockets.server")


class Parsed(NamedTuple):
    """A request head parsed here: a GET of HTTP/1.1 (the only requests taken here), its
    target and its header fields in order, as sent; for a head known but for its key
    (:class:`_Known`), what :func:`_switchable` found of the first such head, which is
    this one's (the same bytes, a key as valid)."""

    target: bytes
    fields: list[tuple[bytes, bytes]]
    known: tuple[_Switch | None] | None = None

    def request(self) -> Request:
        """websockets' ``Request`` of this head, as its parser makes it."""
        headers = Headers([(name.decode(), value.decode()) for name, value in self.fields])
        return Request(self.target.decode(), headers)


class Head:
    """The bytes of a connection's request head, gathered until it ends.

    :meth:`feed` answers ``(parsed, rest)`` once the head is whole: the head parsed here
    (None: hand every byte received, ``rest``, to websockets' parser instead) and the
    bytes after the head (a HELLO sent without waiting for the 101, say).
    """

    __slots__ = ("received",)

    def __init__(self) -> None:
        self.received = b""

    def feed(self, data: bytes) -> tuple[Parsed | None, bytes] | None:
        """None while the head is incomplete and may still be parsed here."""
        received = self.received + data if self.received else data
        end = received.find(HEAD_END)
        if end < 0:
            # A bare CR or LF, or a head too long: websockets decides, at once, as it would.
            if len(received) > MAX_HEAD_LENGTH or not _only_crlf(received):
                return None, received
            self.received = received
            return None
        end += len(HEAD_END)
        head, rest = received[:end], received[end:]
        parsed = parse(head)
        if parsed is None:
            return None, received
        return parsed, rest


def _only_crlf(data: bytes) -> bool:
    """Every CR is followed by LF and every LF preceded by CR (a split CRLF may end it)."""
    crlf = data.count(b"\r\n")
    cr, lf = data.count(b"\r"), data.count(b"\n")
    return lf == crlf and cr - crlf <= (1 if data.endswith(b"\r") else 0)


def parse(head: bytes) -> Parsed | None:
    """``head`` (the bytes up to and including the blank line) parsed, or None when
    websockets' parser is not certain to read it the same way.

    Taken: what llhttp parsed, written out again as ``GET SP target SP HTTP/1.1 CRLF``,
    each header as ``name: value CRLF``, then CRLF, is the head exactly, within
    websockets' limits (line length, header count), ASCII, without a body
    (Transfer-Encoding, Content-Length), a control character or whitespace ending a
    line. Other methods and versions, which websockets' releases read differently, go
    to its parser. A head that differs from one parsed before only in its
    Sec-WebSocket-Key's value (see :class:`_Known`) is not parsed again.
    """
    known = _known.get(head)
    if known is not None:
        return known
    parsed = _parse(head)
    if parsed is not None:
        _known.remember(head, parsed)
    return parsed


def _parse(head: bytes) -> Parsed | None:
    # bytes.find rather than ``in``: ``in`` tries the operand as an int first, and the
    # TypeError it clears costs more than the search (CPython 3.11).
    if (
        len(head) > MAX_HEAD_LENGTH
        or not head.startswith(b"GET ")
        or not head.isascii()  # obs-text in a value: rare, websockets' to decode
        or _CONTROL.search(head.replace(b"\r\n", b""))
        or head.find(b" \r\n") >= 0  # whitespace websockets strips from a value's end
        or head.find(b"\t\r\n") >= 0
    ):
        return None
    lowered = head.lower()
    if lowered.find(b"content-length") >= 0 or lowered.find(b"transfer-encoding") >= 0:
        return None  # a body, which websockets refuses (or a value naming one: rare)
    parser = RequestParser()
    try:
        parser.feed(head)
    except HTTPError:
        return None  # websockets answers it
    fields = parser.fields
    if not parser.whole or parser.version != "1.1" or len(fields) > MAX_NUM_HEADERS:
        return None
    written = [b"GET ", parser.target, b" HTTP/1.1\r\n"]
    written += [b"%s: %s\r\n" % field for field in fields]
    written.append(b"\r\n")
    if b"".join(written) != head:
        return None
    return Parsed(parser.target, fields)


# The key's header line as clients write it, and a key as RFC 6455 4.1 has clients make
# it: the base64 of 16 bytes (24 characters, the last two "=").
_KEY_LINE = b"\r\nSec-WebSocket-Key: "
_KEY_NAME = b"sec-websocket-key"
_KEY = re.compile(rb"[A-Za-z0-9+/]{22}==")
_KEY_LENGTH = 24
# Heads remembered (each a few hundred bytes): the clients of a node send a handful of
# shapes; a peer that sends many more only empties the table (then they are parsed).
KNOWN_HEADS = 64


class _Switch(NamedTuple):
    """What :func:`switch_protocols` takes from a request it can answer."""

    origin: Origin | None
    subprotocol: bool  # tokend.v1 was offered (else no subprotocol header)


class _Known:
    """Heads parsed before, by their bytes but the Sec-WebSocket-Key's value: a resume
    storm's requests differ in nothing else (bench/results/2026-12-04-resume.md).

    The same bytes with a key of another 24 characters of base64 parse the same way
    whatever the parser: those characters are token characters (RFC 9110 5.6.2) and
    none is whitespace, a control character, a letter of "content-length" or
    "transfer-encoding" (which have a "-") or a CR or LF, so the head's lines, every
    check of :func:`_parse` and websockets' own parse come out as they did, but for
    that header's value. Taken only when the head has one Sec-WebSocket-Key line,
    spelt so; tests/test_handshake.py holds a known head's outcome equal to websockets'.
    """

    __slots__ = ("heads",)

    def __init__(self) -> None:
        # The head without its key's value -> the head parsed, its key's position among
        # the fields, and whether (and how) switch_protocols answers it.
        self.heads: dict[bytes, tuple[Parsed, int, _Switch | None]] = {}

    @staticmethod
    def _split(head: bytes) -> tuple[bytes, bytes] | None:
        """The head without its key's value, and the key; None if it has no key line
        as clients write it, or a key not made as RFC 6455 says."""
        start = head.find(_KEY_LINE)
        if start < 0:
            return None
        start += len(_KEY_LINE)
        end = start + _KEY_LENGTH
        key = head[start:end]
        if head[end : end + 2] != b"\r\n" or not _KEY.fullmatch(key):
            return None
        return head[:start] + head[end:], key

    def get(self, head: bytes) -> Parsed | None:
        split = self._split(head)
        if split is None:
            return None
        template, key = split
        known = self.heads.get(template)
        if known is None:
            return None
        parsed, index, switch = known
        fields = parsed.fields.copy()
        fields[index] = (fields[index][0], key)
        return Parsed(parsed.target, fields, (switch,))

    def remember(self, head: bytes, parsed: Parsed) -> None:
        split = self._split(head)
        if split is None:
            return
        names = [name.lower() for name, _ in parsed.fields]
        if names.count(_KEY_NAME) != 1:
            return
        heads = self.heads
        if len(heads) >= KNOWN_HEADS:
            heads.clear()
        heads[split[0]] = (parsed, names.index(_KEY_NAME), _switchable(parsed))


_known = _Known()


# Connection values that websockets' parse_connection reads as naming "upgrade".
_UPGRADE_CONNECTION = frozenset({b"upgrade", b"keep-alive, upgrade"})


def _switchable(parsed: Parsed) -> _Switch | None:
    """Whether the head is one ``ServerProtocol.accept`` certainly takes with tokend's
    protocol (whatever its ``origins``): one of each header websockets checks, each in a
    spelling its parsers read as accepted, a key of 16 bytes; None if not."""
    values: dict[bytes, list[bytes]] = {}
    for name, value in parsed.fields:
        values.setdefault(name.lower(), []).append(value)
    connection = values.get(b"connection", [])
    upgrade = values.get(b"upgrade", [])
    keys = values.get(b"sec-websocket-key", [])
    origins = values.get(b"origin", [])
    subprotocols = values.get(b"sec-websocket-protocol", [])
    if (
        len(connection) != 1
        or connection[0].lower() not in _UPGRADE_CONNECTION
        or len(upgrade) != 1
        or upgrade[0].lower() != b"websocket"
        or len(keys) != 1
        or values.get(b"sec-websocket-version") != [b"13"]
        or len(origins) > 1
        or subprotocols not in ([], [_SUBPROTOCOL_BYTES])
    ):
        return None
    try:
        if len(base64.b64decode(keys[0], validate=True)) != 16:
            return None
    except binascii.Error:
        return None
    return _Switch(Origin(origins[0].decode()) if origins else None, bool(subprotocols))


def switch_protocols(parsed: Parsed, origins: Sequence[str | None] | None) -> bytes | None:
    """The 101 of ``parsed`` (RFC 6455 4.2.2) as ``ServerProtocol.accept`` then
    ``send_response`` write it, when certain they would accept it with ``origins``;
    None (they are to answer it): a request :func:`_switchable` does not take, or whose
    Origin ``origins`` does not name exactly."""
    switch = parsed.known[0] if parsed.known is not None else _switchable(parsed)
    if switch is None:
        return None
    if origins is not None and switch.origin not in origins:
        return None  # websockets refuses it, or a pattern of its own matches it
    key = next(value for name, value in parsed.fields if name.lower() == _KEY_NAME)
    return (
        b"HTTP/1.1 101 Switching Protocols\r\nDate: %s\r\nUpgrade: websocket\r\n"
        b"Connection: Upgrade\r\nSec-WebSocket-Accept: %s\r\n%s\r\n"
        % (_date(), _accept_key(key), _CHOSEN if switch.subprotocol else b"")
    )


def _accept_key(key: bytes) -> bytes:
    """RFC 6455 4.2.2: the base64 of the SHA-1 of the key and the GUID."""
    return binascii.b2a_base64(hashlib.sha1(key + _GUID).digest(), newline=False)


_SUBPROTOCOL_BYTES = p.SUBPROTOCOL.encode()
_CHOSEN = b"Sec-WebSocket-Protocol: " + _SUBPROTOCOL_BYTES + b"\r\n"


_dated: tuple[int, bytes] = (0, b"")


def _date() -> bytes:
    """The Date header's value now (RFC 9110 5.6.7), as websockets writes it: made once a
    second (a resume storm answers thousands in one)."""
    global _dated
    second = int(time.time())
    if _dated[0] != second:
        _dated = (second, email.utils.formatdate(second, usegmt=True).encode())
    return _dated[1]


def select_subprotocol(
    protocol: ServerProtocol, subprotocols: Sequence[Subprotocol]
) -> Subprotocol | None:
    """websockets' subprotocol choice for tokend (RFC 6455 4.2.2 /subprotocol/):
    ``tokend.v1`` if offered; no header is accepted; only others is HTTP 400."""
    if not subprotocols:
        return None
    if p.SUBPROTOCOL in subprotocols:
        return Subprotocol(p.SUBPROTOCOL)
    raise NegotiationError(f"unsupported subprotocol; this server speaks {p.SUBPROTOCOL}")


class Handshake:
    """The opening handshake of one connection (RFC 6455 4.2), its bytes in, its answer out.

    Feed the connection's bytes to :meth:`receive_data` until it answers True (the
    request is whole: :attr:`path`); then :meth:`answer` with the gate's HTTP answer or
    :meth:`switch`. :meth:`data_to_send` is what to write (``b""``: half-close), as
    websockets' Sans-I/O API says. Once switched, :attr:`rest` holds the bytes that came
    after the head. ``origins`` are the acceptable Origin headers (None among them: no
    header), None for any.
    """

    __slots__ = ("head", "origins", "parsed", "protocol", "request", "rest", "scanned", "writes")

    def __init__(self, origins: Sequence[str | None] | None) -> None:
        self.origins = origins
        self.head: Head | None = Head()  # gathering a head to parse here
        self.parsed: Parsed | None = None  # the head, parsed here
        # websockets' protocol, once it has a part: the head went to its parser, or a
        # request was for it to answer.
        self.protocol: ServerProtocol | None = None
        self.request: Request | None = None  # the request websockets' parser made
        # The last bytes fed to websockets' parser (a head's end may straddle two reads).
        self.scanned = b""
        self.rest = b""
        self.writes: list[bytes] = []

    def _websockets(self) -> ServerProtocol:
        if self.protocol is None:
            self.protocol = ServerProtocol(
                origins=cast("Sequence[Origin | None] | None", self.origins),
                select_subprotocol=select_subprotocol,
                logger=_ws_logger,
            )
        return self.protocol

    @property
    def path(self) -> str:
        """The request's target (path and query), once :meth:`receive_data` said True."""
        if self.parsed is not None:
            return self.parsed.target.decode()
        assert self.request is not None
        return self.request.path

    def receive_data(self, data: bytes) -> bool:
        """Bytes of the connection: True once the request's head is whole (the bytes
        after it are :attr:`rest`); False while it is not, or when websockets refused it
        (its answer is then among the data to send). Bytes that come after the request
        while its answer is awaited are not read: a client sends frames after the 101."""
        if self.parsed is not None or self.request is not None:
            return False
        head = self.head
        if head is not None:
            fed = head.feed(data)
            if fed is None:
                return False
            self.head = None
            parsed, data = fed
            if parsed is not None:
                self.parsed, self.rest = parsed, data
                return True
        return self._to_websockets(data)

    def _to_websockets(self, data: bytes) -> bool:
        """Bytes for websockets' request parser, up to the head's end and no further: a
        head it parses ends at the first CRLF CRLF (each of its lines ends with CRLF,
        an empty one last); what follows is :attr:`rest`."""
        protocol = self._websockets()
        scanned = self.scanned + data
        end = scanned.find(HEAD_END)
        if end < 0:
            self.scanned = scanned[-(len(HEAD_END) - 1) :]
            protocol.receive_data(data)
        else:
            cut = end + len(HEAD_END) - len(self.scanned)
            protocol.receive_data(data[:cut])
            self.rest = data[cut:]
        for event in protocol.events_received():
            if isinstance(event, Request):
                self.request = event
                return True
        return False

    def receive_eof(self) -> None:
        """The client's end of the stream before its head was whole: websockets' answer."""
        protocol = self._websockets()
        if self.head is not None:
            protocol.receive_data(self.head.received)
            self.head = None
        protocol.receive_eof()

    def answer(self, response: Response) -> None:
        """Answer the request with ``response`` (not a 101); the stream then ends."""
        self._websockets().send_response(response)

    def switch(self) -> int:
        """Accept the request with a 101, or refuse it (websockets' refusal, with the
        stream's end): the response's status."""
        parsed = self.parsed
        if parsed is not None:
            response = switch_protocols(parsed, self.origins)
            if response is not None:
                self.writes.append(response)
                return 101
        request = self.request or (parsed.request() if parsed is not None else None)
        assert request is not None
        protocol = self._websockets()
        answer = protocol.accept(request)
        protocol.send_response(answer)
        return answer.status_code

    def data_to_send(self) -> list[bytes]:
        writes, self.writes = self.writes, []
        if self.protocol is not None:
            writes += self.protocol.data_to_send()
        return writes

    def close_expected(self) -> bool:
        """Whether the stream was ended, refused or answered: the client is to close."""
        return self.protocol is not None and self.protocol.close_expected()
