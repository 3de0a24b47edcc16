"""The admin API (``/v1/*``, docs/operations.md): mint, show, list and revoke sessions,
the dashboard's stats and events; every request must carry the bearer ``admin_token``."""

from __future__ import annotations

import hmac
import http
import json
import re
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from tokend.core.claims import DEFAULT_PRIO, PRIO_RANGE
from tokend.core.store_messages import EndOutcome
from tokend.edge.http_request import HTTPError, Request
from tokend.ops.admin.event_ring import EventRing
from tokend.ops.admin.listener import Response, only
from tokend.ops.monitor import Monitor
from tokend.store.unavailable import NotConfirmed

log = structlog.get_logger("tokend.admin")

MAX_PAGE = 500
MAX_NODE_NAME = 256
DEFAULT_PAGE = 100
_SESSION_PATH = re.compile(r"/v1/sessions/([^/]+)")
_STATES = ("ACTIVE", "WARN")
_REVOKE_RESULTS = {
    EndOutcome.ENDED: "revoked",
    EndOutcome.BARRED: "barred",
    EndOutcome.ALREADY_ENDED: "already_ended",
}

Handler = Callable[[Request, dict[str, str]], Awaitable[Response]]


class AdminApi:
    """The ``/v1`` routes of one node (its store, tokens and metrics) and its event ring."""

    def __init__(self, monitor: Monitor, ring: EventRing) -> None:
        self.monitor = monitor
        self.node = node = monitor.node
        self.ring = ring
        self.token = node.settings.admin_token.encode()

    async def route(self, request: Request) -> Response:
        self._authenticate(request)
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
        elif request.path == "/v1/nodes":
            routes = {"GET": self._nodes}
        elif request.path == "/v1/history":
            routes = {"GET": self._history}
        else:
            raise HTTPError(http.HTTPStatus.NOT_FOUND, "not_found", f"no route {request.path}")
        only(request, *routes)
        return await routes[request.method](request, params)

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
        """GET /v1/stats: this node's view and the cluster's counts (docs/operations.md);
        answered while Redis is unreachable too (the health it shows says so)."""
        return Response.json(http.HTTPStatus.OK, await self.monitor.stats())

    async def _nodes(self, request: Request, params: dict[str, str]) -> Response:
        """GET /v1/nodes -> {nodes}: the view of every node sharing the store."""
        return Response.json(http.HTTPStatus.OK, {"nodes": await self.monitor.nodes()})

    async def _history(self, request: Request, params: dict[str, str]) -> Response:
        """GET /v1/history?node=&after= -> {node, interval, samples}: a node's samples
        (this one's by default; "all" adds every node's up) after ``after`` (unix ms)."""
        node = request.query.get("node") or self.node.name
        if len(node) > MAX_NODE_NAME:
            raise _invalid(f"node: at most {MAX_NODE_NAME} characters")
        after = _query_int(request, "after", 0, range(0, 1 << 62))
        samples = await self.monitor.history(node, after)
        return Response.json(
            http.HTTPStatus.OK,
            {"node": node, "interval": self.monitor.interval, "samples": samples},
        )

    async def _events(self, request: Request, params: dict[str, str]) -> Response:
        """GET /v1/events?after=&limit= -> {events, next}: recent events, oldest first."""
        after = _query_int(request, "after", 0, range(0, 1 << 62))
        limit = _query_int(request, "limit", DEFAULT_PAGE, range(1, MAX_PAGE + 1))
        return Response.json(http.HTTPStatus.OK, self.ring.after(after, limit))


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
