"""An HTTP/1.x request (RFC 9112), parsed by llhttp through httptools: what both
listeners read with, within one set of limits.

:class:`RequestParser` is Sans-I/O: bytes in; a :class:`Request` out, or the
:class:`HTTPError` that refuses it. The admin listener answers a refusal with its
status and one log line (tokend/ops/admin/listener.py). The main port hands a refused
upgrade request, byte for byte, to websockets' own parser, which answers it as it
always did (tokend/edge/handshake.py, which also takes only a head websockets is certain to
read the same way).

Limits (docs/operations.md): a request target of :data:`MAX_TARGET` bytes (else 414);
a head (request line and headers) of :data:`MAX_HEAD` bytes and :data:`MAX_HEADERS`
header lines (else 431); a body only with a Content-Length, of at most the parser's
``max_body`` (else 411, 413).
"""

from __future__ import annotations

import http
from dataclasses import dataclass
from urllib.parse import parse_qsl

import httptools
from httptools.parser.url_parser import URL

# Request line plus headers (the bytes up to and including the blank line, as they
# are written without optional whitespace); a longer head, or more header lines, gets 431.
MAX_HEAD = 16384
MAX_HEADERS = 100
# A longer request target gets 414.
MAX_TARGET = 8192


class HTTPError(Exception):
    """Answer with this status and the stable error shape."""

    def __init__(
        self,
        status: http.HTTPStatus,
        error: str,
        detail: str,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.error = error
        self.detail = detail
        self.headers = headers or {}


@dataclass(slots=True)
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]  # lower-case names
    body: bytes = b""


class _Whole(Exception):
    """The request was complete: stop parsing (one request per connection)."""


class RequestParser:
    """One HTTP/1.x request (RFC 9112) from the bytes :meth:`feed` is given, parsed by
    llhttp (httptools) within the limits of this module; Sans-I/O.

    A request that cannot be served raises :class:`HTTPError`: malformed (request line,
    header, Content-Length, or both Content-Length and Transfer-Encoding: 400), a
    Transfer-Encoding (411: bodies need a Content-Length), a body over ``max_body``
    (413), a target over :data:`MAX_TARGET` (414), a head over :data:`MAX_HEAD` or
    :data:`MAX_HEADERS` (431), not exactly one Host in HTTP/1.1 (400), a Host not in
    ``allowed_hosts`` (421; None allows any), an HTTP version other than 1.x (505).
    Bytes after the request are ignored.

    Besides the :class:`Request`, what was received as it came: ``target``, ``fields``
    (each header's name and value, in order) and ``version`` ("1.1").
    """

    __slots__ = (
        "_body",
        "_head_done",
        "_head_fed",
        "_head_size",
        "_parser",
        "_url",
        "allowed_hosts",
        "fields",
        "max_body",
        "started",
        "target",
        "version",
        "whole",
    )

    def __init__(self, max_body: int = 0, allowed_hosts: frozenset[str] | None = None) -> None:
        self.max_body = max_body
        self.allowed_hosts = allowed_hosts
        self.whole = False  # the request is complete, its body too
        self.started = False  # some bytes came
        self.target = b""
        self.fields: list[tuple[bytes, bytes]] = []
        self.version = ""
        self._parser = httptools.HttpRequestParser(self)
        self._url: URL | None = None  # the target parsed, once the head is complete
        self._head_fed = 0  # bytes fed while the head was incomplete
        # Bytes of the head parsed, but the target's: the request line's method, spaces,
        # version and CRLF, the blank line's CRLF, each header line.
        self._head_size = 0
        self._head_done = False
        self._body = bytearray()

    @property
    def method(self) -> bytes:
        return self._parser.get_method()

    @property
    def request(self) -> Request | None:
        """The request, once whole (made on demand: the main port reads ``fields``)."""
        if not self.whole:
            return None
        url = self._url
        target = self.target.decode("latin-1")
        path = url.path.decode("latin-1") if url is not None and url.path else target
        query = url.query.decode("latin-1") if url is not None and url.query else ""
        headers = {
            name.decode("latin-1").lower(): value.decode("latin-1") for name, value in self.fields
        }
        method = self.method.decode("latin-1")
        return Request(method, path, dict(parse_qsl(query)), headers, bytes(self._body))

    @property
    def method_and_path(self) -> tuple[str, str]:
        """What the log line names: as much of the request line as was parsed."""
        if not self.target:
            return "-", "-"
        method = self.method.decode("latin-1")
        return method, self.target.decode("latin-1").partition("?")[0][:200]

    def feed(self, data: bytes) -> None:
        if self.whole:
            return  # what follows the request is not read
        self.started = True
        if not self._head_done:
            self._head_fed += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            # What a callback raised: _Whole, an HTTPError, or a bug (then a 500, logged).
            if isinstance(exc.__context__, _Whole):
                return
            raise exc.__context__ or exc from None
        except httptools.HttpParserUpgrade:
            return  # llhttp stops after an upgrade request, whole
        except httptools.HttpParserError as exc:
            if self.whole:
                return  # what follows the request is not read
            raise _malformed(str(exc)) from None
        # A head still incomplete (a header too long to have been parsed whole yet).
        if not self._head_done and self._head_fed > MAX_HEAD:
            raise _head_too_large()

    # httptools' callbacks

    def on_url(self, url: bytes) -> None:  # called once per piece of the target
        if not self.target:  # "METHOD SP", "SP HTTP/1.1 CRLF", then the last CRLF
            self._head_size = len(self.method) + 14
        self.target += url
        if len(self.target) > MAX_TARGET:
            raise HTTPError(
                http.HTTPStatus.REQUEST_URI_TOO_LONG,
                "target_too_long",
                f"the request target exceeds {MAX_TARGET} bytes",
            )

    def on_header(self, name: bytes, value: bytes) -> None:
        fields = self.fields
        fields.append((name, value))
        self._head_size += len(name) + len(value) + 4  # ": " and CRLF
        if len(fields) > MAX_HEADERS or len(self.target) + self._head_size > MAX_HEAD:
            raise _head_too_large()

    def on_headers_complete(self) -> None:
        self._head_done = True
        version = self.version = self._parser.get_http_version()
        if not version.startswith("1."):
            raise HTTPError(
                http.HTTPStatus.HTTP_VERSION_NOT_SUPPORTED,
                "version_not_supported",
                "this listener speaks HTTP/1.1",
            )
        try:
            url = self._url = httptools.parse_url(self.target) if self.target != b"*" else None
        except httptools.HttpParserInvalidURLError:
            raise _malformed("invalid request target") from None
        hosts: list[bytes] = []
        length = b"0"
        coded = False  # a Transfer-Encoding
        for name, value in self.fields:
            key = name.lower()
            if key == b"host":
                hosts.append(value)
            elif key == b"content-length":
                length = value
            elif key == b"transfer-encoding":
                coded = True
        self._check_host(version, url, hosts)
        if coded:
            raise HTTPError(
                http.HTTPStatus.LENGTH_REQUIRED,
                "length_required",
                "send the body with a Content-Length",
            )
        # llhttp took only digits, once: int() cannot fail.
        if int(length) > self.max_body:
            raise HTTPError(
                http.HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                "body_too_large",
                f"bodies are limited to {self.max_body} bytes",
            )

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_message_complete(self) -> None:
        self.whole = True

    def on_message_begin(self) -> None:
        if self.whole:  # a second request, pipelined: not read
            raise _Whole

    def _check_host(self, version: str, url: URL | None, hosts: list[bytes]) -> None:
        """RFC 9112 3.2: exactly one Host in HTTP/1.1; an absolute-form target's authority
        takes its place. Then it must be one this listener answers to."""
        if len(hosts) > 1 or (not hosts and version == "1.1"):
            raise HTTPError(
                http.HTTPStatus.BAD_REQUEST, "bad_request", "exactly one Host header is needed"
            )
        host = hosts[0].decode("latin-1").lower() if hosts else None
        if url is not None and url.host:
            host = url.host.decode("latin-1").lower()
            if url.port is not None:
                host += f":{url.port}"
        if self.allowed_hosts is None or host is None or host in self.allowed_hosts:
            return  # HTTP/1.0 without Host: not a browser, which always sends one
        raise HTTPError(
            http.HTTPStatus.MISDIRECTED_REQUEST,
            "wrong_host",
            f"this listener does not answer for Host {host[:100]!r} (admin_allowed_hosts)",
        )


def _malformed(reason: str) -> HTTPError:
    return HTTPError(http.HTTPStatus.BAD_REQUEST, "bad_request", f"malformed request: {reason}")


def _head_too_large() -> HTTPError:
    return HTTPError(
        http.HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
        "head_too_large",
        f"request line and headers exceed {MAX_HEAD} bytes or {MAX_HEADERS} lines",
    )
