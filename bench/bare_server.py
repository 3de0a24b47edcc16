"""Bare servers with tokend's framing and no logic: the baseline, and the client's ceiling.

``--impl websockets`` (the baseline the targets are judged against): the same library
and event loop as tokend through its asyncio server (no compression, no pings, 16 KiB
messages, backlog 4096). ``--impl sansio``: the same library's Sans-I/O core driven by
a plain ``asyncio.Protocol``, as tokend drives it (tokend/server/connection.py): the floor of
tokend's design, a second baseline. ``--impl picows``: a Cython server, much cheaper
per message than any websockets server; the heartbeat scenario runs its load
generator against it to show how far above the measured rates the client itself can go.

Both answer a 50-byte heartbeat with a 20-byte ACK-shaped frame and any other message
(the HELLO) with a 72-byte WELCOME-shaped frame, both prepared once at start. With
``--verify-keys DIR`` (the connect storm's baseline) the websockets server first checks
the HELLO token's Ed25519 signature with the public key its ``kid`` names in DIR: the
one piece of tokend's work at HELLO that no server can skip, and most of its cost.

With ``--tls-cert FILE --tls-key FILE`` each serves wss:// with the context tokend
builds from the same files (:func:`tokend.edge.tls.server_context`: TLS 1.2+, the ssl
module's default ciphers), TLS done by the event loop's own TLS layer.

Run as ``python -m bench.bare_server --port PORT [--impl picows]``; prints
``listening`` when ready and stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import signal
import ssl
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import cast

import uvloop
from cryptography.exceptions import InvalidSignature
from picows import WSFrame, WSListener, WSMsgType, WSTransport, ws_create_server
from websockets.asyncio.server import ServerConnection, serve
from websockets.frames import Frame, Opcode
from websockets.http11 import Request
from websockets.server import ServerProtocol
from websockets.typing import Subprotocol

from tokend.core import protocol as p
from tokend.edge.tls import server_context
from tokend.tokens.keys import KeyRing

ACK = p.encode(p.HeartbeatAck(seq=1, exp_ms=0))
WELCOME = p.encode(p.Welcome(bytes(16), 0, 30_000, 90_000, 120_000, os.urandom(32)))


async def answer(ws: ServerConnection) -> None:
    async for message in ws:
        await ws.send(ACK if len(message) == p.HEARTBEAT_LENGTH else WELCOME)


def verifying(keys: KeyRing) -> Callable[[ServerConnection], Awaitable[None]]:
    """``answer``, after checking each HELLO token's signature (closing 4501 if bad)."""

    async def answer_verified(ws: ServerConnection) -> None:
        async for message in ws:
            if len(message) != p.HEARTBEAT_LENGTH:
                hello = message if isinstance(message, bytes) else message.encode()
                # The token is L bytes after the 4-byte head; a resume proof may follow.
                length = int.from_bytes(hello[2:4], "big")
                signing_input, _, signature = hello[4 : 4 + length].rpartition(b".")
                header = json.loads(
                    base64.urlsafe_b64decode(signing_input.partition(b".")[0] + b"==")
                )
                key = keys.public_key(header["kid"])
                try:
                    assert key is not None
                    key.verify(base64.urlsafe_b64decode(signature + b"=="), signing_input)
                except (AssertionError, InvalidSignature):
                    await ws.close(p.CloseCode.INVALID_TOKEN)
                    return
            await ws.send(ACK if len(message) == p.HEARTBEAT_LENGTH else WELCOME)

    return answer_verified


class PicowsAnswer(WSListener):
    def on_ws_frame(self, transport: WSTransport, frame: WSFrame) -> None:
        if frame.msg_type == WSMsgType.BINARY:
            reply = ACK if frame.payload_size == p.HEARTBEAT_LENGTH else WELCOME
            transport.send(WSMsgType.BINARY, reply)
        elif frame.msg_type == WSMsgType.CLOSE:
            transport.send_close(frame.get_close_code())
            transport.disconnect()


class SansIoAnswer(asyncio.Protocol):
    """websockets' ServerProtocol on a plain asyncio.Protocol: no task, no future."""

    __slots__ = ("transport", "ws")

    def __init__(self) -> None:
        self.ws = ServerProtocol(subprotocols=[Subprotocol(p.SUBPROTOCOL)], max_size=16384)
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream's (uvloop's transports are not subclasses of asyncio's).
        self.transport = cast("asyncio.Transport", transport)

    def data_received(self, data: bytes) -> None:
        ws = self.ws
        ws.receive_data(data)
        for event in ws.events_received():
            if isinstance(event, Frame):
                if event.opcode is Opcode.BINARY:
                    ws.send_binary(ACK if len(event.data) == p.HEARTBEAT_LENGTH else WELCOME)
            elif isinstance(event, Request):  # the opening handshake
                ws.send_response(ws.accept(event))
        self.write()

    def eof_received(self) -> None:
        self.ws.receive_eof()
        self.write()

    def write(self) -> None:
        assert self.transport is not None
        for chunk in self.ws.data_to_send():
            if chunk:
                self.transport.write(chunk)
            elif self.transport.can_write_eof():
                self.transport.write_eof()


async def run_sansio(port: int, stop: asyncio.Event, tls: ssl.SSLContext | None) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(SansIoAnswer, "127.0.0.1", port, backlog=4096, ssl=tls)
    print("listening", file=sys.stderr, flush=True)
    await stop.wait()
    server.close()


async def run_picows(port: int, stop: asyncio.Event, tls: ssl.SSLContext | None) -> None:
    server = await ws_create_server(
        lambda _request: PicowsAnswer(), "127.0.0.1", port, backlog=4096, ssl=tls
    )
    print("listening", file=sys.stderr, flush=True)
    await stop.wait()
    server.close()


async def run(port: int, impl: str, verify_keys: Path | None, tls: ssl.SSLContext | None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    if impl == "picows":
        await run_picows(port, stop, tls)
        return
    if impl == "sansio":
        await run_sansio(port, stop, tls)
        return
    async with serve(
        verifying(KeyRing.open(verify_keys)) if verify_keys else answer,
        "127.0.0.1",
        port,
        subprotocols=[Subprotocol(p.SUBPROTOCOL)],
        compression=None,
        max_size=16384,
        ping_interval=None,
        close_timeout=2,
        server_header=None,
        backlog=4096,
        ssl=tls,
    ):
        print("listening", file=sys.stderr, flush=True)
        await stop.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--impl", choices=("websockets", "sansio", "picows"), default="websockets")
    parser.add_argument("--verify-keys", type=Path, help="check HELLO signatures (websockets)")
    parser.add_argument("--tls-cert", help="serve wss:// with this certificate chain")
    parser.add_argument("--tls-key", help="the key of --tls-cert")
    args = parser.parse_args()
    tls = server_context(args.tls_cert, args.tls_key) if args.tls_cert else None
    uvloop.run(run(args.port, args.impl, args.verify_keys, tls))


if __name__ == "__main__":
    main()
