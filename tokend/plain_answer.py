"""The main port's plain HTTP answers: given in place of the WebSocket handshake's.

The gate answers some requests itself (``Gate.answer``: ``/healthz``, ``/readyz``, the
JWKS, a refusal such as 429 or 503, 404): the answer (:class:`HttpAnswer`, shared with
the admin listener) is written by websockets' ``ServerProtocol`` where its 101 would
have gone, which then closes the connection as after any answer but a 101. An answer
the gate must wait for (``/readyz`` asks Redis) is written once it is ready, by a
task of the node.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from websockets.datastructures import Headers
from websockets.http11 import Response
from websockets.protocol import State
from websockets.server import ServerProtocol

from tokend.http_answer import HttpAnswer
from tokend.peer import Hub


def give(
    ws: ServerProtocol,
    answer: HttpAnswer | Awaitable[HttpAnswer],
    hub: Hub,
    write: Callable[[], None],
) -> None:
    """Send ``answer`` through ``ws``: now (the caller writes it), or once it is ready
    (then ``write`` writes it), unless the connection has gone on or ended by then."""
    if isinstance(answer, HttpAnswer):
        ws.send_response(response(answer))
    else:
        hub.spawn(_later(ws, answer, write))


async def _later(
    ws: ServerProtocol, answer: Awaitable[HttpAnswer], write: Callable[[], None]
) -> None:
    ready = response(await answer)
    if ws.state is State.CONNECTING:
        ws.send_response(ready)
        write()


def response(answer: HttpAnswer) -> Response:
    """websockets' ``Response`` of ``answer``."""
    headers, body = answer.encoded()
    return Response(answer.status.value, answer.status.phrase, Headers(headers), body)
