"""The claims a client reads from its token, without verifying it: the server verifies
every token it is given, and a client holds no key to check one with.

A JWT in compact form (RFC 7519 §3) is three base64url segments: a JSON header, a JSON
payload (the claims) and a signature. Reading the claims needs base64 and JSON only.
"""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from typing import Any, NamedTuple


class TokenClaimsError(ValueError):
    """A token that is not a JWT whose claims hold a UUID ``jti`` and an integer ``exp``."""


class TokenClaims(NamedTuple):
    """What a session needs to know of its token."""

    tid: uuid.UUID  # the token id: the ``jti`` claim
    sub: str  # the subject ("" without one)
    exp_ms: int  # the expiry, epoch milliseconds


def _segment(segment: str, what: str) -> dict[str, Any]:
    """One base64url (unpadded) segment holding a JSON object."""
    try:
        raw = base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4))
        value = json.loads(raw)
    except (binascii.Error, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError
        raise TokenClaimsError(f"not a JWT: its {what} is not base64url JSON ({exc})") from None
    if not isinstance(value, dict):
        raise TokenClaimsError(f"not a JWT: its {what} is not a JSON object")
    return value


def read_claims(token: str) -> TokenClaims:
    """The token's ``jti``, ``sub`` and ``exp``, read without verifying its signature.

    Raises :class:`TokenClaimsError` for a token that is not a JWT with a UUID ``jti``
    and an integer ``exp``.
    """
    if not token.isascii():
        raise TokenClaimsError("not a JWT: not ASCII")
    parts = token.split(".")
    if len(parts) != 3:
        raise TokenClaimsError("not a JWT: not three dot-separated segments")
    _segment(parts[0], "header")
    claims = _segment(parts[1], "payload")
    try:
        tid = uuid.UUID(claims["jti"])
    except (KeyError, TypeError, ValueError, AttributeError):
        raise TokenClaimsError("the token's jti is not a UUID") from None
    exp = claims.get("exp")
    if not isinstance(exp, int) or isinstance(exp, bool):
        raise TokenClaimsError("the token has no integer exp claim")
    return TokenClaims(tid, str(claims.get("sub", "")), exp * 1000)
