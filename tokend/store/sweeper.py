"""The sweeper: every node makes the due WARN/EXPIRED transitions of every shard, so no
clock dies with a node (docs/protocol.md "Session states and clocks", Sweeping).

A sweep is one sweep.lua call per shard, all in one round trip; each call finds its
shard's due sessions and judges them (as :func:`tokend.core.lifecycle.due_transition` decides) in
one atomic step, so two nodes sweeping at once, or a node dying mid-sweep, can neither
double a transition nor lose one.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable

import structlog

from tokend.config import Settings
from tokend.core.protocol import CloseCode
from tokend.core.store_messages import Swept
from tokend.metrics import Metrics
from tokend.store.sessions import Store
from tokend.store.unavailable import Retry, StoreUnavailable

log = structlog.get_logger("tokend.sweeper")

# Due sessions one sweep.lua call judges at most, per shard. The 16 calls of a sweep go in
# one pipeline, which Redis runs without serving anyone else, so this bounds how long a
# sweep holds Redis: an expiry is about ten commands (an XADD and a PUBLISH among them;
# bench/results/2026-12-04-expiry.md). A sweep that found this many in a shard is followed by
# the next at once: 10,000 due at once take 4 round trips. Deadlines falling at 20,000 a
# second leave about 100 due in all after a MIN_SWEEP_PAUSE.
SWEEP_BATCH = 200
# Shortest pause between sweeps that found work ahead: bounds the round trips a node
# spends on deadlines falling due one by one.
MIN_SWEEP_PAUSE = 0.005

# Told to warn ("notice") or close a connection of this node: (op, tid, conn, code).
Act = Callable[[str, str, str, int | None], None]


class Sweeper:
    """Sweeps every shard, forever: at least every ``sweep_interval``, sooner for the
    earliest deadline it knows of, at once again when a shard filled its batch.

    ``act`` warns or closes a connection of this node that a transition concerns (the
    script sends no control message for those). ``replay_first`` says whether heartbeats
    held through an outage are still to be stored (and has them stored): the sweep waits
    for them, or their sessions would be warned or expired wrongly.
    """

    def __init__(
        self,
        store: Store,
        settings: Settings,
        metrics: Metrics,
        act: Act,
        replay_first: Callable[[], bool],
        batch: int = SWEEP_BATCH,
    ) -> None:
        self.store = store
        self.interval = settings.sweep_interval
        self.metrics = metrics
        self.act = act
        self.replay_first = replay_first
        self.batch = batch
        # Redis time of this node's first sweep: a node that has just begun serving holds
        # parked sessions while their clients come back (tokend.core.lifecycle.parked_hold).
        self.since_ms = 0

    async def run(self, running: Callable[[], bool]) -> None:
        """Sweep until ``running()`` is false."""
        retry = Retry(first=2 * self.interval)
        while running():
            pause = self.interval
            try:
                if not self.replay_first():
                    pause = await self.sweep_once()
                retry.succeeded()
            except StoreUnavailable as exc:
                log.warning("sweep skipped: store unavailable", error=str(exc))
                pause = retry.failed()
            except Exception:
                log.exception("sweep failed")
            if pause:
                await asyncio.sleep(pause)

    async def sweep_once(self) -> float:
        """Make every shard's due transitions (one round trip); warn or close those held here.

        Returns how long to wait before the next sweep: none when a shard filled its
        batch (more may be due there), else until the earliest deadline left, within
        [MIN_SWEEP_PAUSE, sweep_interval]: a deadline is met within a few milliseconds
        rather than up to a whole interval late.
        """
        loop = asyncio.get_running_loop()
        began = loop.time()
        swept = await self.store.sweep(self.batch, self.since_ms)
        self.since_ms = self.since_ms or swept.now_ms
        if swept.made:
            self._report(swept.made)
        if swept.full:
            return 0.0
        # The earliest deadline as of the sweep, less the time the sweep took since.
        due = swept.next_due_ms
        until_due = self.interval if due is None else (due - swept.now_ms) / 1000
        until_due -= loop.time() - began
        return min(self.interval, max(MIN_SWEEP_PAUSE, until_due))

    def _report(self, made: list[tuple[str, Swept, str]]) -> None:
        """Act on the transitions a sweep made and log them: each WARN (the spec asks for
        it), the expiries of a sweep in one line. Only the one node whose script made them
        logs them."""
        expired: Counter[str] = Counter()
        vanished = 0
        for tid, what, conn in made:
            if what is Swept.GONE:
                # Only when no node swept for expire_after past the token's exp: the
                # script dropped the orphaned deadline entry.
                vanished += 1
            elif what is Swept.WARN:
                log.warning("session warn", tid=tid)
                if conn:
                    self.act("notice", tid, conn, None)
            else:
                expired[what] += 1
                self.metrics.expired(what)
                if conn:
                    self.act("close", tid, conn, CloseCode.SESSION_EXPIRED)
        if vanished:
            log.warning("sessions vanished unswept", count=vanished)
        if expired:
            log.info("sessions expired", count=expired.total(), reasons=dict(expired))
