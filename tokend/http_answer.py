"""The JSON answer of both listeners to a plain HTTP request: the main port's (given
instead of, or before, the WebSocket handshake) and the admin listener's."""

from __future__ import annotations

import http
import json
from collections.abc import Sequence
from typing import Any, NamedTuple


class HttpAnswer(NamedTuple):
    status: http.HTTPStatus
    body: Any  # JSON
    headers: Sequence[tuple[str, str]] = ()

    def encoded(self) -> tuple[list[tuple[str, str]], bytes]:
        """Its headers and body, as either listener sends them."""
        body = json.dumps(self.body).encode()
        return head(body, "application/json", self.headers), body


def head(
    body: bytes, content_type: str, extra: Sequence[tuple[str, str]] = ()
) -> list[tuple[str, str]]:
    """The headers of an answer with ``body``: its type and length, then ``extra``. Never
    cached unless ``extra`` says otherwise (health and admin answers change by the second)."""
    headers = [("Content-Type", content_type), ("Content-Length", str(len(body))), *extra]
    if not any(name.lower() == "cache-control" for name, _ in extra):
        headers.append(("Cache-Control", "no-store"))
    return headers
