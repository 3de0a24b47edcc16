"""Protocol v1 frame codec: bytes in, frames out, and back. No I/O.

Implements the frame layouts of ``docs/protocol.md`` (section 2, "Frames"). Every
integer is unsigned big-endian, every time is Unix epoch milliseconds.

:func:`decode` raises nothing but :class:`ProtocolError`, whatever the input.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import importlib
import struct
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from hmac import compare_digest
from typing import Protocol

VERSION = 1
SUBPROTOCOL = "tokend.v1"
WS_PATH = "/v1/ws"
MAX_TOKEN_LENGTH = 8192
TID_LENGTH = 16
SESSION_KEY_LENGTH = 32
MAC_LENGTH = 16
# Spec 0x01, "Resume proof" (revision 2): optional, after HELLO's token.
RESUME_PROOF_LENGTH = 16
RESUME_PROOF_LABEL = b"tokend-resume"


class FrameType(IntEnum):
    HELLO = 0x01
    WELCOME = 0x02
    HEARTBEAT = 0x03
    HEARTBEAT_ACK = 0x04
    BYE = 0x05
    NOTICE = 0x06


class CloseCode(IntEnum):
    """Close codes of the spec's table "Close codes"."""

    NORMAL = 1000
    GOING_AWAY = 1001
    MESSAGE_TOO_BIG = 1009
    INTERNAL_ERROR = 1011
    TRY_AGAIN_LATER = 1013
    HELLO_TIMEOUT = 4008
    RATE_LIMITED = 4029
    INVALID_TOKEN = 4501
    TOKEN_EXPIRED = 4502
    PROTOCOL_ERROR = 4503
    BAD_HEARTBEAT = 4504
    SESSION_EXPIRED = 4505
    TOKEN_REVOKED = 4506
    TAKEN_OVER = 4507
    SESSION_IN_USE = 4509

    def describe(self) -> str:
        """The code in words, e.g. "session expired" (the SDKs' ``meaning``)."""
        return _CLOSE_REASONS[self]

    @property
    def reason(self) -> str:
        """The close reason of a close ordered from elsewhere (a control message, a
        sweep), named like the session's own (docs/protocol.md §7)."""
        # Revoked: the word a HELLO on the revoked session's tombstone gets too.
        return "session_revoked" if self is CloseCode.TOKEN_REVOKED else self.name.lower()

    @property
    def reconnectable(self) -> bool:
        """True for the codes that invite a reconnect; the others end the token."""
        return self in RECONNECTABLE


_CLOSE_REASONS = {
    CloseCode.NORMAL: "bye",
    CloseCode.GOING_AWAY: "server going away",
    CloseCode.MESSAGE_TOO_BIG: "message too big",
    CloseCode.INTERNAL_ERROR: "internal error",
    CloseCode.TRY_AGAIN_LATER: "try again later",
    CloseCode.HELLO_TIMEOUT: "no HELLO in time",
    CloseCode.RATE_LIMITED: "rate limited",
    CloseCode.INVALID_TOKEN: "invalid token",
    CloseCode.TOKEN_EXPIRED: "token expired",
    CloseCode.PROTOCOL_ERROR: "protocol error",
    CloseCode.BAD_HEARTBEAT: "bad heartbeat proof",
    CloseCode.SESSION_EXPIRED: "session expired",
    CloseCode.TOKEN_REVOKED: "token revoked",
    CloseCode.TAKEN_OVER: "session taken over",
    CloseCode.SESSION_IN_USE: "session in use by another connection",
}

RECONNECTABLE = frozenset(
    {
        CloseCode.GOING_AWAY,
        CloseCode.INTERNAL_ERROR,
        CloseCode.TRY_AGAIN_LATER,
        CloseCode.HELLO_TIMEOUT,
        CloseCode.RATE_LIMITED,
        CloseCode.SESSION_IN_USE,
    }
)


class SessionState(IntEnum):
    """Session state as carried in WELCOME and NOTICE."""

    ACTIVE = 0
    WARN = 1


class ProtocolError(ValueError):
    """A message that is not a well-formed protocol v1 frame (close 4503)."""


# Flag bits of HEARTBEAT_ACK (spec 0x04).
ACK_RENEWED = 0x01
ACK_RESENT = 0x02
ACK_WAS_WARN = 0x04
# Flag bit of WELCOME (spec 0x02).
WELCOME_RESUMED = 0x01

_HELLO_HEAD = struct.Struct(">BBH")  # type, version, L
_WELCOME = struct.Struct(">BBBB16sQIII32s")
_HEARTBEAT_SIGNED = struct.Struct(">BB16sQQ")  # the 34 bytes covered by the mac
_HEARTBEAT_FIELDS = struct.Struct(">2x16sQQ")  # tid, seq, exp_ms: after type and flags
_ACK_HEAD = struct.Struct(">BBQQH")
_NOTICE = struct.Struct(">BB")

_ACK_TYPE = int(FrameType.HEARTBEAT_ACK)

HEARTBEAT_LENGTH = _HEARTBEAT_SIGNED.size + MAC_LENGTH  # 50
WELCOME_LENGTH = _WELCOME.size  # 72
ACK_HEAD_LENGTH = _ACK_HEAD.size  # 20


@dataclass(frozen=True, slots=True)
class Hello:
    token: str
    version: int = VERSION
    # Spec "Resume proof" (revision 2): 16 bytes, or None for a v1 HELLO without one.
    proof: bytes | None = None


@dataclass(frozen=True, slots=True)
class Welcome:
    tid: bytes
    exp_ms: int
    heartbeat_ms: int
    warn_ms: int
    expire_ms: int
    session_key: bytes
    resumed: bool = False
    state: SessionState = SessionState.ACTIVE


@dataclass(frozen=True, slots=True)
class Heartbeat:
    tid: bytes
    seq: int
    exp_ms: int
    mac: bytes

    def signed_part(self) -> bytes:
        """The frame's first 34 bytes, over which the mac is computed."""
        return _HEARTBEAT_SIGNED.pack(FrameType.HEARTBEAT, 0, self.tid, self.seq, self.exp_ms)

    def mac_is_valid(self, session_key: bytes) -> bool:
        """Constant-time check of the heartbeat proof (spec 0x03) of a frame object (the
        server checks the bytes as they came: :func:`heartbeat_proof_holds`)."""
        return hmac.compare_digest(self.mac, heartbeat_mac(session_key, self.signed_part()))


@dataclass(frozen=True, slots=True)
class HeartbeatAck:
    seq: int
    exp_ms: int
    token: str | None = None
    renewed: bool = False
    resent: bool = False
    was_warn: bool = False

    @property
    def flags(self) -> int:
        return (
            (ACK_RENEWED if self.renewed else 0)
            | (ACK_RESENT if self.resent else 0)
            | (ACK_WAS_WARN if self.was_warn else 0)
        )


@dataclass(frozen=True, slots=True)
class Bye:
    pass


@dataclass(frozen=True, slots=True)
class Notice:
    state: SessionState = SessionState.WARN


Frame = Hello | Welcome | Heartbeat | HeartbeatAck | Bye | Notice
CLIENT_FRAMES = (Hello, Heartbeat, Bye)
SERVER_FRAMES = (Welcome, HeartbeatAck, Notice)

_BYE = bytes([FrameType.BYE])


def heartbeat_mac(session_key: bytes, signed_part: bytes) -> bytes:
    """First 16 bytes of HMAC-SHA256(session key, the heartbeat's first 34 bytes)."""
    return hmac.digest(session_key, signed_part, "sha256")[:MAC_LENGTH]


# A HEARTBEAT message read as it came, without a Heartbeat object: the server's one
# message per interval per session (spec 0x03; decode() gives the same fields).


def is_heartbeat(data: bytes) -> bool:
    """Whether ``data`` is a well-formed HEARTBEAT (50 bytes, type 0x03, flags 0): what
    :func:`decode` would return as a :class:`Heartbeat`."""
    return len(data) == HEARTBEAT_LENGTH and data[0] == FrameType.HEARTBEAT and not data[1]


def heartbeat_mac_key(session_key: bytes) -> HeartbeatMacKey:
    """A session key made ready for :func:`heartbeat_proof_holds`: HMAC-SHA256's inner and
    outer hashes with the key's padded block already hashed (RFC 2104 section 2), made
    once per session. Each heartbeat then hashes one block for each, where a one-shot
    HMAC hashes two (and OpenSSL's looks its algorithm up by name every time)."""
    if len(session_key) > _SHA256_BLOCK:
        session_key = _sha256(session_key).digest()
    block = session_key.ljust(_SHA256_BLOCK, b"\0")
    return _sha256(block.translate(_IPAD)), _sha256(block.translate(_OPAD))


def heartbeat_proof_holds(data: bytes, mac_key: HeartbeatMacKey) -> bool:
    """Constant-time check of a well-formed HEARTBEAT's mac (spec 0x03), computed over
    its first 34 bytes as they came, with the session's :func:`heartbeat_mac_key`."""
    inner, outer = mac_key
    inner = inner.copy()
    inner.update(data[:_SIGNED_LENGTH])
    outer = outer.copy()
    outer.update(inner.digest())
    return compare_digest(data[_SIGNED_LENGTH:], outer.digest()[:MAC_LENGTH])


_SIGNED_LENGTH = _HEARTBEAT_SIGNED.size
# CPython's own SHA-256 (C, no OpenSSL): a copy of its state is a plain memory copy,
# where OpenSSL's allocates a context.


class Sha256(Protocol):
    """A SHA-256 in progress, as :func:`heartbeat_proof_holds` uses one."""

    def copy(self) -> Sha256: ...

    def update(self, data: bytes, /) -> None: ...

    def digest(self) -> bytes: ...


def _own_sha256() -> Callable[[bytes], Sha256]:
    for module in ("_sha256", "_sha2"):  # Python 3.11; 3.12 and later
        with contextlib.suppress(ImportError):
            found: Callable[[bytes], Sha256] = importlib.import_module(module).sha256
            return found
    return hashlib.sha256  # pragma: no cover - a build without them


_sha256 = _own_sha256()
_SHA256_BLOCK = 64
_IPAD = bytes(b ^ 0x36 for b in range(256))
_OPAD = bytes(b ^ 0x5C for b in range(256))
# What a session keeps of its key for its heartbeats' macs: the inner and outer hashes.
HeartbeatMacKey = tuple[Sha256, Sha256]
# A well-formed HEARTBEAT's (tid, seq, exp_ms): the struct's own method, no Python frame.
heartbeat_fields = _HEARTBEAT_FIELDS.unpack_from


def resume_proof(session_key: bytes, tid: bytes) -> bytes:
    """Spec "Resume proof": first 16 bytes of HMAC-SHA256(K, "tokend-resume" || tid), K the
    session key of the client's last WELCOME and tid the token's 16 raw bytes."""
    return hmac.digest(session_key, RESUME_PROOF_LABEL + tid, "sha256")[:RESUME_PROOF_LENGTH]


def make_heartbeat(session_key: bytes, tid: bytes, seq: int, exp_ms: int) -> Heartbeat:
    """Build a heartbeat with its proof, as a client does."""
    signed = _HEARTBEAT_SIGNED.pack(FrameType.HEARTBEAT, 0, tid, seq, exp_ms)
    return Heartbeat(tid, seq, exp_ms, heartbeat_mac(session_key, signed))


def encode(frame: Frame) -> bytes:
    """Serialize a frame. Raises :class:`ProtocolError` for values out of range."""
    try:
        match frame:
            case Heartbeat():
                if len(frame.mac) != MAC_LENGTH or len(frame.tid) != TID_LENGTH:
                    raise ProtocolError("heartbeat: tid is 16 bytes, mac 16 bytes")
                return frame.signed_part() + frame.mac
            case HeartbeatAck():
                return encode_ack(
                    frame.seq,
                    frame.exp_ms,
                    frame.token,
                    renewed=frame.renewed,
                    resent=frame.resent,
                    was_warn=frame.was_warn,
                )
            case Hello():
                token = frame.token.encode("ascii")
                if not 1 <= len(token) <= MAX_TOKEN_LENGTH:
                    raise ProtocolError("hello: token length must be 1..8192")
                proof = frame.proof
                if proof is not None and len(proof) != RESUME_PROOF_LENGTH:
                    raise ProtocolError("hello: a resume proof is 16 bytes")
                head = _HELLO_HEAD.pack(FrameType.HELLO, frame.version, len(token))
                return head + token + (proof or b"")
            case Welcome():
                if len(frame.tid) != TID_LENGTH or len(frame.session_key) != SESSION_KEY_LENGTH:
                    raise ProtocolError("welcome: tid is 16 bytes, session key 32 bytes")
                return _WELCOME.pack(
                    FrameType.WELCOME,
                    VERSION,
                    frame.state,
                    WELCOME_RESUMED if frame.resumed else 0,
                    frame.tid,
                    frame.exp_ms,
                    frame.heartbeat_ms,
                    frame.warn_ms,
                    frame.expire_ms,
                    frame.session_key,
                )
            case Bye():
                return _BYE
            case Notice():
                return _NOTICE.pack(FrameType.NOTICE, frame.state)
    except (struct.error, UnicodeEncodeError) as exc:
        raise ProtocolError(f"cannot encode {type(frame).__name__}: {exc}") from None
    raise ProtocolError(f"not a frame: {frame!r}")


def encode_plain_ack(seq: int, exp_ms: int, was_warn: bool) -> bytes:
    """:func:`encode_ack` of an ACK without a token (neither renewed nor re-sent): most
    ACKs, one per heartbeat."""
    try:
        return _ACK_HEAD.pack(_ACK_TYPE, ACK_WAS_WARN if was_warn else 0, seq, exp_ms, 0)
    except struct.error as exc:
        raise ProtocolError(f"cannot encode HeartbeatAck: {exc}") from None


# encode_plain_ack(seq, exp_ms, False), the common ACK, with no Python frame: the struct's
# own method with the type and flags bound, the token length (0) as two pad bytes. A
# client's seq and the store's exp_ms are 8-byte integers (out of range: struct.error).
_OK_ACK = struct.Struct(">BBQQ2x")
encode_ok_ack = functools.partial(_OK_ACK.pack, _ACK_TYPE, 0)


def encode_ack(
    seq: int,
    exp_ms: int,
    token: str | bytes | None = None,
    *,
    renewed: bool = False,
    resent: bool = False,
    was_warn: bool = False,
) -> bytes:
    """Serialize a HEARTBEAT_ACK (spec 0x04) without building the frame object first.

    The server sends one per heartbeat; :func:`encode` of a :class:`HeartbeatAck`
    comes here too, so there is one layout.
    """
    if token is None and not (renewed or resent):  # most ACKs: no token
        return encode_plain_ack(seq, exp_ms, was_warn)
    # A token the node signed comes as its ASCII bytes (TokenService.sign_as).
    raw = token if isinstance(token, bytes) else token.encode("ascii") if token else b""
    if bool(raw) != (renewed or resent):
        raise ProtocolError("ack: a token goes with the renewed or resent flag")
    if len(raw) > MAX_TOKEN_LENGTH:
        raise ProtocolError("ack: token longer than 8192 bytes")
    flags = (ACK_RENEWED if renewed else 0) | (ACK_RESENT if resent else 0)
    if was_warn:
        flags |= ACK_WAS_WARN
    try:
        return _ACK_HEAD.pack(FrameType.HEARTBEAT_ACK, flags, seq, exp_ms, len(raw)) + raw
    except struct.error as exc:
        raise ProtocolError(f"cannot encode HeartbeatAck: {exc}") from None


def decode(data: bytes) -> Frame:
    """Parse one binary message into a frame.

    The length must match the type's layout exactly, reserved flag bits must be
    zero, and enumerated fields must hold a defined value (spec "Frames").
    """
    if not data:
        raise ProtocolError("empty message")
    kind = data[0]
    size = len(data)
    if kind == FrameType.HEARTBEAT:
        if size != HEARTBEAT_LENGTH:
            raise ProtocolError(f"heartbeat is 50 bytes, got {size}")
        _, flags, tid, seq, exp_ms = _HEARTBEAT_SIGNED.unpack_from(data)
        if flags:
            raise ProtocolError("heartbeat flags must be 0")
        return Heartbeat(tid, seq, exp_ms, bytes(data[34:50]))
    if kind == FrameType.HELLO:
        if size < _HELLO_HEAD.size:
            raise ProtocolError("hello shorter than its header")
        _, version, length = _HELLO_HEAD.unpack_from(data)
        if version != VERSION:
            raise ProtocolError(f"unsupported protocol version {version}")
        end = _HELLO_HEAD.size + length
        # The token alone (v1), or the token and a resume proof (revision 2).
        if not 1 <= length <= MAX_TOKEN_LENGTH or size not in (end, end + RESUME_PROOF_LENGTH):
            raise ProtocolError("hello token length does not match the message")
        token = _ascii(data[4:end], "hello token")
        return Hello(token, version, bytes(data[end:]) if size > end else None)
    if kind == FrameType.HEARTBEAT_ACK:
        if size < ACK_HEAD_LENGTH:
            raise ProtocolError("ack shorter than its header")
        _, flags, seq, exp_ms, length = _ACK_HEAD.unpack_from(data)
        if flags & ~(ACK_RENEWED | ACK_RESENT | ACK_WAS_WARN):
            raise ProtocolError("ack has reserved flag bits set")
        if size != ACK_HEAD_LENGTH + length or length > MAX_TOKEN_LENGTH:
            raise ProtocolError("ack token length does not match the message")
        carries_token = bool(flags & (ACK_RENEWED | ACK_RESENT))
        if carries_token != (length > 0):
            raise ProtocolError("ack token present without its flag, or flag without token")
        return HeartbeatAck(
            seq,
            exp_ms,
            _ascii(data[20:], "ack token") if length else None,
            renewed=bool(flags & ACK_RENEWED),
            resent=bool(flags & ACK_RESENT),
            was_warn=bool(flags & ACK_WAS_WARN),
        )
    if kind == FrameType.WELCOME:
        if size != WELCOME_LENGTH:
            raise ProtocolError(f"welcome is 72 bytes, got {size}")
        _, version, state, flags, tid, exp_ms, hb, warn, expire, key = _WELCOME.unpack(data)
        if version != VERSION or state != SessionState.ACTIVE or flags & ~WELCOME_RESUMED:
            raise ProtocolError("welcome has an unknown version, state or flag")
        return Welcome(tid, exp_ms, hb, warn, expire, key, resumed=bool(flags & WELCOME_RESUMED))
    if kind == FrameType.BYE:
        if size != 1:
            raise ProtocolError(f"bye is 1 byte, got {size}")
        return Bye()
    if kind == FrameType.NOTICE:
        if size != _NOTICE.size:
            raise ProtocolError(f"notice is 2 bytes, got {size}")
        if data[1] != SessionState.WARN:
            raise ProtocolError(f"notice with unknown state {data[1]}")
        return Notice(SessionState.WARN)
    raise ProtocolError(f"unknown frame type 0x{kind:02x}")


def _ascii(raw: bytes, what: str) -> str:
    try:
        return bytes(raw).decode("ascii")
    except UnicodeDecodeError:
        raise ProtocolError(f"{what} is not ASCII") from None
