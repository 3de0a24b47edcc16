"""The admin listener: a small HTTP/1.1 server beside the WebSocket port.

websockets answers only GET requests from its handshake, so the admin API (POST,
DELETE) has a listener of its own (``admin_host``:``admin_port``; docs/operations.md).
One request per connection (``Connection: close``), parsed by llhttp through httptools
(:class:`RequestParser`, RFC 9112): a malformed request gets a 4xx and one log line,
never a 500. The request head and body must arrive within ``hello_timeout`` (else
408), a body is read only with a Content-Length of at most ``admin_max_body`` (else
413); the ``Host`` must be one of ``admin_allowed_hosts`` (else 421: a page that
rebinds its own name to this address cannot read the answers); at most
``admin_max_connections`` at once (else 503).

Always served: ``/metrics`` (Prometheus text), ``/healthz``, ``/readyz``. With an
``admin_token`` set: ``/v1/*`` (bearer token required) and the dashboard's static
files under ``/dashboard``; without one, both answer 404 ``admin_disabled``. Errors
are JSON ``{"error": "<snake_code>", "detail": "<text>"}``. Every request is logged
(method, path, status); never a token.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import http
import json
import re
import socket
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

import httptools
import structlog
from httptools.parser.url_parser import URL

from tokend import events, health
from tokend.answers import EndOutcome
from tokend.config import Settings
from tokend.http_answer import HttpAnswer, head
from tokend.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from tokend.node import Background, Node
from tokend.store.unavailable import UNAVAILABLE, NotConfirmed, Retry, StoreUnavailable
from tokend.tokens import DEFAULT_PRIO, PRIO_RANGE

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
_WILDCARDS = ("", "0.0.0.0", "::")
# Events kept for GET /v1/events.
EVENT_RING = 500
MAX_PAGE = 500
DEFAULT_PAGE = 100
DASHBOARD_DIR = Path(__file__).parent / "dashboard"
DASHBOARD_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
# A dashboard path segment: no leading dot (so no "..", no hidden files), no escapes.
_SEGMENT = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")
_SESSION_PATH = re.compile(r"/v1/sessions/([^/]+)")
_STATES = ("ACTIVE", "WARN")
_REVOKE_RESULTS = {
    EndOutcome.ENDED: "revoked",
    EndOutcome.BARRED: "barred",
    EndOutcome.ALREADY_ENDED: "already_ended",
}


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
    if settings.admin_host not in _WILDCARDS:
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


class EventRing:
    """The last :data:`EVENT_RING` events seen on the events channel, numbered from 1."""

    def __init__(self, size: int = EVENT_RING) -> None:
        self.events: deque[dict[str, Any]] = deque(maxlen=size)
        self.seq = 0

    def add(self, event: dict[str, Any]) -> None:
        self.seq += 1
        self.events.append({"seq": self.seq, **event})

    def after(self, seq: int, limit: int) -> dict[str, Any]:
        page = [e for e in self.events if e["seq"] > seq][:limit]
        return {"events": page, "next": page[-1]["seq"] if page else max(seq, 0)}


Handler = Callable[[Request, dict[str, str]], Awaitable[Response]]


class AdminServer:
    """The admin listener of one node; :class:`tokend.server.App` starts and stops it."""

    def __init__(
        self, node: Node, draining: Callable[[], bool], sock: socket.socket | None = None
    ) -> None:
        self.node = node
        self.sock = sock  # an inherited listening socket, else admin_host:admin_port
        self.settings = node.settings
        self.draining = draining
        self.token = self.settings.admin_token.encode()
        self.ring = EventRing()
        self.dashboard_dir = DASHBOARD_DIR
        self.server: asyncio.Server | None = None
        self.background = Background()
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
        if self.token:
            self.background.spawn(self._follow_events(), "admin events")
        log.info(
            "admin listening",
            host=self.server.sockets[0].getsockname()[0],
            port=self.port,
            admin_api="enabled" if self.token else "disabled",
        )
        if self.settings.admin_host in _WILDCARDS and not self.settings.admin_host_list:
            log.warning(
                "admin listener on every address answers only loopback names: list the "
                "names its clients use in admin_allowed_hosts",
                allowed=sorted(self.allowed_hosts or ()),
            )

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        await self.background.stop()

    async def _follow_events(self) -> None:
        """Fill the ring from the events channel (at-most-once: gaps across outages)."""
        retry = Retry()
        while True:
            try:
                async for event in events.live(self.node.redis, self.node.store.keys):
                    self.ring.add(event)
                    retry.succeeded()
            except UNAVAILABLE:
                await retry.wait()

    # One connection, one request

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
            response = await self._route(request)
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

    # Routing

    async def _route(self, request: Request) -> Response:
        path = request.path
        if path == "/metrics":
            _only(request, "GET")
            return Response.raw(
                http.HTTPStatus.OK, self.node.metrics.exposition(), METRICS_CONTENT_TYPE
            )
        if path == "/healthz":
            _only(request, "GET")
            return Response.of(health.liveness(self.node))
        if path == "/readyz":
            _only(request, "GET")
            return Response.of(await health.readiness(self.node, self.draining()))
        if path == "/dashboard" or path.startswith("/dashboard/"):
            self._require_enabled()
            _only(request, "GET")
            return await _static(
                self.dashboard_dir, path.removeprefix("/dashboard").strip("/") or "index.html"
            )
        if path.startswith("/v1/"):
            self._require_enabled()
            self._authenticate(request)
            return await self._api(request)
        raise HTTPError(http.HTTPStatus.NOT_FOUND, "not_found", f"no route {path}")

    def _require_enabled(self) -> None:
        if not self.token:
            raise HTTPError(
                http.HTTPStatus.NOT_FOUND,
                "admin_disabled",
                "the admin API is disabled: set admin_token (TOKEND_ADMIN_TOKEN)",
            )

    def _authenticate(self, request: Request) -> None:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        given_token = given.strip().encode()
        if scheme.lower() != "bearer" or not hmac.compare_digest(given_token, self.token):
            raise HTTPError(
                http.HTTPStatus.UNAUTHORIZED,
                "unauthorized",
                "missing or wrong admin token (Authorization: Bearer <admin_token>)",
                {"WWW-Authenticate": 'Bearer realm="tokend-admin"'},
            )

    async def _api(self, request: Request) -> Response:
        routes: dict[str, Handler]
        params: dict[str, str] = {}
        if request.path == "/v1/tokens":
            routes = {"POST": self._mint}
        elif request.path == "/v1/sessions":
            routes = {"GET": self._list}
        elif match := _SESSION_PATH.fullmatch(request.path):
            routes = {"GET": self._show, "DELETE": self._revoke}
            params["tid"] = match.group(1)
        elif request.path == "/v1/stats":
            routes = {"GET": self._stats}
        elif request.path == "/v1/events":
            routes = {"GET": self._events}
        else:
            raise HTTPError(http.HTTPStatus.NOT_FOUND, "not_found", f"no route {request.path}")
        _only(request, *routes)
        return await routes[request.method](request, params)

    # /v1 handlers

    async def _mint(self, request: Request, params: dict[str, str]) -> Response:
        """POST /v1/tokens {sub, ttl?, prio?} -> 201 {token, tid, exp (unix ms)}."""
        try:
            body = json.loads(request.body)
        except (ValueError, UnicodeDecodeError):
            bad = http.HTTPStatus.BAD_REQUEST
            raise HTTPError(bad, "invalid_json", "body is not JSON") from None
        if not isinstance(body, dict):
            raise _invalid("body must be a JSON object")
        unknown = set(body) - {"sub", "ttl", "prio"}
        if unknown:
            raise _invalid(f"unknown fields: {', '.join(sorted(unknown))}")
        sub = body.get("sub")
        if not isinstance(sub, str) or not sub:
            raise _invalid("sub: a non-empty string is required")
        tokens = self.node.tokens
        ttl = _int_field(body, "ttl", tokens.default_ttl_s, range(1, 10 * 365 * 86400))
        prio = _int_field(body, "prio", DEFAULT_PRIO, PRIO_RANGE)
        claims = tokens.new_claims(sub, ttl_s=ttl, prio=prio)
        return Response.json(
            http.HTTPStatus.CREATED,
            {"token": tokens.sign(claims), "tid": str(claims.tid), "exp": claims.exp * 1000},
        )

    async def _show(self, request: Request, params: dict[str, str]) -> Response:
        """GET /v1/sessions/{tid}: the live session, or its tombstone (state ENDED)."""
        tid = _tid(params["tid"])
        view = await self.node.store.queries.session(tid)
        if view is None:
            raise HTTPError(http.HTTPStatus.NOT_FOUND, "session_not_found", f"no session {tid}")
        return Response.json(http.HTTPStatus.OK, view.as_json())

    async def _revoke(self, request: Request, params: dict[str, str]) -> Response:
        """DELETE /v1/sessions/{tid}: the revocation of ``tokend revoke`` (close 4506).

        200 once ``durable_replicas`` replicas hold it; 504 ``not_confirmed`` when they did
        not acknowledge it in time: the master has it, a failover may undo it.
        """
        tid = _tid(params["tid"])
        try:
            outcome = await self.node.store.revoke(tid, by=f"admin:{self.node.name}")
        except NotConfirmed as exc:
            log.warning(
                "revocation not confirmed",
                tid=str(tid),
                acknowledged=exc.acknowledged,
                wanted=exc.wanted,
            )
            body = {
                "error": "not_confirmed",
                "detail": f"the master revoked it, but {exc}: a failover may undo it; repeat "
                "the request",
                "tid": str(tid),
                "acknowledged": exc.acknowledged,
                "wanted": exc.wanted,
            }
            return Response.json(http.HTTPStatus.GATEWAY_TIMEOUT, body)
        result = _REVOKE_RESULTS[outcome]
        return Response.json(http.HTTPStatus.OK, {"tid": str(tid), "result": result})

    async def _list(self, request: Request, params: dict[str, str]) -> Response:
        """GET /v1/sessions?state=&cursor=&limit= -> {sessions, cursor (null: last page)}."""
        state = request.query.get("state") or None
        if state is not None and state not in _STATES:
            raise _invalid(f"state: one of {', '.join(_STATES)}")
        limit = _query_int(request, "limit", DEFAULT_PAGE, range(1, MAX_PAGE + 1))
        try:
            page, cursor = await self.node.store.queries.sessions(
                state, request.query.get("cursor", ""), limit
            )
        except ValueError as exc:
            raise _invalid(f"cursor: {exc}") from None
        return Response.json(
            http.HTTPStatus.OK, {"sessions": [v.as_json() for v in page], "cursor": cursor}
        )

    async def _stats(self, request: Request, params: dict[str, str]) -> Response:
        """GET /v1/stats: the dashboard's feed (docs/operations.md)."""
        total = await self.node.store.queries.count_sessions()
        return Response.json(http.HTTPStatus.OK, self.node.metrics.stats(self.node.name, total))

    async def _events(self, request: Request, params: dict[str, str]) -> Response:
        """GET /v1/events?after=&limit= -> {events, next}: recent events, oldest first."""
        after = _query_int(request, "after", 0, range(0, 1 << 62))
        limit = _query_int(request, "limit", DEFAULT_PAGE, range(1, MAX_PAGE + 1))
        return Response.json(http.HTTPStatus.OK, self.ring.after(after, limit))


# Helpers


def _only(request: Request, *methods: str) -> None:
    if request.method not in methods:
        raise HTTPError(
            http.HTTPStatus.METHOD_NOT_ALLOWED,
            "method_not_allowed",
            f"{request.method} not allowed here; use {', '.join(methods)}",
            {"Allow": ", ".join(methods)},
        )


def _invalid(detail: str) -> HTTPError:
    return HTTPError(http.HTTPStatus.BAD_REQUEST, "invalid_request", detail)


def _tid(text: str) -> uuid.UUID:
    try:
        return uuid.UUID(text)
    except ValueError:
        raise _invalid(f"not a token id (UUID): {text[:64]!r}") from None


def _int_field(body: dict[str, Any], name: str, default: int, allowed: range) -> int:
    return _bounded(name, body.get(name, default), allowed)


def _query_int(request: Request, name: str, default: int, allowed: range) -> int:
    text = request.query.get(name)
    if text is None:
        return default
    return _bounded(name, int(text) if text.isdigit() else text, allowed)


def _bounded(name: str, value: object, allowed: range) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value not in allowed:
        raise _invalid(f"{name}: an integer in {allowed.start}..{allowed.stop - 1}")
    return value


async def _static(directory: Path, name: str) -> Response:
    """A file of ``directory`` (tokend/dashboard/), by a name that cannot leave it."""
    segments = name.split("/")
    suffix = Path(name).suffix
    if not all(_SEGMENT.fullmatch(s) for s in segments) or suffix not in DASHBOARD_TYPES:
        raise HTTPError(http.HTTPStatus.NOT_FOUND, "not_found", "no such dashboard file")
    path = directory.joinpath(*segments)
    try:
        data = await asyncio.to_thread(path.read_bytes)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise HTTPError(http.HTTPStatus.NOT_FOUND, "not_found", "no such dashboard file") from None
    return Response.raw(http.HTTPStatus.OK, data, DASHBOARD_TYPES[suffix])
