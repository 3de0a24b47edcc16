"""Why a client's session ended for good: the :class:`TokendError` families, and which
close codes end a session (docs/protocol.md §7; the spec's table "Close codes").

Pure: no I/O. :mod:`tokend_client.core` decides with :func:`classify`; both SDKs name
the same families (sdk/js/tokend.js mirrors them).
"""

from __future__ import annotations

from tokend_client import protocol as p
from tokend_client.protocol import CloseCode

# Close codes a client itself sends when the server breaks the protocol below protocol
# v1 (RFC 6455 §7.4.1: 1002 protocol error, 1007 invalid data, 1009 message too big).
CLIENT_SIDE_VIOLATIONS = frozenset({1002, 1007, 1009})


class TokendError(Exception):
    """Why a session ended for good.

    ``code`` is the close code that decided it, or None when no close frame did
    (a malformed frame, a refused handshake, reconnect attempts used up). ``reason``
    is then the close frame's reason (tokend's are stable words, docs/protocol.md §7,
    e.g. "bad_signature"), or else what went wrong, in words.
    """

    def __init__(self, code: int | None, reason: str = "") -> None:
        self.code = code
        self.reason = reason
        super().__init__(code, reason)

    @property
    def meaning(self) -> str:
        """The close code in words, e.g. "token revoked"; the reason when there is no code."""
        return self.reason if self.code is None else describe(self.code)

    def __str__(self) -> str:
        if self.code is None:
            return self.reason
        head = f"{self.code} {self.meaning}"
        return f"{head}: {self.reason}" if self.reason and self.reason != self.meaning else head


class AuthError(TokendError):
    """The token was refused: 4501 invalid token, 4502 token expired at HELLO. Get a new one."""


class SessionExpired(TokendError):
    """4505: the session expired (heartbeats missed, or the token's exp passed)."""


class Revoked(TokendError):
    """4506: the token was revoked, or its session logged out (BYE) elsewhere."""


class TakenOver(Revoked):
    """4507: a newer connection resumed this session; this one stops."""


class ProtocolViolation(TokendError):
    """1009, 4503, 4504, or a server that does not speak protocol v1: a bug, not retried."""


class CertificateError(TokendError):
    """The server's TLS certificate failed verification (unknown CA, wrong host name,
    expired): not retried, since trying again cannot make it trusted. ``ca_file`` (or an
    ``ssl`` context) names what to trust."""


class RetriesExhausted(TokendError):
    """``Backoff.max_attempts`` reconnect attempts in a row failed; ``code`` is the last one."""


_TERMINAL: dict[int, type[TokendError]] = {
    CloseCode.INVALID_TOKEN: AuthError,
    CloseCode.TOKEN_EXPIRED: AuthError,
    CloseCode.SESSION_EXPIRED: SessionExpired,
    CloseCode.TOKEN_REVOKED: Revoked,
    CloseCode.TAKEN_OVER: TakenOver,
    CloseCode.MESSAGE_TOO_BIG: ProtocolViolation,
    CloseCode.PROTOCOL_ERROR: ProtocolViolation,
    CloseCode.BAD_HEARTBEAT: ProtocolViolation,
    **{code: ProtocolViolation for code in CLIENT_SIDE_VIOLATIONS},
}


def classify(code: int | None) -> type[TokendError] | None:
    """The error family a close ends the session with; None when it invites a reconnect.

    None (no close frame: the network or the server process went away) and the
    spec's reconnectable codes reconnect. Codes outside the spec's table are
    terminal too, as plain :class:`TokendError`.
    """
    if code is None or code in p.RECONNECTABLE:
        return None
    return _TERMINAL.get(code, TokendError)


def describe(code: int | None) -> str:
    """A close code in words; None is a connection lost without a close frame."""
    if code is None:
        return "connection lost"
    try:
        return CloseCode(code).describe()
    except ValueError:
        return f"close code {code}"
