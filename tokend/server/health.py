"""Liveness and readiness, answered alike on the main port and the admin listener."""

from __future__ import annotations

import http
from typing import TYPE_CHECKING

from tokend.edge.http_responses import HttpAnswer

if TYPE_CHECKING:
    from tokend.server.node import Node


def liveness(node: Node) -> HttpAnswer:
    """``/healthz``: 200 while the process runs."""
    return HttpAnswer(http.HTTPStatus.OK, {"status": "ok", "node": node.name})


async def readiness(node: Node, draining: bool) -> HttpAnswer:
    """``/readyz``: 200 when this node can take sessions; else 503 naming each failing part.

    Either way ``keys`` lists the key files the node refused (by file name: why), while
    it serves with the others: every node sharing the directory refuses the same file,
    so taking them all out of the balancer for it would be an outage, not a fix.
    """
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
    keys = {"keys": node.tokens.keys.problems} if node.tokens.keys.problems else {}
    if problems:
        return HttpAnswer(
            http.HTTPStatus.SERVICE_UNAVAILABLE, {"status": "unavailable", **problems, **keys}
        )
    return HttpAnswer(http.HTTPStatus.OK, {"status": "ready", **keys})
