"""The opening handshake's HTTP request (RFC 6455 4.1, RFC 9112 3 and 5), parsed by llhttp.

websockets parses the upgrade request with a generator per line, a regex per header
and a ``Headers`` built one call at a time: a tenth of what a resume costs in Python
(bench/results/2026-12-04-resume.md). Here the parser both listeners read with
(:class:`tokend.edge.http_request.RequestParser`: httptools, llhttp as uvicorn uses it)
splits the request's head, and the result is handed to websockets as the ``Request``
its own parser would have made, queued as its parser queues it (then
``ServerProtocol.accept`` and ``send_response`` as before).

Only a head that websockets' parser is certain to read the same way is taken: what
llhttp parsed, written out again as ``METHOD SP path SP HTTP/1.x CRLF``, each header
as ``name: value CRLF``, then CRLF, must be the received bytes exactly, within
websockets' limits (line length, header count), ASCII, without a body
(Transfer-Encoding, Content-Length), a control character or whitespace ending a line.
Anything else (a request the shared parser refuses, an unusual but valid spelling, a
bare LF) goes to websockets' parser, byte for byte, which answers it as it always did.

The 101 of such a request, when websockets' ``accept`` is certain to take it (the
shapes clients send: one ``Connection: Upgrade``, ``Upgrade: websocket``, a key of
16 bytes, version 13, an allowed Origin, ``tokend.v1`` or no subprotocol), is written
by :func:`switch_protocols` byte for byte as ``accept`` and ``send_response`` write
it, and the protocol left as they leave it. tests/test_handshake.py holds the two
equal.

A resume storm's requests differ only in their Sec-WebSocket-Key: a head parsed once
is remembered (:class:`_Known`) with what :func:`switch_protocols` found of it, and
the same head with another client's key is neither parsed nor checked again.
"""

from __future__ import annotations

import base64
import binascii
import email.utils
import hashlib
import re
import time
from typing import NamedTuple

from websockets.datastructures import Headers
from websockets.http11 import MAX_LINE_LENGTH, MAX_NUM_HEADERS, Request
from websockets.protocol import Protocol, State
from websockets.server import ServerProtocol
from websockets.typing import Origin, Subprotocol
from websockets.utils import GUID

from tokend.core import protocol as p
from tokend.edge.http_request import HTTPError, RequestParser

HEAD_END = b"\r\n\r\n"
# A head longer than this goes to websockets' parser (which takes longer lines one by
# one, up to MAX_LINE_LENGTH each): no common client sends one. Below the shared
# parser's MAX_HEAD, so that every line taken here is one websockets takes too.
MAX_HEAD_LENGTH = MAX_LINE_LENGTH
# What websockets' header value check refuses (http11._value_re's complement), and a
# CR or LF anywhere but at a line's end (checked by counts, see Head.feed).
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_VERSIONS = {"1.1": "HTTP/1.1", "1.0": "HTTP/1.0"}


class Head:
    """The bytes of a connection's request head, gathered until it ends.

    :meth:`feed` answers ``(request, rest)`` once the head is whole: the ``Request``
    (None: hand every byte received, ``rest``, to websockets' parser instead) and the
    bytes after the head (a HELLO sent without waiting for the 101, say).
    """

    __slots__ = ("received",)

    def __init__(self) -> None:
        self.received = b""

    def feed(self, data: bytes) -> tuple[Request | None, bytes] | None:
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
        request = parse(head)
        if request is None:
            return None, received
        return request, rest


def _only_crlf(data: bytes) -> bool:
    """Every CR is followed by LF and every LF preceded by CR (a split CRLF may end it)."""
    crlf = data.count(b"\r\n")
    cr, lf = data.count(b"\r"), data.count(b"\n")
    return lf == crlf and cr - crlf <= (1 if data.endswith(b"\r") else 0)


def parse(head: bytes) -> Request | None:
    """The ``Request`` websockets' parser would make of ``head`` (the bytes up to and
    including the blank line), or None when it is not certain to be the same.

    A head that differs from one parsed before only in its Sec-WebSocket-Key's value
    (see :class:`_Known`) is not parsed again: its ``Request`` is the earlier one's
    with the new key.
    """
    known = _known.get(head)
    if known is not None:
        return known
    request = _parse(head)
    if request is not None:
        _known.remember(head, request)
    return request


def _parse(head: bytes) -> Request | None:
    # bytes.find rather than ``in``: ``in`` tries the operand as an int first, and the
    # TypeError it clears costs more than the search (CPython 3.11).
    if (
        len(head) > MAX_HEAD_LENGTH
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
    protocol = _VERSIONS.get(parser.version)
    fields = parser.fields
    if not parser.whole or protocol is None or len(fields) > MAX_NUM_HEADERS:
        return None
    method, url = parser.method, parser.target
    written = [method, b" ", url, b" ", protocol.encode(), b"\r\n"]
    written += [b"%s: %s\r\n" % field for field in fields]
    written.append(b"\r\n")
    if b"".join(written) != head:
        return None
    parsed = Headers()
    for name, value in fields:
        parsed.set_insecure(name.decode(), value.decode())
    return Request(url.decode(), parsed, method.decode(), protocol)


# The key's header line as clients write it, and a key as RFC 6455 4.1 has clients make
# it: the base64 of 16 bytes (24 characters, the last two "=").
_KEY_LINE = b"\r\nSec-WebSocket-Key: "
_KEY_NAME = "Sec-WebSocket-Key"
_KEY = re.compile(rb"[A-Za-z0-9+/]{22}==")
_KEY_LENGTH = 24
# Heads remembered (each a few hundred bytes): the clients of a node send a handful of
# shapes; a peer that sends many more only empties the table (then they are parsed).
KNOWN_HEADS = 64


class _Known:
    """Heads parsed before, by their bytes but the Sec-WebSocket-Key's value: a resume
    storm's requests differ in nothing else (bench/results/2026-12-04-resume.md).

    The same bytes with a key of another 24 characters of base64 parse the same way
    whatever the parser: those characters are token characters (RFC 9110 5.6.2) and
    none is whitespace, a control character, a letter of "content-length" or
    "transfer-encoding" (which have a "-") or a CR or LF, so the head's lines, every
    check of :func:`_parse` and websockets' own parse come out as they did, but for
    that header's value. Taken only when the head has one Sec-WebSocket-Key line,
    spelt so; tests/test_handshake.py holds a known head's ``Request`` equal to
    websockets' parse.
    """

    __slots__ = ("heads",)

    def __init__(self) -> None:
        # The head without its key's value -> the Request parsed, its key's position
        # among the headers, and whether (and how) switch_protocols answers it.
        self.heads: dict[bytes, tuple[Request, int, _Switch | None]] = {}

    @staticmethod
    def _split(head: bytes) -> tuple[bytes, str] | None:
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
        return head[:start] + head[end:], key.decode()

    def get(self, head: bytes) -> Request | None:
        split = self._split(head)
        if split is None:
            return None
        template, key = split
        known = self.heads.get(template)
        if known is None:
            return None
        request, index, switch = known
        # A copy of the first's headers but the key (the value lists are shared: no one
        # changes a request's), with what switch_protocols found of them.
        first = request.headers
        headers = _KnownHeaders.__new__(_KnownHeaders)  # Headers.__init__ parses its arguments
        headers._dict = first._dict.copy()
        headers._dict[_KEY_NAME.lower()] = [key]
        headers._list = first._list.copy()
        headers._list[index] = (_KEY_NAME, key)
        headers.switch = switch
        return Request(request.path, headers, request.method, request.protocol)

    def remember(self, head: bytes, request: Request) -> None:
        split = self._split(head)
        if split is None or len(request.headers.get_all(_KEY_NAME)) != 1:
            return
        names = [name for name, _ in request.headers.raw_items()]
        if names.count(_KEY_NAME) != 1:
            return
        heads = self.heads
        if len(heads) >= KNOWN_HEADS:
            heads.clear()
        heads[split[0]] = (request, names.index(_KEY_NAME), _switchable(request))


class _KnownHeaders(Headers):
    """The headers of a head known but for its key: with :func:`_switchable`'s answer
    for the head first parsed, which is this one's (the same bytes, a key as valid)."""

    __slots__ = ("switch",)

    switch: _Switch | None

    def copy(self) -> Headers:
        return Headers(self)  # a plain copy: the answer is this request's alone


_known = _Known()


def hand_over(ws: ServerProtocol, request: Request) -> None:
    """Leave ``ws`` as its own parser leaves it after reading ``request``: the request
    queued as its event, the parser at the first frame (the bytes after the head are
    parsed as frames before the request is answered, as websockets does)."""
    ws.events.append(request)
    ws.parser = Protocol.parse(ws)
    next(ws.parser)


# Connection values that websockets' parse_connection reads as naming "upgrade".
_UPGRADE_CONNECTION = frozenset({"upgrade", "keep-alive, upgrade"})


def switch_protocols(ws: ServerProtocol, request: Request) -> bool:
    """Accept ``request`` and send the 101 as ``ws.accept`` then ``ws.send_response``
    would, when certain they would accept it; False (nothing done): call them instead.

    Certain: the protocol is as tokend makes it (no extensions offered, no debug log),
    the request is one :func:`_switchable` takes, and its Origin one ``origins`` names
    exactly. A head known but for its key (:class:`_Known`) was found switchable or not
    when first parsed: its key, a client's, is 16 bytes of base64 as that one's was.
    """
    if ws.debug or ws.available_extensions is not None or ws.state is not _CONNECTING:
        return False
    headers = request.headers
    switch = headers.switch if type(headers) is _KnownHeaders else _switchable(request)
    if switch is None:
        return False
    origin, subprotocol = switch
    if ws.origins is not None and origin not in ws.origins:
        return False  # websockets refuses it, or a pattern of its own matches it
    ws.accept_called = True
    ws.origin = origin
    ws.extensions = []
    if subprotocol:
        ws.subprotocol = _SUBPROTOCOL
        chosen = _CHOSEN
    else:
        ws.subprotocol = None
        chosen = b""
    key = headers.get_all("Sec-WebSocket-Key")[0]
    ws.writes.append(
        b"HTTP/1.1 101 Switching Protocols\r\nDate: %s\r\nUpgrade: websocket\r\n"
        b"Connection: Upgrade\r\nSec-WebSocket-Accept: %s\r\n%s\r\n"
        % (_date(), _accept_key(key), chosen)
    )
    ws.state = _OPEN
    ws.logger.info("connection open")
    return True


class _Switch(NamedTuple):
    """What :func:`switch_protocols` takes from a request it can answer."""

    origin: Origin | None
    subprotocol: bool  # tokend.v1 was offered (else no subprotocol header)


def _switchable(request: Request) -> _Switch | None:
    """Whether ``request`` is one ``ServerProtocol.accept`` certainly takes with tokend's
    protocol (whatever its ``origins``): GET HTTP/1.1 with one of each header websockets
    checks, each in a spelling its parsers read as accepted, a key of 16 bytes; None if
    not. Reads nothing but the request."""
    if request.method != "GET" or request.protocol != "HTTP/1.1":
        return None
    headers = request.headers
    connection = headers.get_all("Connection")
    upgrade = headers.get_all("Upgrade")
    keys = headers.get_all("Sec-WebSocket-Key")
    origins = headers.get_all("Origin")
    subprotocols = headers.get_all("Sec-WebSocket-Protocol")
    if (
        len(connection) != 1
        or connection[0].lower() not in _UPGRADE_CONNECTION
        or len(upgrade) != 1
        or upgrade[0].lower() != "websocket"
        or len(keys) != 1
        or headers.get_all("Sec-WebSocket-Version") != ["13"]
        or len(origins) > 1
        or subprotocols not in ([], [p.SUBPROTOCOL])
    ):
        return None
    try:
        if len(base64.b64decode(keys[0].encode(), validate=True)) != 16:
            return None
    except binascii.Error:
        return None
    return _Switch(Origin(origins[0]) if origins else None, bool(subprotocols))


def _accept_key(key: str) -> bytes:
    """``websockets.utils.accept_key`` (RFC 6455 4.2.2: the base64 of the SHA-1 of the key
    and the GUID) as the bytes the 101 carries."""
    return binascii.b2a_base64(hashlib.sha1(key.encode() + _GUID).digest(), newline=False)


# Enum members read once: an Enum class's attribute costs a __getattr__ hook (3.11).
_CONNECTING, _OPEN = State.CONNECTING, State.OPEN
_SUBPROTOCOL = Subprotocol(p.SUBPROTOCOL)
_CHOSEN = b"Sec-WebSocket-Protocol: " + p.SUBPROTOCOL.encode() + b"\r\n"
_GUID = GUID.encode()


_dated: tuple[int, bytes] = (0, b"")


def _date() -> bytes:
    """The Date header's value now (RFC 9110 5.6.7), as websockets writes it: made once a
    second (a resume storm answers thousands in one)."""
    global _dated
    second = int(time.time())
    if _dated[0] != second:
        _dated = (second, email.utils.formatdate(second, usegmt=True).encode())
    return _dated[1]
