"""tokend/edge/websocket.py against websockets' public Sans-I/O ``ServerProtocol``.

The same bytes, cut into reads anywhere, go to tokend's frame layer and to websockets'
server protocol made OPEN (``ServerProtocol(state=State.OPEN)``, read through
:class:`testkit.reference_websocket.ReferenceWebSocket`), with the server's own closes
(``send_close``) at the same points. After every step both must have the same
events (websockets' frames read as tokend reads them: whole binary messages, a text
message's start, pings, the client's close, nothing after our close frame), the same
bytes to write (pongs, close frames with their codes and reasons, the end of the
stream), the same state and the same close frames sent and received: on valid frames,
fragmented messages with control frames between their fragments, messages over the
size limit, every protocol error RFC 6455 names, and any bytes at all.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from websockets.frames import Frame, Opcode
from websockets.utils import apply_mask

from testkit.reference_websocket import ReferenceWebSocket
from tokend.edge import websocket
from tokend.edge.websocket import Close, WebSocket, binary_frame, unmask, unmask_in_python

MAX_SIZE = 300


def observed(layer: WebSocket | ReferenceWebSocket) -> tuple[Any, ...]:
    return (layer.state, layer.close_sent, layer.close_rcvd, layer.close_expected())


@dataclass(frozen=True)
class SendClose:
    """The server closes here (a session's close), if the connection is still OPEN."""

    code: int
    reason: str


Step = bytes | SendClose


def run_both(steps: Sequence[Step], eof: bool, max_size: int | None = MAX_SIZE) -> WebSocket:
    """Run the same steps through both; after each, they must be alike."""
    ours, theirs = WebSocket(max_size), ReferenceWebSocket(max_size)
    for step in steps:
        if isinstance(step, SendClose):
            if theirs.state is not websocket.State.OPEN:
                assert ours.state is not websocket.State.OPEN
                continue
            ours.send_close(step.code, step.reason)
            theirs.send_close(step.code, step.reason)
        else:
            ours.receive_data(step)
            theirs.receive_data(step)
        assert ours.events_received() == theirs.events_received()
        assert ours.data_to_send() == theirs.data_to_send()
        assert observed(ours) == observed(theirs)
    if eof:
        ours.receive_eof()
        theirs.receive_eof()
        assert ours.data_to_send() == theirs.data_to_send()
        assert observed(ours) == observed(theirs)
    return ours


def raw(
    opcode: int,
    payload: bytes = b"",
    *,
    fin: bool = True,
    rsv: int = 0,
    mask: bytes | None = b"\x01\x02\x03\x04",
    length_form: int = 0,
) -> bytes:
    """A client's frame, any of its fields as given (a ``mask`` of None: unmasked);
    ``length_form`` 16 or 64 writes the length in that many bits whatever it is."""
    head1 = (0x80 if fin else 0) | (rsv & 0x7) << 4 | opcode
    masked = 0x80 if mask is not None else 0
    n = len(payload)
    if length_form == 64 or (not length_form and n >= 0x10000):
        head = struct.pack("!BBQ", head1, masked | 127, n)
    elif length_form == 16 or n >= 126:
        head = struct.pack("!BBH", head1, masked | 126, n)
    else:
        head = struct.pack("!BB", head1, masked | n)
    if mask is None:
        return head + payload
    return head + mask + apply_mask(payload, mask)


def cut(data: bytes, cuts: Sequence[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True) if b > a]


def close_body(code: int, reason: bytes = b"") -> bytes:
    return struct.pack("!H", code) + reason


MASKS = st.binary(min_size=4, max_size=4)
PAYLOADS = st.binary(max_size=140)
frames = st.one_of(
    st.builds(lambda d, m: raw(0x2, d, mask=m), PAYLOADS, MASKS),
    st.builds(lambda d: raw(0x1, d), PAYLOADS),
    st.builds(lambda d: raw(0x9, d), st.binary(max_size=125)),
    st.builds(lambda d: raw(0xA, d), st.binary(max_size=125)),
    # A binary or text message in fragments, control frames perhaps between them.
    st.builds(
        lambda first, parts, opcode, ping: b"".join(
            [
                raw(opcode, first, fin=False),
                *(raw(0x0, part, fin=False) + (raw(0x9, b"p") if ping else b"") for part in parts),
                raw(0x0, b"end"),
            ]
        ),
        PAYLOADS,
        st.lists(st.binary(max_size=120), max_size=3),
        st.sampled_from([0x1, 0x2]),
        st.booleans(),
    ),
    # Closes: valid, without a body, too short, a code no close may carry, bad UTF-8.
    st.builds(
        lambda code, reason: raw(0x8, close_body(code, reason)),
        st.sampled_from([1000, 1001, 1005, 1006, 1015, 999, 2999, 3000, 4503, 4999, 5000]),
        st.sampled_from([b"", b"bye", "caf\xe9".encode(), b"\xff\xfe", b"\xc3"]),
    ),
    st.just(raw(0x8)),
    st.just(raw(0x8, b"\x03")),
    # Protocol errors: reserved bits, bad opcodes, unmasked, control frames too long or
    # fragmented, a continuation out of place, over the size limit, long length forms.
    st.builds(lambda rsv: raw(0x2, b"x", rsv=rsv), st.integers(1, 7)),
    st.builds(lambda op: raw(op, b"x"), st.sampled_from([0x3, 0x7, 0xB, 0xF])),
    st.just(raw(0x2, b"unmasked", mask=None)),
    st.just(raw(0x9, b"x" * 126)),
    st.just(raw(0x9, b"x", fin=False)),
    st.just(raw(0x0, b"x")),
    st.just(raw(0x2, b"x" * (MAX_SIZE + 1))),
    st.just(raw(0x2, b"x" * MAX_SIZE)),
    st.just(raw(0x2, b"x" * 100, fin=False) + raw(0x0, b"y" * (MAX_SIZE - 100))),
    st.just(raw(0x2, b"x" * 100, fin=False) + raw(0x0, b"y" * (MAX_SIZE - 99))),
    st.builds(
        lambda n, form: raw(0x2, b"y" * n, length_form=form),
        st.integers(0, 200),
        st.sampled_from([16, 64]),
    ),
    st.binary(max_size=40),
)
closes = st.builds(
    SendClose, st.sampled_from([1000, 1001, 1011, 1013, 4503, 4504]), st.sampled_from(["", "bye"])
)


@settings(max_examples=1000, deadline=None)
@given(
    parts=st.lists(st.one_of(frames, closes), min_size=1, max_size=10),
    cuts=st.lists(st.integers(0, 2000), max_size=10),
    eof=st.booleans(),
)
@example(parts=[raw(0x2, b"hello")], cuts=[1], eof=True)
def test_any_frames_cut_anywhere_come_out_as_websockets_reads_them(
    parts: list[bytes | SendClose], cuts: list[int], eof: bool
) -> None:
    steps: list[Step] = []
    stream = b""
    for part in parts:
        if isinstance(part, SendClose):
            steps += cut(stream, cuts)
            steps.append(part)
            stream = b""
        else:
            stream += part
    steps += cut(stream, cuts)
    run_both(steps, eof)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=400), cuts=st.lists(st.integers(0, 400), max_size=6))
def test_any_bytes_come_out_as_websockets_reads_them(data: bytes, cuts: list[int]) -> None:
    run_both(cut(data, cuts), eof=True)


@pytest.mark.parametrize("max_size", [None, 0, 1, 50, 65535, 65536])
def test_the_size_limit_counts_a_messages_fragments_together(max_size: int | None) -> None:
    """1009 when a frame would take its message over the limit, the fragments read so far
    named in its reason, as websockets names them."""
    payload = os.urandom(40_000)
    stream = raw(0x2, payload[:30_000], fin=False) + raw(0x0, payload[30_000:])
    stream += raw(0x2, b"x" * 70_000)
    ours = run_both(cut(stream, [5, 9, 30_010, 40_030]), eof=True, max_size=max_size)
    if max_size is not None:
        assert ours.close_sent is not None and ours.close_sent.code == 1009


@pytest.mark.parametrize("over", [0, 1])
def test_a_message_at_the_size_limit_passes_and_one_byte_more_fails(over: int) -> None:
    whole = raw(0x2, b"x" * (MAX_SIZE + over))
    fragmented = raw(0x2, b"x" * 100, fin=False) + raw(0x0, b"y" * (MAX_SIZE - 100 + over))
    for stream in (whole, fragmented):
        ours = run_both([stream], eof=False)
        assert (ours.close_sent is not None) == bool(over)


@pytest.mark.parametrize(
    ("frame", "code", "reason"),
    [
        (raw(0x2, b"x", rsv=4), 1002, "reserved bits must be 0"),
        (raw(0x3, b"x"), 1002, "invalid opcode"),
        (raw(0x2, b"x", mask=None), 1002, "incorrect masking"),
        (raw(0x9, b"x" * 126), 1002, "control frame too long"),
        (raw(0x9, b"x", fin=False), 1002, "fragmented control frame"),
        (raw(0x0, b"x"), 1002, "unexpected continuation frame"),
        (raw(0x2, b"a", fin=False) + raw(0x2, b"b"), 1002, "expected a continuation frame"),
        (
            raw(0x2, b"a", fin=False) + raw(0x8, close_body(1000)),
            1002,
            "incomplete fragmented message",
        ),
        (raw(0x8, b"\x03"), 1002, "close frame too short"),
        (raw(0x8, close_body(1006)), 1002, "invalid status code"),
        (raw(0x8, close_body(1000, b"\xff")), 1007, "invalid start byte at position 0"),
        (raw(0x2, b"x" * (MAX_SIZE + 1)), 1009, "frame with 301 bytes exceeds limit of 300 bytes"),
    ],
)
def test_each_protocol_error_fails_the_connection_with_its_code(
    frame: bytes, code: int, reason: str
) -> None:
    """RFC 6455 7.1.7: a close frame with the code and reason, then the end of the stream;
    nothing after it is read."""
    ours = run_both([frame + raw(0x9, b"after")], eof=False)
    assert ours.close_sent == Close(code, reason)
    assert ours.state is websocket.State.CLOSING and ours.eof_sent


def test_a_clients_close_is_echoed_and_the_stream_ends() -> None:
    ours = WebSocket()
    ours.receive_data(raw(0x8, close_body(1000, b"bye")) + raw(0x9, b"discarded"))
    assert ours.events_received() == [Close(1000, "bye")]
    assert ours.data_to_send() == [b"\x88\x05" + close_body(1000, b"bye"), b""]
    ours.receive_eof()
    assert ours.state is websocket.State.CLOSED


def test_the_unparsed_bytes_are_the_beginning_of_the_next_frame() -> None:
    """What a connection moved between processes carries: the bytes of a frame begun."""
    ours = WebSocket()
    whole, half = raw(0x2, b"one"), raw(0x2, b"two")
    ours.receive_data(whole + half[:5])
    assert ours.events_received() == [b"one"]
    assert ours.unparsed() == half[:5] and not ours.at_frame_boundary
    moved = WebSocket()
    moved.receive_data(ours.unparsed())
    moved.receive_data(half[5:])
    assert moved.events_received() == [b"two"] and moved.at_frame_boundary
    ours.receive_data(raw(0x2, b"a", fin=False))
    assert ours.unparsed() == b"" and not ours.at_frame_boundary  # a message under way


@settings(max_examples=300, deadline=None)
@given(payload=st.binary(max_size=1000), mask=MASKS)
def test_unmasking_is_websockets_masking(payload: bytes, mask: bytes) -> None:
    """Both ways tokend unmasks (websockets' frames module's loop, its own without it) do
    what websockets' documented apply_mask does."""
    assert unmask(payload, mask) == unmask_in_python(payload, mask) == apply_mask(payload, mask)


@pytest.mark.parametrize("size", [0, 1, 20, 125, 126, 127, 370, 65535, 65536, 70000])
def test_binary_frames_are_framed_as_websockets_frames_them(size: int) -> None:
    payload = os.urandom(size)
    assert binary_frame(payload) == Frame(Opcode.BINARY, payload).serialize(mask=False)
