"""Loopback addresses and plain HTTP to a tokend listener."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from tokend.core import protocol as p

LOOPBACK = "127.0.0.1"


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            return int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# Ports are handed out below the kernel's ephemeral range: a port the kernel picked for
# a listener and released is as likely to be taken next by an outgoing connection (a
# Redis client, a health check) as by the process it was meant for. Each port is handed
# out at most once per test process, in an order that differs between processes so that
# concurrent runs rarely probe the same ports.
_PORTS = range(10_000, _ephemeral_low())
_next_port = iter(random.sample(_PORTS, len(_PORTS)))


def free_port() -> int:
    """A TCP port free on loopback now, outside the ephemeral range, never given twice."""
    for port in _next_port:
        with socket.socket() as s:
            try:
                s.bind((LOOPBACK, port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free loopback port left in {_PORTS}")


async def http_get(port: int, path: str) -> tuple[int, Any]:
    """GET a tokend HTTP route; returns (status, decoded JSON body)."""

    def get() -> tuple[int, Any]:
        try:
            with urllib.request.urlopen(f"http://{LOOPBACK}:{port}{path}", timeout=5) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"null")

    return await asyncio.to_thread(get)


async def is_ready(port: int) -> bool:
    """Whether a node's ``/readyz`` answers 200: what an operator polls."""
    return (await http_get(port, "/readyz"))[0] == 200


@dataclass
class HttpReply:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


async def http_request(
    port: int,
    method: str,
    path: str,
    *,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
    raw: bytes | None = None,
    timeout: float = 5.0,
) -> HttpReply:
    """One HTTP/1.1 request over a fresh connection (or ``raw`` bytes as they are),
    read until the server closes; for the admin listener, which closes after each."""
    reader, writer = await asyncio.open_connection(LOOPBACK, port)
    try:
        if raw is None:
            lines = [f"{method} {path} HTTP/1.1", f"Host: {LOOPBACK}:{port}"]
            lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
            if body:
                lines.append(f"Content-Length: {len(body)}")
            raw = ("\r\n".join(lines) + "\r\n\r\n").encode() + body
        writer.write(raw)
        async with asyncio.timeout(timeout):
            data = await reader.read()
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    head, _, content = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    fields = dict(line.split(": ", 1) for line in header_lines)
    return HttpReply(
        int(status_line.split(" ")[1]), {k.lower(): v for k, v in fields.items()}, content
    )


def url_of(port: int) -> str:
    """The WebSocket URL of a tokend listening on ``port`` of loopback."""
    return f"ws://{LOOPBACK}:{port}{p.WS_PATH}"


async def admin_json(port: int, token: str, path: str) -> Any:
    """The JSON of ``GET path`` on the admin listener of ``port``, with its bearer
    ``token``; anything but a 200 fails."""
    reply = await http_request(port, "GET", path, headers={"Authorization": f"Bearer {token}"})
    assert reply.status == 200, reply
    return reply.json()
