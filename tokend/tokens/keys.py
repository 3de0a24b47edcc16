"""Signing keys on disk (spec "Tokens"): the key files and the :class:`KeyRing`.

Keys are Ed25519, one PEM file per key in the keys directory, named by its
``kid``. Kids sort by creation time, so the greatest one is the newest. A rotated
key is published at once and signs after a delay; a key that stopped signing is
published until its tokens have expired (:class:`tokend.tokens.schedule.KeySchedule`).
A private key file must be readable by its owner only, as ssh requires
(:meth:`KeyRing.open`)."""

from __future__ import annotations

import binascii
import fcntl
import json
import os
import re
import secrets
import stat
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from tokend.config import ConfigError

# (inode, size, mtime_ns, mode) of a file: another version of the file, or another
# mode, has another stamp.
Stamp = tuple[int, int, int, int]

log = structlog.get_logger("tokend.tokens")

KID_PATTERN = re.compile(r"^[0-9]{8}T[0-9]{6}Z-[0-9a-f]{8}$")


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


def b64url(raw: bytes) -> str:
    """RFC 7515 2: base64url without padding, as text."""
    return b64url_bytes(raw).decode()


def b64url_bytes(raw: bytes) -> bytes:
    """:func:`b64url` as ASCII bytes (``base64.urlsafe_b64encode``'s, two calls fewer): a
    renewal makes two, and its token goes out as bytes."""
    return binascii.b2a_base64(raw, newline=False).translate(_URLSAFE).rstrip(b"=")


_URLSAFE = bytes.maketrans(b"+/", b"-_")


class KeyFileError(ConfigError):
    """A keys directory tokend will not start with; the message names the file and the fix."""


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
    the event loop (:meth:`scan` in a thread, then :meth:`apply`; tokend.server.node). A file
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
                    "x": b64url(raw),
                }
            )
        return {"keys": keys}

    def sign(self, claims: dict[str, Any], kid: str) -> str:
        """A compact JWS of ``claims`` (RFC 7515 7.1), EdDSA-signed with ``kid``'s key.

        Built here rather than with ``jwt.encode``, whose checks and encoders, in Python,
        are most of what a renewal costs besides the signature itself;
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
                b64url_bytes(
                    json.dumps(
                        {"alg": "EdDSA", "kid": kid, "typ": "JWT"}, separators=(",", ":")
                    ).encode()
                )
                + b"."
            )
        signing_input = header + b64url_bytes(claims)
        return signing_input + b"." + b64url_bytes(self._private[kid].sign(signing_input))
