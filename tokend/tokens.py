"""Signing keys, token minting and verification (spec "Tokens").

Keys are Ed25519, one PEM file per key in the keys directory, named by its
``kid``. Kids sort by creation time, so the greatest one is the newest: it alone
signs, every key in the directory verifies (rotation).
"""

from __future__ import annotations

import base64
import binascii
import fcntl
import json
import os
import re
import secrets
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import jwt
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
    """The keys of one keys directory: the newest signs, all of them verify."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._private: dict[str, Ed25519PrivateKey] = {}
        self._public: dict[str, Ed25519PublicKey] = {}
        self._mtime = 0  # the directory's mtime at the last reload
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
        """Make a new key the signing key; older keys keep verifying."""
        with _locked(self.directory):
            return self._add_new_key()

    def _add_new_key(self) -> str:
        # Greater than every kid known or on disk (we hold the lock), so it sorts last.
        on_disk = (p.stem for p in self.directory.glob("*.pem") if KID_PATTERN.match(p.stem))
        kid = _new_kid(max([*self._private, *on_disk], default=""))
        key = Ed25519PrivateKey.generate()
        _write_private_key(self.directory / f"{kid}.pem", key)
        self._private[kid] = key
        self._public[kid] = key.public_key()
        return kid

    def refresh(self) -> None:
        """Reload if the directory changed (another process rotated); at most once a second."""
        now = time.monotonic()
        if now - self._checked < REFRESH_INTERVAL:
            return
        self._checked = now
        if self.directory.stat().st_mtime_ns != self._mtime:
            self.reload()

    def reload(self) -> None:
        """Re-read the directory (picks up keys rotated by another process)."""
        # Taken before reading, so a key added meanwhile changes it again.
        self._mtime = self.directory.stat().st_mtime_ns
        for path in sorted(self.directory.glob("*.pem")):
            kid = path.stem
            if kid in self._private or not KID_PATTERN.match(kid):
                continue
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
            if not isinstance(key, Ed25519PrivateKey):
                raise ValueError(f"{path}: not an Ed25519 private key")
            self._private[kid] = key
            self._public[kid] = key.public_key()

    @property
    def current_kid(self) -> str:
        return max(self._private)

    def public_key(self, kid: str) -> Ed25519PublicKey | None:
        return self._public.get(kid)

    def jwks(self) -> dict[str, Any]:
        """The public keys as a JWKS (RFC 7517; OKP keys per RFC 8037)."""
        keys = []
        for kid in sorted(self._public, reverse=True):
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

    def sign(self, claims: dict[str, Any]) -> str:
        self.refresh()  # a key rotated in by `tokend keys rotate` signs from now on
        kid = self.current_kid
        return jwt.encode(claims, self._private[kid], algorithm="EdDSA", headers={"kid": kid})


class TokenService:
    """Mints and verifies tokens under one issuer, audience and key ring."""

    def __init__(self, settings: Settings, keys: KeyRing) -> None:
        self.keys = keys
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
        return self.keys.sign(body)

    def _key_for(self, kid: str) -> Ed25519PublicKey:
        key = self.keys.public_key(kid)
        if key is None:
            # Perhaps a key rotated in by another process since we last looked.
            self.keys.refresh()
            key = self.keys.public_key(kid)
        if key is None:
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
