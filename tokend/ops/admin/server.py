"""The admin listener of one node: its routes, beside the WebSocket port.

websockets answers only GET requests from its handshake, so the admin API (POST,
DELETE) has a listener of its own (``admin_host``:``admin_port``; docs/operations.md),
whose HTTP/1.1 layer is :mod:`tokend.ops.admin.listener`.

Always served: ``/metrics`` (Prometheus text), ``/healthz``, ``/readyz``. With an
``admin_token`` set: ``/v1/*`` (bearer token required; :mod:`tokend.ops.admin.api`) and
the dashboard's static files under ``/dashboard``; without one, both answer 404
``admin_disabled``. Errors are JSON ``{"error": "<snake_code>", "detail": "<text>"}``.
Every request is logged (method, path, status); never a token.
"""

from __future__ import annotations

import asyncio
import http
import re
import socket
from pathlib import Path

import structlog

from tokend.edge.http_request import HTTPError, Request
from tokend.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from tokend.ops.admin.api import AdminApi
from tokend.ops.admin.event_ring import EventRing
from tokend.ops.admin.listener import WILDCARDS, HttpListener, Response, only
from tokend.ops.monitor import Monitor
from tokend.server import health
from tokend.server.background import Background

log = structlog.get_logger("tokend.admin")

DASHBOARD_DIR = Path(__file__).parent.parent / "dashboard"
DASHBOARD_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
# A dashboard path segment: no leading dot (so no "..", no hidden files), no escapes.
_SEGMENT = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")


class AdminServer:
    """The admin listener of one node; :class:`tokend.ops.app.App` starts and stops it."""

    def __init__(self, monitor: Monitor, sock: socket.socket | None = None) -> None:
        self.node = node = monitor.node
        self.settings = node.settings
        self.admission = monitor.admission
        self.ring = EventRing()
        self.api = AdminApi(monitor, self.ring)
        self.dashboard_dir = DASHBOARD_DIR
        self.listener = HttpListener(self.settings, self._route, sock)
        self.background = Background()

    @property
    def enabled(self) -> bool:
        """The admin API and dashboard are served (an admin_token is set)."""
        return bool(self.settings.admin_token)

    @property
    def port(self) -> int:
        return self.listener.port

    async def start(self) -> None:
        await self.listener.start()
        if self.enabled:
            self.background.spawn(
                self.ring.follow(self.node.redis, self.node.store.keys), "admin events"
            )
        assert self.listener.server is not None
        log.info(
            "admin listening",
            host=self.listener.server.sockets[0].getsockname()[0],
            port=self.port,
            admin_api="enabled" if self.enabled else "disabled",
        )
        if self.settings.admin_host in WILDCARDS and not self.settings.admin_host_list:
            log.warning(
                "admin listener on every address answers only loopback names: list the "
                "names its clients use in admin_allowed_hosts",
                allowed=sorted(self.listener.allowed_hosts or ()),
            )

    async def stop(self) -> None:
        self.listener.close()
        await self.background.stop()

    async def _route(self, request: Request) -> Response:
        path = request.path
        if path == "/metrics":
            only(request, "GET")
            return Response.raw(
                http.HTTPStatus.OK, self.node.metrics.exposition(), METRICS_CONTENT_TYPE
            )
        if path == "/healthz":
            only(request, "GET")
            return Response.of(health.liveness(self.node))
        if path == "/readyz":
            only(request, "GET")
            return Response.of(await health.readiness(self.node, self.admission.draining))
        if path == "/dashboard" or path.startswith("/dashboard/"):
            self._require_enabled()
            only(request, "GET")
            return await _static(
                self.dashboard_dir, path.removeprefix("/dashboard").strip("/") or "index.html"
            )
        if path.startswith("/v1/"):
            self._require_enabled()
            return await self.api.route(request)
        raise HTTPError(http.HTTPStatus.NOT_FOUND, "not_found", f"no route {path}")

    def _require_enabled(self) -> None:
        if not self.enabled:
            raise HTTPError(
                http.HTTPStatus.NOT_FOUND,
                "admin_disabled",
                "the admin API is disabled: set admin_token (TOKEND_ADMIN_TOKEN)",
            )


async def _static(directory: Path, name: str) -> Response:
    """A file of ``directory`` (tokend/ops/dashboard/), by a name that cannot leave it."""
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
