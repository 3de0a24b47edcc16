"""tokend/edge/handshake.py against websockets' public Sans-I/O ``ServerProtocol``.

The same bytes, cut into reads anywhere, go to websockets' ``ServerProtocol`` as it
parses them itself (``accept``/``send_response`` answering its request, the frames after
the head parsed by it), and to tokend's :class:`Handshake` (its 101 or websockets'
refusal, the bytes after the head to tokend's frame layer). Both must come to the same:
the same request (method, path, protocol, headers in order), the same response, byte
for byte but the Date, the same messages after a 101, the same end of the stream.
Valid requests of every common shape, a table of malformed ones, and hypothesis'
variations of both.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from websockets.datastructures import Headers
from websockets.frames import Frame, Opcode
from websockets.http11 import Request, Response
from websockets.server import ServerProtocol
from websockets.typing import Origin

from tokend.core import protocol as p
from tokend.edge import handshake
from tokend.edge.handshake import (
    HEAD_END,
    MAX_HEAD_LENGTH,
    Handshake,
    Parsed,
    parse,
    select_subprotocol,
    switch_protocols,
)
from tokend.edge.http_request import MAX_HEADERS
from tokend.edge.websocket import WebSocket

KEY = base64.b64encode(b"0123456789abcdef").decode()
HEADERS = [
    ("Host", "127.0.0.1:8765"),
    ("Upgrade", "websocket"),
    ("Connection", "Upgrade"),
    ("Sec-WebSocket-Key", KEY),
    ("Sec-WebSocket-Version", "13"),
    ("Sec-WebSocket-Protocol", p.SUBPROTOCOL),
]
# A masked binary frame a client may send right behind its request (a HELLO).
HELLO_FRAME = Frame(Opcode.BINARY, p.encode(p.Hello("a.b.c"))).serialize(mask=True)
MAX_SIZE = 16384


def request_bytes(
    headers: list[tuple[str, str]] = HEADERS,
    line: str = "GET /v1/ws HTTP/1.1",
    separator: str = ": ",
    eol: str = "\r\n",
) -> bytes:
    text = line + eol + "".join(f"{n}{separator}{v}{eol}" for n, v in headers) + eol
    return text.encode("latin-1")


@dataclass
class Outcome:
    request: tuple[Any, ...] | None  # what the request's head says (method, path, ...)
    status: int | str | None  # the response's, or what went wrong answering
    response: bytes  # the response as written, the Date header's value blanked
    messages: list[bytes]  # the binary messages after a 101
    eof_sent: bool


Origins = list[str | None] | None
_DATE = re.compile(rb"\r\nDate: [^\r]*\r\n")


def _outcome(
    request: tuple[Any, ...] | None,
    status: int | str | None,
    writes: list[bytes],
    messages: list[bytes],
) -> Outcome:
    responses = [w for w in writes if w.startswith(b"HTTP/")]
    response = _DATE.sub(
        lambda m: b"\r\nDate: " + b"-" * (len(m.group()) - 10) + b"\r\n", b"".join(responses)
    )
    return Outcome(request, status, response, messages if status == 101 else [], b"" in writes)


def _fields(request: Request) -> tuple[Any, ...]:
    return (
        getattr(request, "method", "GET"),  # websockets before 17 reads GET only
        request.path,
        getattr(request, "protocol", "HTTP/1.1"),  # and HTTP/1.1 only
        list(request.headers.raw_items()),
    )


def _websockets(origins: Origins = None) -> ServerProtocol:
    return ServerProtocol(
        origins=None if origins is None else [o if o is None else Origin(o) for o in origins],
        select_subprotocol=select_subprotocol,
        max_size=MAX_SIZE,
    )


def by_websockets(chunks: list[bytes], eof: bool = False, origins: Origins = None) -> Outcome:
    """websockets alone: its ServerProtocol parses the request, ``accept`` and
    ``send_response`` answer it, then it parses the frames after the head.

    Its parser is given the bytes up to the head's end (the first CRLF CRLF) until the
    request is answered, the rest after: given every byte at once, it would parse the
    frames behind the head before the request is answered, and fail on a bad one with
    its answer still to come. That the cut changes nothing of the request it reads is
    checked here too, against a parser given every byte.
    """
    data = b"".join(chunks)
    end = data.find(HEAD_END)
    head_end = end + len(HEAD_END) if end >= 0 else len(data)
    ws = _websockets(origins)
    request: tuple[Any, ...] | None = None
    status: int | str | None = None
    writes: list[bytes] = []
    messages: list[bytes] = []
    offset = 0
    for chunk in chunks:
        start, offset = offset, offset + len(chunk)
        if status is None:
            ws.receive_data(chunk[: max(0, head_end - start)])
            after = chunk[max(0, head_end - start) :]
        else:
            after = chunk
        for event in ws.events_received():
            if isinstance(event, Request):
                request = _fields(event)
                try:
                    response = ws.accept(event)
                    ws.send_response(response)
                    status = response.status_code
                except Exception as exc:
                    status = f"failed: {type(exc).__name__}"
        if status == 101 and after:
            ws.receive_data(after)
            messages += [
                bytes(e.data)
                for e in ws.events_received()
                if isinstance(e, Frame) and e.opcode is Opcode.BINARY
            ]
        writes += ws.data_to_send()
    if eof:
        ws.receive_eof()
        writes += ws.data_to_send()
    whole = _websockets(origins)
    whole.receive_data(data)
    requests = [_fields(e) for e in whole.events_received() if isinstance(e, Request)]
    assert requests == ([] if request is None else [request])
    return _outcome(request, status, writes, messages)


def by_handshake(chunks: list[bytes], eof: bool = False, origins: Origins = None) -> Outcome:
    """tokend: Connection's path through tokend.edge.handshake.Handshake, then the bytes
    after the head through tokend's frame layer."""
    opening = Handshake(origins)
    frames: WebSocket | None = None
    request: tuple[Any, ...] | None = None
    status: int | str | None = None
    writes: list[bytes] = []
    messages: list[bytes] = []
    for chunk in chunks:
        if frames is not None:
            frames.receive_data(chunk)
        elif status is None and opening.receive_data(chunk):
            source = opening.request
            if source is None:  # a known head: its request made from what was parsed before
                assert opening.parsed is not None
                source = opening.parsed.request()
            request = _fields(source)
            try:
                status = opening.switch()
            except Exception as exc:
                status = f"failed: {type(exc).__name__}"
            if status == 101:
                frames = WebSocket(MAX_SIZE)
                frames.receive_data(opening.rest)
        if frames is not None:
            messages += [m for m in frames.events_received() if type(m) is bytes]
        writes += opening.data_to_send() + (frames.data_to_send() if frames else [])
    if eof:
        if frames is not None:
            frames.receive_eof()
        else:  # as Connection.eof_received: the handshake takes it
            opening.receive_eof()
        writes += opening.data_to_send() + (frames.data_to_send() if frames else [])
    return _outcome(request, status, writes, messages)


def cut(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


def assert_same(
    data: bytes,
    cuts: list[int] = [],  # noqa: B006
    eof: bool = False,
    origins: Origins = None,
) -> Outcome:
    chunks = cut(data, cuts)
    expected = by_websockets(chunks, eof, origins)
    assert by_handshake(chunks, eof, origins) == expected
    return expected


# Valid requests

VALID = {
    "tokend client": request_bytes(),
    "browser-like": request_bytes(
        [
            ("Host", "example.com"),
            ("Connection", "Upgrade"),
            ("Pragma", "no-cache"),
            ("Cache-Control", "no-cache"),
            ("User-Agent", "Mozilla/5.0 (X11; Linux x86_64) Chrome/120.0"),
            ("Upgrade", "websocket"),
            ("Origin", "http://example.com"),
            ("Sec-WebSocket-Version", "13"),
            ("Accept-Encoding", "gzip, deflate, br"),
            ("Accept-Language", "en-US,en;q=0.9"),
            ("Sec-WebSocket-Key", KEY),
            ("Sec-WebSocket-Extensions", "permessage-deflate; client_max_window_bits"),
            ("Sec-WebSocket-Protocol", p.SUBPROTOCOL),
        ]
    ),
    "query string": request_bytes(line="GET /v1/ws?x=1&y=%20 HTTP/1.1"),
    "absolute form": request_bytes(line="GET http://127.0.0.1:8765/v1/ws HTTP/1.1"),
    "no subprotocol": request_bytes(HEADERS[:5]),
    "empty header value": request_bytes([*HEADERS, ("X-Empty", "")]),
    "obs-text value": request_bytes([*HEADERS, ("X-Latin", "caf\xe9")]),
    "tab inside a value": request_bytes([*HEADERS, ("X-Tab", "a\tb")]),
    "lower-case names": request_bytes([(n.lower(), v) for n, v in HEADERS]),
    "health check": request_bytes([("Host", "x")], line="GET /readyz HTTP/1.1"),
    # Spelt otherwise than clients do: websockets' parser takes these.
    "no space after colon": request_bytes(separator=":"),
    "trailing space in a value": request_bytes([*HEADERS, ("X-Trailing", "a ")]),
    # Refused by the parser both listeners read with (the admin listener's 400 and 431):
    # websockets decides them here.
    "no Host": request_bytes(HEADERS[1:]),
    "more header lines than the shared parser takes": request_bytes(
        [*HEADERS, *[(f"X-{i}", "1") for i in range(MAX_HEADERS)]]
    ),
    "just over the head limit": request_bytes(
        [*HEADERS, ("X-Big", "x" * (MAX_HEAD_LENGTH - len(request_bytes()) + 1))]
    ),
}


@pytest.mark.parametrize("name", VALID)
def test_a_valid_request_parses_as_websockets_parses_it(name: str) -> None:
    data = VALID[name]
    outcome = assert_same(data)
    assert outcome.request is not None


def test_the_common_requests_take_the_httptools_path() -> None:
    """The fast path is taken (else this module would only be websockets' again)."""
    for name in ("tokend client", "browser-like", "query string", "lower-case names"):
        request = parse(VALID[name])
        assert request is not None, name
        assert _fields(request.request()) == by_websockets([VALID[name]]).request


def test_what_the_shared_parser_refuses_websockets_decides() -> None:
    """A refusal of tokend.edge.http_request is no answer on the main port: those requests
    take websockets' parser, which accepts them (above, the same outcome)."""
    for name in ("no Host", "more header lines than the shared parser takes"):
        assert parse(VALID[name]) is None, name
        assert by_websockets([VALID[name]]).status == 101, name


def test_the_common_requests_are_switched_by_tokend() -> None:
    """switch_protocols writes their 101 (else this would only be websockets' again);
    above and below, byte for byte as websockets writes it."""
    for name in ("tokend client", "browser-like", "query string", "no subprotocol"):
        parsed = parse(VALID[name])
        assert parsed is not None and switch_protocols(parsed, None) is not None, name


ORIGIN_CASES: dict[str, tuple[str | None, Origins]] = {
    "allowed": ("https://a.example", ["https://a.example", None]),
    "none, allowed": (None, ["https://a.example", None]),
    "none, not allowed": (None, ["https://a.example"]),
    "other": ("https://b.example", ["https://a.example", None]),
    "any": ("https://b.example", None),
}


@pytest.mark.parametrize("name", ORIGIN_CASES)
def test_origins_are_checked_as_websockets_checks_them(name: str) -> None:
    origin, origins = ORIGIN_CASES[name]
    headers = HEADERS if origin is None else [*HEADERS, ("Origin", origin)]
    outcome = assert_same(request_bytes(headers) + HELLO_FRAME, origins=origins)
    assert outcome.status == (101 if origins is None or origin in origins else 403)


def test_a_handshake_accepted_gives_101_and_the_subprotocol() -> None:
    outcome = assert_same(request_bytes())
    assert outcome.status == 101
    assert b"\r\nSec-WebSocket-Protocol: tokend.v1\r\n" in outcome.response


@pytest.mark.parametrize("split", [1, 2, 7, 64])
def test_a_request_split_into_many_reads_with_a_hello_behind_it(split: int) -> None:
    data = request_bytes() + HELLO_FRAME
    outcome = assert_same(data, list(range(split, len(data), split)))
    assert outcome.status == 101
    assert outcome.messages == [p.encode(p.Hello("a.b.c"))]


def test_a_request_coalesced_with_a_hello_and_a_second_request() -> None:
    data = request_bytes() + HELLO_FRAME + request_bytes()
    outcome = assert_same(data)
    assert outcome.status == 101


# Requests websockets' releases read differently (websockets 17 parses other versions
# and answers them; before, its parser refused them; a non-ASCII path, a body of none):
# never parsed here, each comes out as the websockets installed reads it.
RELEASE_DEPENDENT = {
    "HTTP/1.0": request_bytes(line="GET /v1/ws HTTP/1.0"),
    "Content-Length: 0": request_bytes([*HEADERS, ("Content-Length", "0")]),
    "non-ASCII path": request_bytes(line="GET /v1/w\xe9 HTTP/1.1"),
    "HEAD": request_bytes(line="HEAD /v1/ws HTTP/1.1"),
}


@pytest.mark.parametrize("name", RELEASE_DEPENDENT)
def test_what_websockets_releases_read_differently_websockets_decides(name: str) -> None:
    data = RELEASE_DEPENDENT[name]
    assert parse(data) is None
    assert_same(data + HELLO_FRAME, list(range(1, len(data), 7)), eof=True)


# Invalid requests: each must be refused alike (same status, or no response and EOF)


def _replace(old: str, new: str) -> bytes:
    return request_bytes().replace(old.encode(), new.encode())


INVALID = {
    "POST": request_bytes(line="POST /v1/ws HTTP/1.1"),
    "lower-case method": request_bytes(line="get /v1/ws HTTP/1.1"),
    "unknown method": request_bytes(line="FOO /v1/ws HTTP/1.1"),
    "HTTP/2": request_bytes(line="GET /v1/ws HTTP/2.0"),
    "HTTP/1.2": request_bytes(line="GET /v1/ws HTTP/1.2"),
    "no version": request_bytes(line="GET /v1/ws"),
    "two spaces": request_bytes(line="GET  /v1/ws HTTP/1.1"),
    "space in path": request_bytes(line="GET /v1/ w HTTP/1.1"),
    "missing Upgrade": request_bytes([h for h in HEADERS if h[0] != "Upgrade"]),
    "missing Connection": request_bytes([h for h in HEADERS if h[0] != "Connection"]),
    "missing key": request_bytes([h for h in HEADERS if h[0] != "Sec-WebSocket-Key"]),
    "missing version": request_bytes([h for h in HEADERS if h[0] != "Sec-WebSocket-Version"]),
    "duplicate key": request_bytes([*HEADERS, ("Sec-WebSocket-Key", KEY)]),
    "duplicate Upgrade": request_bytes([*HEADERS, ("Upgrade", "websocket")]),
    "duplicate Origin": request_bytes([*HEADERS, ("Origin", "https://a"), ("Origin", "https://a")]),
    "bad key": _replace(KEY, "not base64!"),
    "short key": _replace(KEY, base64.b64encode(b"short").decode()),
    "version 8": _replace("Sec-WebSocket-Version: 13", "Sec-WebSocket-Version: 8"),
    "Upgrade: h2c": _replace("Upgrade: websocket", "Upgrade: h2c"),
    "Connection: close": _replace("Connection: Upgrade", "Connection: close"),
    "other subprotocol": _replace(p.SUBPROTOCOL, "chat"),
    "chunked body": request_bytes([*HEADERS, ("Transfer-Encoding", "chunked")])
    + b"5\r\nhello\r\n0\r\n\r\n",
    "Content-Length: 5": request_bytes([*HEADERS, ("Content-Length", "5")]) + b"hello",
    "bare LF line ends": request_bytes(eol="\n"),
    "bare CR in a value": _replace("Upgrade: websocket", "Upgrade: web\rsocket"),
    "LF in a value": _replace("Upgrade: websocket", "Upgrade: web\nsocket"),
    "NUL in a value": _replace("Upgrade: websocket", "Upgrade: web\x00socket"),
    "space before colon": request_bytes(separator=" : "),
    "folded header": _replace("Upgrade: websocket", "Upgrade: websocket\r\n continued"),
    "header without colon": _replace("Upgrade: websocket", "Upgrade websocket"),
    "bad header name": _replace("Upgrade: websocket", "Up(grade): websocket"),
    "non-ASCII header name": _replace("Upgrade: websocket", "Upgr\xe4de: websocket"),
    "empty header name": _replace("Upgrade: websocket", ": websocket"),
    "blank line first": b"\r\n" + request_bytes(),
    "oversize header": request_bytes([*HEADERS, ("X-Big", "x" * 9000)]),
    "oversize request line": request_bytes(line="GET /" + "a" * 9000 + " HTTP/1.1"),
    "too many headers": request_bytes([*HEADERS, *[(f"X-{i}", "1") for i in range(130)]]),
    "not HTTP": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(64),
    "PROXY-like": b"PROXY TCP4 1.2.3.4 5.6.7.8 1 2\r\n" + request_bytes(),
}


@pytest.mark.parametrize("name", INVALID)
@pytest.mark.parametrize("reads", ["whole", "bytewise", "with EOF"])
def test_a_malformed_request_is_refused_as_websockets_refuses_it(name: str, reads: str) -> None:
    data = INVALID[name]
    cuts = list(range(1, len(data))) if reads == "bytewise" and len(data) < 3000 else []
    outcome = assert_same(data, cuts, eof=reads == "with EOF")
    assert outcome.status != 101


def test_an_incomplete_request_then_eof_gets_no_response() -> None:
    outcome = assert_same(request_bytes()[:40], eof=True)
    assert outcome.status is None and outcome.eof_sent


# Variations

_NAMES = st.sampled_from(
    ["Host", "Upgrade", "Connection", "Sec-WebSocket-Key", "Sec-WebSocket-Version", "X-A"]
) | st.text(st.characters(min_codepoint=0, max_codepoint=255), min_size=0, max_size=8)
_VALUES = st.sampled_from(["websocket", "Upgrade", KEY, "13", p.SUBPROTOCOL, ""]) | st.text(
    st.characters(min_codepoint=0, max_codepoint=255), max_size=12
)
_LINES = st.sampled_from(
    ["GET /v1/ws HTTP/1.1", "GET /v1/ws HTTP/1.0", "GET / HTTP/1.1", "HEAD /v1/ws HTTP/1.1"]
) | st.text(st.characters(min_codepoint=0, max_codepoint=255), max_size=24)


@settings(max_examples=400, deadline=None)
@given(
    line=_LINES,
    changes=st.lists(st.tuples(st.integers(0, 10), _NAMES, _VALUES), max_size=4),
    drop=st.sets(st.integers(0, len(HEADERS) - 1), max_size=2),
    separator=st.sampled_from([": ", ":", " : ", ":  ", ":\t"]),
    eol=st.sampled_from(["\r\n", "\r\n", "\r\n", "\n", "\r"]),
    rest=st.sampled_from([b"", HELLO_FRAME, b"\r\n", b"GET / HTTP/1.1\r\n\r\n"]),
    cuts=st.lists(st.integers(0, 400), max_size=6),
    eof=st.booleans(),
)
@example(
    line="GET /v1/ws HTTP/1.1", changes=[], drop=set(), separator=": ", eol="\r\n",
    rest=HELLO_FRAME, cuts=[3, 50, 140], eof=False,
)  # fmt: skip
@example(  # websockets 15's accept raises on it; then the client's EOF
    line="GET /v1/ws HTTP/1.1", changes=[(0, "Host", "websocket"), (0, "Upgrade", "\x80")],
    drop=set(), separator=": ", eol="\r\n", rest=b"", cuts=[], eof=True,
)  # fmt: skip
def test_variations_of_a_request_come_to_the_same_outcome(
    line: str,
    changes: list[tuple[int, str, str]],
    drop: set[int],
    separator: str,
    eol: str,
    rest: bytes,
    cuts: list[int],
    eof: bool,
) -> None:
    headers = [h for i, h in enumerate(HEADERS) if i not in drop]
    for position, name, value in changes:
        headers.insert(min(position, len(headers)), (name, value))
    assert_same(request_bytes(headers, line, separator, eol) + rest, cuts, eof)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=300), cuts=st.lists(st.integers(0, 300), max_size=4))
def test_any_bytes_come_to_the_same_outcome(data: bytes, cuts: list[int]) -> None:
    assert_same(data, cuts, eof=True)


@settings(max_examples=300, deadline=None)
@given(
    position=st.integers(0, len(request_bytes()) - 1),
    byte=st.integers(0, 255),
    cuts=st.lists(st.integers(0, 300), max_size=3),
)
def test_a_request_with_one_byte_changed_comes_to_the_same_outcome(
    position: int, byte: int, cuts: list[int]
) -> None:
    data = bytearray(request_bytes() + HELLO_FRAME)
    data[position] = byte
    assert_same(bytes(data), cuts)


# Heads known by all but their key (tokend.edge.handshake._Known)

_KEYS = st.binary(min_size=16, max_size=16).map(lambda raw: base64.b64encode(raw).decode())


def _with_key(data: bytes, key: str) -> bytes:
    return data.replace(KEY.encode(), key.encode())


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(sorted(VALID)),
    keys=st.lists(_KEYS, min_size=2, max_size=3),
    cuts=st.lists(st.integers(0, 400), max_size=3),
)
def test_a_head_known_but_for_its_key_comes_to_the_same_outcome(
    name: str, keys: list[str], cuts: list[int]
) -> None:
    """The same head again with other keys, each answered from the head parsed first:
    the same outcome as websockets' parse of those very bytes (its request with that
    key, the 101's accept key of that key)."""
    for key in keys:
        outcome = assert_same(_with_key(VALID[name], key) + HELLO_FRAME, cuts)
        if outcome.request is not None and outcome.status == 101:
            assert [v for n, v in outcome.request[3] if n.lower() == "sec-websocket-key"] == [key]


def test_a_known_head_is_not_parsed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The second request of a shape (another key) comes from the table, not from the
    parser: the common clients' resume storm parses each shape once."""
    handshake._known.heads.clear()
    first = parse(_with_key(VALID["browser-like"], "A" * 22 + "=="))
    assert first is not None and len(handshake._known.heads) == 1
    parsed: list[bytes] = []
    original = handshake._parse

    def spied(head: bytes) -> Parsed | None:
        parsed.append(head)
        return original(head)

    monkeypatch.setattr(handshake, "_parse", spied)
    second = parse(_with_key(VALID["browser-like"], "B" * 22 + "=="))
    assert parsed == [] and second is not None and second.known is not None
    assert (b"Sec-WebSocket-Key", b"B" * 22 + b"==") in second.fields
    assert (b"Sec-WebSocket-Key", b"A" * 22 + b"==") in first.fields  # not changed


@pytest.mark.parametrize(
    "key",
    [
        "A" * 24,  # no padding: not the base64 of 16 bytes
        "A" * 21 + "===",
        "A" * 22 + "== ",  # whitespace websockets strips
        "A" * 22 + "==A",  # longer
        "A" * 21 + "-==",  # not the base64 alphabet ("-" of content-length)
        "A" * 20 + "\x01\x02==",  # control characters
    ],
)
def test_a_head_whose_key_is_not_clients_form_is_parsed_as_before(key: str) -> None:
    """A key other than 24 characters of base64 ending "==" is never taken from the
    table: the head is parsed (or handed to websockets) as any other."""
    parse(VALID["tokend client"])  # the shape is known
    data = _with_key(VALID["tokend client"], key)
    assert handshake._Known._split(data) is None
    assert_same(data + HELLO_FRAME)


def test_two_key_lines_are_not_remembered() -> None:
    """Only a head with one Sec-WebSocket-Key line (spelt so) is remembered: with two,
    the key's position would not say which value the table's request changes."""
    handshake._known.heads.clear()
    data = request_bytes([*HEADERS, ("Sec-WebSocket-Key", KEY)])
    assert parse(data) is not None
    assert handshake._known.heads == {}
    data = request_bytes([*HEADERS, ("sec-websocket-key", KEY)])
    assert parse(data) is not None
    assert handshake._known.heads == {}
    assert_same(data)


def test_the_table_of_known_heads_is_bounded() -> None:
    """A peer sending ever new shapes only empties the table: it never holds more than
    KNOWN_HEADS heads."""
    handshake._known.heads.clear()
    for n in range(3 * handshake.KNOWN_HEADS):
        assert parse(request_bytes([*HEADERS, ("X-N", str(n))])) is not None
        assert len(handshake._known.heads) <= handshake.KNOWN_HEADS
    assert_same(request_bytes([*HEADERS, ("X-N", "1")]))


@settings(max_examples=200, deadline=None)
@given(
    name=st.sampled_from(sorted(VALID)),
    key=_KEYS,
    origin=st.sampled_from([None, "https://a.example", "https://b.example"]),
    origins=st.sampled_from([None, ["https://a.example", None], ["https://a.example"]]),
)
def test_a_known_heads_origin_is_checked_against_each_connections_origins(
    name: str, key: str, origin: str | None, origins: Origins
) -> None:
    """What switch_protocols keeps of a known head (its Origin among the rest) is checked
    against the origins of each connection, as websockets checks them."""
    data = _with_key(VALID[name], key)
    if origin is not None:
        data = data.replace(b"\r\n\r\n", f"\r\nOrigin: {origin}\r\n\r\n".encode(), 1)
    parse(data)
    request = parse(data)
    if request is not None and b"Sec-WebSocket-Key: " in data:
        assert request.known is not None
    assert_same(data + HELLO_FRAME, origins=origins)


@pytest.mark.parametrize("after", [b"GET / HTTP/1.1\r\n\r\n", HELLO_FRAME, b"\r\n"])
def test_bytes_after_a_request_whose_answer_is_awaited_are_not_read(after: bytes) -> None:
    """The gate may answer later (/readyz asks Redis): whatever the client sends meanwhile
    is neither parsed as another request nor in the way of that answer."""
    for head in (request_bytes(line="GET /readyz HTTP/1.1"), request_bytes(eol="\n")):
        opening = Handshake(None)
        if not opening.receive_data(head):
            continue  # websockets refused it: nothing is awaited
        assert not opening.receive_data(after)
        opening.answer(Response(200, "OK", Headers([("Content-Length", "0")]), b""))
        writes = opening.data_to_send()
        assert writes[0].startswith(b"HTTP/1.1 200 OK\r\n") and writes[-1] == b""
