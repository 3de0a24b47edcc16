"""The admin listener: a small HTTP/1.1 server beside the WebSocket port.

websockets answers only GET requests from its handshake, so the admin API (POST,
DELETE) has a listener of its own (``admin_host``:``admin_port``; docs/operations.md).
One request per connection (``Connection: close``); the request head and body must
arrive within ``hello_timeout`` (else 408), a body is read only with a
Content-Length of at most ``admin_max_body`` (else 413).

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
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

import structlog

from tokend import events, health
from tokend.answers import EndOutcome
from tokend.http_answer import HttpAnswer, head
from tokend.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from tokend.node import Background, Node
from tokend.store.unavailable import UNAVAILABLE, NotConfirmed, Retry, StoreUnavailable
from tokend.tokens import DEFAULT_PRIO, PRIO_RANGE

log = structlog.get_logger("tokend.admin")

# Request line plus headers; a longer head gets 431.
MAX_HEAD = 16384
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


@dataclass(slots=True)
class Response:
    """An answer of the admin listener: JSON (:class:`HttpAnswer`) or a file's bytes."""

    status: http.HTTPStatus
    body: bytes
    headers: list[tuple[str, str]]

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
        return cls.json(exc.status, {"error": exc.error, "detail": exc.detail}, **exc.headers)

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

    def __init__(self, node: Node, draining: Callable[[], bool]) -> None:
        self.node = node
        self.settings = node.settings
        self.draining = draining
        self.token = self.settings.admin_token.encode()
        self.ring = EventRing()
        self.dashboard_dir = DASHBOARD_DIR
        self.server: asyncio.Server | None = None
        self.background = Background()

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        self.server = await asyncio.start_server(
            self._connection, self.settings.admin_host, self.settings.admin_port, limit=MAX_HEAD
        )
        if self.token:
            self.background.spawn(self._follow_events(), "admin events")
        log.info(
            "admin listening",
            host=self.settings.admin_host,
            port=self.port,
            admin_api="enabled" if self.token else "disabled",
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
        try:
            await self._answer(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the peer went away: nobody to answer
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        method, path = "-", "-"
        try:
            request = await self._read_in_time(reader)
            method, path = request.method, request.path
            response = await self._route(request)
        except HTTPError as exc:
            response = Response.error(exc)
        except StoreUnavailable as exc:
            unavailable = http.HTTPStatus.SERVICE_UNAVAILABLE
            response = Response.error(HTTPError(unavailable, "store_unavailable", str(exc)))
        except (ConnectionError, asyncio.IncompleteReadError):
            raise
        except Exception:
            log.exception("admin request failed", method=method, path=path)
            internal = http.HTTPStatus.INTERNAL_SERVER_ERROR
            response = Response.error(HTTPError(internal, "internal_error", "see the node's log"))
        peer = writer.get_extra_info("peername")
        log.info(
            "admin request",
            method=method,
            path=path,
            status=response.status.value,
            peer=peer[0] if peer else "?",
        )
        writer.write(response.encode())
        await writer.drain()

    async def _read_in_time(self, reader: asyncio.StreamReader) -> Request:
        try:
            async with asyncio.timeout(self.settings.hello_timeout):
                return await self._read(reader)
        except TimeoutError:
            timeout = http.HTTPStatus.REQUEST_TIMEOUT
            raise HTTPError(timeout, "timeout", "request not read in time") from None

    async def _read(self, reader: asyncio.StreamReader) -> Request:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            raise HTTPError(
                http.HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
                "head_too_large",
                f"request line and headers exceed {MAX_HEAD} bytes",
            ) from None
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise HTTPError(http.HTTPStatus.BAD_REQUEST, "bad_request", "malformed request line")
        method, target, _ = parts
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if not line:
                continue
            name, sep, value = line.partition(":")
            if not sep or not name.strip():
                raise HTTPError(http.HTTPStatus.BAD_REQUEST, "bad_request", "malformed header")
            headers[name.strip().lower()] = value.strip()
        path, _, query = target.partition("?")
        request = Request(method, path, dict(parse_qsl(query)), headers)
        if "transfer-encoding" in headers:
            raise HTTPError(
                http.HTTPStatus.LENGTH_REQUIRED,
                "length_required",
                "send the body with a Content-Length",
            )
        length = headers.get("content-length", "0")
        if not length.isdigit():
            raise HTTPError(http.HTTPStatus.BAD_REQUEST, "bad_request", "bad Content-Length")
        if int(length) > self.settings.admin_max_body:
            raise HTTPError(
                http.HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                "body_too_large",
                f"bodies are limited to {self.settings.admin_max_body} bytes",
            )
        request.body = await reader.readexactly(int(length))
        return request

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
        tid, iat = uuid.uuid4(), int(time.time())
        token = tokens.mint(sub, ttl_s=ttl, prio=prio, tid=tid, iat=iat)
        return Response.json(
            http.HTTPStatus.CREATED, {"token": token, "tid": str(tid), "exp": (iat + ttl) * 1000}
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
