"""The drain: a node closes every connection with 1001, spread over ``drain_period``.

One close loop for the drain on SIGTERM and for the stop (period 0: all at once).
Batches are due at fixed times against the loop's clock (a late batch is caught up
by bigger next ones, at most :data:`CATCH_UP` batches at once, so the drain ends near
``drain_period`` unless its closes alone take longer), and between two batches the
loop serves the connections not yet closed: their heartbeats are answered
throughout. Each batch's sessions are parked before their clients hear the 1001
(:meth:`tokend.server.node.Node.going_away`, docs/protocol.md §5, "Planned close"); one
timer per batch, not one per connection, bounds the batch's closing handshakes; one
log line per batch. docs/operations.md, "Graceful drain".
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import socket
import struct
from collections.abc import Sequence

import structlog

from tokend.server.admission import Admission
from tokend.server.connection import CLOSE_TIMEOUT, Connection
from tokend.server.node import Node

log = structlog.get_logger("tokend.drain")

# Least time between two batches of a drain's closes.
DRAIN_TICK = 0.05
# Most batches' worth of closes a late drain catches up at once: closing thousands in
# one go would stall the heartbeats of the rest for as long as their closes take.
CATCH_UP = 4
# struct tcp_info up to tcpi_unacked, which a listening socket fills with the length of
# its accept queue (Linux: tcp_get_info).
_TCP_INFO = struct.Struct("8B5I")


class AcceptQueue:
    """The accept queue of a listening socket this process no longer accepts on: how
    many connections wait for the processes that still do."""

    def __init__(self, listening: int, limit: int) -> None:
        # A copy of the listening socket's descriptor: the server closes its own when it
        # stops accepting.
        self.socket = socket.socket(fileno=os.dup(listening))
        self.limit = limit

    def length(self) -> int | None:
        """Connections waiting to be accepted; None where TCP_INFO cannot tell (not Linux)."""
        option = getattr(socket, "TCP_INFO", None)
        if option is None:
            return None
        try:
            info = self.socket.getsockopt(socket.IPPROTO_TCP, option, _TCP_INFO.size)
        except OSError:
            return None
        return _TCP_INFO.unpack_from(info)[-1] if len(info) >= _TCP_INFO.size else None

    def behind(self) -> int | None:
        """The queue's length when over the limit (the accepting processes are behind)."""
        length = self.length()
        return length if self.limit and length is not None and length > self.limit else None

    def close(self) -> None:
        self.socket.close()


class Drain:
    """Closes the connections ``admission`` holds, once ``server`` stops accepting."""

    def __init__(
        self,
        admission: Admission,
        node: Node,
        server: asyncio.Server,
        accept_queue: AcceptQueue | None = None,
    ) -> None:
        self.admission = admission
        self.node = node
        self.server = server
        self.accept_queue = accept_queue  # a reload's: the new workers accept
        self.park = True  # until Redis fails to take a batch's parks

    async def run(self, period: float, hurry: asyncio.Event) -> None:
        """Stop accepting, close every connection with 1001 spread over ``period`` (0: at
        once), then wait for their closing handshakes.

        Sessions stay resumable, each parked before its client is told (one round trip
        per batch, the batches' round trips overlapping; none more once Redis failed to
        answer one). Once ``hurry`` is set, the rest are closed at once, without waiting
        for Redis. With an ``accept_queue`` over its limit the schedule is held, for at
        most ``period`` in all.
        """
        self.admission.draining = True
        self.server.close()
        connections = list(self.admission.connections)
        n = len(connections)
        loop = asyncio.get_running_loop()
        start = loop.time()
        ticks = max(1, min(n, int(period / DRAIN_TICK)))
        slot = period / ticks
        if n:
            log.info("draining", connections=n, period=period, batches=ticks)
        closing: list[asyncio.Task[None]] = []
        done = tick = 0
        held = 0.0  # seconds the schedule was held for the accepting workers
        while done < n:
            waiting = self._accept_queue_behind(held, period, hurry)
            if waiting is not None:
                # Hold the schedule, not just this batch: no catch-up burst after it.
                if not held:
                    log.warning("drain held: the accepting workers are behind", waiting=waiting)
                began = loop.time()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(DRAIN_TICK):
                        await hurry.wait()
                waited = loop.time() - began
                start += waited
                held += waited
                continue
            if hurry.is_set():
                if tick < ticks:
                    log.warning("second signal: closing every connection now", left=n - done)
                tick = ticks
            else:
                # The batch due now; a late loop catches up on the ones it missed, a
                # few batches at a time.
                late = math.floor((loop.time() - start) / slot) + 1 if slot else ticks
                tick = max(tick + 1, min(ticks, late, tick + CATCH_UP))
            due = n * tick // ticks
            batch = connections[done:due]
            done = due
            # Each batch waits for its own parks, not for the batches before it: a slow
            # Redis delays a batch's closes, never the schedule.
            wait = self.park and not hurry.is_set()
            closing.append(asyncio.create_task(self._close(batch, n - done, wait=wait)))
            if done < n:
                # Yield to the loop until the next batch is due (at once if it is).
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout_at(start + tick * slot):
                        await hurry.wait()
        await asyncio.gather(*closing)
        if held:
            log.info("drain was held", held=round(held, 1))
        await self._closed_within(CLOSE_TIMEOUT + 1)

    def _accept_queue_behind(self, held: float, period: float, hurry: asyncio.Event) -> int | None:
        """The accept queue's length when the next batch should wait for the accepting
        workers: over its limit, unless the drain was already held ``period`` in all or is
        hurried."""
        if self.accept_queue is None or held >= period or hurry.is_set():
            return None
        return self.accept_queue.behind()

    async def _close(self, batch: Sequence[Connection], left: int, *, wait: bool) -> None:
        """Close the batch's connections still open, once their sessions are parked (with
        ``wait``); one timer drops the ones whose clients have not finished the closing
        handshake within CLOSE_TIMEOUT."""
        open_now = self.admission.connections
        batch = [c for c in batch if c in open_now]
        for connection in batch:
            # Their closing handshakes are bounded by the batch's timer, not one each.
            connection.closing = True
        parked = await self.node.going_away(batch, wait=wait)
        if not parked:
            self.park = False  # Redis did not answer: the next batches close without waiting
        asyncio.get_running_loop().call_later(CLOSE_TIMEOUT, self._drop, batch)
        log.info("drained a batch", closed=len(batch), left=left, parked=parked and wait)

    def _drop(self, batch: Sequence[Connection]) -> None:
        open_now = self.admission.connections
        for connection in batch:
            if connection in open_now and connection.transport is not None:
                connection.transport.abort()

    async def _closed_within(self, seconds: float) -> None:
        """Wait until every connection is gone; after ``seconds``, drop what is left."""
        admission = self.admission
        if admission.connections:
            admission.all_closed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(seconds):
                    await admission.all_closed.wait()
        for connection in list(admission.connections):
            if connection.transport is not None:
                connection.transport.abort()
        if admission.connections:
            # Each aborted connection ends at the loop's next turn (connection_lost), where
            # its node is told to release its session: before the node stops, not after.
            admission.all_closed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1):
                    await admission.all_closed.wait()
