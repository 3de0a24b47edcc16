"""The opening handshake's HTTP request (RFC 6455 4.1, RFC 9112 3 and 5), parsed by llhttp.

websockets parses the upgrade request with a generator per line, a regex per header
and a ``Headers`` built one call at a time: a tenth of what a resume costs in Python
(docs/performance.md, "Resume"). Here the parser both listeners read with
(:class:`tokend.http_request.RequestParser`: httptools, llhttp as uvicorn uses it)
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
tests/test_handshake.py holds the two equal.
"""

from __future__ import annotations

import re

from websockets.datastructures import Headers
from websockets.http11 import MAX_LINE_LENGTH, MAX_NUM_HEADERS, Request
from websockets.protocol import Protocol
from websockets.server import ServerProtocol

from tokend.http_request import HTTPError, RequestParser

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
    including the blank line), or None when it is not certain to be the same."""
    if (
        len(head) > MAX_HEAD_LENGTH
        or not head.isascii()  # obs-text in a value: rare, websockets' to decode
        or _CONTROL.search(head.replace(b"\r\n", b""))
        or b" \r\n" in head  # whitespace websockets strips from a value's end
        or b"\t\r\n" in head
    ):
        return None
    lowered = head.lower()
    if b"content-length" in lowered or b"transfer-encoding" in lowered:
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


def hand_over(ws: ServerProtocol, request: Request) -> None:
    """Leave ``ws`` as its own parser leaves it after reading ``request``: the request
    queued as its event, the parser at the first frame (the bytes after the head are
    parsed as frames before the request is answered, as websockets does)."""
    ws.events.append(request)
    ws.parser = Protocol.parse(ws)
    next(ws.parser)
