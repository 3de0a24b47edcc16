"""TLS on the main port (tokend/edge/tls.py): wss:// and https:// with a certificate made by
the test, verified by clients tokend's authors did not write (Python's ``ssl`` and the
websockets client, urllib), the certificate reloaded from disk without a restart, and
a PROXY protocol header before the TLS handshake.

In-process nodes run on asyncio's loop (its TLS protocol); the node started as
``tokend serve`` runs on uvloop (uvloop's): tokend/edge/tls.py begins TLS with either.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import ssl
import subprocess
import sys
import urllib.request
import warnings
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus
from websockets.typing import Subprotocol

from testkit.certificates import Authority, served_serial
from testkit.clients import RawClient, open_socket
from testkit.net import LOOPBACK
from testkit.tokend_process import CALM_CLOCKS, TokendProcess, node_env
from testkit.waiting import eventually
from tokend.config import ConfigError, Settings
from tokend.core import protocol as p
from tokend.ops.app import App
from tokend.tokens.service import TokenService

SERIAL, NEW_SERIAL = 1001, 2002


@pytest.fixture(scope="module")
def authority() -> Authority:
    return Authority.create()


@pytest.fixture
def pair(tmp_path: Path, authority: Authority) -> tuple[Path, Path]:
    return authority.issue(tmp_path / "cert.pem", tmp_path / "key.pem", serial=SERIAL)


@pytest.fixture
def trusting(tmp_path: Path, authority: Authority) -> ssl.SSLContext:
    """A client context that trusts the test's CA, verification on."""
    return authority.client_context(tmp_path / "ca.pem")


@pytest.fixture
async def tls_app(
    start_app: Callable[..., Awaitable[App]], pair: tuple[Path, Path]
) -> Callable[..., Awaitable[App]]:
    async def start(**overrides: object) -> App:
        return await start_app(tls_cert_file=str(pair[0]), tls_key_file=str(pair[1]), **overrides)

    return start


def replace_pair(authority: Authority, pair: tuple[Path, Path], serial: int) -> None:
    """A new certificate and key put in place as a deployment does: written aside, then
    renamed over the old files (key first: a certificate never names a missing key)."""
    cert_file, key_file = pair
    new_cert, new_key = authority.issue(
        cert_file.with_suffix(".new"), key_file.with_suffix(".new"), serial=serial
    )
    os.replace(new_key, key_file)
    os.replace(new_cert, cert_file)


async def serial_served(port: int, context: ssl.SSLContext) -> int:
    """The serial of the certificate a new connection to ``port`` is shown."""
    _, writer = await asyncio.open_connection(LOOPBACK, port, ssl=context)
    try:
        return served_serial(writer.get_extra_info("ssl_object"))
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            await writer.wait_closed()


def blocking_handshake(port: int, context: ssl.SSLContext) -> None:
    with (
        socket.create_connection((LOOPBACK, port), timeout=5) as sock,
        context.wrap_socket(sock, server_hostname=LOOPBACK),
    ):
        pass


async def https_get(port: int, path: str, context: ssl.SSLContext) -> tuple[int, object]:
    def get() -> tuple[int, object]:
        url = f"https://{LOOPBACK}:{port}{path}"
        with urllib.request.urlopen(url, timeout=5, context=context) as reply:
            return reply.status, json.loads(reply.read())

    return await asyncio.to_thread(get)


async def test_a_websockets_client_with_verification_on_speaks_protocol_v1_over_wss(
    tls_app: Callable[..., Awaitable[App]], trusting: ssl.SSLContext, tokens: TokenService
) -> None:
    app = await tls_app()
    assert trusting.verify_mode is ssl.CERT_REQUIRED and trusting.check_hostname
    async with connect(
        f"wss://{LOOPBACK}:{app.port}{p.WS_PATH}",
        ssl=trusting,
        subprotocols=[Subprotocol(p.SUBPROTOCOL)],
    ) as ws:
        ssl_object = ws.transport.get_extra_info("ssl_object")
        assert ssl_object.version() in ("TLSv1.2", "TLSv1.3")
        assert ssl_object.selected_alpn_protocol() is None  # the client offered none
        assert served_serial(ssl_object) == SERIAL
        client = RawClient(ws)
        # A client that offers HTTP/2 first (as browsers do) is given HTTP/1.1.
        trusting.set_alpn_protocols(["h2", "http/1.1"])
        _, writer = await asyncio.open_connection(LOOPBACK, app.port, ssl=trusting)
        assert writer.get_extra_info("ssl_object").selected_alpn_protocol() == "http/1.1"
        writer.close()
        welcome = await client.hello(tokens.mint("over-tls"))
        for _ in range(3):
            ack = await client.heartbeat()
            assert isinstance(ack, p.HeartbeatAck) and ack.exp_ms == welcome.exp_ms
    await eventually(lambda: not app.connections, what="the connection released")


@pytest.mark.parametrize("client", ["system CAs", "another CA"])
async def test_a_client_that_does_not_trust_the_ca_fails_the_handshake(
    tls_app: Callable[..., Awaitable[App]], tmp_path: Path, client: str
) -> None:
    app = await tls_app()
    context = (
        ssl.create_default_context()
        if client == "system CAs"
        else Authority.create("someone else").client_context(tmp_path / "other.pem")
    )
    with pytest.raises(ssl.SSLCertVerificationError):
        async with RawClient.connect(app.port, ssl=context):
            pass
    # The node ended its side too: nothing left counted against its budget or the cap.
    await eventually(lambda: not app.connections and not app.connections_per_ip)


def _client(maximum: ssl.TLSVersion) -> ssl.SSLContext:
    """A client that offers nothing newer than ``maximum``, the ciphers of old versions
    allowed (OpenSSL 3 drops them at its default security level)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_ciphers("ALL:@SECLEVEL=0")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TLSv1_1: deprecated, the point
        context.minimum_version = ssl.TLSVersion.TLSv1
        context.maximum_version = maximum
    return context


async def test_tls_1_1_is_refused_and_1_2_accepted(
    tls_app: Callable[..., Awaitable[App]],
) -> None:
    app = await tls_app()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old = _client(ssl.TLSVersion.TLSv1_1)
    # The node's TLS layer closes without flushing its alert: the client may see EOF.
    # Its log line names the version: test_tokend_serve_on_uvloop_serves_wss_and_reloads.
    with pytest.raises((ssl.SSLError, ConnectionError)):
        await serial_served(app.port, old)
    assert await serial_served(app.port, _client(ssl.TLSVersion.TLSv1_2)) == SERIAL
    await eventually(lambda: not app.connections)


async def test_health_readiness_and_jwks_over_https_on_the_same_port(
    tls_app: Callable[..., Awaitable[App]], trusting: ssl.SSLContext
) -> None:
    app = await tls_app()
    assert await https_get(app.port, "/healthz", trusting) == (
        200,
        {"status": "ok", "node": "node-a"},
    )
    assert await https_get(app.port, "/readyz", trusting) == (200, {"status": "ready"})
    status, jwks = await https_get(app.port, "/.well-known/jwks.json", trusting)
    assert status == 200 and isinstance(jwks, dict) and jwks["keys"]


async def test_plain_http_on_a_tls_port_gets_no_answer(
    tls_app: Callable[..., Awaitable[App]],
) -> None:
    app = await tls_app()
    reader, writer = await asyncio.open_connection(LOOPBACK, app.port)
    writer.write(b"GET /readyz HTTP/1.1\r\nHost: tokend\r\n\r\n")
    async with asyncio.timeout(5):
        answer = await reader.read()
    writer.close()
    assert b"ready" not in answer  # at most a TLS alert, never the route's answer
    await eventually(lambda: not app.connections)


async def test_a_handshake_is_counted_and_timed_like_the_rest_of_the_opening(
    tls_app: Callable[..., Awaitable[App]],
) -> None:
    """A client that starts a ClientHello and stalls holds a counted connection, closed
    after hello_timeout: TLS handshakes cannot pile up outside the node's budget."""
    app = await tls_app(hello_timeout=0.5)
    reader, writer = await asyncio.open_connection(LOOPBACK, app.port)
    writer.write(b"\x16\x03\x01\x00")  # the start of a TLS record, and no more
    await eventually(lambda: len(app.connections) == 1 and app.connections_per_ip[LOOPBACK])
    async with asyncio.timeout(5):
        assert await reader.read() == b""
    writer.close()
    await eventually(lambda: not app.connections and not app.connections_per_ip)


async def test_a_new_certificate_on_disk_is_served_to_the_next_connection(
    tls_app: Callable[..., Awaitable[App]],
    authority: Authority,
    pair: tuple[Path, Path],
    trusting: ssl.SSLContext,
    tokens: TokenService,
) -> None:
    """No restart: the next connection gets the new certificate; an open one goes on."""
    app = await tls_app(tls_reload_interval=0.05)
    async with RawClient.connect(app.port, ssl=trusting) as open_before:
        await open_before.hello(tokens.mint("before"))
        replace_pair(authority, pair, NEW_SERIAL)
        await eventually(
            _serves(app.port, trusting, NEW_SERIAL), timeout=10, what="the new certificate"
        )
        assert await open_before.heartbeat()
        assert served_serial(open_before.ws.transport.get_extra_info("ssl_object")) == SERIAL
    assert app.node.metrics.tls_reloads["ok"] >= 1
    assert not app.node.metrics.tls_failing


def _serves(port: int, context: ssl.SSLContext, serial: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return await serial_served(port, context) == serial

    return check


async def test_a_bad_pair_on_disk_keeps_the_served_one_logged_once_and_flagged(
    tls_app: Callable[..., Awaitable[App]],
    authority: Authority,
    pair: tuple[Path, Path],
    trusting: ssl.SSLContext,
    tokend_logs: list[dict[str, Any]],
) -> None:
    app = await tls_app(tls_reload_interval=0.05)
    metrics = app.node.metrics
    pair[0].write_text("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    await eventually(lambda: metrics.tls_failing, what="the bad file seen")
    await asyncio.sleep(0.3)  # several more checks of the same bad file
    assert await serial_served(app.port, trusting) == SERIAL
    lines = [e for e in tokend_logs if e["event"].startswith("TLS certificate not reloaded")]
    assert len(lines) == 1 and lines[0]["log_level"] == "error", tokend_logs
    assert lines[0]["cert_file"] == str(pair[0])
    assert metrics.tls_reloads["failed"] == 1
    scraped = metrics.exposition().decode()
    assert "tokend_tls_reload_failing 1.0" in scraped
    assert 'tokend_tls_reloads_total{result="failed"} 1.0' in scraped
    replace_pair(authority, pair, NEW_SERIAL)
    await eventually(_serves(app.port, trusting, NEW_SERIAL), timeout=10, what="the good pair")
    assert not metrics.tls_failing
    assert "tokend_tls_reload_failing 0.0" in metrics.exposition().decode()


async def test_a_proxy_header_then_tls_in_one_read(
    tls_app: Callable[..., Awaitable[App]], trusting: ssl.SSLContext
) -> None:
    """HAProxy in TCP mode with send-proxy-v2 in front of a TLS node: the header and the
    ClientHello may arrive together. Written here in one send, to be sure they do."""
    app = await tls_app(proxy_protocol_from=LOOPBACK)
    header = b"PROXY TCP4 198.51.100.4 192.0.2.1 40100 443\r\n"
    sock = await open_socket(app.port)
    loop = asyncio.get_running_loop()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = trusting.wrap_bio(incoming, outgoing, server_hostname=LOOPBACK)
    with sock:

        async def step() -> bool:
            """One handshake step: True once done."""
            try:
                tls.do_handshake()
                done = True
            except ssl.SSLWantReadError:
                done = False
            if pending := outgoing.read():
                await loop.sock_sendall(sock, pending)
            return done

        with contextlib.suppress(ssl.SSLWantReadError):
            tls.do_handshake()
        await loop.sock_sendall(sock, header + outgoing.read())  # one write
        while not await step():
            async with asyncio.timeout(5):
                incoming.write(await loop.sock_recv(sock, 65536))
        assert served_serial(tls) == SERIAL
        await eventually(lambda: dict(app.connections_per_ip) == {"198.51.100.4": 1})
        tls.write(b"GET /readyz HTTP/1.1\r\nHost: tokend\r\n\r\n")
        await loop.sock_sendall(sock, outgoing.read())
        answer = b""
        while b"ready" not in answer:
            async with asyncio.timeout(5):
                incoming.write(await loop.sock_recv(sock, 65536))
            with contextlib.suppress(ssl.SSLWantReadError):
                answer += tls.read()
        assert answer.startswith(b"HTTP/1.1 200")


async def test_a_proxy_header_then_wss(
    tls_app: Callable[..., Awaitable[App]], trusting: ssl.SSLContext, tokens: TokenService
) -> None:
    app = await tls_app(proxy_protocol_from=LOOPBACK, max_connections_per_ip=1)
    header = b"PROXY TCP4 198.51.100.4 192.0.2.1 40100 443\r\n"
    other = b"PROXY TCP4 198.51.100.5 192.0.2.1 40101 443\r\n"
    async with RawClient.connect(app.port, preface=header, ssl=trusting) as client:
        await client.hello(tokens.mint("tls-behind-lb"))
        await client.heartbeat()
        (connection,) = app.connections
        assert connection.peer == "198.51.100.4:40100"
        with pytest.raises(InvalidStatus) as over:
            async with RawClient.connect(app.port, preface=header, ssl=trusting):
                pass
        assert over.value.response.status_code == 429
        # Another client behind the same balancer: its own address, not capped.
        async with RawClient.connect(app.port, preface=other, ssl=trusting) as second:
            await second.hello(tokens.mint("second"))


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        ({"tls_cert_file": "cert.pem"}, "tls_cert_file: must be set with tls_key_file"),
        ({"tls_key_file": "key.pem"}, "tls_cert_file: must be set with tls_key_file"),
        ({"tls_reload_interval": 0}, "tls_reload_interval: must be more than 0"),
    ],
)
def test_settings_are_checked(
    make_settings: Callable[..., Settings], overrides: dict[str, object], error: str
) -> None:
    with pytest.raises(ConfigError, match=error):
        make_settings(**overrides)


@pytest.mark.parametrize("broken", ["missing key", "key of another certificate", "not PEM"])
async def test_a_pair_that_does_not_load_stops_the_start_naming_the_files(
    make_settings: Callable[..., Settings],
    authority: Authority,
    pair: tuple[Path, Path],
    tmp_path: Path,
    broken: str,
) -> None:
    cert_file, key_file = pair
    if broken == "missing key":
        key_file.unlink()
    elif broken == "key of another certificate":
        authority.issue(tmp_path / "other.pem", key_file)
    else:
        cert_file.write_text("hello")
    app = App(make_settings(tls_cert_file=str(cert_file), tls_key_file=str(key_file)))
    with pytest.raises(ConfigError) as refused:
        await app.start()
    await app.stop()
    assert str(refused.value).startswith(
        f"tls_cert_file, tls_key_file: cannot load {cert_file} with {key_file}: "
    )


async def test_tokend_serve_on_uvloop_serves_wss_and_reloads(
    make_settings: Callable[..., Settings],
    authority: Authority,
    pair: tuple[Path, Path],
    trusting: ssl.SSLContext,
    tokens: TokenService,
    tmp_path: Path,
) -> None:
    """The same through ``tokend serve`` (uvloop's TLS protocol): a session over wss, a
    client that does not trust the CA logged once, a reload under an open connection."""
    settings = make_settings(
        **CALM_CLOCKS,
        tls_cert_file=str(pair[0]),
        tls_key_file=str(pair[1]),
        tls_reload_interval=0.1,
    )
    node = TokendProcess(node_env(settings))
    node.start()
    try:
        (listening,) = node.logged("listening")
        assert listening["scheme"] == "https"
        async with RawClient.connect(node.port, ssl=trusting) as client:
            await client.hello(tokens.mint("uvloop"))
            # Blocking ssl sockets: they send their alert before closing (asyncio's do not).
            untrusting = Authority.create("someone else").client_context(tmp_path / "x.pem")
            with pytest.raises(ssl.SSLCertVerificationError):
                await asyncio.to_thread(blocking_handshake, node.port, untrusting)
            (failed,) = await asyncio.to_thread(node.wait_logged, "TLS handshake failed")
            assert "UNKNOWN_CA" in failed["error"].upper().replace(" ", "_"), failed
            assert failed["peer"].startswith(f"{LOOPBACK}:")
            with pytest.raises((ssl.SSLError, ConnectionError)):
                await asyncio.to_thread(
                    blocking_handshake, node.port, _client(ssl.TLSVersion.TLSv1_1)
                )
            failed = (await asyncio.to_thread(node.wait_logged, "TLS handshake failed", 2))[1]
            assert "UNSUPPORTED_PROTOCOL" in failed["error"].upper().replace(" ", "_"), failed
            with socket.create_connection((LOOPBACK, node.port), timeout=5) as plain:
                plain.sendall(b"GET /readyz HTTP/1.1\r\nHost: tokend\r\n\r\n")
                assert b"ready" not in plain.recv(1000)
            failed = (await asyncio.to_thread(node.wait_logged, "TLS handshake failed", 3))[2]
            assert "HTTP_REQUEST" in failed["error"].upper().replace(" ", "_"), failed
            replace_pair(authority, pair, NEW_SERIAL)
            await asyncio.to_thread(node.wait_logged, "TLS certificate reloaded")
            assert await serial_served(node.port, trusting) == NEW_SERIAL
            await client.heartbeat()
    finally:
        node.stop()


def test_tokend_serve_exits_2_naming_a_pair_that_does_not_load(
    make_settings: Callable[..., Settings], pair: tuple[Path, Path]
) -> None:
    pair[1].write_text("not a key")
    settings = make_settings(tls_cert_file=str(pair[0]), tls_key_file=str(pair[1]))
    done = subprocess.run(
        [sys.executable, "-m", "tokend", "serve"],
        env={**os.environ, **node_env(settings)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1].startswith(
        f"tokend: configuration error: tls_cert_file, tls_key_file: cannot load {pair[0]} "
        f"with {pair[1]}: not PEM, or not the kind expected ("
    )
