"""The handoff format: what an old worker tells the new worker of its slot about each live
connection it hands over in a rolling reload, and the new worker's answer. Pure: bytes in,
records out (the socket, the file descriptors and the store's move are the server's,
:mod:`tokend.server.handoff`).

A *batch* is one message: up to :data:`MAX_BATCH` connections, whose descriptors travel
beside it (SCM_RIGHTS, in the same order). Each record holds what the new worker needs to
go on with the connection at a frame boundary: the session (its claims, key, last seq,
clocks, exp, the digest of the token the store has yet to keep, the connection id that
holds it in the store now), the bytes read from the socket and not parsed yet, a binary
message whose first fragments came, and the client's address as the connection knew it
(a PROXY header's, or the TCP peer's). The session key travels here and nowhere else: never
to a log, never to a disk (the socketpair is in memory, between two processes of one user).

Every message begins with the same 10 bytes in every version: a magic, the version, the
batch number. A new worker that does not speak a batch's version can still read which
batch it is, and refuses it whole (:attr:`BatchStatus.UNKNOWN_VERSION`); the old worker
keeps those connections and closes them the usual way (1001, resume).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import Any

from tokend.core.claims import Claims, Tid
from tokend.core.session import Cadence, Host, Phase, Session, TokenBucket

HANDOFF_VERSION = 1
# Linux's SCM_MAX_FD: the most descriptors one message may carry.
MAX_BATCH = 253
BATCH_MAGIC = b"tkho"
REPLY_MAGIC = b"tkha"
# Magic, version (u16), batch number (u32): the same in every version.
_HEAD = struct.Struct("!4sHI")
_COUNT = struct.Struct("!H")
_LENGTH = struct.Struct("!I")
# The claims' iat and exp, since_ms, last_seq, exp_ms, iat_s, token_exp_ms; prio, flags.
_NUMBERS = struct.Struct("!qqqQqqqBB")
# A clock reading, or a rate bucket (allowance, last taken).
_CLOCK = struct.Struct("!d")
_BUCKET = struct.Struct("!dd")
_PEER_PORT = struct.Struct("!H")
_FLAG_RESUMED, _FLAG_WARNED, _FLAG_CADENCED, _FLAG_HEARTBEAT = 1, 2, 4, 8
_FLAG_FRAMES, _FLAG_PEER, _FLAG_FRAGMENTS, _FLAG_PINGS = 16, 32, 64, 128


class HandoffFormatError(ValueError):
    """A message that is not a handoff message of the version it says it is."""


class FallbackReason(Enum):
    """Why a connection was not handed over, but closed the usual way (1001, resume)."""

    TLS = "tls"  # Python's ssl cannot export a TLS session's state
    BEFORE_WELCOME = "before_welcome"  # its opening or HELLO did not finish in time
    NOT_QUIET = "not_quiet"  # store answers or unsent bytes still pending
    UNKNOWN_VERSION = "unknown_version"  # the new worker does not speak this format
    NEW_WORKER_FAILED = "new_worker_failed"  # it refused, died or did not answer in time
    STORE_UNAVAILABLE = "store_unavailable"  # the new worker could not take the sessions
    NOT_HELD = "not_held"  # the session ended or moved to another connection meanwhile


class BatchStatus(IntEnum):
    """The new worker's answer to a whole batch."""

    READ = 0  # each record has its own outcome
    UNKNOWN_VERSION = 1
    REFUSED = 2  # the new worker takes nothing (it is stopping)


class Taken(IntEnum):
    """The new worker's answer to one record of a batch it read."""

    TAKEN = 0  # the session is the new worker's in the store, the socket too
    NOT_HELD = 1  # the store says the old connection no longer holds it
    STORE_UNAVAILABLE = 2


@dataclass(frozen=True, slots=True)
class SessionState:
    """What a :class:`Session` needs to go on in another process (its OPEN phase only).

    ``last_beat`` and ``frames`` are CLOCK_MONOTONIC readings (``time.monotonic``), one
    clock for every process of the machine. ``stored_token`` is the digest of a token
    this connection was given that the store has yet to keep (the next heartbeat's)."""

    conn: str
    since_ms: int
    claims: Claims
    key: bytes
    last_seq: int
    last_beat: float  # -inf: no heartbeat on this connection yet
    cadenced: bool
    exp_ms: int
    iat_s: int
    token_exp_ms: int
    signed_digest: str
    stored_token: str
    resumed: bool
    warned: bool
    frames: tuple[float, float] | None  # the frame rate bucket: allowance, last taken


@dataclass(frozen=True, slots=True)
class Moving:
    """One connection handed over: its session, and the connection's own state."""

    session: SessionState
    peer: tuple[str, int] | None  # the client's address and port (a PROXY header's)
    unparsed: bytes  # read from the socket, not yet a whole frame
    fragments: bytes | None  # a binary message under way: its fragments so far
    pings: tuple[float, float] | None  # the ping rate bucket: allowance, last taken


@dataclass(frozen=True, slots=True)
class Batch:
    number: int
    records: list[Moving]


@dataclass(frozen=True, slots=True)
class Reply:
    number: int
    status: BatchStatus
    taken: list[Taken]


# The session core, out and in


def export_session(session: Session, stored_token: str) -> SessionState:
    """The state of an OPEN ``session`` with nothing pending (no heartbeat unanswered)."""
    claims = session.claims
    assert session.phase is Phase.OPEN and claims is not None and not session.unanswered
    frames = session.frames
    return SessionState(
        conn=session.conn,
        since_ms=session.since_ms,
        claims=claims,
        key=session.key,
        last_seq=session.last_seq,
        last_beat=session.last_beat,
        cadenced=session.cadenced,
        exp_ms=session.exp_ms,
        iat_s=session.iat_s,
        token_exp_ms=session.token_exp_ms,
        signed_digest=session.signed_digest,
        stored_token=stored_token,
        resumed=session.resumed,
        warned=session.warned,
        frames=(frames.allowance, frames.checked) if frames is not None else None,
    )


def adopt_session(
    state: SessionState,
    host: Host,
    cadence: Cadence,
    conn: str,
    since_ms: int,
    clock: Callable[[], float],
) -> Session:
    """A session OPEN on connection ``conn`` (which took it in the store at ``since_ms``),
    going on from ``state``: the same key, seq rules, clocks and token."""
    session = Session(host, cadence, conn, clock)
    session.phase = Phase.OPEN
    session.claims = state.claims
    session.tid_bytes = state.claims.tid.bytes
    session.key = state.key
    session.last_seq = state.last_seq
    session.last_beat = state.last_beat
    session.cadenced = state.cadenced
    session.exp_ms = state.exp_ms
    session.iat_s = state.iat_s
    session.token_exp_ms = state.token_exp_ms
    session.signed_digest = state.signed_digest
    session.resumed = state.resumed
    session.warned = state.warned
    session.since_ms = since_ms
    if cadence.max_frame_rate:
        session.frames = bucket(cadence.max_frame_rate, state.frames, clock())
    return session


def bucket(rate: float, state: tuple[float, float] | None, now: float) -> TokenBucket:
    """A rate bucket going on from ``state`` (a fresh one without)."""
    frames = TokenBucket(rate, now)
    if state is not None:
        frames.allowance, frames.checked = min(frames.burst, state[0]), state[1]
    return frames


# Batches


def encode_batch(number: int, records: Sequence[Moving], version: int = HANDOFF_VERSION) -> bytes:
    """One batch message (its descriptors go beside it, in the same order)."""
    if len(records) > MAX_BATCH:
        raise ValueError(f"a batch holds at most {MAX_BATCH} connections")
    parts = [_HEAD.pack(BATCH_MAGIC, version, number), _COUNT.pack(len(records))]
    for record in records:
        body = _record(record)
        parts += [_LENGTH.pack(len(body)), body]
    return b"".join(parts)


def batch_number(data: bytes) -> tuple[int, int]:
    """(version, batch number) of a batch message of any version."""
    if len(data) < _HEAD.size:
        raise HandoffFormatError("shorter than a handoff message's head")
    magic, version, number = _HEAD.unpack_from(data)
    if magic != BATCH_MAGIC:
        raise HandoffFormatError("not a handoff batch")
    return version, number


def decode_batch(data: bytes) -> Batch:
    """A batch of the version this module speaks; HandoffFormatError otherwise (read the
    batch number with :func:`batch_number` to refuse it)."""
    version, number = batch_number(data)
    if version != HANDOFF_VERSION:
        raise HandoffFormatError(f"handoff version {version}: this worker speaks {HANDOFF_VERSION}")
    reader = _Reader(data, _HEAD.size)
    (count,) = reader.unpack(_COUNT)
    records = []
    for _ in range(count):
        (length,) = reader.unpack(_LENGTH)
        records.append(_read_record(_Reader(reader.take(length))))
    if reader.offset != len(data):
        raise HandoffFormatError("bytes after the last record")
    return Batch(number, records)


def _record(record: Moving) -> bytes:
    s = record.session
    c = s.claims
    flags = (
        (_FLAG_RESUMED if s.resumed else 0)
        | (_FLAG_WARNED if s.warned else 0)
        | (_FLAG_CADENCED if s.cadenced else 0)
        | (_FLAG_HEARTBEAT if s.last_beat != -math.inf else 0)
        | (_FLAG_FRAMES if s.frames is not None else 0)
        | (_FLAG_PEER if record.peer is not None else 0)
        | (_FLAG_FRAGMENTS if record.fragments is not None else 0)
        | (_FLAG_PINGS if record.pings is not None else 0)
    )
    parts = [
        c.tid.bytes,
        _NUMBERS.pack(
            c.iat, c.exp, s.since_ms, s.last_seq, s.exp_ms, s.iat_s, s.token_exp_ms, c.prio, flags
        ),
        _CLOCK.pack(s.last_beat if flags & _FLAG_HEARTBEAT else 0.0),
        _BUCKET.pack(*(s.frames or (0.0, 0.0))),
        _BUCKET.pack(*(record.pings or (0.0, 0.0))),
    ]
    for text in (s.conn, c.sub, s.signed_digest, s.stored_token):
        parts.append(_short(text.encode()))
    parts.append(_short(s.key))
    if record.peer is not None:
        parts += [_short(record.peer[0].encode()), _PEER_PORT.pack(record.peer[1])]
    parts += [_LENGTH.pack(len(record.unparsed)), record.unparsed]
    if record.fragments is not None:
        parts += [_LENGTH.pack(len(record.fragments)), record.fragments]
    return b"".join(parts)


def _read_record(reader: _Reader) -> Moving:
    tid = Tid(str(_uuid(reader.take(16))))
    iat, exp, since_ms, last_seq, exp_ms, iat_s, token_exp_ms, prio, flags = reader.unpack(_NUMBERS)
    (last_beat,) = reader.unpack(_CLOCK)
    allowance, checked = reader.unpack(_BUCKET)
    ping_allowance, ping_checked = reader.unpack(_BUCKET)
    conn, sub, signed_digest, stored_token = (reader.short().decode() for _ in range(4))
    key = reader.short()
    peer = None
    if flags & _FLAG_PEER:
        host = reader.short().decode()
        peer = (host, reader.unpack(_PEER_PORT)[0])
    unparsed = reader.take(reader.unpack(_LENGTH)[0])
    fragments = reader.take(reader.unpack(_LENGTH)[0]) if flags & _FLAG_FRAGMENTS else None
    if reader.offset != len(reader.data):
        raise HandoffFormatError("bytes after a record's last field")
    session = SessionState(
        conn=conn,
        since_ms=since_ms,
        claims=Claims(tid, sub, iat, exp, prio),
        key=key,
        last_seq=last_seq,
        last_beat=last_beat if flags & _FLAG_HEARTBEAT else -math.inf,
        cadenced=bool(flags & _FLAG_CADENCED),
        exp_ms=exp_ms,
        iat_s=iat_s,
        token_exp_ms=token_exp_ms,
        signed_digest=signed_digest,
        stored_token=stored_token,
        resumed=bool(flags & _FLAG_RESUMED),
        warned=bool(flags & _FLAG_WARNED),
        frames=(allowance, checked) if flags & _FLAG_FRAMES else None,
    )
    return Moving(
        session=session,
        peer=peer,
        unparsed=unparsed,
        fragments=fragments,
        pings=(ping_allowance, ping_checked) if flags & _FLAG_PINGS else None,
    )


# Replies


def encode_reply(
    number: int, status: BatchStatus, taken: Sequence[Taken] = (), version: int = HANDOFF_VERSION
) -> bytes:
    """The new worker's answer to batch ``number``."""
    return b"".join(
        [
            _HEAD.pack(REPLY_MAGIC, version, number),
            bytes([status]),
            _COUNT.pack(len(taken)),
            bytes(taken),
        ]
    )


def decode_reply(data: bytes) -> Reply:
    if len(data) < _HEAD.size + 1 + _COUNT.size:
        raise HandoffFormatError("shorter than a handoff reply")
    magic, _, number = _HEAD.unpack_from(data)
    if magic != REPLY_MAGIC:
        raise HandoffFormatError("not a handoff reply")
    reader = _Reader(data, _HEAD.size)
    try:
        status = BatchStatus(reader.take(1)[0])
        (count,) = reader.unpack(_COUNT)
        taken = [Taken(value) for value in reader.take(count)]
    except ValueError as exc:
        raise HandoffFormatError(f"handoff reply: {exc}") from None
    if reader.offset != len(data):
        raise HandoffFormatError("bytes after a handoff reply")
    return Reply(number, status, taken)


# Reading and writing fields


def _short(value: bytes) -> bytes:
    if len(value) > 0xFFFF:
        raise ValueError("a field of a handoff record holds at most 65,535 bytes")
    return _PEER_PORT.pack(len(value)) + value


def _uuid(raw: bytes) -> str:
    h = raw.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


class _Reader:
    __slots__ = ("data", "offset")

    def __init__(self, data: bytes, offset: int = 0) -> None:
        self.data = data
        self.offset = offset

    def take(self, n: int) -> bytes:
        end = self.offset + n
        if end > len(self.data):
            raise HandoffFormatError("a handoff message cut short")
        value = self.data[self.offset : end]
        self.offset = end
        return value

    def unpack(self, layout: struct.Struct) -> tuple[Any, ...]:
        return layout.unpack(self.take(layout.size))

    def short(self) -> bytes:
        return self.take(self.unpack(_PEER_PORT)[0])
