"""TLS on the main port: the server's context, its reload, and TLS begun on a connection.

``wss://`` and ``https://`` (``/healthz``, ``/readyz``, the JWKS) share the port: TLS
is below HTTP, so one :class:`tokend.server.connection.Connection` answers both, as on a
plain port.

Why TLS is begun per connection (:func:`begin`) rather than by the listener
(``create_server(ssl=...)``): a load balancer in TCP mode writes its PROXY protocol
header in clear before the client's ClientHello, often in the same read, and only the
connection can take the header off and hand the bytes after it to TLS; and the
connection is counted from accept (descriptor budget, per-IP cap, drain) with
``hello_timeout`` running through its TLS handshake. :func:`begin` does what the
loop's own ``start_tls`` does (the loop's TLS protocol, an ``ssl.MemoryBIO`` pair,
set as the transport's protocol), plus feeding it the bytes already read, which
``start_tls`` cannot take. That protocol class is the loop's internal one (uvloop's
``SSLProtocol`` under ``tokend serve``, asyncio's in the in-process tests): both are
exercised by tests/test_tls.py.

The certificate is reloaded without a restart (:class:`ServerCertificate`): a timer of
the node compares the files' identity (inode, size, mtime), builds a new context
off the event loop when they change, and new connections take it; connections already
open keep the context they began with.
"""

from __future__ import annotations

import asyncio
import asyncio.sslproto
import importlib
import os
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
from cryptography import x509

from tokend.config import ConfigError

if TYPE_CHECKING:
    from tokend.metrics import Metrics

log = structlog.get_logger("tokend.tls")

MINIMUM_VERSION = ssl.TLSVersion.TLSv1_2
# Announced in the handshake: the WebSocket handshake is HTTP/1.1 (RFC 6455 4.1).
ALPN = ["http/1.1"]

# What identifies the files' contents without reading them: inode, device, size and
# mtime of each (follows symlinks, as a certbot or Kubernetes secret swap uses), or
# the error met looking.
Stamp = tuple[tuple[int, int, int, int], ...] | str


def server_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """A server context: TLS 1.2 or later, the ssl module's default ciphers and options
    (no compression, server cipher preference), the chain and key loaded."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = MINIMUM_VERSION
    context.set_alpn_protocols(ALPN)
    context.load_cert_chain(cert_file, key_file)
    return context


def describe(cert_file: str) -> dict[str, str]:
    """The leaf certificate's serial and end of validity, for the log."""
    leaf = x509.load_pem_x509_certificate(Path(cert_file).read_bytes())
    return {"serial": f"{leaf.serial_number:x}", "not_after": leaf.not_valid_after_utc.isoformat()}


def _stamp(files: tuple[str, str]) -> Stamp:
    try:
        return tuple(
            (s.st_ino, s.st_dev, s.st_size, s.st_mtime_ns) for s in (os.stat(f) for f in files)
        )
    except OSError as exc:
        return f"{exc.filename}: {exc.strerror}"


def _load(files: tuple[str, str]) -> tuple[ssl.SSLContext, dict[str, str]]:
    return server_context(*files), describe(files[0])


class ServerCertificate:
    """The context new connections begin TLS with, reloaded when its files change.

    Invariant: ``context`` was built from a certificate and key that loaded together;
    a pair on disk that does not load (half written, mismatched, unreadable) leaves
    it as it was, logged once per change of the files, and counted
    (``tokend_tls_reloads{result="failed"}``, ``tokend_tls_reload_failing`` 1 until a
    good pair loads).
    """

    def __init__(self, cert_file: str, key_file: str) -> None:
        """Load the pair now; a pair that does not load stops the start (ConfigError)."""
        self.files = (cert_file, key_file)
        self.stamp = _stamp(self.files)
        try:
            self.context, facts = _load(self.files)
        except (OSError, ssl.SSLError, ValueError) as exc:
            raise ConfigError(
                f"tls_cert_file, tls_key_file: cannot load {cert_file} with {key_file}: "
                f"{error_text(exc)}"
            ) from None
        self.failing: str | None = None  # why the files on disk are not the ones served
        log.info("TLS certificate loaded", cert_file=cert_file, **facts)

    async def watch(self, interval: float, metrics: Metrics) -> None:
        """Check the files every ``interval`` seconds, for the node's lifetime."""
        while True:
            await asyncio.sleep(interval)
            await self.check(metrics)

    async def check(self, metrics: Metrics) -> None:
        """Load the pair again if its files changed since the last look."""
        stamp = _stamp(self.files)
        if stamp == self.stamp:
            return
        self.stamp = stamp
        if isinstance(stamp, str):
            self._failed(stamp, metrics)
            return
        try:
            self.context, facts = await asyncio.to_thread(_load, self.files)
        except (OSError, ssl.SSLError, ValueError) as exc:
            self._failed(error_text(exc), metrics)
            return
        self.failing = None
        metrics.tls_reloads["ok"] += 1
        metrics.tls_failing = False
        log.info("TLS certificate reloaded", cert_file=self.files[0], **facts)

    def _failed(self, why: str, metrics: Metrics) -> None:
        self.failing = why
        metrics.tls_reloads["failed"] += 1
        metrics.tls_failing = True
        log.error(
            "TLS certificate not reloaded: the previous one is still served",
            cert_file=self.files[0],
            key_file=self.files[1],
            error=why,
        )


def error_text(exc: BaseException) -> str:
    """An error of loading a pair or of a handshake, short, for one log line."""
    if isinstance(exc, ssl.SSLError):
        if exc.reason:
            return f"{exc.library or 'ssl'}: {exc.reason}"
        # OpenSSL's "PEM lib": a file that holds no PEM block of the kind expected.
        return f"not PEM, or not the kind expected ({exc.strerror})"
    if isinstance(exc, ConnectionError) and not str(exc):
        return "the connection was closed"
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    return str(exc) or type(exc).__name__


def begin(
    transport: asyncio.Transport,
    protocol: asyncio.Protocol,
    context: ssl.SSLContext,
    received: bytes,
    handshake_timeout: float,
) -> asyncio.Future[None]:
    """Begin TLS, server side, on an accepted connection, whose first ``received``
    bytes (the start of the ClientHello, possibly empty) were already read.

    From here the transport's bytes go to the TLS layer; once its handshake is done
    it calls ``protocol.connection_made`` with the decrypted transport, and the
    returned future completes. If the handshake fails or the connection is lost
    during it, the future completes (with the error, or None) and ``protocol`` gets
    no ``connection_lost`` from the TLS layer: the caller ends the connection.
    """
    loop = asyncio.get_running_loop()
    handshake: asyncio.Future[None] = loop.create_future()
    layer = _tls_protocol(loop)(
        loop,
        protocol,
        context,
        handshake,
        server_side=True,
        ssl_handshake_timeout=handshake_timeout,
    )
    transport.set_protocol(layer)
    layer.connection_made(transport)
    # What the transport would have passed on had the layer been there from the start.
    view = memoryview(received)
    while view:
        buffer = layer.get_buffer(len(view))
        n = min(len(buffer), len(view))
        buffer[:n] = view[:n]
        layer.buffer_updated(n)
        view = view[n:]
    return handshake


def _tls_protocol(loop: asyncio.AbstractEventLoop) -> Callable[..., Any]:
    """The loop's TLS protocol class: the one its ``start_tls`` uses."""
    try:
        import uvloop

        # Not in uvloop's type stubs, which declare only its public API.
        uvloop_tls = importlib.import_module("uvloop.loop").SSLProtocol
    except ImportError:  # pragma: no cover - platforms without uvloop
        return asyncio.sslproto.SSLProtocol
    return uvloop_tls if isinstance(loop, uvloop.Loop) else asyncio.sslproto.SSLProtocol
