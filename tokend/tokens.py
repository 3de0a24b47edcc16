"""Signing keys, token minting and verification (spec "Tokens").

Keys are Ed25519, one PEM file per key in the keys directory, named by its
``kid``. Kids sort by creation time, so the greatest one is the newest. A rotated
key is published at once and signs after a delay; a key that stopped signing is
published until its tokens have expired (:class:`KeySchedule`).
"""

from __future__ import annotations

import base64
import binascii
import bisect
import calendar
import fcntl
import functools
import json
import math
import os
import re
import secrets
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from tokend.config import Settings

KID_PATTERN = re.compile(r"^[0-9]{8}T[0-9]{6}Z-[0-9a-f]{8}$")
REQUIRED_CLAIMS = ("iss", "aud", "sub", "jti", "iat", "exp")
DEFAULT_PRIO = 5
REFRESH_INTERVAL = 1.0  # seconds between looks at the keys directory for rotated keys
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


@dataclass(frozen=True, slots=True)
class Claims:
    """What tokend needs from a verified token."""

    tid: uuid.UUID
    sub: str
    iat: int
    exp: int
    prio: int = DEFAULT_PRIO


def _new_kid(newest: str = "") -> str:
    """A kid that sorts after ``newest`` (the greatest existing kid), so it becomes current."""
    kid = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(4)
    if kid > newest:
        return kid
    # Same second as the newest key (or the clock went back): the next kid after it.
    stamp, _, suffix = newest.partition("-")
    following = int(suffix, 16) + 1
    if following > 0xFFFFFFFF:
        raise RuntimeError(f"no kid left after {newest}")
    return f"{stamp}-{following:08x}"


def _write_private_key(path: Path, key: Ed25519PrivateKey) -> None:
    """Write atomically with mode 0600: readers see no file or the whole file."""
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, pem)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)


@contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """Serialize key generation between processes sharing the directory."""
    with (directory / ".lock").open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _b64url(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


class KeyRing:
    """The keys of one keys directory, as the directory holds them now.

    Which key signs and which are published is :class:`KeySchedule`'s to say.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._private: dict[str, Ed25519PrivateKey] = {}
        self._headers: dict[str, str] = {}  # the JWS header of each kid, base64url-encoded
        self._public: dict[str, Ed25519PublicKey] = {}
        self.kids: list[str] = []  # every kid, oldest first
        self._checked = 0.0  # monotonic time of the last look at the directory

    @classmethod
    def open(cls, directory: Path) -> KeyRing:
        """Load the directory, generating a first key if it has none."""
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        ring = cls(directory)
        with _locked(directory):
            ring.reload()
            if not ring._private:
                ring._add_new_key()
        return ring

    def rotate(self) -> str:
        """Add a new key, the newest; it signs once :class:`KeySchedule` says so."""
        with _locked(self.directory):
            return self._add_new_key()

    def _add_new_key(self) -> str:
        # Greater than every kid known or on disk (we hold the lock), so it sorts last.
        kid = _new_kid(max([*self._private, *self._kids_on_disk()], default=""))
        key = Ed25519PrivateKey.generate()
        _write_private_key(self.directory / f"{kid}.pem", key)
        self._add(kid, key)
        return kid

    def _add(self, kid: str, key: Ed25519PrivateKey) -> None:
        self._private[kid] = key
        self._public[kid] = key.public_key()
        self.kids = sorted(self._private)

    def _kids_on_disk(self) -> set[str]:
        return {p.stem for p in self.directory.glob("*.pem") if KID_PATTERN.match(p.stem)}

    def refresh(self, interval: float = REFRESH_INTERVAL) -> None:
        """Follow the directory (keys rotated in or deleted by another process), looking
        at it at most once per ``interval`` seconds."""
        now = time.monotonic()
        if now - self._checked < interval:
            return
        self._checked = now
        if self._kids_on_disk() != self._private.keys():
            self.reload()

    def reload(self) -> None:
        """Re-read the directory: load the keys added, forget the keys deleted."""
        on_disk = self._kids_on_disk()
        for kid in self._private.keys() - on_disk:
            del self._private[kid], self._public[kid]
        self.kids = sorted(self._private)
        for kid in sorted(on_disk - self._private.keys()):
            path = self.directory / f"{kid}.pem"
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
            if not isinstance(key, Ed25519PrivateKey):
                raise ValueError(f"{path}: not an Ed25519 private key")
            self._add(kid, key)

    def public_key(self, kid: str) -> Ed25519PublicKey | None:
        return self._public.get(kid)

    def jwks(self, kids: Iterable[str]) -> dict[str, Any]:
        """The public keys of ``kids`` as a JWKS (RFC 7517; OKP keys per RFC 8037),
        newest first."""
        keys = []
        for kid in sorted(kids, reverse=True):
            raw = self._public[kid].public_bytes(
                serialization.Encoding.Raw, serialization.PublicFormat.Raw
            )
            keys.append(
                {
                    "kty": "OKP",
                    "crv": "Ed25519",
                    "kid": kid,
                    "use": "sig",
                    "alg": "EdDSA",
                    "x": _b64url(raw),
                }
            )
        return {"keys": keys}

    def sign(self, claims: dict[str, Any], kid: str) -> str:
        """A compact JWS of ``claims`` (RFC 7515 7.1), EdDSA-signed with ``kid``'s key.

        Built here rather than with ``jwt.encode``, whose checks and encoders cost ~20 us
        of Python per token, most of what a renewal costs besides the signature itself;
        the bytes are PyJWT's (tests/test_tokens.py holds them equal).
        """
        header = self._headers.get(kid)
        if header is None:
            header = self._headers[kid] = _b64url(
                json.dumps(
                    {"alg": "EdDSA", "kid": kid, "typ": "JWT"}, separators=(",", ":")
                ).encode()
            )
        payload = _b64url(json.dumps(claims, separators=(",", ":")).encode())
        signing_input = f"{header}.{payload}"
        return f"{signing_input}.{_b64url(self._private[kid].sign(signing_input.encode()))}"


@functools.cache
def _created(kid: str) -> float:
    """The end of the second a kid names (UTC ``YYYYmmddTHHMMSSZ``): its key was
    created no later."""
    fields = (kid[0:4], kid[4:6], kid[6:8], kid[9:11], kid[11:13], kid[13:15])
    return calendar.timegm(tuple(map(int, fields))) + 1.0


@dataclass(frozen=True, slots=True)
class KeySchedule:
    """When each key signs and while it is published, from the kids alone (the second
    each names) and two settings, so that every node sharing the directory agrees.

    A new key is published at once, and signs once ``publish_delay`` has passed, by
    when every JWKS cached before it (for at most ``jwks_max_age`` < the delay) has
    expired. Before that the key before it goes on signing (the oldest, while none is
    due). A key that stopped signing stays published ``retire_after`` (token_ttl +
    leeway), until every token it signed has expired, and then neither is published
    nor verifies.
    """

    publish_delay: float
    retire_after: float

    @classmethod
    def of(cls, settings: Settings) -> KeySchedule:
        return cls(settings.key_publish_delay, settings.token_ttl + settings.leeway)

    def signs_from(self, kid: str) -> float:
        return _created(kid) + self.publish_delay

    def signing(self, kids: Sequence[str], now: float) -> str:
        """The kid that signs at ``now`` (``kids`` oldest first, not empty)."""
        due = [kid for kid in kids if self.signs_from(kid) <= now]
        return due[-1] if due else kids[0]

    def retires_at(self, kid: str, kids: Sequence[str]) -> float:
        """When ``kid`` (one of ``kids``, oldest first) stops being published."""
        newer = bisect.bisect_right(kids, kid)
        if newer == len(kids):
            return math.inf
        return self.signs_from(kids[newer]) + self.retire_after

    def published(self, kids: Sequence[str], now: float) -> list[str]:
        """The kids published (and verifying) at ``now``: all but the retired."""
        return [kid for kid in kids if now < self.retires_at(kid, kids)]


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

    def mint(
        self,
        sub: str,
        *,
        ttl_s: int | None = None,
        prio: int = DEFAULT_PRIO,
        tid: uuid.UUID | None = None,
        iat: int | None = None,
    ) -> str:
        """A new token (a fresh ``jti`` unless ``tid`` is given)."""
        if prio not in PRIO_RANGE:
            raise ValueError("prio must be 0..9")
        ttl_s = self.default_ttl_s if ttl_s is None else ttl_s
        if ttl_s < 1:
            raise ValueError("ttl must be at least 1 second")
        iat = int(time.time()) if iat is None else iat
        return self.sign(Claims(tid or uuid.uuid4(), sub, iat, iat + ttl_s, prio))

    def sign(self, claims: Claims) -> str:
        body: dict[str, Any] = {
            "iss": self.issuer,
            "aud": self.audience,
            "sub": claims.sub,
            "jti": str(claims.tid),
            "iat": claims.iat,
            "exp": claims.exp,
        }
        if claims.prio != DEFAULT_PRIO:
            body["prio"] = claims.prio
        self.keys.refresh()  # a key rotated in by `tokend keys rotate` comes due in time
        return self.keys.sign(body, self.signing_kid)

    @property
    def signing_kid(self) -> str:
        return self.schedule.signing(self.keys.kids, time.time())

    def published_kids(self) -> list[str]:
        return self.schedule.published(self.keys.kids, time.time())

    def jwks(self) -> dict[str, Any]:
        """The published keys, as the keys directory holds them at this moment."""
        self.keys.refresh(0)  # a listing of a few names: nothing to save by waiting
        return self.keys.jwks(self.published_kids())

    def _key_for(self, kid: str) -> Ed25519PublicKey:
        self.keys.refresh()  # keys rotated in or deleted by another process, within a second
        key = self.keys.public_key(kid)
        if key is None or time.time() >= self.schedule.retires_at(kid, self.keys.kids):
            raise TokenError("unknown_kid")
        return key

    def verify(self, token: str) -> Claims:
        """Check signature, algorithm, issuer, audience, times and claim shapes.

        The same checks as ``jwt.decode`` with ``strict_aud`` and the required
        claims (RFC 7515 compact serialization, RFC 7519 claims), done on the
        primitives: PyJWT spends ~340 us per token validating base64 one character
        at a time, more than the Ed25519 verification itself, on every HELLO.
        """
        segments = token.split(".")
        if len(segments) != 3 or not all(map(_B64URL.fullmatch, segments)):
            raise TokenError("malformed")
        header = _json_segment(segments[0])
        alg, kid = header.get("alg"), header.get("kid")
        # Only Ed25519 keys exist here: an allowed algorithm of another family
        # could never verify, so it is refused rather than tried.
        if alg not in self.algorithms or alg != "EdDSA":
            raise TokenError("bad_algorithm")
        if not isinstance(kid, str) or not KID_PATTERN.match(kid):
            raise TokenError("unknown_kid")
        key = self._key_for(kid)
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
        now = time.time()
        for claim in ("exp", "iat", "nbf"):
            value = payload.get(claim)
            if claim in payload and (isinstance(value, bool) or not isinstance(value, int | float)):
                raise TokenError("bad_time")
        if payload["exp"] <= now - self.leeway:
            raise TokenError("expired")
        if payload["iat"] > now + self.leeway or payload.get("nbf", 0) > now + self.leeway:
            raise TokenError("not_yet_valid")
        return _claims(payload)


_B64URL = re.compile(r"[A-Za-z0-9_-]+")


def _b64decode(segment: str) -> bytes:
    return base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4))


def _json_segment(segment: str) -> dict[str, Any]:
    try:
        value = json.loads(_b64decode(segment))
    except (ValueError, binascii.Error):
        raise TokenError("malformed") from None
    if not isinstance(value, dict):
        raise TokenError("malformed")
    return value


def _claims(payload: dict[str, Any]) -> Claims:
    jti, sub, prio = payload["jti"], payload["sub"], payload.get("prio", DEFAULT_PRIO)
    try:
        tid = uuid.UUID(jti) if isinstance(jti, str) else None
    except ValueError:
        tid = None
    if tid is None or str(tid) != jti:
        raise TokenError("bad_jti")
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
