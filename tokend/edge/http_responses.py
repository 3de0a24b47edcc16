"""The JSON answer of both listeners to a plain HTTP request: the main port's (given
instead of, or before, the WebSocket handshake) and the admin listener's.

On the main port the gate answers some requests itself (``Gate.answer``: ``/healthz``,
``/readyz``, the JWKS, a refusal such as 429 or 503, 404): the answer is written by
websockets' ``ServerProtocol.send_response`` where its 101 would have gone
(:meth:`tokend.edge.handshake.Handshake.answer`), which then ends the connection as after
any answer but a 101. An answer the gate must wait for (``/readyz`` asks Redis) is
written once it is ready, by a task of the node.
"""

from __future__ import annotations

import http
import json
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, NamedTuple

from websockets.datastructures import Headers
from websockets.http11 import Response


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


def give(
    answer: HttpAnswer | Awaitable[HttpAnswer],
    send: Callable[[Response], None],
    spawn: Callable[[Coroutine[Any, Any, None]], None],
) -> None:
    """``send`` the response of ``answer``: now, or once it is ready (from a task
    ``spawn`` runs)."""
    if isinstance(answer, HttpAnswer):
        send(response(answer))
    else:
        spawn(_later(answer, send))


async def _later(answer: Awaitable[HttpAnswer], send: Callable[[Response], None]) -> None:
    send(response(await answer))


def response(answer: HttpAnswer) -> Response:
    """websockets' ``Response`` of ``answer``."""
    headers, body = answer.encoded()
    return Response(answer.status.value, answer.status.phrase, Headers(headers), body)
