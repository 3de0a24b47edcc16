"""websockets' public Sans-I/O ``ServerProtocol``, OPEN, standing where tokend's frame layer
(:class:`tokend.edge.websocket.WebSocket`) stands: the reference the differential tests
hold tokend's frames to (tests/test_websocket.py for the layer, tests/test_connection.py
for a whole connection with its session).

Its frames are read as tokend's layer hands them up: whole binary messages (fragments
joined), a text message's start, pings, the client's close; nothing once our close frame
was sent (nor the client's reply to it). It is never at a frame boundary: websockets'
public API does not say, so a connection with it never takes the heartbeat fast path.
"""

from __future__ import annotations

from websockets.frames import Frame, Opcode
from websockets.protocol import State as WebSocketsState
from websockets.server import ServerProtocol

from tokend.edge import websocket
from tokend.edge.websocket import PING, TEXT, Close, State


class ReferenceWebSocket:
    """websockets' ``ServerProtocol`` behind :class:`tokend.edge.websocket.WebSocket`'s
    interface."""

    at_frame_boundary = False

    def __init__(self, max_size: int | None = 2**20) -> None:
        self.protocol = ServerProtocol(state=WebSocketsState.OPEN, max_size=max_size)
        self.fragments: bytearray | None = None  # a binary message's fragments so far
        self.text = False  # a text message's fragments are under way
        self.open = True  # OPEN when the last bytes came

    def receive_data(self, data: bytes) -> None:
        # Within one call the state before it holds for every frame it hands up: a close
        # sent or received, or a failure, ends the frames parsed.
        self.open = self.protocol.state is WebSocketsState.OPEN
        self.protocol.receive_data(data)

    def receive_eof(self) -> None:
        self.protocol.receive_eof()

    def send_close(self, code: int, reason: str) -> None:
        self.protocol.send_close(code, reason)

    def events_received(self) -> list[websocket.Event]:
        events: list[websocket.Event] = []
        for frame in self.protocol.events_received():
            assert isinstance(frame, Frame)  # past the opening handshake: frames only
            event = self._event(frame)
            if event is not None and self.open:
                events.append(event)
        return events

    def _event(self, frame: Frame) -> websocket.Event | None:
        opcode, data = frame.opcode, bytes(frame.data)
        if opcode is Opcode.BINARY:
            if frame.fin:
                return data
            self.fragments = bytearray(data)
        elif opcode is Opcode.TEXT:
            self.text = not frame.fin
            return TEXT
        elif opcode is Opcode.CONT:
            if self.text:
                self.text = not frame.fin
                return None
            assert self.fragments is not None
            self.fragments += data
            if frame.fin:
                message, self.fragments = bytes(self.fragments), None
                return message
        elif opcode is Opcode.PING:
            return PING
        elif opcode is Opcode.CLOSE:
            return self.close_rcvd
        return None

    def data_to_send(self) -> list[bytes]:
        return self.protocol.data_to_send()

    def close_expected(self) -> bool:
        return self.protocol.close_expected()

    def unparsed(self) -> bytes:
        raise NotImplementedError("websockets' public API does not tell")

    @property
    def state(self) -> State:
        return State(self.protocol.state.name.lower())

    @property
    def current_size(self) -> int | None:
        return len(self.fragments) if self.fragments is not None else None

    @property
    def close_sent(self) -> Close | None:
        sent = self.protocol.close_sent
        return None if sent is None else Close(sent.code, sent.reason)

    @property
    def close_rcvd(self) -> Close | None:
        rcvd = self.protocol.close_rcvd
        return None if rcvd is None else Close(rcvd.code, rcvd.reason)
