"""Liveness and readiness, answered alike on the main port and the admin listener."""

from __future__ import annotations

import http
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokend.node import Node

Answer = tuple[http.HTTPStatus, dict[str, Any]]


def liveness(node: Node) -> Answer:
    """``/healthz``: 200 while the process runs."""
    return http.HTTPStatus.OK, {"status": "ok", "node": node.name}


async def readiness(node: Node, draining: bool) -> Answer:
    """``/readyz``: 200 when this node can take sessions; else 503 naming each failing part."""
    problems = {}
    redis_problem = await node.store.ready()
    failed = node.failed_task()
    if failed:
        problems["node"] = f"background task {failed!r} stopped; restart this node"
    if redis_problem:
        problems["redis"] = redis_problem
    elif not node.subscribed.is_set():
        problems["control"] = "control subscription not established"
    if draining:
        problems["drain"] = "shutting down: not accepting connections"
    if problems:
        return http.HTTPStatus.SERVICE_UNAVAILABLE, {"status": "unavailable", **problems}
    return http.HTTPStatus.OK, {"status": "ready"}
