"""Signing keys, token minting and verification (spec "Tokens").

Keys are Ed25519, one PEM file per key in the keys directory, named by its
``kid``. Kids sort by creation time, so the greatest one is the newest. A rotated
key is published at once and signs after a delay; a key that stopped signing is
published until its tokens have expired (:class:`KeySchedule`). A private key file
must be readable by its owner only, as ssh requires (:meth:`KeyRing.open`).

Verifying and signing read neither a clock nor a file: the caller passes the time,
and the node refreshes the :class:`KeyRing` from the directory on a timer.
"""

from __future__ import annotations

import binascii
import bisect
import calendar
import fcntl
import functools
import hashlib
import json
import math
import os
import re
import secrets
import stat
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import structlog
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from tokend.config import ConfigError, Settings

log = structlog.get_logger("tokend.tokens")

KID_PATTERN = re.compile(r"^[0-9]{8}T[0-9]{6}Z-[0-9a-f]{8}$")
REQUIRED_CLAIMS = ("iss", "aud", "sub", "jti", "iat", "exp")
DEFAULT_PRIO = 5
PRIO_RANGE = range(10)
# Distinct JWS headers whose kid TokenService keeps (a node sees a handful: one per key).
HEADER_CACHE_SIZE = 64


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
    and the store's keys and arguments several times a resume (docs/performance.md,
    "Resume"). Equal to, and hashed as, the ``uuid.UUID`` of the same value."""

    __slots__ = ("_text",)

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


def _raw(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _b64url(raw: bytes) -> str:
    """RFC 7515 2: base64url without padding, as text."""
    return _b64url_bytes(raw).decode()


def _b64url_bytes(raw: bytes) -> bytes:
    """:func:`_b64url` as ASCII bytes (``base64.urlsafe_b64encode``'s, two calls fewer): a
    renewal makes two, and its token goes out as bytes."""
    return binascii.b2a_base64(raw, newline=False).translate(_URLSAFE).rstrip(b"=")


_URLSAFE = bytes.maketrans(b"+/", b"-_")
# A JSON string as json.dumps writes it (ensure_ascii): the C encoder json uses itself.
_json_string = json.encoder.encode_basestring_ascii


class KeyFileError(ConfigError):
    """A keys directory tokend will not start with; the message names the file and the fix."""


# (inode, size, mtime_ns, mode) of a file: another version of the file, or another
# mode, has another stamp.
Stamp = tuple[int, int, int, int]


def _too_open(stamp: Stamp) -> bool:
    """Group or others may read or write the file: ssh's rule for a private key file."""
    return bool(stat.S_IMODE(stamp[3]) & 0o077)


@dataclass(frozen=True, slots=True)
class KeyFile:
    """One version of a ``.pem`` file of the keys directory: its key, or why it was refused."""

    stamp: Stamp
    key: Ed25519PrivateKey | None
    why: str = ""

    @property
    def too_open(self) -> bool:
        return _too_open(self.stamp)


def _read_key_file(path: Path, stamp: Stamp) -> KeyFile:
    """The key of ``path``, or why it is refused (never the key's bytes in the reason)."""
    if not KID_PATTERN.match(path.stem):
        return KeyFile(stamp, None, "not named <YYYYmmddTHHMMSSZ>-<8 hex digits>.pem: ignored")
    if _too_open(stamp):
        mode = f"{stat.S_IMODE(stamp[3]):04o}"
        return KeyFile(
            stamp, None, f"readable by group or others (mode {mode}): run chmod 600 {path}"
        )
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except OSError as exc:
        return KeyFile(stamp, None, f"cannot be read: {exc.strerror}")
    except (ValueError, TypeError, UnsupportedAlgorithm):
        return KeyFile(stamp, None, "not a PEM private key without a passphrase")
    if not isinstance(key, Ed25519PrivateKey):
        return KeyFile(stamp, None, "not an Ed25519 private key")
    return KeyFile(stamp, key)


class KeyRing:
    """The keys of one keys directory, as it held them at the last :meth:`refresh`.

    Signing and verifying read only memory: a node refreshes the ring on a timer, off
    the event loop (:meth:`scan` in a thread, then :meth:`apply`; tokend.node). A file
    refused (malformed, not Ed25519, readable by group or others, misnamed) is logged
    once per version of it and listed in :attr:`problems` (``/readyz``); a key already
    loaded stays loaded while its file is refused, and the ring never drops to no key.
    Which key signs and which are published is :class:`KeySchedule`'s to say.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._private: dict[str, Ed25519PrivateKey] = {}
        self._headers: dict[str, bytes] = {}  # each kid's JWS header, base64url, and "."
        self._public: dict[str, Ed25519PublicKey] = {}
        self._raw: dict[str, bytes] = {}  # each public key's raw bytes
        self.kids: list[str] = []  # every kid, oldest first
        self.files: dict[str, KeyFile] = {}  # every .pem file by name, as last scanned
        self.unlisted = ""  # why the directory could not be listed at the last scan

    @classmethod
    def open(cls, directory: Path) -> KeyRing:
        """Load the directory, generating a first key if it has none.

        Raises :class:`KeyFileError` for a key file readable by group or others, as ssh
        does, or when no file holds a usable key.
        """
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        ring = cls(directory)
        with _locked(directory):
            scan = ring.scan()
            if isinstance(scan, str):
                raise KeyFileError(f"keys_dir: {directory}: {scan}")
            for name, file in sorted(scan.items()):
                if file.too_open and KID_PATTERN.match(Path(name).stem):
                    raise KeyFileError(f"keys_dir: {directory / name}: {file.why}")
            ring.apply(scan)
            if not any(KID_PATTERN.match(Path(name).stem) for name in scan):
                ring._add_new_key()
            elif not ring._private:
                reasons = "; ".join(f"{name}: {file.why}" for name, file in sorted(scan.items()))
                raise KeyFileError(f"keys_dir: no usable signing key in {directory} ({reasons})")
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
        self._use({**self._private, kid: key})
        return kid

    def _use(self, keys: dict[str, Ed25519PrivateKey]) -> None:
        """Sign and verify with ``keys`` from now on (each attribute replaced whole)."""
        self._public = {
            kid: self._public[kid] if self._private.get(kid) is key else key.public_key()
            for kid, key in keys.items()
        }
        self._raw = {
            kid: self._raw[kid] if self._private.get(kid) is key else _raw(self._public[kid])
            for kid, key in keys.items()
        }
        self._private = keys
        self.kids = sorted(keys)

    def _kids_on_disk(self) -> set[str]:
        return {p.stem for p in self.directory.glob("*.pem") if KID_PATTERN.match(p.stem)}

    def scan(self) -> dict[str, KeyFile] | str:
        """Every ``.pem`` file of the directory, reading only those that changed since the
        last :meth:`apply`; or why the directory could not be listed.

        Safe in another thread while the ring signs and verifies: it reads the ring's
        :attr:`files` only, which :meth:`apply` replaces rather than changes.
        """
        known = self.files
        files: dict[str, KeyFile] = {}
        try:
            with os.scandir(self.directory) as entries:
                for entry in entries:
                    if not entry.name.endswith(".pem"):
                        continue
                    try:
                        st = entry.stat()
                    except FileNotFoundError:  # deleted since it was listed
                        continue
                    stamp = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode)
                    before = known.get(entry.name)
                    if before is not None and before.stamp == stamp:
                        files[entry.name] = before
                    else:
                        files[entry.name] = _read_key_file(Path(entry.path), stamp)
        except OSError as exc:
            return exc.strerror or type(exc).__name__
        return files

    def apply(self, scan: dict[str, KeyFile] | str) -> None:
        """Use what :meth:`scan` found: keys added, keys whose file was deleted dropped.

        A refused file is logged once per version of it (and its key, if one was loaded
        from an earlier version, kept); a scan with no usable key, or of a directory that
        could not be listed, changes no key.
        """
        if isinstance(scan, str):
            if scan != self.unlisted:
                log.error("keys directory unreadable: keeping the keys loaded", why=scan)
            self.unlisted = scan
            return
        if self.unlisted:
            log.info("keys directory readable again")
            self.unlisted = ""
        keys: dict[str, Ed25519PrivateKey] = {}
        for name, file in scan.items():
            kid = Path(name).stem
            if file.why and self.files.get(name) != file:
                log.error("key file refused", file=str(self.directory / name), why=file.why)
            if file.key is not None:
                keys[kid] = file.key
            elif kid in self._private:  # refused now: keep the key its old version held
                keys[kid] = self._private[kid]
        for name, before in self.files.items():
            after = scan.get(name)
            if before.why and after is not None and not after.why:
                log.info("key file accepted", file=str(self.directory / name))
        self.files = scan
        if not keys and self._private:
            log.error("no usable key in the keys directory: keeping the keys loaded")
            return
        self._use(keys)

    def refresh(self) -> None:
        """Scan and apply at once, in this thread (the CLI; tests)."""
        self.apply(self.scan())

    @property
    def problems(self) -> dict[str, str]:
        """What the last scan refused, by file name (``keys_dir`` for the directory)."""
        problems = {name: file.why for name, file in sorted(self.files.items()) if file.why}
        if self.unlisted:
            problems["keys_dir"] = self.unlisted
        return problems

    def public_key(self, kid: str) -> Ed25519PublicKey | None:
        return self._public.get(kid)

    def raw_public_key(self, kid: str) -> bytes:
        """The 32 bytes of ``kid``'s public key (RFC 8032 5.1.5)."""
        return self._raw[kid]

    def jwks(self, kids: Iterable[str]) -> dict[str, Any]:
        """The public keys of ``kids`` as a JWKS (RFC 7517; OKP keys per RFC 8037),
        newest first."""
        keys = []
        for kid in sorted(kids, reverse=True):
            raw = self._raw[kid]
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
        return self.sign_json(json.dumps(claims, separators=(",", ":")).encode(), kid).decode()

    def sign_json(self, claims: bytes, kid: str) -> bytes:
        """:meth:`sign` of claims already written as compact JSON, in ASCII bytes (the
        token as an ACK carries it: no text made and encoded again)."""
        header = self._headers.get(kid)
        if header is None:
            # With the dot that follows it: one concatenation less per token.
            header = self._headers[kid] = (
                _b64url_bytes(
                    json.dumps(
                        {"alg": "EdDSA", "kid": kid, "typ": "JWT"}, separators=(",", ":")
                    ).encode()
                )
                + b"."
            )
        signing_input = header + _b64url_bytes(claims)
        return signing_input + b"." + _b64url_bytes(self._private[kid].sign(signing_input))


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
        the time, the ring holds the keys (refreshed by the node, tokend.node).

        The same checks as ``jwt.decode`` with ``strict_aud`` and the required
        claims (RFC 7515 compact serialization, RFC 7519 claims), done on the
        primitives: PyJWT spends ~340 us per token validating base64 one character
        at a time, more than the Ed25519 verification itself, on every HELLO.
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
        return _claims(payload), token_digest(raw_key, token)

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
    return _b64url(hashlib.sha256(data).digest()[:16])


_B64URL_AND_DOT = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_."
# A UUID as str() writes it (RFC 9562 4: lower-case hex, hyphenated 8-4-4-4-12): the
# only jti taken, so that the same tid has one spelling everywhere.
_CANONICAL_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


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


def _claims(payload: dict[str, Any]) -> Claims:
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
