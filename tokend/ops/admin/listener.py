"""The admin listener's HTTP/1.1 layer: one request per connection, parsed by llhttp.

One request per connection (``Connection: close``), parsed by llhttp through httptools
(:class:`tokend.edge.http_request.RequestParser`, RFC 9112, as the main port's upgrade
request is): a malformed request gets a 4xx and one log line, never a 500. The
request head and body must arrive within ``hello_timeout`` (else 408), a body is read
only with a Content-Length of at most ``admin_max_body`` (else 413); the ``Host`` must
be one of ``admin_allowed_hosts`` (else 421: a page that rebinds its own name to this
address cannot read the answers); at most ``admin_max_connections`` at once (else
503). :class:`HttpListener` knows nothing of routes: it hands each whole request to
the callable it was given.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog

from tokend.config import Settings
from tokend.edge.http_request import HTTPError, Request, RequestParser
from tokend.edge.http_responses import HttpAnswer, head
from tokend.store.unavailable import StoreUnavailable

log = structlog.get_logger("tokend.admin")

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


# The answer beyond admin_max_connections.
TOO_MANY_CONNECTIONS = HTTPError(
    http.HTTPStatus.SERVICE_UNAVAILABLE,
    "too_many_connections",
    "too many admin connections open (admin_max_connections); retry later",
    {"Retry-After": "1"},
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
        # (tokend.server.admission.connection_budget) keeps admin_max_connections free, no more.
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
