"""A whole connection (tokend/server/connection.py) against one whose frames websockets reads.

``Connection.data_received`` unmasks a read that is exactly one whole heartbeat frame
itself when its WebSocket is at a frame boundary. These tests feed the same bytes, cut
at every kind of place, to three connections: one with the fast path, one without it
(every frame through tokend's frame layer), and one whose frame layer is websockets'
public ``ServerProtocol`` (:class:`testkit.reference_websocket.ReferenceWebSocket`).
Each is a real :class:`Connection` with its real session, opened by a real handshake
and HELLO before a fake :class:`tokend.server.seams.Node`. They require the same round
trips asked of the node, in the same order, the same bytes written back (pongs, close
frames: the closes the session makes on either path among them), the same session
outcome and the same WebSocket state: split frames (inside the header, the masking key,
the payload), several frames coalesced in one read, fragmented messages, control frames
between fragments, text, unmasked frames, heartbeats the session refuses, and masking
keys chosen to look like a heartbeat frame's first bytes.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import ssl
import uuid
from collections.abc import Awaitable, Coroutine, Sequence
from typing import Any, NamedTuple

import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st
from websockets.frames import Close, Frame, Opcode, apply_mask

from testkit.clients import upgrade_request
from testkit.reference_websocket import ReferenceWebSocket
from testkit.waiting import eventually
from tokend import config
from tokend.core import protocol as p
from tokend.core.claims import Claims
from tokend.core.session import Cadence
from tokend.core.store_messages import HelloAnswer, HelloOutcome
from tokend.edge.http_responses import HttpAnswer
from tokend.edge.websocket import State, WebSocket
from tokend.metrics import Metrics
from tokend.server import connection as connection_module
from tokend.server import seams
from tokend.server.connection import HEARTBEAT_FRAME_LENGTH, Connection
from tokend.server.link import SessionLink
from tokend.server.shedding import Shedder

SETTINGS = config.load({"max_frame_rate": 0}, environ={})
CADENCE = Cadence(1000, 3000, 4000, 0)
TID = uuid.UUID(bytes=os.urandom(16))
EXP_MS = 2_000_000_000_000


class Transport(asyncio.Transport):
    """A socket that keeps what is written to it."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[bytes] = []
        self.closed = False
        self.reading = True

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def is_reading(self) -> bool:
        return self.reading

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def can_write_eof(self) -> bool:
        return True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 40000) if name == "peername" else default

    def write_eof(self) -> None:
        self.written.append(b"<EOF>")

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True


class RecordingNode(seams.Node):
    """The node as a connection sees it (tokend.server.seams.Node): records the round trips
    asked."""

    def __init__(self) -> None:
        self.metrics = Metrics()
        self.shedder = Shedder(0, lambda: (), lambda: False)
        self.asked: list[tuple[str, int]] = []

    def check(self, token: str, signature: bool) -> tuple[Claims, str]:
        return Claims(TID, "alice", 0, EXP_MS // 1000), "digest"

    def sign(self, claims: Claims, iat_s: int, exp_s: int) -> tuple[bytes, str]:
        raise AssertionError("no renewal here")

    def sub_is_full(self, claims: Claims) -> bool:
        return False

    def new_conn_id(self) -> str:
        return "test/1"

    def submit_hello(self, link: seams.SessionLink) -> None:
        self.asked.append(("hello", 0))

    def forget_hello(self, link: seams.SessionLink) -> None:
        self.asked.append(("forget_hello", 0))

    def submit_heartbeat(self, link: seams.SessionLink) -> None:
        self.asked.append(("heartbeat", link.session.last_seq))

    def end(self, link: seams.SessionLink) -> None:
        self.asked.append(("bye", 0))

    def attach(self, link: seams.SessionLink) -> None:
        self.asked.append(("attach", 0))

    def detach(self, link: seams.SessionLink) -> None:
        self.asked.append(("detach", 0))

    def release(self, link: seams.SessionLink) -> None:
        self.asked.append(("release", 0))

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        raise AssertionError("nothing is answered later here")


class Gate(connection_module.Gate):
    """The server as a connection sees it (tokend.server.connection.Gate): every handshake
    goes on."""

    settings = SETTINGS
    cadence = CADENCE
    origins: Sequence[str | None] | None = None

    def __init__(self) -> None:
        self.recording = RecordingNode()

    @property
    def node(self) -> RecordingNode:
        return self.recording

    def opened(self, connection: Connection) -> None:
        pass

    def addressed(self, connection: Connection) -> None:
        pass

    def closed(self, connection: Connection) -> None:
        pass

    def expects_proxy_header(self, peer_ip: str) -> bool:
        return False

    def tls_context(self) -> ssl.SSLContext | None:
        return None

    def answer(self, ip: str, path: str) -> HttpAnswer | Awaitable[HttpAnswer] | None:
        return None

    def shed(self, connection: Connection) -> None:
        pass

    def refuses_hello(self, token: str) -> bool:
        return False


class Beat(NamedTuple):
    """A heartbeat frame for the session the connection was WELCOMEd to: its seq, the
    masking key (None: a random one) and whether its mac is right."""

    seq: int
    mask: bytes | None = None
    valid: bool = True


Part = bytes | Beat


def masked(frame: Frame, mask: bytes | None = None) -> bytes:
    """A client's frame; with ``mask``, masked with that key."""
    data = frame.serialize(mask=True, extensions=[])
    if mask is None:
        return data
    # Re-mask with the chosen key: the key is the 4 bytes before the payload.
    head = len(data) - len(frame.data) - 4
    return data[:head] + mask + apply_mask(frame.data, mask)


class Opened(NamedTuple):
    connection: Connection
    link: SessionLink
    node: RecordingNode
    transport: Transport
    key: bytes  # the session key its WELCOME carried


# The three kinds of connection compared.
FAST, SLOW, WEBSOCKETS = "fast", "slow", "websockets"


def opened(kind: str) -> Opened:
    """A connection through its handshake and HELLO, WELCOMEd: with the fast path, without
    it, or with websockets' frame layer in place of tokend's."""
    gate = Gate()
    connection = Connection(gate)
    transport = Transport()
    connection.connection_made(transport)
    connection.data_received(upgrade_request())
    assert connection.websocket is not None and connection.websocket.state is State.OPEN
    if kind == WEBSOCKETS:
        # websockets' frame layer where tokend's stands: all the connection asks of it
        # but the fast path's (off here), which no type of the connection's names.
        reference = ReferenceWebSocket(SETTINGS.max_message_size)
        connection.websocket = reference  # type: ignore[assignment]  # see above
    connection.fast_path = kind == FAST
    connection.data_received(masked(Frame(Opcode.BINARY, p.encode(p.Hello("token")))))
    link = connection.link
    assert link is not None and gate.node.asked == [("hello", 0)]
    link.hello_answered(HelloAnswer(HelloOutcome.STARTED, EXP_MS, 0, 1))
    welcome = p.decode(transport.written[-1][2:])
    assert isinstance(welcome, p.Welcome)
    gate.node.asked.clear()
    transport.written.clear()
    return Opened(connection, link, gate.node, transport, welcome.session_key)


def wire(part: Part, key: bytes) -> bytes:
    """The bytes of ``part`` for the session of ``key``."""
    if isinstance(part, bytes):
        return part
    hb = p.make_heartbeat(key if part.valid else os.urandom(32), TID.bytes, part.seq, EXP_MS)
    return masked(Frame(Opcode.BINARY, p.encode(hb)), part.mask)


def feed(parts: Sequence[Part], cuts: Sequence[int], kind: str) -> Opened:
    """Open a connection, then feed it ``parts`` in reads cut at ``cuts``."""

    async def run() -> Opened:
        o = opened(kind)
        stream = b"".join(wire(part, o.key) for part in parts)
        start = 0
        for cut in [*sorted({c % (len(stream) + 1) for c in cuts}), len(stream)]:
            if cut > start:
                o.connection.data_received(stream[start:cut])
                start = cut
        return o

    return asyncio.run(run())


def same(parts: Sequence[Part], cuts: Sequence[int]) -> Opened:
    """Feed the three connections alike; they must have done the same."""
    fast, *others = (feed(parts, cuts, kind) for kind in (FAST, SLOW, WEBSOCKETS))
    for other in others:
        assert fast.node.asked == other.node.asked
        assert b"".join(fast.transport.written) == b"".join(other.transport.written)
        assert fast.link.session.ended_by == other.link.session.ended_by
        assert fast.link.session.last_seq == other.link.session.last_seq
        ours, theirs = fast.connection.websocket, other.connection.websocket
        assert ours is not None and theirs is not None
        assert (ours.state, ours.close_sent) == (theirs.state, theirs.close_sent)
    return fast


class CountingWebSocket(WebSocket):
    """The frame layer, recording every read it is given."""

    __slots__ = ("parsed",)

    def __init__(self, max_size: int | None) -> None:
        super().__init__(max_size)
        self.parsed: list[bytes] = []

    def receive_data(self, data: bytes) -> None:
        self.parsed.append(data)
        super().receive_data(data)


# A heartbeat frame whose masking key starts like a heartbeat frame: if it were read
# from mid-frame, it would look like the start of one.
LOOKALIKE_MASK = bytes([0x82, 0x80 | p.HEARTBEAT_LENGTH, 0x00, 0x00])

SEQS = st.integers(min_value=1, max_value=40)
parts = st.one_of(
    # Heartbeats the session takes, or refuses (an old seq: 4504 old_seq; a bad mac).
    SEQS.map(Beat),
    SEQS.map(lambda seq: Beat(seq, LOOKALIKE_MASK)),
    SEQS.map(lambda seq: Beat(seq, valid=False)),
    # Messages the codec refuses (4503 malformed_frame), control frames.
    st.binary(min_size=0, max_size=200).map(lambda b: masked(Frame(Opcode.BINARY, b))),
    st.binary(min_size=1, max_size=125).map(lambda b: masked(Frame(Opcode.PING, b))),
    st.binary(min_size=0, max_size=125).map(lambda b: masked(Frame(Opcode.PONG, b))),
    # A heartbeat-sized message in two fragments, with a ping between them.
    st.just(
        masked(Frame(Opcode.BINARY, b"\x03" * 20, fin=False))
        + masked(Frame(Opcode.PING, b"between"))
        + masked(Frame(Opcode.CONT, b"\x03" * 30, fin=True))
    ),
    st.just(masked(Frame(Opcode.TEXT, b"hello"))),
    st.just(Frame(Opcode.BINARY, b"\x03" * 50).serialize(mask=False, extensions=[])),
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(parts, min_size=1, max_size=12),
    st.lists(st.integers(min_value=0, max_value=3000), max_size=12),
    st.booleans(),
)
def test_the_fast_path_is_the_parser_on_any_cut(
    stream: list[Part], cuts: list[int], closing: bool
) -> None:
    if closing:
        stream = [*stream, masked(Frame(Opcode.CLOSE, Close(1000, "bye").serialize()))]
    same(stream, cuts)


def test_whole_heartbeat_reads_take_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The case the path is for: one read, one heartbeat frame (else it saves nothing)."""
    beats = [Beat(seq) for seq in range(1, 6)]
    fast = same(beats, [HEARTBEAT_FRAME_LENGTH * i for i in range(1, 5)])
    assert fast.node.asked == [("heartbeat", seq) for seq in range(1, 6)]
    assert fast.connection.websocket is not None and fast.connection.websocket.at_frame_boundary
    monkeypatch.setattr(connection_module, "WebSocket", CountingWebSocket)

    async def parsed() -> list[bytes]:
        o = opened(FAST)
        layer = o.connection.websocket
        assert isinstance(layer, CountingWebSocket)
        layer.parsed.clear()  # the HELLO
        for beat in beats:
            o.connection.data_received(wire(beat, o.key))
        assert len(o.node.asked) == 5
        return layer.parsed

    assert asyncio.run(parsed()) == []  # nothing went through the frame layer


def test_a_close_the_session_makes_on_the_fast_path_is_sent_at_once() -> None:
    """A heartbeat refused on the fast path (its seq is old): 4504 goes out with that read."""
    fast = same([Beat(5), Beat(5)], [HEARTBEAT_FRAME_LENGTH])
    assert fast.link.session.ended_by == (p.CloseCode.BAD_HEARTBEAT, "old_seq")
    assert fast.connection.websocket is not None
    assert fast.connection.websocket.close_sent == (p.CloseCode.BAD_HEARTBEAT, "old_seq")
    assert b"".join(fast.transport.written).startswith(b"\x88")  # the close frame
    assert fast.node.asked == [("heartbeat", 5)]


def test_a_read_starting_mid_frame_is_never_taken_for_a_heartbeat() -> None:
    """[2 header bytes] then [56 bytes: a lookalike masking key, payload, next header]."""
    fast = same([Beat(1, LOOKALIKE_MASK), Beat(2)], [2, 2 + HEARTBEAT_FRAME_LENGTH])
    assert fast.node.asked == [("heartbeat", 1), ("heartbeat", 2)]


def test_fragments_with_a_ping_between_are_one_message() -> None:
    """A valid heartbeat in two fragments, a ping between them, then one whole."""
    rng = random.Random(7)

    async def run(cuts: list[int]) -> tuple[Opened, bytes]:
        o = opened(FAST)
        payload = p.encode(p.make_heartbeat(o.key, TID.bytes, 1, EXP_MS))
        stream = (
            masked(Frame(Opcode.BINARY, payload[:20], fin=False))
            + masked(Frame(Opcode.PING, b"x"))
            + masked(Frame(Opcode.CONT, payload[20:], fin=True))
            + wire(Beat(2), o.key)
        )
        start = 0
        for cut in [*sorted({c % len(stream) for c in cuts}), len(stream)]:
            if cut > start:
                o.connection.data_received(stream[start:cut])
                start = cut
        return o, stream

    for _ in range(200):
        o, _ = asyncio.run(run([rng.randrange(200) for _ in range(rng.randrange(6))]))
        assert o.node.asked == [("heartbeat", 1), ("heartbeat", 2)]
        assert b"".join(o.transport.written) == Frame(Opcode.PONG, b"x").serialize(
            mask=False, extensions=[]
        )


def test_an_idle_session_holds_nothing_of_its_opening() -> None:
    """After WELCOME the connection keeps neither the handshake (its request's head) nor
    the HELLO frame: its WebSocket holds no byte, no event and nothing to send, which an
    idle session would otherwise keep for its life (the heartbeats after it take the
    fast path)."""
    o = asyncio.run(_opened_fast())
    layer = o.connection.websocket
    assert isinstance(layer, WebSocket) and o.connection.handshake is None
    assert (layer.unparsed(), layer.events, layer.writes, layer.fragments) == (b"", [], [], None)
    assert layer.at_frame_boundary


def test_a_session_logs_with_the_logger_bound_at_its_welcome() -> None:
    """One logger per session, bound once with its fields (not built per line)."""
    o = asyncio.run(_opened_fast())
    log = o.connection.log
    assert log is o.link.log and o.connection.log is log
    context = structlog.get_context(log)
    assert context == {"peer": "127.0.0.1:40000", "conn": "test/1", "tid": str(TID), "sub": "alice"}


async def _opened_fast() -> Opened:
    return opened(FAST)


async def test_a_connection_handed_to_another_node_goes_on_between_frames() -> None:
    """The hand-off of a reload: a connection quiet but for half a heartbeat frame read is
    let go by one node (its socket duplicated, its session not released) and adopted by
    another with its session and the unparsed bytes; the rest of the frame goes to the
    new node, whose ACK the client reads on the same socket, which never closed."""
    loop = asyncio.get_running_loop()
    server_side, client = socket.socketpair()
    client.setblocking(False)
    old_gate, new_gate = Gate(), Gate()
    old = Connection(old_gate)
    await loop.connect_accepted_socket(lambda: old, server_side)
    await loop.sock_sendall(client, upgrade_request())
    assert (await loop.sock_recv(client, 4096)).startswith(b"HTTP/1.1 101 ")
    await loop.sock_sendall(client, masked(Frame(Opcode.BINARY, p.encode(p.Hello("token")))))
    await eventually(lambda: old_gate.node.asked == [("hello", 0)], what="HELLO asked")
    link = old.link
    assert link is not None
    link.hello_answered(HelloAnswer(HelloOutcome.STARTED, EXP_MS, 0, 1))
    welcome = p.decode((await loop.sock_recv(client, 4096))[2:])
    assert isinstance(welcome, p.Welcome)

    beat = wire(Beat(1), welcome.session_key)
    await loop.sock_sendall(client, beat[:20])
    await eventually(lambda: old.unparsed() == beat[:20], what="half a frame read")
    old.pause_reading()
    assert old.quiet
    handed = old.hand_off()
    assert handed.unparsed == beat[:20] and handed.session is link.session
    session = handed.session
    assert ("detach", 0) in old_gate.node.asked and session.take_release() is None

    new = Connection.adopt(new_gate, session, handed.unparsed, handed.address)
    await loop.connect_accepted_socket(lambda: new, handed.socket)
    await loop.sock_sendall(client, beat[20:])
    await eventually(
        lambda: new_gate.node.asked == [("attach", 0), ("heartbeat", 1)], what="heartbeat"
    )
    session.take_heartbeats()
    assert new.link is not None
    new.link.heartbeats_stored(EXP_MS)
    ack = p.decode((await loop.sock_recv(client, 4096))[2:])
    assert isinstance(ack, p.HeartbeatAck) and ack.seq == 1
    assert new.transport is not None and not new.transport.is_closing()
    new.transport.close()
    client.close()
