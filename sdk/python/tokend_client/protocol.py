"""Protocol v1 frames as a client speaks them: HELLO, HEARTBEAT and BYE encoded,
WELCOME, HEARTBEAT_ACK and NOTICE decoded, and the close codes. No I/O.

Every integer is unsigned big-endian, every time Unix epoch milliseconds (the spec's
"Frames"). :func:`decode` raises nothing but :class:`ProtocolError`, whatever the input.
The server keeps its own codec of both directions; a differential test holds the two to
the same bytes (tests/test_client_codec.py).
"""

from __future__ import annotations

import hmac
import struct
from dataclasses import dataclass
from enum import IntEnum

VERSION = 1
SUBPROTOCOL = "tokend.v1"
WS_PATH = "/v1/ws"
MAX_TOKEN_LENGTH = 8192
TID_LENGTH = 16
SESSION_KEY_LENGTH = 32
MAC_LENGTH = 16
# Spec 0x01, "Resume proof": optional, after HELLO's token.
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
        """The code in words, e.g. "session expired" (an error's ``meaning``)."""
        return _CLOSE_MEANINGS[self]


_CLOSE_MEANINGS = {
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

# The codes that invite a reconnect; every other code ends the session.
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
    """A message that is not a well-formed protocol v1 frame of the server's."""


# Flag bits of HEARTBEAT_ACK (spec 0x04) and WELCOME (spec 0x02).
ACK_RENEWED = 0x01
ACK_RESENT = 0x02
ACK_WAS_WARN = 0x04
WELCOME_RESUMED = 0x01

_HELLO_HEAD = struct.Struct(">BBH")  # type, version, token length
_HEARTBEAT_SIGNED = struct.Struct(">BB16sQQ")  # the 34 bytes the mac covers
_WELCOME = struct.Struct(">BBBB16sQIII32s")
_ACK_HEAD = struct.Struct(">BBQQH")
_NOTICE = struct.Struct(">BB")

HEARTBEAT_LENGTH = _HEARTBEAT_SIGNED.size + MAC_LENGTH  # 50
WELCOME_LENGTH = _WELCOME.size  # 72
ACK_HEAD_LENGTH = _ACK_HEAD.size  # 20


# What a client sends.


@dataclass(frozen=True, slots=True)
class Hello:
    token: str
    version: int = VERSION
    # Spec "Resume proof": 16 bytes, or None for a HELLO without one.
    proof: bytes | None = None


@dataclass(frozen=True, slots=True)
class Heartbeat:
    tid: bytes
    seq: int
    exp_ms: int
    mac: bytes


@dataclass(frozen=True, slots=True)
class Bye:
    pass


# What a server sends.


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
class HeartbeatAck:
    seq: int
    exp_ms: int
    token: str | None = None
    renewed: bool = False
    resent: bool = False
    was_warn: bool = False


@dataclass(frozen=True, slots=True)
class Notice:
    state: SessionState = SessionState.WARN


ClientFrame = Hello | Heartbeat | Bye
ServerFrame = Welcome | HeartbeatAck | Notice


def heartbeat_signed_part(tid: bytes, seq: int, exp_ms: int) -> bytes:
    """A heartbeat's first 34 bytes, over which its mac is computed."""
    return _HEARTBEAT_SIGNED.pack(FrameType.HEARTBEAT, 0, tid, seq, exp_ms)


def make_heartbeat(session_key: bytes, tid: bytes, seq: int, exp_ms: int) -> Heartbeat:
    """A heartbeat with its proof (spec 0x03): the first 16 bytes of HMAC-SHA256(session
    key, the frame's first 34 bytes)."""
    signed = heartbeat_signed_part(tid, seq, exp_ms)
    return Heartbeat(tid, seq, exp_ms, hmac.digest(session_key, signed, "sha256")[:MAC_LENGTH])


def resume_proof(session_key: bytes, tid: bytes) -> bytes:
    """Spec "Resume proof": first 16 bytes of HMAC-SHA256(K, "tokend-resume" || tid), K the
    session key of the client's last WELCOME and tid the token's 16 raw bytes."""
    return hmac.digest(session_key, RESUME_PROOF_LABEL + tid, "sha256")[:RESUME_PROOF_LENGTH]


def encode(frame: ClientFrame) -> bytes:
    """A client frame's bytes. Raises :class:`ProtocolError` for values out of range."""
    try:
        match frame:
            case Heartbeat():
                if len(frame.mac) != MAC_LENGTH or len(frame.tid) != TID_LENGTH:
                    raise ProtocolError("heartbeat: tid is 16 bytes, mac 16 bytes")
                return heartbeat_signed_part(frame.tid, frame.seq, frame.exp_ms) + frame.mac
            case Hello():
                token = frame.token.encode("ascii")
                if not 1 <= len(token) <= MAX_TOKEN_LENGTH:
                    raise ProtocolError("hello: token length must be 1..8192")
                if frame.proof is not None and len(frame.proof) != RESUME_PROOF_LENGTH:
                    raise ProtocolError("hello: a resume proof is 16 bytes")
                head = _HELLO_HEAD.pack(FrameType.HELLO, frame.version, len(token))
                return head + token + (frame.proof or b"")
            case Bye():
                return bytes([FrameType.BYE])
    except (struct.error, UnicodeEncodeError) as exc:
        raise ProtocolError(f"cannot encode {type(frame).__name__}: {exc}") from None
    raise ProtocolError(f"not a client frame: {frame!r}")


_CLIENT_FRAME_NAMES = {
    FrameType.HELLO: "Hello",
    FrameType.HEARTBEAT: "Heartbeat",
    FrameType.BYE: "Bye",
}


def decode(data: bytes) -> ServerFrame:
    """One binary message of the server's, parsed.

    The length must match the type's layout exactly, reserved flag bits must be zero,
    and enumerated fields must hold a defined value (spec "Frames").
    """
    if not data:
        raise ProtocolError("empty message")
    kind = data[0]
    size = len(data)
    if kind == FrameType.HEARTBEAT_ACK:
        if size < ACK_HEAD_LENGTH:
            raise ProtocolError("ack shorter than its header")
        _, flags, seq, exp_ms, length = _ACK_HEAD.unpack_from(data)
        if flags & ~(ACK_RENEWED | ACK_RESENT | ACK_WAS_WARN):
            raise ProtocolError("ack has reserved flag bits set")
        if size != ACK_HEAD_LENGTH + length or length > MAX_TOKEN_LENGTH:
            raise ProtocolError("ack token length does not match the message")
        if bool(flags & (ACK_RENEWED | ACK_RESENT)) != (length > 0):
            raise ProtocolError("ack token present without its flag, or flag without token")
        return HeartbeatAck(
            seq,
            exp_ms,
            _ascii(data[ACK_HEAD_LENGTH:], "ack token") if length else None,
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
    if kind == FrameType.NOTICE:
        if size != _NOTICE.size:
            raise ProtocolError(f"notice is 2 bytes, got {size}")
        if data[1] != SessionState.WARN:
            raise ProtocolError(f"notice with unknown state {data[1]}")
        return Notice(SessionState.WARN)
    if kind in _CLIENT_FRAME_NAMES:
        raise ProtocolError(f"client frame {_CLIENT_FRAME_NAMES[FrameType(kind)]} from the server")
    raise ProtocolError(f"unknown frame type 0x{kind:02x}")


def _ascii(raw: bytes, what: str) -> str:
    try:
        return bytes(raw).decode("ascii")
    except UnicodeDecodeError:
        raise ProtocolError(f"{what} is not ASCII") from None
