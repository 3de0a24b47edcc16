"""The handoff of a rolling reload: the old worker of a slot hands each of its live
connections to the new worker of the same slot, which goes on with it at a frame boundary;
the client sees nothing (docs/operations.md, "Restarts").

The two workers talk over a SOCK_SEQPACKET socketpair their supervisor made for them
(tokend/ops/supervisor.py): a batch message (:mod:`tokend.core.handoff`) with up to 253
sockets beside it (SCM_RIGHTS), answered by one reply. Ownership is never in doubt: a
connection is the old worker's until the new worker's reply says it took it (before
replying, the new worker moved the session to its own connection in the store, move.lua,
and until then it neither reads nor writes the socket); the old worker then drops its
copy without a word. A connection the reply does not take, or that no reply came for (the
new worker refused, died, or did not answer within :data:`REPLY_TIMEOUT_S`), stays with
the old worker and is closed the usual way later (1001, resume): its session is moved back
first if the new worker had moved it.

Before a connection goes it is made quiet: its reading is held, its heartbeats' store
round trips answered and their ACKs written (its send buffer empty), and the bytes read
and not yet parsed go with it. What cannot go, and why, is counted
(:class:`tokend.core.handoff.FallbackReason`).
"""

from __future__ import annotations

import _socket
import asyncio
import contextlib
import os
import socket
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import structlog

from tokend.core.handoff import (
    HANDOFF_VERSION,
    MAX_BATCH,
    BatchStatus,
    FallbackReason,
    HandoffFormatError,
    Moving,
    Taken,
    batch_number,
    bucket,
    decode_batch,
    decode_reply,
    encode_batch,
    encode_reply,
)
from tokend.core.session import Phase, Session
from tokend.server.connection import Connection, Gate
from tokend.server.node import Node
from tokend.store.sessions import MoveRequest

log = structlog.get_logger("tokend.handoff")
_OPEN = Phase.OPEN  # a module global: an Enum class's attribute is a slow read on 3.11

# How long the old worker waits for a connection to become quiet (its heartbeats
# answered, its send buffer written) or to finish its opening and HELLO: a store round
# trip or two, milliseconds; past it the connection falls back.
SETTLE_S = 3.0
ROUND_PAUSE_S = 0.005  # between two passes over the connections not quiet yet
# A new worker that has not answered a batch within this has failed (it is starved or
# stuck): what it has not taken stays with the old worker.
REPLY_TIMEOUT_S = 10.0
# Bytes of one batch message at most: a SOCK_SEQPACKET message must fit the sending
# socket's buffer (net.core.wmem_default: 212,992 bytes on Linux).
MAX_MESSAGE = 128 * 1024
RECEIVE_BUFFER = MAX_MESSAGE
# Adoptions under way at once, each in turn through its share of a batch: an adoption
# waits two loop passes for its transport, which those side by side share (a task per
# adoption costs more than the passes it saves).
ADOPTING_AT_ONCE = 8
# Batches sent and not yet answered, at most. The new worker takes one at a time; while
# it does, the next waits for it, packed (it never waits for the old worker). More would
# hold their connections' reading longer, and move none sooner.
WINDOW = 2


@dataclass
class HandoffReport:
    """What a handoff did: connections moved, and those that fell back, by reason."""

    moved: int = 0
    fell_back: Counter[str] = field(default_factory=Counter)

    def as_fields(self) -> dict[str, object]:
        return {"moved": self.moved, "fell_back": dict(sorted(self.fell_back.items()))}


# The old worker's side


class Giver:
    """Hands the connections of ``connections`` over ``sock`` to ``new_node``."""

    def __init__(
        self, connections: set[Connection], node: Node, sock: socket.socket, new_node: str
    ) -> None:
        self.connections = connections
        self.node = node
        self.sock = sock
        self.new_node = new_node
        self.report = HandoffReport()
        self.number = 0
        # Batches sent and not answered: by number, their connections and transports.
        self.sent: dict[int, list[tuple[Connection, asyncio.Transport]]] = {}
        self.failed: FallbackReason | None = None  # once the new worker failed: why
        self.version = HANDOFF_VERSION  # of the batches it writes
        self.window = WINDOW  # batches sent and not answered, at most
        # This process's CPU time over the handoff (all it did meanwhile: an upper bound).
        self.cpu_s = 0.0

    async def run(self) -> HandoffReport:
        """Hand every connection over, or decide why it stays: each is counted once, as
        moved or by the reason it fell back.

        A batch at a time, gathered only once the window has room for it: its
        connections' reading is held from then to when the new worker answers it (a
        heartbeat sent meanwhile waits for that round trip, behind one batch at most, not
        for every batch sent before it). One not quiet yet (a heartbeat at the store,
        bytes unsent) waits, held, for a later batch, at most SETTLE_S; one before
        WELCOME is looked at again until SETTLE_S after the start."""
        loop = asyncio.get_running_loop()
        cpu = time.process_time()
        began = loop.time()
        pending = deque(self.connections)
        settling: dict[Connection, float] = {}  # held, not quiet yet: since when
        while (pending or settling) and self.failed is None:
            await self._room()
            if self.failed is not None:
                break
            now = loop.time()
            batch: list[Connection] = []
            for connection, since in list(settling.items()):
                if connection.quiet:
                    del settling[connection]
                    batch.append(connection)
                elif now - since > SETTLE_S or _cannot_move(connection) is not None:
                    del settling[connection]
                    _release(connection)
                    self._fall_back(connection, _not_ready(connection))
            greeting = []  # before WELCOME: looked at again next time
            while pending and len(batch) < MAX_BATCH and len(settling) < MAX_BATCH:
                connection = pending.popleft()
                reason = _cannot_move(connection)
                if reason is None:
                    if _hold(connection):
                        batch.append(connection)
                    else:
                        settling[connection] = now
                elif reason is FallbackReason.BEFORE_WELCOME and now - began <= SETTLE_S:
                    greeting.append(connection)
                else:
                    self._fall_back(connection, reason)
            pending.extend(greeting)
            if batch:
                await self._send(batch)
            else:
                await asyncio.sleep(ROUND_PAUSE_S)
        while self.sent and self.failed is None:
            await self._answered()
        if self.failed is not None:
            self._last_replies()
            await self._take_back()
            for connection in [*settling, *pending]:
                _release(connection)
                self._fall_back(connection, self.failed)
        with contextlib.suppress(OSError):
            self.sock.close()
        self.cpu_s += time.process_time() - cpu
        _log_report(self.report, loop.time() - began, self.cpu_s)
        return self.report

    def _fall_back(self, connection: Connection, reason: FallbackReason) -> None:
        self.report.fell_back[reason.value] += 1
        self.node.metrics.handoff_fell_back[reason.value] += 1

    async def _room(self) -> None:
        """Until fewer than ``window`` batches are unanswered (or the new worker failed)."""
        while len(self.sent) >= self.window and self.failed is None:
            await self._answered()

    async def _send(self, batch: list[Connection]) -> None:
        """Send ``batch`` (split while its message is too large), keeping at most ``window``
        batches unanswered; once the new worker failed, the batch stays here."""
        await self._room()
        if self.failed is not None:
            for connection in batch:
                _release(connection)
                self._fall_back(connection, self.failed)
            return
        sockets = [_socket_of(c) for c in batch]
        records = [_record(c, sock.family) for c, sock in zip(batch, sockets, strict=True)]
        message = encode_batch(self.number + 1, records, self.version)
        if len(message) > MAX_MESSAGE:
            if len(batch) == 1:
                _release(batch[0])
                self._fall_back(batch[0], FallbackReason.NOT_QUIET)
                return
            half = len(batch) // 2
            await self._send(batch[:half])
            await self._send(batch[half:])
            return
        self.number += 1
        # The transports' own descriptors: each stays open until the reply is applied.
        fds = [sock.fileno() for sock in sockets]
        sealed = []
        for connection in batch:
            transport = connection.transport
            assert transport is not None
            # Nothing more is written to it here (a NOTICE or a close the store asks for
            # is dropped; the store's move fails for a session ended meanwhile).
            connection.transport = None
            sealed.append((connection, transport))
        self.sent[self.number] = sealed
        try:
            await _send_with_fds(self.sock, message, fds)
        except OSError:
            self.failed = FallbackReason.NEW_WORKER_FAILED  # _take_back decides the batch

    async def _answered(self) -> None:
        """Wait for the next reply and act on it; a new worker that closed its end or did
        not answer in time has failed (``failed`` set)."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(REPLY_TIMEOUT_S):
                data = await loop.sock_recv(self.sock, RECEIVE_BUFFER)
        except (TimeoutError, OSError):
            data = b""
        if data:
            self._apply(data)
            return
        self.failed = self.failed or FallbackReason.NEW_WORKER_FAILED

    def _last_replies(self) -> None:
        """The new worker failed: it may not answer any more. What it has answered is
        read (those connections are its own); what it has not, it will not (its reply
        fails from now on, and it takes nothing)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RD)
        self.sock.setblocking(False)
        while self.sent:
            try:
                data = self.sock.recv(RECEIVE_BUFFER)
            except OSError:  # BlockingIOError among them: nothing more
                return
            if not data:
                return
            self._apply(data)

    def _apply(self, data: bytes) -> None:
        try:
            reply = decode_reply(data)
        except HandoffFormatError as exc:
            log.error("handoff reply refused", error=str(exc))
            self.failed = FallbackReason.NEW_WORKER_FAILED
            return
        sealed = self.sent.pop(reply.number, None)
        if sealed is None:
            return
        if reply.status is not BatchStatus.READ:
            reason = (
                FallbackReason.UNKNOWN_VERSION
                if reply.status is BatchStatus.UNKNOWN_VERSION
                else FallbackReason.NEW_WORKER_FAILED
            )
            self.failed = reason
            for connection, transport in sealed:
                _unseal(connection, transport)
                self._fall_back(connection, reason)
            return
        moved = 0
        for (connection, transport), taken in zip(sealed, reply.taken, strict=False):
            if taken is Taken.TAKEN:
                _handed_over(connection, transport)
                moved += 1
            else:
                _unseal(connection, transport)
                self._fall_back(
                    connection,
                    FallbackReason.NOT_HELD
                    if taken is Taken.NOT_HELD
                    else FallbackReason.STORE_UNAVAILABLE,
                )
        for connection, transport in sealed[len(reply.taken) :]:
            _unseal(connection, transport)
            self._fall_back(connection, FallbackReason.NEW_WORKER_FAILED)
        self.report.moved += moved
        self.node.metrics.handoff_moved += moved

    async def _take_back(self) -> None:
        """The new worker failed with batches unanswered: they stay here, their sessions
        moved back from whatever connection of the new worker holds them."""
        sealed = [pair for batch in self.sent.values() for pair in batch]
        self.sent.clear()
        if not sealed:
            return
        requests = []
        for connection, _ in sealed:
            session = connection.session
            assert session is not None and session.claims is not None
            requests.append(MoveRequest.of(session.claims.tid, self.new_node, None, session.conn))
        try:
            sinces = await self.node.store.moves(requests)
        except Exception as exc:  # StoreUnavailable: their release will find them moved
            log.warning("handoff: sessions not moved back", error=str(exc), count=len(requests))
            sinces = [0] * len(requests)
        for (connection, transport), since in zip(sealed, sinces, strict=True):
            session = connection.session
            if since and session is not None:
                session.since_ms = since
            _unseal(connection, transport)
            self._fall_back(connection, self.failed or FallbackReason.NEW_WORKER_FAILED)


def _cannot_move(connection: Connection) -> FallbackReason | None:
    """Why ``connection`` cannot be handed over (BEFORE_WELCOME: not yet), None if it may."""
    transport = connection.transport
    if transport is None or transport.is_closing() or connection.closing:
        return FallbackReason.CLOSING
    if transport.get_extra_info("ssl_object") is not None:
        return FallbackReason.TLS
    link = connection.link
    if link is None:
        return FallbackReason.BEFORE_WELCOME
    phase = link.session.phase
    if phase is _OPEN:
        return None
    if phase is Phase.HELLO or phase is Phase.STARTING:
        return FallbackReason.BEFORE_WELCOME
    return FallbackReason.CLOSING


def _hold(connection: Connection) -> bool:
    """Hold the connection's reading (kept held until it goes or falls back); whether it
    is quiet now: no heartbeat waiting for the store, nothing unsent, no message under
    way (the bytes of a frame begun go along: Connection.unparsed)."""
    transport = connection.transport
    assert transport is not None
    if not connection.moving:
        connection.moving = True
        transport.pause_reading()
    return connection.quiet


def _not_ready(connection: Connection) -> FallbackReason:
    """Why a connection held for the handoff never became quiet enough to go."""
    return _cannot_move(connection) or FallbackReason.NOT_QUIET


def _release(connection: Connection) -> None:
    """A connection that stays here reads again."""
    if connection.moving:
        connection.moving = False
        transport = connection.transport
        if transport is not None and not connection.paused and not transport.is_closing():
            transport.resume_reading()


def _unseal(connection: Connection, transport: asyncio.Transport) -> None:
    """A connection sent and not taken: it is this worker's again."""
    connection.transport = transport
    session = connection.session
    if session is not None and session.phase is Phase.CLOSED:
        # Closed by the store while it was away (revoked, taken over, expired): its close
        # frame was not written; the client reconnects and is told.
        transport.abort()
        return
    _release(connection)


def _handed_over(connection: Connection, transport: asyncio.Transport) -> None:
    """The new worker took the connection: drop this worker's copy without a word. Its
    session is the new worker's: nothing is released here, nothing is sent."""
    connection.transport = transport
    session = connection.session
    if session is not None:
        session.released = True  # whatever happened to it here meanwhile
    connection.let_go()


def _socket_of(connection: Connection) -> socket.socket:
    transport = connection.transport
    assert transport is not None
    sock: socket.socket = transport.get_extra_info("socket")
    return sock


def _record(connection: Connection, family: int) -> Moving:
    link = connection.link
    assert link is not None
    request = link.heartbeat_request
    pings = connection.pings
    return Moving(
        link.session,
        request.token if request is not None else "",
        connection.address,
        connection.unparsed(),
        None,  # quiet: no message under way
        (pings.allowance, pings.checked) if pings is not None else None,
        family,
    )


def _log_report(report: HandoffReport, seconds: float, cpu_s: float) -> None:
    for reason, count in sorted(report.fell_back.items()):
        log.warning("handoff: connections fall back to a close (1001)", reason=reason, count=count)
    log.info(
        "handed over",
        moved=report.moved,
        fell_back=dict(report.fell_back),
        seconds=round(seconds, 3),
        cpu_s=round(cpu_s, 3),
    )


async def _send_with_fds(sock: socket.socket, message: bytes, fds: Sequence[int]) -> None:
    loop = asyncio.get_running_loop()
    while True:
        try:
            socket.send_fds(sock, [message], fds)
            return
        except BlockingIOError:
            writable = loop.create_future()
            loop.add_writer(sock, writable.set_result, None)
            try:
                await writable
            finally:
                loop.remove_writer(sock)


# The new worker's side


class Taker:
    """Takes the connections an old worker sends over ``sock`` (until it closes its end).

    One batch at a time, in the order sent: the next batch is read once the last one's
    connections are adopted (read and written here). Its reply goes before its
    adoptions, so the old worker's window of unanswered batches would not bound the
    batches answered and not yet adopted; taken in turn, those are one at most, and a
    connection's heartbeats wait for the batches ahead of it in the window alone."""

    def __init__(
        self, gate: Gate, node: Node, sock: socket.socket, accepting: Callable[[], bool]
    ) -> None:
        self.gate = gate
        self.node = node
        self.sock = sock
        self.accepting = accepting
        self.report = HandoffReport()
        self.loop = asyncio.get_running_loop()
        # This process's CPU time from its first batch to its last adoption (all it did
        # meanwhile: an upper bound).
        self.first_cpu: float | None = None
        self.cpu_s = 0.0

    def start(self) -> asyncio.Task[None]:
        """Take connections until the old worker closes its end: the task that does."""
        self.sock.setblocking(False)
        task = asyncio.ensure_future(self._run())
        _TAKING.add(task)
        task.add_done_callback(_TAKING.discard)
        return task

    async def _run(self) -> None:
        while True:
            data, fds, flags = await self._receive()
            if not data:
                _close_all(fds)
                break
            await self._take(data, fds, flags)
        self.sock.close()
        log.info("took over", moved=self.report.moved, cpu_s=round(self.cpu_s, 3))

    async def _receive(self) -> tuple[bytes, list[int], int]:
        """The next batch message and its descriptors; empty once the old worker closed
        its end (or the socket failed)."""
        while True:
            try:
                data, fds, flags, _ = socket.recv_fds(self.sock, RECEIVE_BUFFER, MAX_BATCH)
            except BlockingIOError:
                readable = self.loop.create_future()
                self.loop.add_reader(self.sock, readable.set_result, None)
                try:
                    await readable
                finally:
                    self.loop.remove_reader(self.sock)
                continue
            except OSError:
                return b"", [], 0
            return data, fds, flags

    async def _take(self, data: bytes, fds: list[int], flags: int) -> None:
        if self.first_cpu is None:
            self.first_cpu = time.process_time()
        try:
            version, number = batch_number(data)
        except HandoffFormatError as exc:
            log.error("handoff batch refused", error=str(exc))
            _close_all(fds)
            return
        if version != HANDOFF_VERSION:
            log.warning("handoff batch refused: unknown version", version=version)
            _close_all(fds)
            await self._reply(encode_reply(number, BatchStatus.UNKNOWN_VERSION))
            return
        node = self.node
        try:
            records = decode_batch(data, node, self.gate.cadence, time.monotonic).records
        except HandoffFormatError as exc:
            log.error("handoff batch refused", error=str(exc))
            records = []
        truncated = flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC)
        if not records or truncated or len(fds) != len(records) or not self.accepting():
            _close_all(fds)
            await self._reply(encode_reply(number, BatchStatus.REFUSED))
            return
        conns = [node.new_conn_id() for _ in records]
        # Each session's conn and since_ms are the old connection's until it is adopted.
        requests = [
            _move(r.session, r.session.conn, r.session.since_ms, c)
            for r, c in zip(records, conns, strict=True)
        ]
        try:
            sinces = await node.store.moves(requests)
        except Exception as exc:  # StoreUnavailable, or a script error
            log.warning("handoff: store unavailable", error=str(exc), count=len(records))
            _close_all(fds)
            await self._reply(
                encode_reply(number, BatchStatus.READ, [Taken.STORE_UNAVAILABLE] * len(records))
            )
            return
        taken = [Taken.TAKEN if since else Taken.NOT_HELD for since in sinces]
        if not await self._reply(encode_reply(number, BatchStatus.READ, taken)):
            # The old worker gave up on this batch: the connections stay with it.
            _close_all(fds)
            back = [
                _move(r.session, conn, since, r.session.conn)
                for r, conn, since in zip(records, conns, sinces, strict=True)
                if since
            ]
            with contextlib.suppress(Exception):
                await node.store.moves(back)
            return
        adopting = []
        for record, conn, since, fd in zip(records, conns, sinces, fds, strict=True):
            if since:
                adopting.append((record, conn, since, fd))
            else:
                os.close(fd)
        lanes = min(ADOPTING_AT_ONCE, len(adopting))
        await asyncio.gather(*(self._adopt_in_turn(adopting[i::lanes]) for i in range(lanes)))
        self.report.moved += len(adopting)
        node.metrics.handoff_taken += len(adopting)
        self.cpu_s = time.process_time() - self.first_cpu

    async def _reply(self, message: bytes) -> bool:
        try:
            await _send_with_fds(self.sock, message, ())
        except OSError:
            return False
        return True

    async def _adopt_in_turn(self, adopting: list[tuple[Moving, str, int, int]]) -> None:
        for record, conn, since, fd in adopting:
            await self._adopt(record, conn, since, fd)

    async def _adopt(self, record: Moving, conn: str, since: int, fd: int) -> None:
        gate = self.gate
        session = record.session
        session.conn, session.since_ms = conn, since
        # Its family given, the socket is not asked for it (three getsockopt calls); it is
        # non-blocking already (O_NONBLOCK belongs to the open file, shared with the old
        # worker's descriptor).
        sock = _Socket(record.family or -1, socket.SOCK_STREAM, 0, fd)
        connection = Connection.adopt(gate, session, record.unparsed, record.peer)
        try:
            await self.loop.connect_accepted_socket(lambda: connection, sock)
        except OSError as exc:
            # Gone meanwhile (the client left): its session is released as any other.
            log.info("handed-over connection lost", error=str(exc))
            sock.close()
            return
        # Attached to the node as the connection was made: what the store has yet to keep.
        link = connection.link
        stored = record.stored_token
        if stored and link is not None and link.heartbeat_request is not None:
            link.heartbeat_request = link.heartbeat_request._replace(token=stored)
        if record.pings is not None and gate.settings.max_frame_rate:
            connection.pings = bucket(gate.settings.max_frame_rate, record.pings, time.monotonic())


def _move(session: Session, source: str, since_ms: int, to: str) -> MoveRequest:
    claims = session.claims
    assert claims is not None  # WELCOMEd
    return MoveRequest.of(claims.tid, source, since_ms, to)


# A socket whose ``family`` and ``type`` read as the plain numbers the OS gives: those of
# socket.socket make an enum member of each, each time they are read, which costs more
# than the rest of the socket object (the loop reads them three times as it takes one).
_Socket = type(
    "_Socket",
    (socket.socket,),
    {"__slots__": (), "family": _socket.socket.family, "type": _socket.socket.type},
)


# The takers running, kept until they end (the loop holds its tasks weakly).
_TAKING: set[asyncio.Task[None]] = set()


def _close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        os.close(fd)
