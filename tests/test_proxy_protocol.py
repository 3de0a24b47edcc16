"""The PROXY protocol: the pure parser (tokend/edge/proxy_protocol.py) against HAProxy's
specification, and a node that takes it from trusted sources only, over real sockets
(a raw socket writes the headers; tests/test_haproxy.py has a real HAProxy)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from websockets.exceptions import InvalidStatus

from testkit.clients import RawClient, open_socket
from testkit.net import LOOPBACK, http_request
from testkit.waiting import eventually
from tokend import config
from tokend.config import ConfigError
from tokend.edge.proxy_protocol import (
    V2_SIGNATURE,
    ProxyHeader,
    ProxyHeaderError,
    parse,
    starts_header,
)
from tokend.ops.app import App
from tokend.tokens.service import TokenService

Logs = list[dict[str, Any]]  # the tokend_logs fixture's lines
REST = b"GET /v1/ws HTTP/1.1\r\n"
UNTRUSTED = "closed: PROXY protocol header from an address not in proxy_protocol_from"


def v2(
    source: tuple[str, int] | None = None,
    destination: tuple[str, int] = ("192.0.2.1", 443),
    *,
    command: int = 0x1,
    version: int = 0x2,
    family: int | None = None,
    addresses: bytes | None = None,
    tlvs: bytes = b"",
) -> bytes:
    """A version 2 header (section 2.2) as a sender writes it; every field can be set
    to what a sender must not write."""
    if addresses is None and source is not None:
        ip = ipaddress.ip_address(source[0])
        packed_destination = ipaddress.ip_address(destination[0]).packed
        addresses = ip.packed + packed_destination + struct.pack("!HH", source[1], destination[1])
        family = family if family is not None else (0x11 if ip.version == 4 else 0x21)
    addresses = addresses or b""
    body = addresses + tlvs
    fixed = struct.pack("!BBH", version << 4 | command, family or 0, len(body))
    return V2_SIGNATURE + fixed + body


def tlv(kind: int, value: bytes) -> bytes:
    return struct.pack("!BH", kind, len(value)) + value


# --- the parser -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (
            b"PROXY TCP4 192.168.0.1 192.168.0.11 56324 443\r\n" + REST,
            ProxyHeader(1, ("192.168.0.1", 56324), ("192.168.0.11", 443), REST),
        ),
        (
            b"PROXY TCP6 2001:db8::1 2001:DB8::2 0 65535\r\n",
            ProxyHeader(1, ("2001:db8::1", 0), ("2001:db8::2", 65535), b""),
        ),
        (
            b"PROXY TCP6 ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff "
            b"ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff 65535 65535\r\n",
            ProxyHeader(
                1,
                ("ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", 65535),
                ("ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", 65535),
                b"",
            ),
        ),
        # UNKNOWN: the rest of the line is ignored, the connection's own peer stands.
        (b"PROXY UNKNOWN\r\n" + REST, ProxyHeader(1, None, None, REST)),
        (
            b"PROXY UNKNOWN ffff:f::f ffff:f::f 65535 65535 whatever\r\n",
            ProxyHeader(1, None, None, b""),
        ),
        (
            v2(("203.0.113.7", 5555)) + REST,
            ProxyHeader(2, ("203.0.113.7", 5555), ("192.0.2.1", 443), REST),
        ),
        (
            v2(("2001:db8::7", 1), ("2001:db8::1", 8765)),
            ProxyHeader(2, ("2001:db8::7", 1), ("2001:db8::1", 8765), b""),
        ),
        # TLVs (section 2.2.1+) are skipped, whatever their types.
        (
            v2(
                ("203.0.113.7", 5555),
                tlvs=tlv(0x01, b"http/1.1") + tlv(0x04, b"") + tlv(0xE0, b"x"),
            )
            + REST,
            ProxyHeader(2, ("203.0.113.7", 5555), ("192.0.2.1", 443), REST),
        ),
        # LOCAL (a health check): no address, or some that must be skipped, any family.
        (v2(command=0x0) + REST, ProxyHeader(2, None, None, REST)),
        (
            v2(command=0x0, family=0x11, addresses=bytes(12), tlvs=tlv(4, b"pad")) + REST,
            ProxyHeader(2, None, None, REST),
        ),
        (v2(command=0x0, family=0x77, addresses=bytes(3)), ProxyHeader(2, None, None, b"")),
        # PROXY over AF_UNSPEC or AF_UNIX: no IP address; handled as UNSPEC (allowed).
        (v2(command=0x1, family=0x00) + REST, ProxyHeader(2, None, None, REST)),
        (v2(family=0x31, addresses=bytes(216)) + REST, ProxyHeader(2, None, None, REST)),
    ],
    ids=lambda value: value[:22] if isinstance(value, bytes) else "",
)
def test_a_valid_header(data: bytes, expected: ProxyHeader) -> None:
    assert parse(data) == expected


@pytest.mark.parametrize(
    "header",
    [
        b"PROXY TCP4 192.168.0.1 192.168.0.11 56324 443\r\n",
        b"PROXY UNKNOWN\r\n",
        v2(("203.0.113.7", 5555), tlvs=tlv(0x05, b"id")),
        v2(command=0x0),
    ],
    ids=["v1", "v1-unknown", "v2", "v2-local"],
)
def test_split_input_needs_more_until_the_header_is_whole(header: bytes) -> None:
    """Any cut: None for every proper prefix (section 2: "tolerant" to partial headers),
    the same header once whole, the rest carried over whatever it is."""
    whole = parse(header + REST)
    assert whole is not None and whole.rest == REST
    for cut in range(len(header)):
        assert parse(header[:cut]) is None, cut
    assert parse(header) == ProxyHeader(whole.version, whole.source, whole.destination, b"")


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (b"GET / HTTP/1.1\r\n", "not a PROXY protocol header"),
        (b"\x16\x03\x01\x02\x00", "not a PROXY protocol header"),  # a TLS ClientHello
        (b"proxy TCP4 1.2.3.4 5.6.7.8 1 2\r\n", "not a PROXY protocol header"),
        # Version 1 (section 2.1).
        (b"PROXY TCP5 1.2.3.4 5.6.7.8 1 2\r\n", "protocol must be TCP4, TCP6 or UNKNOWN"),
        (b"PROXY  TCP4 1.2.3.4 5.6.7.8 1 2\r\n", "protocol must be TCP4, TCP6 or UNKNOWN"),
        (b"PROXY TCP4 1.2.3.4  5.6.7.8 1 2\r\n", "each after exactly one space"),
        (b"PROXY TCP4 1.2.3.4 5.6.7.8 1 2 \r\n", "each after exactly one space"),
        (b"PROXY TCP4 1.2.3.4 5.6.7.8 1\r\n", "each after exactly one space"),
        (b"PROXY TCP4 01.2.3.4 5.6.7.8 1 2\r\n", "'01.2.3.4' is not a TCP4 address"),
        (b"PROXY TCP4 1.2.3.256 5.6.7.8 1 2\r\n", "is not a TCP4 address"),
        (b"PROXY TCP4 ::1 5.6.7.8 1 2\r\n", "'::1' is not a TCP4 address"),
        (b"PROXY TCP6 1.2.3.4 ::1 1 2\r\n", "'1.2.3.4' is not a TCP6 address"),
        (b"PROXY TCP6 fe80::1%eth0 ::1 1 2\r\n", "is not a TCP6 address"),
        (b"PROXY TCP4 1.2.3.4 5.6.7.8 01 2\r\n", "'01' is not a port"),
        (b"PROXY TCP4 1.2.3.4 5.6.7.8 1 65536\r\n", "'65536' is not a port"),
        (b"PROXY TCP4 1.2.3.4 5.6.7.8 -1 2\r\n", "'-1' is not a port"),
        (b"PROXY TCP4 1.2.3.4 5.6.7.8 \xd9\xa1 2\r\n", "is not a port"),  # an Arabic-Indic 1
        (b"PROXY TCP4 1.2.3.4 5.6.7.8 1 2\n", "CRLF, not CR or LF alone"),
        (b"PROXY TCP4 1.2.3.4 5.6.7.8 1 2\rX", "CRLF, not CR or LF alone"),
        (b"PROXY TCP4 1.2.3.4\r 5.6.7.8 1 2\r\n", "CRLF, not CR or LF alone"),
        (b"PROXY UNKNOWN " + b"x" * 92 + b"\r\n", "no CRLF within 107 bytes"),
        (b"PROXY UNKNOWN " + b"x" * 200, "no CRLF within 107 bytes"),
        # Version 2 (section 2.2), each refused from its 16 fixed bytes, before the rest.
        (v2(("1.2.3.4", 1), version=0x1)[:16], "version must be 2, not 1"),
        (v2(("1.2.3.4", 1), version=0x3)[:16], "version must be 2, not 3"),
        (v2(("1.2.3.4", 1), command=0x2)[:16], "command must be LOCAL or PROXY, not 0x2"),
        (v2(("1.2.3.4", 1), command=0xF)[:16], "command must be LOCAL or PROXY, not 0xf"),
        (v2(family=0x41, addresses=bytes(12))[:16], "family and protocol 0x41 are not defined"),
        (v2(family=0x13, addresses=bytes(12))[:16], "family and protocol 0x13 are not defined"),
        (v2(family=0x01, addresses=bytes(12))[:16], "family and protocol 0x01 are not defined"),
        (v2(family=0x10, addresses=bytes(12))[:16], "family and protocol 0x10 are not defined"),
        (v2(family=0x12, addresses=bytes(12))[:16], "a datagram (UDP) connection"),
        (v2(family=0x22, addresses=bytes(36))[:16], "a datagram (UDP) connection"),
        (v2(family=0x32, addresses=bytes(216))[:16], "a datagram (UDP) connection"),
        (v2(family=0x11, addresses=bytes(11))[:16], "11 bytes of addresses, 12 needed"),
        (v2(family=0x21, addresses=bytes(12))[:16], "12 bytes of addresses, 36 needed"),
        (v2(family=0x31, addresses=bytes(108))[:16], "108 bytes of addresses, 216 needed"),
    ],
    ids=lambda value: value[:30] if isinstance(value, bytes) else value,
)
def test_a_malformed_header_is_refused_with_its_reason(data: bytes, error: str) -> None:
    with pytest.raises(ProxyHeaderError) as refused:
        parse(data)
    assert error in str(refused.value)


@pytest.mark.parametrize(
    ("data", "begins"),
    [
        (b"", None),
        (b"P", None),
        (b"PROXY", None),
        (b"PROXY ", True),
        (b"PROXY TCP4", True),
        (b"\r\n\r\n", None),
        (V2_SIGNATURE[:11], None),
        (V2_SIGNATURE, True),
        (b"GET /v1/ws HTTP/1.1\r\n", False),
        (b"PROXX", False),
        (b"\r\n\r\nX", False),
        (b"\x16\x03\x01", False),  # TLS
    ],
)
def test_starts_header(data: bytes, begins: bool | None) -> None:
    assert starts_header(data) is begins


# --- a node behind a trusted balancer (a raw socket plays it) ---------------------------


def v1(source: tuple[str, int], destination: tuple[str, int] = ("192.0.2.1", 8765)) -> bytes:
    family = "TCP4" if ipaddress.ip_address(source[0]).version == 4 else "TCP6"
    return f"PROXY {family} {source[0]} {destination[0]} {source[1]} {destination[1]}\r\n".encode()


async def refused(port: int, *chunks: bytes) -> bytes:
    """Send ``chunks`` (a pause between them) on a fresh connection; what the node
    answers before it closes (b"" if nothing)."""
    reader, writer = await asyncio.open_connection(LOOPBACK, port)
    try:
        for chunk in chunks:
            writer.write(chunk)
            await writer.drain()
            await asyncio.sleep(0.05)
        async with asyncio.timeout(5):
            return await reader.read()
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def test_the_header_address_is_the_client_for_the_per_ip_cap_and_logs(
    start_app: Callable[..., Awaitable[App]], tokens: TokenService, tokend_logs: Logs
) -> None:
    """Two clients behind one balancer address: each is itself for the cap, in v1 or v2;
    the refusal names the header's address, never the balancer's."""
    app = await start_app(proxy_protocol_from="127.0.0.0/8", max_connections_per_ip=1)
    alice, bob = ("203.0.113.7", 40001), ("2001:db8::9", 40002)
    async with RawClient.connect(app.port, preface=v1(alice)) as first:
        await first.hello(tokens.mint("alice"))
        assert dict(app.connections_per_ip) == {"203.0.113.7": 1}
        with pytest.raises(InvalidStatus) as over:
            async with RawClient.connect(app.port, preface=v2((alice[0], 40003))):
                pass
        assert over.value.response.status_code == 429
        (line,) = tokend_logs
        assert line["event"] == "handshake refused: connections per IP"
        assert line["peer"] == "203.0.113.7"
        async with RawClient.connect(app.port, preface=v2(bob, ("2001:db8::1", 8765))) as other:
            await other.hello(tokens.mint("bob"))
            assert dict(app.connections_per_ip) == {"203.0.113.7": 1, "2001:db8::9": 1}
            connection = next(c for c in app.connections if c.ip == "2001:db8::9")
            assert connection.peer == "2001:db8::9:40002"
    await eventually(lambda: not app.connections_per_ip, what="every count released")


async def test_a_health_check_local_header_stands_for_the_balancer_itself(
    start_app: Callable[..., Awaitable[App]],
) -> None:
    app = await start_app(proxy_protocol_from=LOOPBACK)
    request = b"GET /healthz HTTP/1.1\r\nHost: tokend\r\n\r\n"
    for header in (v2(command=0x0), b"PROXY UNKNOWN\r\n"):
        reply = await http_request(app.port, "GET", "/healthz", raw=header + request)
        assert reply.status == 200, header


@pytest.mark.parametrize(
    ("chunks", "error"),
    [
        ((b"GET /healthz HTTP/1.1\r\nHost: tokend\r\n\r\n",), "not a PROXY protocol header"),
        ((b"PROXY TCP4 1.2.3.4 5.6.7.8 1 99999\r\nGET /healthz HTTP/1.1\r\n\r\n",), "not a port"),
        ((V2_SIGNATURE[:6], V2_SIGNATURE[6:] + b"\x2f\x11\x00\x0c"), "command must be"),
    ],
    ids=["no header", "bad v1", "bad v2, split"],
)
async def test_a_trusted_source_without_a_valid_header_is_closed_with_one_line(
    start_app: Callable[..., Awaitable[App]],
    tokend_logs: Logs,
    chunks: tuple[bytes, ...],
    error: str,
) -> None:
    app = await start_app(proxy_protocol_from=LOOPBACK)
    assert await refused(app.port, *chunks) == b""
    (line,) = tokend_logs
    assert line["event"] == "closed: bad PROXY protocol header"
    assert error in line["error"]
    assert line["peer"].startswith(f"{LOOPBACK}:")
    await eventually(lambda: not app.connections, what="the connection gone")


async def test_a_trusted_source_silent_past_hello_timeout_is_closed_with_one_line(
    start_app: Callable[..., Awaitable[App]], tokend_logs: Logs
) -> None:
    app = await start_app(proxy_protocol_from=LOOPBACK, hello_timeout=0.3)
    assert await refused(app.port, b"PROXY TCP4 1.2.3.4") == b""
    assert [e["event"] for e in tokend_logs] == [
        "closed: no PROXY protocol header within hello_timeout"
    ]
    assert not app.connections_per_ip  # never counted: its address never came


@pytest.mark.parametrize("trusted", ["", "10.0.0.0/8"], ids=["off", "others trusted"])
@pytest.mark.parametrize(
    "chunks",
    [
        (b"PROXY TCP4 203.0.113.7 192.0.2.1 1 8765\r\nGET /v1/ws HTTP/1.1\r\n\r\n",),
        (b"PRO", b"XY TCP4 203.0.113.7 192.0.2.1 1 8765\r\n"),
        (v2(("203.0.113.7", 1)) + b"GET /healthz HTTP/1.1\r\n\r\n",),
        (V2_SIGNATURE[:3], V2_SIGNATURE[3:]),
    ],
    ids=["v1", "v1 split", "v2", "v2 split"],
)
async def test_a_header_from_anyone_else_is_refused_not_parsed(
    start_app: Callable[..., Awaitable[App]],
    tokend_logs: Logs,
    trusted: str,
    chunks: tuple[bytes, ...],
) -> None:
    """Closed before any HTTP, one line naming the sender's own address, and the
    address it claimed never counted."""
    app = await start_app(proxy_protocol_from=trusted)
    seen: set[str] = set()
    counting = asyncio.create_task(_watch_counts(app, seen))
    try:
        assert await refused(app.port, *chunks) == b""
    finally:
        counting.cancel()
    (line,) = tokend_logs
    assert (
        line["event"] == "closed: PROXY protocol header from an address not in proxy_protocol_from"
    )
    assert line["peer"].startswith(f"{LOOPBACK}:")
    assert "203.0.113.7" not in seen


async def _watch_counts(app: App, seen: set[str]) -> None:
    while True:
        seen.update(app.connections_per_ip)
        await asyncio.sleep(0.005)


async def test_a_client_not_behind_a_balancer_is_served_as_before(
    start_app: Callable[..., Awaitable[App]], tokens: TokenService
) -> None:
    """proxy_protocol_from names other addresses: loopback clients speak plain HTTP."""
    app = await start_app(proxy_protocol_from="10.0.0.0/8, 192.0.2.1")
    async with RawClient.connect(app.port) as client:
        await client.hello(tokens.mint("direct"))
        assert dict(app.connections_per_ip) == {LOOPBACK: 1}


async def test_open_socket_sends_the_preface_first() -> None:
    """The testkit helper the tests above stand on: its bytes arrive first, as sent."""
    server = await asyncio.start_server(_echo_first_line, LOOPBACK, 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        sock = await open_socket(port, preface=b"PROXY UNKNOWN\r\n", source="127.0.0.2")
        with sock:
            loop = asyncio.get_running_loop()
            assert await loop.sock_recv(sock, 100) == b"127.0.0.2 PROXY UNKNOWN\r\n"


async def _echo_first_line(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    line = await reader.readline()
    writer.write(writer.get_extra_info("peername")[0].encode() + b" " + line)
    await writer.drain()
    writer.close()


@pytest.mark.parametrize("value", ["10.0.0.1/8", "balancer.internal", "10.0.0.1,,::1/129"])
def test_a_bad_proxy_protocol_from_is_named(value: str) -> None:
    with pytest.raises(ConfigError, match=r"^proxy_protocol_from: "):
        config.load({"proxy_protocol_from": value}, environ={})


def test_proxy_protocol_from_lists_addresses_and_networks() -> None:
    settings = config.load({"proxy_protocol_from": " 10.0.0.5, 10.0.1.0/28,::1 "}, environ={})
    assert [str(n) for n in settings.proxy_networks] == ["10.0.0.5/32", "10.0.1.0/28", "::1/128"]
