"""Minting and verifying tokens (spec "Tokens"): :class:`TokenService`, and the digests
the store keeps of tokens and resume proofs.

Verifying and signing read neither a clock nor a file: the caller passes the time,
and the node refreshes the :class:`tokend.tokens.keys.KeyRing` from the directory on a
timer.
"""

from __future__ import annotations

import binascii
import hashlib
import json
import math
import time
import uuid
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from tokend.config import Settings
from tokend.core.claims import (
    DEFAULT_PRIO,
    PRIO_RANGE,
    REQUIRED_CLAIMS,
    Claims,
    TokenError,
    claims_from_payload,
)
from tokend.tokens.keys import KID_PATTERN, KeyRing, b64url
from tokend.tokens.schedule import KeySchedule

# Distinct JWS headers whose kid TokenService keeps (a node sees a handful: one per key).
HEADER_CACHE_SIZE = 64
# A JSON string as json.dumps writes it (ensure_ascii): the C encoder json uses itself.
_json_string = json.encoder.encode_basestring_ascii


class TokenService:
    """Mints and verifies tokens under one issuer, audience and key ring."""

    def __init__(self, settings: Settings, keys: KeyRing) -> None:
        self.keys = keys
        self.schedule = KeySchedule.of(settings)
        # Shorter than the publish delay (config.validate): see KeySchedule.
        self.jwks_cache_control = f"public, max-age={int(settings.jwks_max_age)}"
        self.issuer = settings.issuer
        self.audience = settings.audience
        self.leeway = settings.leeway
        self.algorithms = settings.algorithm_list
        self.default_ttl_s = settings.token_ttl_s
        # What every token's claims begin with, as json.dumps writes them (see sign).
        self._claims_head = (
            f'{{"iss":{_json_string(self.issuer)},"aud":{_json_string(self.audience)},"sub":'
        )
        # signing_kid's last answer: (the ring's kids, the time, the kid).
        self._signing: tuple[list[str], float, str] = ([], math.nan, "")
        # The kid of each JWS header (its base64url text) that named a usable key.
        self._kids: dict[str, str] = {}

    def new_claims(
        self,
        sub: str,
        *,
        ttl_s: int | None = None,
        prio: int = DEFAULT_PRIO,
        tid: uuid.UUID | None = None,
        iat: int | None = None,
    ) -> Claims:
        """The claims of a new token: a fresh ``jti`` unless ``tid`` is given, issued at
        ``iat`` (unix seconds; None: now, by this machine's clock), expiring ``ttl_s``
        (default ``token_ttl``) later."""
        if prio not in PRIO_RANGE:
            raise ValueError("prio must be 0..9")
        ttl_s = self.default_ttl_s if ttl_s is None else ttl_s
        if ttl_s < 1:
            raise ValueError("ttl must be at least 1 second")
        iat = int(time.time()) if iat is None else iat
        return Claims(tid or uuid.uuid4(), sub, iat, iat + ttl_s, prio)

    def mint(self, sub: str, **fields: Any) -> str:
        """A new token: the claims of :meth:`new_claims` (the same keywords), signed."""
        return self.sign(self.new_claims(sub, **fields))

    def sign(self, claims: Claims) -> str:
        """The token of ``claims``, signed by the key that signs at its ``iat``
        (:class:`KeySchedule`): no clock is read, no file."""
        return self.sign_as(claims, claims.iat, claims.exp).decode()

    def sign_as(self, claims: Claims, iat: int, exp: int) -> bytes:
        """The token of ``claims`` with this ``iat`` and ``exp`` instead of theirs (a
        renewal: no Claims made for it), in ASCII bytes, as an ACK carries it.

        The claims are written as ``json.dumps`` writes the dict {iss, aud, sub, jti, iat,
        exp[, prio]} compactly, without building it: a renewal signs one token, and the
        dict and the encoder cost about a third of the signature (tests/test_tokens.py
        holds the bytes equal to PyJWT's).
        """
        prio = "" if claims.prio == DEFAULT_PRIO else f',"prio":{int(claims.prio)}'
        body = (
            f'{self._claims_head}{_json_string(claims.sub)},"jti":"{claims.tid}",'
            f'"iat":{int(iat)},"exp":{int(exp)}{prio}}}'
        )
        return self.keys.sign_json(body.encode(), self.signing_kid(iat))

    def reissue(self, claims: Claims, iat: int, exp: int) -> tuple[bytes, str]:
        """:meth:`sign_as`, with the new token's :func:`token_digest`: the store keeps it
        with the session (heartbeat.lua), as it keeps a verified token's, so that a resume
        with the token this node gave skips the signature as one with the token it
        verified does (docs/security.md "A resume skips the signature of a token the
        store knows")."""
        token = self.sign_as(claims, iat, exp)
        return token, token_digest(self.keys.raw_public_key(self.signing_kid(iat)), token)

    def signing_kid(self, now: float) -> str:
        """The kid that signs at ``now``; the last answer is kept with its ``now`` and
        ring (a storm's renewals share both: their iat is Redis's second; a refresh
        replaces ``keys.kids`` whole, so another ring is another list)."""
        kids = self.keys.kids
        last = self._signing
        if last[0] is kids and last[1] == now:
            return last[2]
        kid = self.schedule.signing(kids, now)
        self._signing = (kids, now, kid)
        return kid

    def published_kids(self, now: float) -> list[str]:
        return self.schedule.published(self.keys.kids, now)

    def jwks(self) -> dict[str, Any]:
        """The keys published now, as the ring held them at its last refresh."""
        return self.keys.jwks(self.published_kids(time.time()))

    def _key_for(self, kid: str, now: float) -> Ed25519PublicKey:
        key = self.keys.public_key(kid)
        if key is None or now >= self.schedule.retires_at(kid, self.keys.kids):
            raise TokenError("unknown_kid")
        return key

    def verify(self, token: str, now: float) -> Claims:
        """Check signature, algorithm, issuer, audience, times (at ``now``, unix seconds,
        within ``leeway``) and claim shapes. Reads no clock and no file: the caller gives
        the time, the ring holds the keys (refreshed by the node, tokend.server.node).

        The same checks as ``jwt.decode`` with ``strict_aud`` and the required
        claims (RFC 7515 compact serialization, RFC 7519 claims), done on the
        primitives: PyJWT validates base64 one character at a time in Python, which
        costs more than the Ed25519 verification itself, on every HELLO.
        """
        return self.check(token, now, signature=True)[0]

    def check(self, token: str, now: float, *, signature: bool) -> tuple[Claims, str]:
        """:meth:`verify`'s checks, all of them, or (``signature`` False) all but the
        Ed25519 signature; and the token's :func:`token_digest` under its key.

        Without the signature the claims are only as good as a store that knows the
        digest as one of a token verified before (hello.lua; docs/security.md "A resume
        skips the signature of a token the store knows"): the key must still be in the
        ring and published, and every claim is checked as for a verified token.
        """
        segments = token.split(".")
        # Three segments of base64url characters, at least one each: what is left of
        # the token once they and its two dots are deleted must be nothing.
        if (
            len(segments) != 3
            or not all(segments)
            or not token.isascii()
            or token.encode("ascii").translate(None, _B64URL_AND_DOT)
        ):
            raise TokenError("malformed")
        key, raw_key = self._header_key(segments[0], now)
        if signature:
            try:
                key.verify(_b64decode(segments[2]), f"{segments[0]}.{segments[1]}".encode("ascii"))
            except (InvalidSignature, binascii.Error):
                raise TokenError("bad_signature") from None
        payload = _json_segment(segments[1])
        for claim in REQUIRED_CLAIMS:
            if claim not in payload:
                raise TokenError("missing_claim")
        if payload["iss"] != self.issuer:
            raise TokenError("wrong_issuer")
        if payload["aud"] != self.audience or not isinstance(payload["aud"], str):
            raise TokenError("wrong_audience")
        for claim in ("exp", "iat", "nbf"):
            value = payload.get(claim)
            if claim in payload and (isinstance(value, bool) or not isinstance(value, int | float)):
                raise TokenError("bad_time")
        if payload["exp"] <= now - self.leeway:
            raise TokenError("expired")
        if payload["iat"] > now + self.leeway or payload.get("nbf", 0) > now + self.leeway:
            raise TokenError("not_yet_valid")
        return claims_from_payload(payload), token_digest(raw_key, token)

    def _header_key(self, segment: str, now: float) -> tuple[Ed25519PublicKey, bytes]:
        """The key a JWS header names (its kid), if the algorithm is EdDSA and the key is
        in the ring and published at ``now``; with its raw bytes (for the digest).

        A header that passed is kept by its exact text (the same few headers come with
        every token): its kid, so that the next is not decoded again. The ring's key and
        the schedule are asked each time: a key removed or retired refuses at once.
        """
        kid = self._kids.get(segment)
        if kid is None:
            header = _json_segment(segment)
            alg, kid = header.get("alg"), header.get("kid")
            # Only Ed25519 keys exist here: an allowed algorithm of another family
            # could never verify, so it is refused rather than tried.
            if alg not in self.algorithms or alg != "EdDSA":
                raise TokenError("bad_algorithm")
            if not isinstance(kid, str) or not KID_PATTERN.match(kid):
                raise TokenError("unknown_kid")
            key = self._key_for(kid, now)
            if len(self._kids) >= HEADER_CACHE_SIZE:
                self._kids.clear()  # headers crafted to fill it: start over
            self._kids[segment] = kid
        else:
            key = self._key_for(kid, now)
        return key, self.keys.raw_public_key(kid)


def token_digest(raw_key: bytes, token: str | bytes) -> str:
    """What the store keeps of the token a session was last verified with (or given by a
    node, :meth:`TokenService.reissue`), and compares a resume's token with: the
    :func:`store_digest` of the raw public key of the token's kid and the token (ASCII).
    Equal digests mean the same token bytes under the same key (a kid that came to name
    another key would not match)."""
    return store_digest(raw_key + (token if isinstance(token, bytes) else token.encode()))


def store_digest(data: bytes) -> str:
    """The form in which the session hash keeps a secret's digest (the token's, the resume
    proof's): the first 16 bytes (128 bits) of its SHA-256, base64url without padding.

    22 characters rather than hex's 32: the session hash is most of a session's Redis
    memory, and this alphabet keeps it text (readable by any client; no '|' to split on,
    as heartbeat.lua's restore argument does).
    """
    return b64url(hashlib.sha256(data).digest()[:16])


_B64URL_AND_DOT = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_."


def _b64decode(segment: str) -> bytes:
    """base64url without padding (RFC 7515 2), read as ``base64.urlsafe_b64decode`` reads
    it, without its two Python calls: one segment per resume."""
    padded = (segment + "=" * (-len(segment) % 4)).encode("ascii")
    return binascii.a2b_base64(padded.translate(_FROM_URLSAFE))


_FROM_URLSAFE = bytes.maketrans(b"-_", b"+/")


def _json_segment(segment: str) -> dict[str, Any]:
    try:
        value = json.loads(_b64decode(segment))
    except (ValueError, binascii.Error):
        raise TokenError("malformed") from None
    if not isinstance(value, dict):
        raise TokenError("malformed")
    return value
