"""The admin listener's HTTP/1.1 layer: one request per connection, parsed by llhttp.

One request per connection (``Connection: close``), parsed by llhttp through httptools
(:class:`RequestParser`, RFC 9112): a malformed request gets a 4xx and one log line,
never a 500. The request head and body must arrive within ``hello_timeout`` (else
408), a body is read only with a Content-Length of at most ``admin_max_body`` (else
413); the ``Host`` must be one of ``admin_allowed_hosts`` (else 421: a page that
rebinds its own name to this address cannot read the answers); at most
``admin_max_connections`` at once (else 503). :class:`HttpListener` knows nothing of
routes: it hands each whole request to the callable it was given.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

import httptools
import structlog
from httptools.parser.url_parser import URL

from tokend.config import Settings
from tokend.http_answer import HttpAnswer, head
from tokend.store.unavailable import StoreUnavailable

log = structlog.get_logger("tokend.admin")

# Request line plus headers; a longer head, or more header lines, gets 431.
MAX_HEAD = 16384
MAX_HEADERS = 100
# A longer request target gets 414.
MAX_TARGET = 8192
# Bytes read from the socket at once.
READ_SIZE = 16384
# After answering a request it did not read whole, the listener reads and drops what the
# client still sends, this long and this much at most, before it closes: closing with
# unread bytes makes the kernel reset the connection, and the client may lose the answer.
LINGER_S = 1.0
LINGER_BYTES = 1 << 20
# Loopback names every admin listener answers to (admin_allowed_hosts left empty).
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
# admin_host values that listen on every address: no name of the listener's own.
WILDCARDS = ("", "0.0.0.0", "::")


def allowed_hosts(settings: Settings, port: int) -> frozenset[str] | None:
    """The Host values the admin listener on ``port`` answers to (None: any, ``*``).

    By default the loopback names and ``admin_host`` (unless it is a wildcard address),
    each alone and with the port: what a client on this machine or one that dials the
    address writes, never the name of a page's own site, as DNS rebinding sends.
    """
    listed = settings.admin_host_list
    if "*" in listed:
        return None
    if listed:
        return frozenset(listed)
    names = set(LOOPBACK_HOSTS)
    if settings.admin_host not in WILDCARDS:
        host = settings.admin_host.lower()
        names.add(f"[{host}]" if ":" in host else host)
    return frozenset(names | {f"{name}:{port}" for name in names})


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


# The answer beyond admin_max_connections.
TOO_MANY_CONNECTIONS = HTTPError(
    http.HTTPStatus.SERVICE_UNAVAILABLE,
    "too_many_connections",
    "too many admin connections open (admin_max_connections); retry later",
    {"Retry-After": "1"},
)


@dataclass(slots=True)
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]  # lower-case names
    body: bytes = b""


class _Whole(Exception):
    """The request is complete: stop parsing (one request per connection)."""


class RequestParser:
    """One HTTP/1.1 request (RFC 9112) from the bytes :meth:`feed` is given, parsed by
    llhttp (httptools) within this listener's limits; Sans-I/O.

    A request that cannot be served raises :class:`HTTPError`: malformed (request line,
    header, Content-Length, or both Content-Length and Transfer-Encoding: 400), a
    Transfer-Encoding (411: bodies need a Content-Length), a body over ``max_body``
    (413), a target over :data:`MAX_TARGET` (414), a head over :data:`MAX_HEAD` or
    :data:`MAX_HEADERS` (431), a Host not in ``allowed_hosts`` (421; None allows any),
    an HTTP version other than 1.x (505). Bytes after the request are ignored.
    """

    def __init__(self, max_body: int, allowed_hosts: frozenset[str] | None) -> None:
        self.max_body = max_body
        self.allowed_hosts = allowed_hosts
        self.request: Request | None = None  # set once its head is complete
        self.whole = False  # and its body too
        self.started = False  # some bytes came
        self._parser = httptools.HttpRequestParser(self)
        self._target = b""
        self._headers: dict[str, str] = {}
        self._hosts: list[str] = []
        self._head_fed = 0  # bytes fed while the head was incomplete
        self._head_size = 0  # bytes of the target and header lines parsed
        self._header_lines = 0
        self._head_done = False
        self._body = bytearray()

    @property
    def method_and_path(self) -> tuple[str, str]:
        """What the log line names: as much of the request line as was parsed."""
        if not self._target:
            return "-", "-"
        method = self._parser.get_method().decode("latin-1")
        return method, self._target.decode("latin-1").partition("?")[0][:200]

    def feed(self, data: bytes) -> None:
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
            return  # only after the message was whole: _Whole above
        except httptools.HttpParserError as exc:
            raise _malformed(str(exc)) from None
        # A head still incomplete (a header too long to have been parsed whole yet).
        if not self._head_done and self._head_fed > MAX_HEAD:
            raise _head_too_large()

    # httptools' callbacks

    def on_url(self, url: bytes) -> None:  # called once per piece of the target
        self._target += url
        if len(self._target) > MAX_TARGET:
            raise HTTPError(
                http.HTTPStatus.REQUEST_URI_TOO_LONG,
                "target_too_long",
                f"the request target exceeds {MAX_TARGET} bytes",
            )

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_lines += 1
        self._head_size += len(name) + len(value) + 4  # ": " and CRLF
        if self._header_lines > MAX_HEADERS or len(self._target) + self._head_size > MAX_HEAD:
            raise _head_too_large()
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        if key == "host":
            self._hosts.append(text.lower())
        self._headers[key] = text

    def on_headers_complete(self) -> None:
        self._head_done = True
        version = self._parser.get_http_version()
        if not version.startswith("1."):
            raise HTTPError(
                http.HTTPStatus.HTTP_VERSION_NOT_SUPPORTED,
                "version_not_supported",
                "this listener speaks HTTP/1.1",
            )
        target = self._target.decode("latin-1")
        try:
            url = httptools.parse_url(self._target) if target != "*" else None
        except httptools.HttpParserInvalidURLError:
            raise _malformed("invalid request target") from None
        self._check_host(version, url)
        if "transfer-encoding" in self._headers:
            raise HTTPError(
                http.HTTPStatus.LENGTH_REQUIRED,
                "length_required",
                "send the body with a Content-Length",
            )
        # llhttp took only digits, once: int() cannot fail.
        if int(self._headers.get("content-length", "0")) > self.max_body:
            raise HTTPError(
                http.HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                "body_too_large",
                f"bodies are limited to {self.max_body} bytes",
            )
        path = url.path.decode("latin-1") if url is not None and url.path else target
        query = url.query.decode("latin-1") if url is not None and url.query else ""
        method = self._parser.get_method().decode("latin-1")
        self.request = Request(method, path, dict(parse_qsl(query)), self._headers)

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_message_complete(self) -> None:
        assert self.request is not None
        self.request.body = bytes(self._body)
        self.whole = True
        raise _Whole

    def _check_host(self, version: str, url: URL | None) -> None:
        """RFC 9112 3.2: exactly one Host in HTTP/1.1; an absolute-form target's authority
        takes its place. Then it must be one this listener answers to."""
        if len(self._hosts) > 1 or (not self._hosts and version == "1.1"):
            raise HTTPError(
                http.HTTPStatus.BAD_REQUEST, "bad_request", "exactly one Host header is needed"
            )
        host = self._hosts[0] if self._hosts else None
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


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """End the answer (FIN), then drop what the client still sends until it closes, at
    most :data:`LINGER_S` and :data:`LINGER_BYTES`."""
    writer.write_eof()
    dropped = 0
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(LINGER_S):
            while dropped < LINGER_BYTES and (data := await reader.read(READ_SIZE)):
                dropped += len(data)


def _malformed(reason: str) -> HTTPError:
    return HTTPError(http.HTTPStatus.BAD_REQUEST, "bad_request", f"malformed request: {reason}")


def _head_too_large() -> HTTPError:
    return HTTPError(
        http.HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
        "head_too_large",
        f"request line and headers exceed {MAX_HEAD} bytes or {MAX_HEADERS} lines",
    )


@dataclass(slots=True)
class Response:
    """An answer of the admin listener: JSON (:class:`HttpAnswer`) or a file's bytes."""

    status: http.HTTPStatus
    body: bytes
    headers: list[tuple[str, str]]
    error_code: str = ""  # of an error answer

    @classmethod
    def of(cls, answer: HttpAnswer) -> Response:
        headers, body = answer.encoded()
        return cls(answer.status, body, headers)

    @classmethod
    def json(cls, status: http.HTTPStatus, body: Any, **headers: str) -> Response:
        return cls.of(HttpAnswer(status, body, tuple(headers.items())))

    @classmethod
    def raw(cls, status: http.HTTPStatus, body: bytes, content_type: str) -> Response:
        return cls(status, body, head(body, content_type))

    @classmethod
    def error(cls, exc: HTTPError) -> Response:
        response = cls.json(exc.status, {"error": exc.error, "detail": exc.detail}, **exc.headers)
        response.error_code = exc.error
        return response

    def encode(self) -> bytes:
        lines = [
            f"HTTP/1.1 {self.status.value} {self.status.phrase}",
            *(f"{name}: {value}" for name, value in self.headers),
            "Connection: close",
        ]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + self.body


def only(request: Request, *methods: str) -> None:
    if request.method not in methods:
        raise HTTPError(
            http.HTTPStatus.METHOD_NOT_ALLOWED,
            "method_not_allowed",
            f"{request.method} not allowed here; use {', '.join(methods)}",
            {"Allow": ", ".join(methods)},
        )


Route = Callable[[Request], Awaitable[Response]]


class HttpListener:
    """Accepts admin connections and answers each one's request with ``route``'s
    :class:`Response` (or the :class:`HTTPError` it raised), one log line per request."""

    def __init__(self, settings: Settings, route: Route, sock: socket.socket | None) -> None:
        self.settings = settings
        self.route = route
        self.sock = sock  # an inherited listening socket, else admin_host:admin_port
        self.server: asyncio.Server | None = None
        self.allowed_hosts: frozenset[str] | None = None  # set by start(): the port is known
        self.open = 0  # connections open now

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        if self.sock is not None:  # inherited: a supervisor's worker, socket activation
            self.server = await asyncio.start_server(self._connection, sock=self.sock)
        else:
            self.server = await asyncio.start_server(
                self._connection, self.settings.admin_host, self.settings.admin_port
            )
        self.allowed_hosts = allowed_hosts(self.settings, self.port)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Beyond the cap, refused before reading: the descriptor budget of the main port
        # (tokend.admission.connection_budget) keeps admin_max_connections free, no more.
        full = self.open >= self.settings.admin_max_connections
        self.open += 1
        try:
            if full:
                await self._send(writer, "-", "-", Response.error(TOO_MANY_CONNECTIONS))
                await _linger(reader, writer)
            else:
                await self._answer(reader, writer)
        except (ConnectionError, TimeoutError):
            writer.transport.abort()  # the peer went away, or reads nothing
        finally:
            self.open -= 1
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        parser = RequestParser(self.settings.admin_max_body, self.allowed_hosts)
        try:
            request = await self._read_in_time(reader, parser)
            if request is None:
                return
            response = await self.route(request)
        except HTTPError as exc:
            response = Response.error(exc)
        except StoreUnavailable as exc:
            unavailable = http.HTTPStatus.SERVICE_UNAVAILABLE
            response = Response.error(HTTPError(unavailable, "store_unavailable", str(exc)))
        except ConnectionError:
            raise
        except Exception:
            method, path = parser.method_and_path
            log.exception("admin request failed", method=method, path=path)
            internal = http.HTTPStatus.INTERNAL_SERVER_ERROR
            response = Response.error(HTTPError(internal, "internal_error", "see the node's log"))
        await self._send(writer, *parser.method_and_path, response)
        if not parser.whole:
            await _linger(reader, writer)

    async def _send(
        self, writer: asyncio.StreamWriter, method: str, path: str, response: Response
    ) -> None:
        """Log the request (its one line), then write the answer within ``send_timeout``."""
        peer = writer.get_extra_info("peername")
        fields: dict[str, Any] = {
            "method": method,
            "path": path,
            "status": response.status.value,
            "peer": peer[0] if peer else "?",
        }
        if response.error_code:
            log.warning("admin request", **fields, error=response.error_code)
        else:
            log.info("admin request", **fields)
        async with asyncio.timeout(self.settings.send_timeout):
            writer.write(response.encode())
            await writer.drain()

    async def _read_in_time(
        self, reader: asyncio.StreamReader, parser: RequestParser
    ) -> Request | None:
        """The request, read within ``hello_timeout``; None if the peer sent nothing."""
        try:
            async with asyncio.timeout(self.settings.hello_timeout):
                while not parser.whole:
                    data = await reader.read(READ_SIZE)
                    if not data:
                        if not parser.started:
                            return None  # a bare TCP connect (a port probe): nobody to answer
                        bad = http.HTTPStatus.BAD_REQUEST
                        raise HTTPError(bad, "bad_request", "connection closed mid-request")
                    parser.feed(data)
        except TimeoutError:
            timeout = http.HTTPStatus.REQUEST_TIMEOUT
            raise HTTPError(timeout, "timeout", "request not read in time") from None
        return parser.request
