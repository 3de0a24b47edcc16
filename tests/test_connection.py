"""The heartbeat fast path of tokend/connection.py against websockets' own parser.

``Connection.data_received`` unmasks a read that is exactly one whole heartbeat frame
itself when websockets' parser waits for the start of a frame. These tests feed the
same bytes, cut at every kind of place, to a connection with the fast path and to one
without it, and require the same messages handed on, in the same order, the same
bytes written back (pongs, close frames) and the same protocol state: split frames
(inside the header, the masking key, the payload), several frames coalesced in one
read, fragmented messages, control frames between fragments, text, unmasked frames,
and masking keys chosen to look like a heartbeat frame's first bytes.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from websockets.frames import Close, Frame, Opcode
from websockets.protocol import State

from tokend import config
from tokend import protocol as p
from tokend.connection import HEARTBEAT_FRAME_LENGTH, Connection, TokendProtocol, binary_frame
from tokend.metrics import Metrics
from tokend.session import Cadence, Session

SETTINGS = config.load({"max_frame_rate": 0}, environ={})


class Transport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def is_reading(self) -> bool:
        return True

    def can_write_eof(self) -> bool:
        return True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 40000) if name == "peername" else default

    def write_eof(self) -> None:
        self.written.append(b"<EOF>")

    def close(self) -> None:
        self.closed = True

    abort = close


class Node:
    name = "test"
    metrics = Metrics()


class Gate:
    settings = SETTINGS
    origins = None
    cadence = Cadence(1000, 3000, 4000, 0)
    node = Node


class Recording(Connection):
    """An OPEN connection that records each message instead of handing it to a session."""

    __slots__ = ("fast", "messages")

    def __init__(self, fast: bool) -> None:
        super().__init__(Gate)  # type: ignore[arg-type]
        self.fast = fast
        self.messages: list[tuple[str, bytes]] = []
        self.ws = TokendProtocol(state=State.OPEN, max_size=SETTINGS.max_message_size)
        self.transport = Transport()  # type: ignore[assignment]
        self.session = Session(None, Gate.cadence, "test/1", time.monotonic)  # type: ignore[arg-type]
        self.aligned = fast

    @property
    def fast_path(self) -> bool:
        return self.fast

    def _message(self, data: Any) -> None:
        self.messages.append(("binary", bytes(data)))

    def _frame(self, frame: Frame) -> None:
        if frame.opcode is not Opcode.BINARY and frame.opcode is not Opcode.CONT:
            self.messages.append((frame.opcode.name, bytes(frame.data)))
        super()._frame(frame)

    def _arm(self, delay: float, callback: Any) -> None:
        pass  # no timers: nothing here waits

    def _close(self, close: Any) -> None:
        if close is not None:
            self.messages.append(("close", str(close)))
            if self.ws.state is State.OPEN:
                self.ws.send_close(close.code, close.reason)


def heartbeat_frame(mask: bytes | None = None) -> bytes:
    hb = p.encode(p.make_heartbeat(os.urandom(32), os.urandom(16), 1, 2))
    return _masked(Frame(Opcode.BINARY, hb), mask)


def _masked(frame: Frame, mask: bytes | None = None) -> bytes:
    data = frame.serialize(mask=True, extensions=[])
    if mask is None:
        return data
    # Re-mask with the chosen key: the key is the 4 bytes before the payload.
    head = len(data) - len(frame.data) - 4
    from websockets.frames import apply_mask

    return data[:head] + mask + apply_mask(frame.data, mask)


# A heartbeat frame whose masking key starts like a heartbeat frame: if it were read
# from mid-frame, it would look like the start of one.
LOOKALIKE_MASK = bytes([0x82, 0x80 | p.HEARTBEAT_LENGTH, 0x00, 0x00])

frames = st.one_of(
    st.builds(heartbeat_frame),
    st.just(heartbeat_frame(LOOKALIKE_MASK)),
    st.binary(min_size=0, max_size=200).map(lambda b: _masked(Frame(Opcode.BINARY, b))),
    st.binary(min_size=1, max_size=125).map(lambda b: _masked(Frame(Opcode.PING, b))),
    st.binary(min_size=0, max_size=125).map(lambda b: _masked(Frame(Opcode.PONG, b))),
    # A heartbeat in two fragments, with a ping between them.
    st.just(
        _masked(Frame(Opcode.BINARY, b"\x03" * 20, fin=False))
        + _masked(Frame(Opcode.PING, b"between"))
        + _masked(Frame(Opcode.CONT, b"\x03" * 30, fin=True))
    ),
    st.just(_masked(Frame(Opcode.TEXT, b"hello"))),
    st.just(Frame(Opcode.BINARY, b"\x03" * 50).serialize(mask=False, extensions=[])),
)


def feed(stream: bytes, cuts: list[int], fast: bool) -> Recording:
    connection = Recording(fast)
    start = 0
    for cut in [*sorted(set(cuts)), len(stream)]:
        if cut > start:
            connection.data_received(stream[start:cut])
            start = cut
    return connection


def same(stream: bytes, cuts: list[int]) -> Recording:
    fast, slow = feed(stream, cuts, True), feed(stream, cuts, False)
    assert fast.messages == slow.messages
    assert b"".join(fast.transport.written) == b"".join(slow.transport.written)  # type: ignore[attr-defined]
    assert (fast.ws.state, fast.ws.close_sent, fast.ws.close_rcvd) == (
        slow.ws.state,
        slow.ws.close_sent,
        slow.ws.close_rcvd,
    )
    return fast


@settings(max_examples=300, deadline=None)
@given(
    st.lists(frames, min_size=1, max_size=12),
    st.lists(st.integers(min_value=0, max_value=3000), max_size=12),
    st.booleans(),
)
def test_the_fast_path_is_the_parser_on_any_cut(
    parts: list[bytes], cuts: list[int], closing: bool
) -> None:
    stream = b"".join(parts)
    if closing:
        stream += _masked(Frame(Opcode.CLOSE, Close(1000, "bye").serialize()))
    same(stream, [c % (len(stream) + 1) for c in cuts])


def test_whole_heartbeat_reads_take_the_fast_path() -> None:
    """The case the path is for: one read, one heartbeat frame (else it saves nothing)."""
    beats = [heartbeat_frame() for _ in range(5)]
    cuts = [HEARTBEAT_FRAME_LENGTH * i for i in range(1, 5)]
    connection = same(b"".join(beats), cuts)
    assert len(connection.messages) == 5 and connection.aligned
    assert not connection.ws.events  # nothing went through websockets' parser


def test_a_read_starting_mid_frame_is_never_taken_for_a_heartbeat() -> None:
    """[2 header bytes] then [56 bytes: a lookalike masking key, payload, next header]."""
    first, second = heartbeat_frame(LOOKALIKE_MASK), heartbeat_frame()
    stream = first + second
    connection = same(stream, [2, 2 + HEARTBEAT_FRAME_LENGTH])
    assert [kind for kind, _ in connection.messages] == ["binary", "binary"]


def test_fragments_with_a_ping_between_are_one_message() -> None:
    stream = (
        _masked(Frame(Opcode.BINARY, b"a" * 20, fin=False))
        + _masked(Frame(Opcode.PING, b"x"))
        + _masked(Frame(Opcode.CONT, b"b" * 30, fin=True))
        + heartbeat_frame()
    )
    rng = random.Random(7)
    for _ in range(200):
        connection = same(stream, [rng.randrange(len(stream)) for _ in range(rng.randrange(6))])
        assert [kind for kind, _ in connection.messages] == ["PING", "binary", "binary"]


@pytest.mark.parametrize("size", [0, 1, 20, 125, 126, 127, 370, 65535, 65536, 70000])
def test_binary_frames_are_framed_as_websockets_frames_them(size: int) -> None:
    payload = os.urandom(size)
    assert binary_frame(payload) == Frame(Opcode.BINARY, payload).serialize(
        mask=False, extensions=[]
    )
