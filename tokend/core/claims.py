"""What tokend takes from a token (spec "Tokens"): :class:`Claims`, the token id
:class:`Tid`, and why a token is refused (:class:`TokenError`, :data:`Refusal`). Pure:
the checks of a claims payload, no key and no clock."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal, get_args

REQUIRED_CLAIMS = ("iss", "aud", "sub", "jti", "iat", "exp")
DEFAULT_PRIO = 5
PRIO_RANGE = range(10)


# Why a token is refused: the reason of its close (4502 for "expired", else 4501), the
# same for every client and release; each is explained in docs/protocol.md §7.
Refusal = Literal[
    "malformed",
    "bad_algorithm",
    "unknown_kid",
    "bad_signature",
    "missing_claim",
    "wrong_issuer",
    "wrong_audience",
    "bad_time",
    "expired",
    "not_yet_valid",
    "bad_jti",
    "bad_sub",
    "bad_prio",
]
REFUSALS: tuple[Refusal, ...] = get_args(Refusal)


class TokenError(Exception):
    """A token that must be refused, and why (:data:`Refusal`)."""

    def __init__(self, reason: Refusal) -> None:
        super().__init__(reason)
        self.reason = reason

    @property
    def expired(self) -> bool:
        """Close with 4502 (token expired) rather than 4501 (invalid token)."""
        return self.reason == "expired"


class Tid(uuid.UUID):
    """A token's jti, a UUID that keeps the canonical text it came as (what ``str``
    of a UUID writes): ``str`` answers that instead of formatting 128 bits again, which
    costs more than the rest of a UUID's use. A session's tid goes into its log fields
    and the store's keys and arguments several times a resume
    (bench/results/2026-12-04-resume.md). Equal to, and hashed as, the ``uuid.UUID`` of
    the same value."""

    __slots__ = ("_text",)
    _text: str

    def __init__(self, text: str) -> None:
        super().__init__(text)
        object.__setattr__(self, "_text", text)  # a UUID refuses setattr

    def __str__(self) -> str:
        return self._text

    def __reduce__(self) -> tuple[type[Tid], tuple[str]]:
        return Tid, (self._text,)  # copied or pickled with its text (UUID's keeps int)


@dataclass(frozen=True, slots=True)
class Claims:
    """What tokend needs from a verified token."""

    tid: uuid.UUID
    sub: str
    iat: int
    exp: int
    prio: int = DEFAULT_PRIO


# A UUID as str() writes it (RFC 9562 4: lower-case hex, hyphenated 8-4-4-4-12): the
# only jti taken, so that the same tid has one spelling everywhere.
_CANONICAL_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def claims_from_payload(payload: dict[str, Any]) -> Claims:
    jti, sub, prio = payload["jti"], payload["sub"], payload.get("prio", DEFAULT_PRIO)
    if not isinstance(jti, str) or not _CANONICAL_UUID.fullmatch(jti):
        raise TokenError("bad_jti")
    tid = Tid(jti)
    if not isinstance(sub, str) or not sub or len(sub) > 256:
        raise TokenError("bad_sub")
    if isinstance(prio, bool) or not isinstance(prio, int) or prio not in PRIO_RANGE:
        raise TokenError("bad_prio")
    iat, exp = payload["iat"], payload["exp"]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (iat, exp)):
        raise TokenError("bad_time")
    if not 0 < exp < 1 << 42:
        raise TokenError("bad_time")
    return Claims(tid, sub, iat, exp, prio)
