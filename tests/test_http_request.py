"""tokend/edge/http_request.py, the request parser both listeners read with, without sockets:
its limits at their edges, and the same answer however the bytes are cut (the head's
limit once depended on it: counted without the request line's framing when whole, with
it while incomplete).

The admin listener's answers to malformed requests are held on a live listener by
tests/test_admin.py, the main port's (websockets', for whatever this parser refuses)
by tests/test_handshake.py.
"""

from __future__ import annotations

import http

import pytest

from tokend.edge.http_request import MAX_HEAD, MAX_HEADERS, MAX_TARGET, HTTPError, RequestParser

S = http.HTTPStatus


def request(target: bytes = b"/healthz", *headers: bytes, body: bytes = b"") -> bytes:
    lines = [b"GET " + target + b" HTTP/1.1", b"Host: localhost", *headers]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def refusal(data: bytes, reads: int = 1) -> S | None:
    """The status the parser refuses ``data`` with, fed in ``reads`` pieces; None: taken."""
    parser = RequestParser(max_body=16)
    size = -(-len(data) // reads)
    try:
        for at in range(0, len(data), size):
            parser.feed(data[at : at + size])
    except HTTPError as exc:
        return exc.status
    assert parser.whole and parser.request is not None
    return None


def padded(size: int) -> bytes:
    """A request whose head (up to and including the blank line) is ``size`` bytes."""
    bare = len(request(b"/healthz", b"X-Pad: "))
    return request(b"/healthz", b"X-Pad: " + b"a" * (size - bare))


EDGES = {
    "target at the limit": (request(b"/" + b"a" * (MAX_TARGET - 1)), None),
    "target over it": (request(b"/" + b"a" * MAX_TARGET), S.REQUEST_URI_TOO_LONG),
    "headers at the limit": (
        request(b"/", *[b"X-%d: 1" % n for n in range(MAX_HEADERS - 1)]),
        None,
    ),
    "one header over it": (
        request(b"/", *[b"X-%d: 1" % n for n in range(MAX_HEADERS)]),
        S.REQUEST_HEADER_FIELDS_TOO_LARGE,
    ),
    "head at the limit": (padded(MAX_HEAD), None),
    "head over it": (padded(MAX_HEAD + 1), S.REQUEST_HEADER_FIELDS_TOO_LARGE),
    "body at max_body": (request(b"/", b"Content-Length: 16", body=b"x" * 16), None),
    "body over it": (request(b"/", b"Content-Length: 17"), S.REQUEST_ENTITY_TOO_LARGE),
    "no Host in HTTP/1.1": (b"GET / HTTP/1.1\r\n\r\n", S.BAD_REQUEST),
    "no Host in HTTP/1.0": (b"GET / HTTP/1.0\r\n\r\n", None),
}


@pytest.mark.parametrize("name", EDGES)
@pytest.mark.parametrize("reads", [1, 3, 997])
def test_each_limit_takes_its_edge_and_refuses_one_past_it(name: str, reads: int) -> None:
    data, status = EDGES[name]
    assert refusal(data, reads) == status


def test_what_was_received_is_kept_as_it_came() -> None:
    """The main port writes the head out again from these (tokend/edge/handshake.py)."""
    parser = RequestParser()
    parser.feed(b"GET /v1/ws?a=1 HTTP/1.0\r\nHOST: Example\r\nX-Empty: \r\n\r\n")
    assert (parser.method, parser.target, parser.version) == (b"GET", b"/v1/ws?a=1", "1.0")
    assert parser.fields == [(b"HOST", b"Example"), (b"X-Empty", b"")]
    assert parser.request is not None
    assert parser.request.headers == {"host": "Example", "x-empty": ""}
    assert (parser.request.path, parser.request.query) == ("/v1/ws", {"a": "1"})


@pytest.mark.parametrize("close", [b"Connection: keep-alive", b"Connection: close"])
@pytest.mark.parametrize(
    "after", [b"GET /other HTTP/1.1\r\nX-Second: 1\r\n\r\n", b"\x00junk\r\n", b"GET /half"]
)
def test_what_follows_the_request_is_not_read(close: bytes, after: bytes) -> None:
    parser = RequestParser(max_body=16)
    parser.feed(request(b"/first", close, b"Content-Length: 2", body=b"ab") + after)
    assert parser.request is not None
    assert (parser.request.path, parser.request.body) == ("/first", b"ab")
    fields = [(b"Host", b"localhost"), tuple(close.split(b": ")), (b"Content-Length", b"2")]
    assert parser.fields == fields
    parser.feed(after)
    assert parser.fields == fields
