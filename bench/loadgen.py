"""Load generator process: many picows WebSocket clients on one uvloop loop.

picows builds and parses frames in Cython and calls back synchronously on every frame,
without a task or a queue per connection, so one process drives far more round trips
than a Python server can answer; the harness prints this process's CPU next to each
figure, so a saturated client would show.

:class:`bench.common.ClientPool` starts it as ``python -m bench.loadgen JOB`` where JOB
is JSON: ``url``, ``proto`` (``tokend``, ``bare`` or ``socketio``), ``tokens`` (a file,
one token per line), ``first`` and ``count`` (this process's slice of that file),
``source`` (the local address its connections come from, "" for any: each loopback
address has its own ephemeral ports, so many processes can hold more connections
than one address's port range); optionally ``ca_file`` (for a ``wss://`` url: the CA
whose certificates it trusts; it verifies the server's, as a real client does) and
``going_away_window`` (seconds; the SDK's :class:`tokend_client.Backoff` default, 5 s,
when absent) and ``connect_timeout`` (seconds a connect may take to WELCOME, 20 by
default; one given up is counted by its stage: ``timeout before the upgrade`` or
``timeout awaiting WELCOME``), ``event_loop`` (``uvloop``, the default, or
``asyncio``: the standard library's loop) and ``opening_at_once`` (reconnects opening at
once, the rest waiting their turn: one process stands for thousands of clients, each of
which would open its own connection on its own CPU; unbounded by default).
Commands arrive as JSON lines on stdin; each is answered by one JSON line on stdout:

* ``connect {concurrency, retry_for, heartbeat, heartbeat_for}``: open the connections
  (tokend and bare: handshake, HELLO, WELCOME; socketio: handshake, engine.io OPEN,
  namespace CONNECT), timed; for ``retry_for`` seconds from a connection's first
  attempt, a refusal the client should retry (HTTP 503, a reconnectable close code) is
  retried with the SDK's backoff (Retry-After honoured). With ``heartbeat`` (seconds,
  tokend), each connection heartbeats from its own WELCOME as the SDK does (one at
  once, then every ``heartbeat``), until the next command's heartbeats take over or
  ``heartbeat_for`` seconds have passed: an open longer than ``warn_after`` puts no
  session in WARN. The reply counts those heartbeats (sent so far) and the
  connections lost after their WELCOME.
* ``loop {warmup, duration}``: closed loop (heartbeat -> ACK, or emit -> ack) on every
  connection; ACKs and latencies inside the measured window. Its heartbeats are signed,
  framed and masked before it starts (enough for :data:`LOOP_PREBUILT_RATE` ACKs a
  second), so that the loop costs this process a write and a read per ACK; the reply
  says what building them cost and how many were built in the loop past them.
* ``burst``: one heartbeat on every connection at once; ACKs and renewals, timed.
* ``soak {interval, duration, reconnect, flood, flood_for, flood_per_write, spread}``:
  every connection heartbeats every ``interval`` seconds (every ``flood`` seconds for the
  first ``flood_for``; staggered, open loop: a heartbeat does not wait for the previous
  ACK) for ``duration``. The flood is built before it begins (:class:`Flood`: every
  heartbeat of it signed, framed and masked, ``flood_per_write`` to a write) and
  written as it is, so that the flood costs this process a write per connection per
  ``flood_per_write`` heartbeats and nothing per heartbeat; its ACKs are not timed.
  A connection that heartbeated keeps its cadence, or with ``spread`` moves to an even
  share of the interval (connections opened together heartbeat
  together otherwise, as real clients do not); heartbeats sent and ACKed, ACK latencies
  (and, by wall-clock second, ACKs, those slower than 250 ms and the slowest), and every
  connection lost meanwhile with its close code (``load_tests/soak.py``). With ``reconnect``, a
  connection closed with a reconnectable code (or dropped) reconnects and resumes its
  session as the Python SDK does: the first reconnect after a 1001 spread over
  ``going_away_window``, then full-jitter backoff, Retry-After of an HTTP 503 honoured,
  and HELLO with the resume proof of the last WELCOME; the reply counts the resumes,
  the refusals met on the way (HTTP 503) and when each resume happened. With
  ``connect``, the connections not open yet connect the same way (a connect storm
  whose sessions keep the cadence from their WELCOME).
* ``prepare_flood {every, seconds, per_write}``: build the next soak's flood now (a
  ``flood`` of ``every`` seconds for ``seconds``, ``per_write`` to a write), so that the
  soak writes it without building it; the reply says the frames and the CPU seconds.
* ``drop``: drop every connection (no close handshake), keep what each learnt (token,
  session key: the next ``connect`` resumes with the resume proof, as the SDK does);
  the reply comes once every connection is down on this side.
* ``exit``: drop every connection (no close handshake) and end.

tokend and the bare server get byte-identical traffic: the same HELLO, the same
50-byte heartbeats with a valid HMAC proof and increasing seq.
"""

from __future__ import annotations

import asyncio
import base64
import faulthandler
import gc
import itertools
import json
import math
import os
import resource
import socket
import ssl
import struct
import sys
import time
from array import array
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from typing import Any

import uvloop
from picows import (
    WSFrame,
    WSInvalidStatusError,
    WSListener,
    WSMsgType,
    WSTransport,
    ws_connect,
)

from tokend.core import protocol as p
from tokend.edge.websocket import unmask
from tokend_client.backoff import Backoff, going_away_limit, retry_after

# The heartbeat's signed part, as in tokend.core.protocol; checked against the codec once
# per connection (Conn._welcome), then built here without the codec's dataclasses.
_SIGNED = struct.Struct(">BB16sQQ")
# Plain values: on Python 3.11 an Enum class's attribute is read through a hook, and
# these are read once per frame.
_HEARTBEAT = p.FrameType.HEARTBEAT.value
_ACK = p.FrameType.HEARTBEAT_ACK.value
_NOTICE = p.FrameType.NOTICE.value
_BINARY, _TEXT, _CLOSE = WSMsgType.BINARY, WSMsgType.TEXT, WSMsgType.CLOSE
# An ACK's flags (byte 1) that say it carries a token: renewed, or re-sent.
_ACK_CARRIES_TOKEN = p.ACK_RENEWED | p.ACK_RESENT
# Socket.IO over engine.io v4: OPEN, CONNECT, EVENT and ACK packets; PING/PONG.
_SIO_OPEN, _SIO_CONNECT, _SIO_ACK = b"0{", b"40", b"43"
_SIO_PING, _SIO_PONG = b"2", b"3"
CONNECT_TIMEOUT = 20.0
_ABORT = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST
MAX_SAMPLES = 2_000_000
SLOW_ACK_US = 250_000  # an ACK slower than this is counted in the soak's timeline
SOAK_GRACE_S = 2.0  # after a soak, how long the last heartbeats' ACKs may take
# A soak's probe of this process's own loop: a timer every LAG_TICK_S, and how late it
# ran. An ACK's latency is taken when this loop reads it, so it includes this lateness.
LAG_TICK_S = 0.05
# A prebuilt flood's connections are written in slices this many seconds apart over each
# tick: what the server reads at once is the same whatever the frames to a write.
FLOOD_SLICE_S = 0.05
# The closed loop's heartbeats are built before it starts (Conn.prebuild_loop), enough for
# this many ACKs a second over its warm-up and window; past them they are built in the loop
# (counted: ``built_live``).
LOOP_PREBUILT_RATE = 200_000


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Closed(Exception):
    """The server closed the connection; ``code`` is its close code."""

    def __init__(self, code: int) -> None:
        super().__init__(f"closed by server with {code}")
        self.code = code


class ConnectTimeout(TimeoutError):
    """A connect given up after the job's ``connect_timeout`` (``CONNECT_TIMEOUT``):
    before the upgrade's answer (the TCP connect, or the server's 101, was late: an
    accept queue) or after it, awaiting WELCOME (the HELLO was late: its worker's loop,
    or its round trip to Redis)."""

    def __init__(self, upgraded: bool) -> None:
        self.stage = "timeout awaiting WELCOME" if upgraded else "timeout before the upgrade"
        super().__init__(self.stage)


def retryable(exc: BaseException) -> bool:
    """A failed connect or a lost connection the spec's client tries again."""
    if isinstance(exc, Closed):
        return exc.code in p.RECONNECTABLE
    return not isinstance(exc, p.ProtocolError)


def failure_name(exc: BaseException) -> str:
    if isinstance(exc, Closed):
        return f"close {exc.code}"
    if isinstance(exc, WSInvalidStatusError) and exc.response is not None:
        return f"http {exc.response.status}"
    if isinstance(exc, ConnectTimeout):
        return exc.stage
    return type(exc).__name__


def refusal_retry_after(exc: BaseException) -> float | None:
    """The Retry-After (seconds) of a refused handshake, if it said one."""
    if isinstance(exc, WSInvalidStatusError) and exc.response is not None:
        return retry_after(exc.response.headers.get("Retry-After"))
    return None


class Attempt(WSListener):
    """One connection attempt of a :class:`Conn`. Only the current attempt speaks for it:
    one given up on (timed out) may still complete later, and must not answer then."""

    def __init__(self, conn: Conn) -> None:
        super().__init__()
        self.conn = conn

    def on_ws_connected(self, transport: WSTransport) -> None:
        if self.conn.attempt is self:
            self.conn.on_ws_connected(transport)
        else:
            transport.disconnect(graceful=False)

    def on_ws_frame(self, transport: WSTransport, frame: WSFrame) -> None:
        if self.conn.attempt is self:
            self.conn.on_ws_frame(transport, frame)

    def on_ws_disconnected(self, transport: WSTransport) -> None:
        if self.conn.attempt is self:
            self.conn.on_ws_disconnected(transport)


class Conn:
    """One client connection; ``on_data`` is the handler of the current phase."""

    def __init__(self, gen: Generator, token: str) -> None:
        self.gen = gen
        self.attempt: Attempt | None = None
        self.token = token
        self.transport: WSTransport | None = None
        self.ready: asyncio.Future[None] = gen.loop.create_future()
        self.answered: asyncio.Future[p.HeartbeatAck] | None = None
        self.on_data: Callable[[bytes], None] = self._opening
        self.key = b""
        self.tid = b""
        self.exp_ms = 0
        self.seq = 0
        self.sent_ns = 0
        self.mac_key = p.heartbeat_mac_key(b"")
        self.live = False  # WELCOMEd and not lost since
        self.last_sent = -math.inf  # loop time of the last soak heartbeat
        self.resumed = False  # the last WELCOME's flag
        self.timer_epoch = -1  # the generator's epoch of this connection's heartbeat timer
        self.spare = math.inf  # seconds a reconnect after 1001 may wait, from WELCOME
        # Soak: (seq, sent at) of the heartbeats not yet ACKed, oldest first.
        self.pending: deque[tuple[int, int]] = deque()
        # Closed loop: its next heartbeats, framed and masked (prebuild_loop), last first.
        self.prebuilt: list[bytes] = []

    # picows callbacks

    def on_ws_connected(self, transport: WSTransport) -> None:
        self.transport = transport
        self.seq = 0
        self.pending.clear()
        if self.gen.proto != "socketio":
            # A resume proves with the key of the last WELCOME, as the SDK does.
            proof = p.resume_proof(self.key, self.tid) if self.key else None
            transport.send(WSMsgType.BINARY, p.encode(p.Hello(self.token, proof=proof)))

    def on_ws_frame(self, transport: WSTransport, frame: WSFrame) -> None:
        msg_type = frame.msg_type  # read once: each read makes the enum member anew
        if msg_type in (_BINARY, _TEXT):
            self.on_data(frame.get_payload_as_bytes())
        elif msg_type == _CLOSE:
            code = frame.get_close_code()
            self._fail(Closed(code.value))
            transport.send_close(code)
            transport.disconnect()

    def on_ws_disconnected(self, transport: WSTransport) -> None:
        self._fail(ConnectionError("disconnected"))

    def _fail(self, exc: Exception) -> None:
        for future in (self.ready, self.answered):
            if future is not None and not future.done():
                future.set_exception(exc)
        if self.live:
            self.live = False
            if self.on_data == self._soak_reply:
                self.gen.connection_lost(self, exc)
        if self.on_data == self._loop_reply or self.on_data == self._sio_loop_reply:
            self.on_data = self._idle
            self.gen.lost += 1
            self.gen.loop_ended()

    # Opening

    def _opening(self, data: bytes) -> None:
        if self.ready.done():
            return  # given up on (timed out) while its answer was on the way
        if self.gen.proto == "socketio":
            if data.startswith(_SIO_OPEN):
                self._send(WSMsgType.TEXT, _SIO_CONNECT)
            elif data.startswith(_SIO_CONNECT):
                self.on_data = self._idle
                self.live = True
                self.ready.set_result(None)
            return
        try:
            frame = p.decode(data)
            if not isinstance(frame, p.Welcome):
                raise p.ProtocolError(f"expected WELCOME, got {type(frame).__name__}")
            self.key, self.tid, self.exp_ms = frame.session_key, frame.tid, frame.exp_ms
            self.mac_key = p.heartbeat_mac_key(self.key)
            if not self.gen.codec_checked:
                codec = p.encode(p.make_heartbeat(self.key, self.tid, 1, self.exp_ms))
                if self._heartbeat(1) != codec:
                    raise p.ProtocolError(
                        "load generator heartbeat differs from tokend.core.protocol"
                    )
                self.gen.codec_checked = True
        except p.ProtocolError as exc:
            self.ready.set_exception(exc)
            return
        self.resumed = frame.resumed
        self.spare = going_away_limit(frame)
        self.on_data = self._idle
        self.live = True
        self.ready.set_result(None)

    def _idle(self, data: bytes) -> None:
        if data == _SIO_PING and self.gen.proto == "socketio":
            self._send(WSMsgType.TEXT, _SIO_PONG)

    # Heartbeats

    def _heartbeat(self, seq: int) -> bytes:
        signed = _SIGNED.pack(_HEARTBEAT, 0, self.tid, seq, self.exp_ms)
        # HMAC-SHA256 from the key's hashed pads (tokend.core.protocol.heartbeat_mac_key),
        # as the server checks it: a third less than copying an hmac object.
        inner, outer = self.mac_key
        inner = inner.copy()
        inner.update(signed)
        outer = outer.copy()
        outer.update(inner.digest())
        return signed + outer.digest()[: p.MAC_LENGTH]

    def masked_heartbeats(self, count: int) -> list[bytes]:
        """The next ``count`` heartbeats (their seqs taken now), each a masked binary
        WebSocket frame (RFC 6455 5.2, 5.3), ready to be written as they are."""
        head = bytes((0x82, 0x80 | p.HEARTBEAT_LENGTH))
        keys = os.urandom(4 * count)
        frames = []
        for at in range(0, 4 * count, 4):
            self.seq += 1
            key = keys[at : at + 4]
            frames.append(head + key + unmask(self._heartbeat(self.seq), key))
        return frames

    def flood_writes(self, writes: int, per_write: int) -> list[bytes]:
        """The next ``writes * per_write`` heartbeats, ``per_write`` to a write."""
        frames = self.masked_heartbeats(writes * per_write)
        return [b"".join(frames[i : i + per_write]) for i in range(0, len(frames), per_write)]

    def _send(self, kind: WSMsgType, data: bytes) -> None:
        assert self.transport is not None
        self.transport.send(kind, data)

    def send_next(self) -> None:
        """Send the next heartbeat (as a Socket.IO emit with ack for socketio)."""
        self.seq += 1
        frame = self._heartbeat(self.seq)
        if self.gen.proto == "socketio":
            event = b'42%d["hb","%s"]' % (self.seq, base64.b64encode(frame))
            self.sent_ns = time.perf_counter_ns()
            self._send(WSMsgType.TEXT, event)
        else:
            self.sent_ns = time.perf_counter_ns()
            self._send(WSMsgType.BINARY, frame)

    # Closed loop

    def prebuild_loop(self, count: int) -> None:
        """Build the closed loop's next ``count`` heartbeats now (not for Socket.IO, whose
        emits are text): signing and masking them is most of what the client does per
        ACK in Python, which would otherwise bound the rates it can measure."""
        if self.gen.proto != "socketio":
            self.prebuilt = self.masked_heartbeats(count)[::-1]  # popped from the end

    def start_loop(self) -> None:
        self.on_data = self._sio_loop_reply if self.gen.proto == "socketio" else self._loop_reply
        self.send_loop_next()

    def send_loop_next(self) -> None:
        """The closed loop's next heartbeat: the next prebuilt frame while there are any."""
        if self.prebuilt:
            assert self.transport is not None
            self.sent_ns = time.perf_counter_ns()
            self.transport.underlying_transport.write(self.prebuilt.pop())
        else:
            self.gen.built_live += 1
            self.send_next()

    def _loop_reply(self, data: bytes) -> None:
        if data[0] != _ACK:
            return  # a NOTICE: not an answer
        self._answered()

    def _sio_loop_reply(self, data: bytes) -> None:
        if data.startswith(_SIO_ACK):
            self._answered()
        elif data == _SIO_PING:
            self._send(WSMsgType.TEXT, _SIO_PONG)

    def _answered(self) -> None:
        gen = self.gen
        now = time.perf_counter_ns()
        if now >= gen.window_end:
            self.on_data = self._idle
            self.prebuilt = []  # their seqs are skipped: the next heartbeat's is higher still
            gen.loop_ended()
            return
        if now >= gen.window_start:
            gen.acks += 1
            if len(gen.latencies) < MAX_SAMPLES:
                gen.latencies.append((now - self.sent_ns) // 1000)
        self.send_loop_next()

    # Soak: a heartbeat every `interval` until `end`, each ACK timed

    def soak_tick(self, epoch: int) -> None:
        """One tick of this connection's heartbeat timer; it ends once another command's
        heartbeats (another ``epoch``) took over, or at the generator's ``beat_until``."""
        gen = self.gen
        now = gen.loop.time()
        if epoch != gen.epoch or now >= gen.beat_until:
            return
        pause = gen.flood if now < gen.flood_end else gen.interval
        if self.live and self.on_data == self._soak_reply:
            if now - self.last_sent < pause / 2:
                # Just resumed, and its first heartbeat went out on WELCOME (as the SDK
                # does): keep the cadence from there.
                pause = self.last_sent + pause - now
            else:
                self.soak_beat(now)
        gen.loop.call_later(pause, self.soak_tick, epoch)

    def start_timer(self, delay: float) -> None:
        """This connection's heartbeat timer, first tick in ``delay`` seconds (none if it
        already has one for the current command)."""
        gen = self.gen
        if self.timer_epoch != gen.epoch:
            self.timer_epoch = gen.epoch
            gen.loop.call_later(delay, self.soak_tick, gen.epoch)

    def welcomed_soaking(self) -> None:
        """On WELCOME during heartbeats: the first at once, as the SDK does, then the
        cadence from there."""
        self.on_data = self._soak_reply
        self.soak_beat(self.gen.loop.time())
        self.start_timer(self.gen.interval)

    def soak_beat(self, now: float) -> None:
        self.gen.sent += 1
        self.send_next()
        self.pending.append((self.seq, self.sent_ns))
        self.last_sent = now

    def _soak_reply(self, data: bytes) -> None:
        if data[0] != _ACK:
            return  # a NOTICE: counted by the server's events, not an answer
        if not self.pending and not data[1] & _ACK_CARRIES_TOKEN:
            return  # a flood heartbeat's ACK (not timed) without a token: nothing to read
        gen = self.gen
        ack = p.decode(data)
        assert isinstance(ack, p.HeartbeatAck)
        pending = self.pending
        while pending and pending[0][0] < ack.seq:  # unanswered: the ACKs come in order
            pending.popleft()
        if not pending:
            return
        gen.acks += 1
        latency = (time.perf_counter_ns() - pending.popleft()[1]) // 1000
        if len(gen.latencies) < MAX_SAMPLES:
            gen.latencies.append(latency)
        gen.ack_second(latency)
        if ack.token:
            self.exp_ms = ack.exp_ms
            self.token = ack.token  # a resume must present the newest

    # Burst

    def burst(self) -> asyncio.Future[p.HeartbeatAck]:
        self.answered = self.gen.loop.create_future()
        self.on_data = self._burst_reply
        self.seq += 1
        self._send(
            WSMsgType.BINARY, p.encode(p.make_heartbeat(self.key, self.tid, self.seq, self.exp_ms))
        )
        return self.answered

    def _burst_reply(self, data: bytes) -> None:
        if data[0] == _NOTICE:
            return
        frame = p.decode(data)
        assert self.answered is not None and isinstance(frame, p.HeartbeatAck)
        if frame.token:
            self.exp_ms = frame.exp_ms
        self.on_data = self._idle
        self.answered.set_result(frame)


class Flood:
    """Heartbeats faster than the cadence, built before they are sent: each connection's
    writes of ``per_write`` frames, written one per ``every * per_write`` seconds, the
    connections spread over that tick in slices :data:`FLOOD_SLICE_S` apart. A connection that
    reconnected meanwhile (another transport: its frames carry the old key) is left out."""

    def __init__(
        self, gen: Generator, conns: list[Conn], every: float, seconds: float, per_write: int
    ) -> None:
        self.gen = gen
        self.tick = every * per_write
        writes = max(1, round(seconds / self.tick))
        self.plans = [(c, c.transport, c.flood_writes(writes, per_write)) for c in conns]
        self.per_write = per_write
        self.writes = writes
        self.frames = writes * per_write * len(self.plans)

    def start(self) -> None:
        slices = max(1, round(self.tick / FLOOD_SLICE_S))
        step = max(1, -(-len(self.plans) // slices))
        for index, first in enumerate(range(0, len(self.plans), step)):
            delay = self.tick * index / slices
            self.gen.loop.call_later(delay, self._write, first, first + step, 0)

    def _write(self, first: int, end: int, nth: int) -> None:
        gen = self.gen
        if nth + 1 < self.writes:
            gen.loop.call_later(self.tick, self._write, first, end, nth + 1)
        written = 0
        for conn, transport, writes in self.plans[first:end]:
            if conn.transport is transport and transport is not None and conn.live:
                transport.underlying_transport.write(writes[nth])
                written += 1
        gen.sent += written * self.per_write


class Generator:
    """This process's connections and the commands that drive them."""

    def __init__(self, job: dict[str, Any]) -> None:
        self.loop = asyncio.get_running_loop()
        self.url: str = job["url"]
        self.proto: str = job["proto"]
        tokens = [""] * job["count"]
        if job["tokens"]:
            with open(job["tokens"]) as fh:
                lines = fh.read().split()
            tokens = lines[job["first"] : job["first"] + job["count"]]
            if len(tokens) != job["count"]:
                raise SystemExit(f"token file has too few tokens for {job}")
        self.conns = [Conn(self, t) for t in tokens]
        # This process's heartbeat encoder held to tokend.core.protocol's, on its first WELCOME.
        self.codec_checked = False
        # A local address of its own: its ephemeral ports are not shared with others.
        self.local_addr = (job["source"], 0) if job.get("source") else None
        ca_file = job.get("ca_file")
        self.ssl_context = ssl.create_default_context(cafile=ca_file) if ca_file else None
        self.headers = {} if self.proto == "socketio" else {"Sec-WebSocket-Protocol": p.SUBPROTOCOL}
        self.connect_timeout: float = job.get("connect_timeout", CONNECT_TIMEOUT)
        # Reconnects opening at once (each timed from its own start); unbounded unless set.
        self.opening = asyncio.Semaphore(job.get("opening_at_once") or len(self.conns) or 1)
        # The Python SDK's: full jitter, 0.5 s doubling up to 30 s; 1001 and 503 waited out.
        window = job.get("going_away_window")
        self.backoff = Backoff() if window is None else Backoff(going_away_window=window)
        self.latencies: array[int] = array("q")
        self.acks = 0
        self.lost = 0
        self.sent = 0
        self.built_live = 0  # closed-loop heartbeats built in the loop, past the prebuilt
        self.closes: Counter[str] = Counter()
        # Soak with reconnects: refusals met, resumes (by wall-clock tenth of a second),
        # new sessions.
        self.soaking = False
        self.reconnect = False
        self.refusals: Counter[str] = Counter()
        self.resumed_at: Counter[int] = Counter()
        self.started_anew = 0
        self.gave_up: Counter[str] = Counter()
        self.first_close: dict[str, float] = {}  # close code -> wall time it was first seen
        # Soak: by wall-clock second, [ACKs, those slower than SLOW_ACK_US, slowest (us),
        # this loop's lateness (us, the most of the second's LAG_TICK_S timers)].
        self.timeline: dict[int, list[int]] = {}
        self.reconnecting: set[asyncio.Task[None]] = set()
        self.running = 0
        self.window_start = self.window_end = 0
        self.ended = asyncio.Event()
        # Heartbeats: each command that sends them starts an epoch (the timers of the one
        # before end at their next tick), at ``interval`` (``flood`` until ``flood_end``),
        # until ``beat_until`` (loop time).
        self.epoch = 0
        self.interval = self.flood = self.flood_end = 0.0
        self.beat_until = -math.inf
        self.prepared: Flood | None = None  # the next soak's flood, built (prepare_flood)

    async def open(self, conn: Conn) -> None:
        """Connect, handshake and (tokend) HELLO → WELCOME; raises what went wrong."""
        conn.ready = self.loop.create_future()
        conn.on_data = conn._opening
        conn.transport = None
        attempt = conn.attempt = Attempt(conn)
        try:
            async with asyncio.timeout(self.connect_timeout):
                await ws_connect(
                    lambda: attempt,
                    self.url,
                    extra_headers=self.headers,
                    websocket_handshake_timeout=self.connect_timeout,
                    local_addr=self.local_addr,
                    ssl_context=self.ssl_context,
                )
                await conn.ready
        except BaseException as exc:
            # Given up (a timeout, a refusal): this attempt must not answer for the next.
            conn.attempt = None
            transport, conn.transport = conn.transport, None
            if transport is not None and not transport.is_disconnected:
                transport.disconnect(graceful=False)
            if isinstance(exc, TimeoutError):
                raise ConnectTimeout(transport is not None) from exc
            raise

    def begin_heartbeats(
        self, interval: float, duration: float, flood: float = 0.0, flood_for: float = 0.0
    ) -> None:
        """A new epoch of heartbeats (the timers of the last one end at their next tick)
        with their counters from zero; a heartbeat still unanswered is not this epoch's."""
        self.epoch += 1
        now = self.loop.time()
        self.interval, self.flood = interval, flood
        self.flood_end = now + flood_for if flood else 0.0
        self.beat_until = now + duration
        self.latencies = array("q")
        self.acks = self.sent = self.started_anew = 0
        for counts in (self.closes, self.refusals, self.resumed_at, self.gave_up):
            counts.clear()
        self.first_close.clear()
        self.timeline = {}
        for conn in self.conns:
            conn.pending.clear()

    async def connect(
        self,
        concurrency: int,
        retry_for: float = 0.0,
        heartbeat: float = 0.0,
        heartbeat_for: float = 0.0,
    ) -> dict[str, Any]:
        errors: Counter[str] = Counter()
        latencies: list[int] = []
        pending = iter(self.conns)
        cpu0, t_start = cpu_seconds(), time.time()
        if heartbeat:
            self.begin_heartbeats(heartbeat, heartbeat_for)

        async def one(conn: Conn) -> None:
            began = time.perf_counter_ns()
            # Each connection's own window: an open of minutes retries its last ones too.
            retry_until = self.loop.time() + retry_for
            for attempt in itertools.count():
                try:
                    await self.open(conn)
                except Exception as exc:
                    self.refusals[failure_name(exc)] += 1
                    if not retryable(exc) or self.loop.time() >= retry_until:
                        errors[failure_name(exc)] += 1
                        return
                    await asyncio.sleep(self.delay(conn, exc, attempt))
                else:
                    latencies.append((time.perf_counter_ns() - began) // 1000)
                    if heartbeat:
                        conn.welcomed_soaking()
                    return

        async def lane() -> None:
            for conn in pending:
                await one(conn)

        await asyncio.gather(*(lane() for _ in range(max(1, concurrency))))
        refusals, self.refusals = dict(self.refusals), Counter()
        return {
            "opened": len(latencies),
            "resumed": sum(c.resumed for c in self.conns if c.live),
            "failed": sum(errors.values()),
            "errors": dict(errors),
            "refusals": refusals,  # every failed attempt, retried or not
            # Heartbeats from each WELCOME (with ``heartbeat``), and connections lost
            # after theirs, by how.
            "sent": self.sent,
            "closes": dict(self.closes),
            "t_start": t_start,
            "t_end": time.time(),
            "cpu_s": cpu_seconds() - cpu0,
            "latencies_us": latencies,
        }

    async def closed_loop(self, warmup: float, duration: float) -> dict[str, Any]:
        self.latencies = array("q")
        self.acks = self.lost = self.built_live = 0
        live = [c for c in self.conns if c.ready.done() and not c.ready.exception()]
        self.running = len(live)
        self.ended.clear()
        cpu0 = cpu_seconds()
        if live:
            each = math.ceil(LOOP_PREBUILT_RATE * (warmup + duration) / len(live))
            for conn in live:
                conn.prebuild_loop(each)
        prebuild_cpu_s = cpu_seconds() - cpu0
        now = time.perf_counter_ns()
        self.window_start = now + int(warmup * 1e9)
        self.window_end = self.window_start + int(duration * 1e9)
        for conn in live:
            conn.start_loop()
        if not live:
            self.ended.set()
        try:
            async with asyncio.timeout(warmup + duration + 10):
                await self.ended.wait()
        except TimeoutError:
            pass
        return {
            "acks": self.acks,
            "window_s": duration,
            "unfinished": self.running,
            "lost": self.lost,
            "latencies_us": self.latencies.tolist(),
            "prebuild_cpu_s": round(prebuild_cpu_s, 2),
            "built_live": self.built_live,  # past the prebuilt ones: signed and masked in the loop
        }

    async def prepare_flood(self, every: float, seconds: float, per_write: int) -> dict[str, Any]:
        """Build the next soak's flood now (:class:`Flood`), so that its cost is not the
        flood's: the CPU seconds it took are answered."""
        cpu0 = cpu_seconds()
        self.prepared = Flood(self, [c for c in self.conns if c.live], every, seconds, per_write)
        return {"frames": self.prepared.frames, "cpu_s": round(cpu_seconds() - cpu0, 2)}

    def loop_ended(self) -> None:
        self.running -= 1
        if self.running <= 0:
            self.ended.set()

    async def soak(
        self,
        interval: float,
        duration: float,
        reconnect: bool = False,
        flood: float = 0.0,
        flood_for: float = 0.0,
        connect: bool = False,
        spread: bool = False,
        flood_per_write: int = 0,
    ) -> dict[str, Any]:
        live = [c for c in self.conns if c.live]
        prebuilt, self.prepared = self.prepared, None
        if flood and flood_per_write and prebuilt is None:  # the cadence runs from its end
            prebuilt = Flood(self, live, flood, flood_for, flood_per_write)
        self.begin_heartbeats(interval, duration, flood, flood_for)
        self.soaking, self.reconnect = True, reconnect
        now = self.loop.time()
        if prebuilt is not None:
            prebuilt.start()
        for i, conn in enumerate(live):
            conn.on_data = conn._soak_reply
            # A connection that has heartbeated keeps its cadence (from its WELCOME, or
            # from the command before; those overdue spread over a moment, not at once),
            # unless it floods now; the others are staggered over one pause.
            due = conn.last_sent + interval - now
            if prebuilt is not None:  # at the cadence once the flood written has ended
                conn.last_sent = now + flood_for
                delay = flood_for + interval * i / len(live)
            elif flood or due == -math.inf:
                delay = (flood or interval) * i / len(live)
            elif spread:
                # Each one's phase i/len(live) of an interval from half an interval after
                # its last (or from now, if that has passed): its next heartbeat stays on
                # cadence, at least half an interval after the last, and the connections
                # heartbeat evenly over the interval from then on.
                delay = max(due - interval / 2, 0.0) + interval * i / len(live)
            else:
                delay = due if due > 0 else SOAK_GRACE_S * i / len(live)
            conn.start_timer(delay)
        if connect:  # a connect storm: each new session keeps the cadence from its WELCOME
            for conn in self.conns:
                if not conn.live:
                    self._reconnect(conn)
        ends = self.loop.time() + duration + min(interval, SOAK_GRACE_S)
        self.probe_lag(self.loop.time(), ends)
        await asyncio.sleep(ends - self.loop.time())  # the last ACKs come in
        self.soaking = False
        for task in list(self.reconnecting):
            task.cancel()
        await asyncio.gather(*self.reconnecting, return_exceptions=True)
        for conn in live:
            if conn.on_data == conn._soak_reply:
                conn.on_data = conn._idle
        return {
            "connections": len(live),
            "live": sum(c.live for c in live),
            "sent": self.sent,
            "acks": self.acks,
            "closes": dict(self.closes),
            "first_close": self.first_close,
            "refusals": dict(self.refusals),
            "resumed_at": {str(k): v for k, v in self.resumed_at.items()},
            "started_anew": self.started_anew,
            "gave_up": dict(self.gave_up),
            "latencies_us": self.latencies.tolist(),
            "timeline": {str(k): v for k, v in self.timeline.items()},
        }

    def second(self) -> list[int]:
        """This wall-clock second's timeline entry."""
        return self.timeline.setdefault(int(time.time()), [0, 0, 0, 0])

    def probe_lag(self, due: float, until: float) -> None:
        """Note how late this loop ran the timer due at ``due`` (loop time); the next,
        until ``until``."""
        now = self.loop.time()
        entry = self.second()
        entry[3] = max(entry[3], int((now - due) * 1_000_000))
        if now < until:
            self.loop.call_at(now + LAG_TICK_S, self.probe_lag, now + LAG_TICK_S, until)

    def ack_second(self, latency_us: int) -> None:
        """Count an ACK (and how slow it was) in this wall-clock second's entry."""
        entry = self.second()
        entry[0] += 1
        entry[1] += latency_us > SLOW_ACK_US
        entry[2] = max(entry[2], latency_us)

    def connection_lost(self, conn: Conn, exc: Exception) -> None:
        """A soaking connection was closed or dropped: count it, and resume if asked."""
        name = str(exc.code) if isinstance(exc, Closed) else type(exc).__name__
        self.closes[name] += 1
        self.first_close.setdefault(name, time.time())
        if self.reconnect and self.soaking and retryable(exc):
            self._reconnect(conn, exc)

    def delay(self, conn: Conn, exc: BaseException | None, attempt: int) -> float:
        """The wait before reconnect attempt ``attempt`` after ``exc``, as the SDK's."""
        asked = refusal_retry_after(exc) if exc is not None else None
        if asked is not None:
            return self.backoff.after_refusal(attempt, asked)
        if isinstance(exc, Closed) and exc.code == p.CloseCode.GOING_AWAY:
            return self.backoff.after_going_away(attempt, conn.spare)
        return self.backoff.delay(attempt)

    def _reconnect(self, conn: Conn, lost: BaseException | None = None) -> None:
        """Resume (or, new, start) the session of ``conn`` (``lost``: how its connection
        ended)."""
        task = self.loop.create_task(self._resume(conn, lost))
        self.reconnecting.add(task)
        task.add_done_callback(self.reconnecting.discard)

    async def _resume(self, conn: Conn, lost: BaseException | None) -> None:
        """Reconnect with backoff until the session is resumed or the soak ends."""
        failure = lost
        for attempt in itertools.count():
            await asyncio.sleep(self.delay(conn, failure, attempt))
            try:
                async with self.opening:
                    await self.open(conn)
            except Exception as exc:
                self.refusals[failure_name(exc)] += 1
                if not retryable(exc):
                    self.gave_up[failure_name(exc)] += 1
                    return
                failure = exc
                continue
            if conn.resumed:
                self.resumed_at[int(time.time() * 10)] += 1  # tenths of a second
            else:
                self.started_anew += 1  # lost and begun again; or new, in a connect storm
            conn.welcomed_soaking()
            return

    async def burst(self) -> dict[str, Any]:
        cpu0, t_start = cpu_seconds(), time.time()
        replies = await asyncio.gather(
            *(c.burst() for c in self.conns if c.ready.done() and not c.ready.exception()),
            return_exceptions=True,
        )
        acks = [r for r in replies if isinstance(r, p.HeartbeatAck)]
        return {
            "acks": len(acks),
            "renewed": sum(a.renewed for a in acks),
            "resent": sum(a.resent for a in acks),
            "failed": len(replies) - len(acks),
            "t_start": t_start,
            "t_end": time.time(),
            "cpu_s": cpu_seconds() - cpu0,
        }

    async def drop_all(self) -> dict[str, Any]:
        """``drop``, answered once every connection is down here."""
        self.drop()
        for conn in self.conns:
            conn.live = False
            if conn.transport is not None:
                await conn.transport.wait_disconnected()
        return {"dropped": len(self.conns)}

    def drop(self) -> None:
        """Reset every connection: no close handshake, no FIN, so no TIME_WAIT.

        Thousands of client-side TIME_WAIT sockets would crowd the loopback ephemeral
        ports and slow every later connect() (the kernel searches for a free port).
        """
        for conn in self.conns:
            if conn.transport is not None and not conn.transport.is_disconnected:
                sock = conn.transport.underlying_transport.get_extra_info("socket")
                if sock is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _ABORT)
                conn.transport.disconnect(graceful=False)


async def serve(job: dict[str, Any]) -> None:
    # Collections traverse every held connection: run them between commands only.
    gc.disable()
    gen = Generator(job)
    commands: dict[str, Callable[..., Awaitable[dict[str, Any]]]] = {
        "connect": gen.connect,
        "loop": gen.closed_loop,
        "burst": gen.burst,
        "soak": gen.soak,
        "prepare_flood": gen.prepare_flood,
        "drop": gen.drop_all,
    }
    reader = asyncio.StreamReader()
    await gen.loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        args = json.loads(line)
        name = args.pop("cmd")
        if name == "exit":
            break
        try:
            reply = {"ok": True, **await commands[name](**args)}
        except Exception as exc:
            reply = {"ok": False, "error": repr(exc)}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
        gc.collect()
    gen.drop()


def main() -> None:
    # A crash below Python (an abort in the event loop's C code) leaves a stack in the log.
    faulthandler.enable()
    job = json.loads(sys.argv[1])
    if job.get("event_loop") == "asyncio":
        asyncio.run(serve(job))
    else:
        uvloop.run(serve(job))


if __name__ == "__main__":
    main()
