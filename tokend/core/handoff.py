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
from enum import Enum, IntEnum
from typing import NamedTuple

from tokend.core.claims import Claims, Tid
from tokend.core.session import Cadence, Node, Phase, Session, TokenBucket

HANDOFF_VERSION = 1
# Linux's SCM_MAX_FD: the most descriptors one message may carry.
MAX_BATCH = 253
BATCH_MAGIC = b"tkho"
REPLY_MAGIC = b"tkha"
# Magic, version (u16), batch number (u32): the same in every version.
_HEAD = struct.Struct("!4sHI")
_COUNT = struct.Struct("!H")
_FLAG_RESUMED, _FLAG_WARNED, _FLAG_CADENCED, _FLAG_HEARTBEAT = 1, 2, 4, 8
_FLAG_FRAMES, _FLAG_PEER, _FLAG_FRAGMENTS, _FLAG_PINGS = 16, 32, 64, 128
_OPEN = Phase.OPEN  # a module global: an Enum class's attribute is a slow read on 3.11


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
    CLOSING = "closing"  # the connection was already closing: it ends as it was going to


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


class Moving(NamedTuple):
    """One connection handed over: its session, and the connection's own state.

    The old worker's session goes as it is (:func:`encode_batch` reads it: OPEN, no
    heartbeat unanswered); :func:`decode_batch` makes the new worker's, OPEN, with the
    same key, seq rules, clocks and token, its ``conn`` and ``since_ms`` still the old
    connection's (the store's move names them) until the new worker sets its own.
    ``last_beat`` and the rate buckets' times are CLOCK_MONOTONIC readings
    (``time.monotonic``), one clock for every process of the machine."""

    session: Session
    stored_token: str  # the digest of a token it was given that the store has yet to keep
    peer: tuple[str, int] | None  # the client's address and port (a PROXY header's)
    unparsed: bytes  # read from the socket, not yet a whole frame
    fragments: bytes | None  # a binary message under way: its fragments so far
    pings: tuple[float, float] | None  # the ping rate bucket: allowance, last taken
    family: int = 0  # the socket's address family (AF_INET, AF_INET6); 0: unknown


class Batch(NamedTuple):
    number: int
    records: list[Moving]


class Reply(NamedTuple):
    number: int
    status: BatchStatus
    taken: list[Taken]


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
    head = [_HEAD.pack(BATCH_MAGIC, version, number), _COUNT.pack(len(records))]
    return b"".join(head + [_record(record) for record in records])


def batch_number(data: bytes) -> tuple[int, int]:
    """(version, batch number) of a batch message of any version."""
    if len(data) < _HEAD.size:
        raise HandoffFormatError("shorter than a handoff message's head")
    magic, version, number = _HEAD.unpack_from(data)
    if magic != BATCH_MAGIC:
        raise HandoffFormatError("not a handoff batch")
    return version, number


def decode_batch(data: bytes, node: Node, cadence: Cadence, clock: Callable[[], float]) -> Batch:
    """A batch of the version this module speaks, its sessions made for ``node`` and
    ``cadence`` (:class:`Moving`); HandoffFormatError otherwise (read the batch number
    with :func:`batch_number` to refuse it)."""
    version, number = batch_number(data)
    if version != HANDOFF_VERSION:
        raise HandoffFormatError(f"handoff version {version}: this worker speaks {HANDOFF_VERSION}")
    end = len(data)
    offset = _HEAD.size + _COUNT.size
    if offset > end:
        raise HandoffFormatError("a handoff message cut short")
    (count,) = _COUNT.unpack_from(data, _HEAD.size)
    reader = _Reader(node, cadence, clock)
    records = []
    try:
        for _ in range(count):
            record, offset = reader.record(data, offset)
            records.append(record)
    except struct.error:
        raise HandoffFormatError("a handoff message cut short") from None
    if offset != end:
        raise HandoffFormatError("a handoff message cut short, or bytes after its last record")
    return Batch(number, records)


# A record: the fixed fields (_RECORD), then the variable ones in this order, each as long
# as the fixed part says: the tid's text, conn, sub, the two digests, the key, the peer's
# host, unparsed, fragments.
_RECORD = struct.Struct("!qqqQqqqBBBdddddHHHHHHHHII")


def _record(record: Moving) -> bytes:
    s = record.session
    c = s.claims
    assert s.phase is _OPEN and c is not None and not s.unanswered
    frames, pings, peer, fragments = s.frames, record.pings, record.peer, record.fragments
    last_beat = s.last_beat
    flags = _FLAG_RESUMED * s.resumed + _FLAG_WARNED * s.warned + _FLAG_CADENCED * s.cadenced
    if last_beat != -math.inf:
        flags |= _FLAG_HEARTBEAT
    else:
        last_beat = 0.0
    if frames is not None:
        flags |= _FLAG_FRAMES
        allowance, checked = frames.allowance, frames.checked
    else:
        allowance = checked = 0.0
    if pings is not None:
        flags |= _FLAG_PINGS
        ping_allowance, ping_checked = pings
    else:
        ping_allowance = ping_checked = 0.0
    if peer is not None:
        flags |= _FLAG_PEER
        host, port = peer[0].encode(), peer[1]
    else:
        host, port = b"", 0
    if fragments is not None:
        flags |= _FLAG_FRAGMENTS
    else:
        fragments = b""
    tid = str(c.tid).encode()
    conn, sub = s.conn.encode(), c.sub.encode()
    signed, stored = s.signed_digest.encode(), record.stored_token.encode()
    key, unparsed = s.key, record.unparsed
    try:
        head = _RECORD.pack(
            c.iat,
            c.exp,
            s.since_ms,
            s.last_seq,
            s.exp_ms,
            s.iat_s,
            s.token_exp_ms,
            c.prio,
            flags,
            record.family,
            last_beat,
            allowance,
            checked,
            ping_allowance,
            ping_checked,
            port,
            len(tid),
            len(conn),
            len(sub),
            len(signed),
            len(stored),
            len(key),
            len(host),
            len(unparsed),
            len(fragments),
        )
    except struct.error:  # a length past its field's size (65,535 bytes for the short ones)
        raise ValueError("a field of a handoff record is too long") from None
    return b"".join((head, tid, conn, sub, signed, stored, key, host, unparsed, fragments))


class _Reader:
    """Reads records straight into the sessions they hand over: no state object between."""

    __slots__ = ("cadence", "clock", "node", "now", "rate")

    def __init__(self, node: Node, cadence: Cadence, clock: Callable[[], float]) -> None:
        self.node = node
        self.cadence = cadence
        self.clock = clock
        self.rate = cadence.max_frame_rate
        self.now = clock() if self.rate else 0.0  # the fresh frame buckets' start

    def record(self, data: bytes, offset: int) -> tuple[Moving, int]:
        (
            iat,
            exp,
            since_ms,
            last_seq,
            exp_ms,
            iat_s,
            token_exp_ms,
            prio,
            flags,
            family,
            last_beat,
            allowance,
            checked,
            ping_allowance,
            ping_checked,
            port,
            tid_n,
            conn_n,
            sub_n,
            signed_n,
            stored_n,
            key_n,
            host_n,
            unparsed_n,
            fragments_n,
        ) = _RECORD.unpack_from(data, offset)
        # Each field's end, from the last one's: one slice per field.
        at = offset + _RECORD.size
        end = at + tid_n + conn_n + sub_n + signed_n + stored_n + key_n + host_n
        end += unparsed_n + fragments_n
        if end > len(data):
            raise HandoffFormatError("a handoff message cut short")
        tid = data[at : (at := at + tid_n)]
        conn = data[at : (at := at + conn_n)]
        sub = data[at : (at := at + sub_n)]
        signed = data[at : (at := at + signed_n)]
        stored = data[at : (at := at + stored_n)]
        key = data[at : (at := at + key_n)]
        host = data[at : (at := at + host_n)]
        unparsed = data[at : (at := at + unparsed_n)]
        try:
            session = Session(self.node, self.cadence, conn.decode(), self.clock)
            claims = session.claims = Claims(Tid(tid.decode()), sub.decode(), iat, exp, prio)
            session.signed_digest = signed.decode()
            stored_token = stored.decode()
            peer = (host.decode(), port) if flags & _FLAG_PEER else None
        except ValueError as exc:  # not UTF-8, not a UUID
            raise HandoffFormatError(f"a handoff record's field: {exc}") from None
        session.phase = _OPEN
        session.tid_bytes = claims.tid.bytes
        session.key = key
        session.last_seq = last_seq
        if flags & _FLAG_HEARTBEAT:
            session.last_beat = last_beat
        session.cadenced = bool(flags & _FLAG_CADENCED)
        session.exp_ms = exp_ms
        session.iat_s = iat_s
        session.token_exp_ms = token_exp_ms
        session.resumed = bool(flags & _FLAG_RESUMED)
        session.warned = bool(flags & _FLAG_WARNED)
        session.since_ms = since_ms
        rate = self.rate
        if rate and flags & _FLAG_FRAMES:  # bucket(), without a tuple and a call
            frames = session.frames = TokenBucket(rate, checked)
            frames.allowance = min(frames.burst, allowance)
        elif rate:
            session.frames = TokenBucket(rate, self.now)
        moving = Moving(
            session,
            stored_token,
            peer,
            unparsed,
            data[at:end] if flags & _FLAG_FRAGMENTS else None,
            (ping_allowance, ping_checked) if flags & _FLAG_PINGS else None,
            family,
        )
        return moving, end


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
    offset = _HEAD.size
    (count,) = _COUNT.unpack_from(data, offset + 1)
    if len(data) != offset + 1 + _COUNT.size + count:
        raise HandoffFormatError("a handoff reply cut short, or bytes after it")
    try:
        status = BatchStatus(data[offset])
        # By index, not Taken(value): an Enum's call costs more than the rest per record.
        taken = [_TAKEN[value] for value in data[offset + 1 + _COUNT.size :]]
    except (ValueError, IndexError) as exc:
        raise HandoffFormatError(f"handoff reply: {exc}") from None
    return Reply(number, status, taken)


_TAKEN = tuple(sorted(Taken))  # each at the index of its value (0, 1, 2)
