"""Python client SDK for tokend protocol v1 (asyncio).

::

    from tokend_client import connect

    async with connect("ws://127.0.0.1:8765/v1/ws", token) as session:
        async for change in session.changes():
            print(change.kind, session.state.name, session.exp)

A :class:`ClientSession` says HELLO, keeps the heartbeat cadence the server gave in
WELCOME (each heartbeat carrying its HMAC proof and the next ``seq``), takes in
renewed tokens (``session.token`` and ``session.exp`` are always the newest),
follows WARN notices, and reports every step as a :class:`Lifecycle` change.

On the close codes the spec marks reconnectable (1001, 1011, 1013, 4008, 4029,
4509) and on network loss it reconnects with full-jitter exponential backoff
(:class:`Backoff`) and resumes with its newest token, proving with the session key
of its last WELCOME that it is the session's rightful client (spec "Resume proof",
revision 2). After a 1001 (the server drains, reloads or stops) the first reconnect
is spread over a window, and an HTTP 503 or 429 with ``Retry-After`` is honoured,
so that the clients of a restarting server do not all come back at once. Any
other close ends the session for good with a :class:`TokendError` subclass naming
the family: :class:`AuthError`, :class:`SessionExpired`, :class:`Revoked` (and
:class:`TakenOver`), :class:`ProtocolViolation`, :class:`CertificateError`.

The package's modules, one noun each: :mod:`tokend_client.core` (the protocol state
machine, Sans-I/O: every rule above), :mod:`tokend_client.asyncio` (the session over
websockets' asyncio client), :mod:`tokend_client.backoff` (the waits between attempts),
:mod:`tokend_client.errors` (the error families). See ``docs/client.md``.
"""

from tokend_client.asyncio import ClientSession, connect
from tokend_client.backoff import Backoff
from tokend_client.core import Change, Lifecycle, SessionStats
from tokend_client.errors import (
    AuthError,
    CertificateError,
    ProtocolViolation,
    RetriesExhausted,
    Revoked,
    SessionExpired,
    TakenOver,
    TokendError,
    classify,
    describe,
)

__all__ = [
    "AuthError",
    "Backoff",
    "CertificateError",
    "Change",
    "ClientSession",
    "Lifecycle",
    "ProtocolViolation",
    "RetriesExhausted",
    "Revoked",
    "SessionExpired",
    "SessionStats",
    "TakenOver",
    "TokendError",
    "classify",
    "connect",
    "describe",
]
