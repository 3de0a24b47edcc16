"""The node's batchers: many connections' store requests in one Redis round trip.

* :class:`HeartbeatBatcher` stores the heartbeats of many connections in one
  Redis round trip per flush and writes their ACKs from the flush; it holds and
  later replays those Redis could not take. :class:`HelloBatcher` does the same
  for HELLOs, :class:`ReleaseBatcher` for the sessions of connections that ended
  (flushed once more when the node stops)."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import time
from collections import Counter, deque
from typing import Generic, Protocol, TypeVar, cast

import structlog

from tokend.core.protocol import CloseCode
from tokend.core.session import SINCE_UNKNOWN
from tokend.core.store_messages import HeartbeatRequest, ReleaseOutcome
from tokend.server import seams
from tokend.store.sessions import HelloRequest, ReleaseRequest, Store
from tokend.store.unavailable import StoreUnavailable

log = structlog.get_logger("tokend.node")

Item = TypeVar("Item")


class Running(Protocol):
    """What a batcher's lanes read of their node (tokend.server.node.Node)."""

    @property
    def running(self) -> bool:
        """False once the node stops: the lanes end."""
        ...


class Batcher(Generic[Item]):
    """Links (or requests) waiting for one store round trip; the next starts when one
    ends.

    A lone request waits for no timer (but a heartbeat may: ``HeartbeatBatcher.gather``),
    while a busy node sends large batches. An item waits at most once (a dict keyed by
    it, in arrival order).
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self.waiting: dict[Item, None] = {}
        self._wake = asyncio.Event()

    def submit(self, item: Item) -> None:
        self.waiting[item] = None
        self._wake.set()

    def forget(self, item: Item) -> None:
        self.waiting.pop(item, None)

    @property
    def pending(self) -> int:
        """How many wait for the next flush."""
        return len(self.waiting)

    def is_waiting(self, item: Item) -> bool:
        return item in self.waiting

    async def run(self, node: Running, lanes: int = 1) -> None:
        """Flush until the node stops, with up to ``lanes`` round trips in flight at once:
        while Redis runs one batch's scripts, the node reads and answers the next."""
        await asyncio.gather(*(self._lane(node) for _ in range(lanes)))

    async def _lane(self, node: Running) -> None:
        while node.running:
            await self._wake.wait()
            self._wake.clear()
            await self.flush()

    async def flush(self) -> None:
        raise NotImplementedError


class HelloBatcher(Batcher[seams.SessionLink]):
    """HELLOs to start or resume sessions, answered with WELCOME (or a close) from the flush.

    Invariant: the connections of this node that held a HELLO's session and ended before
    that HELLO came are released in Redis before it is sent (:meth:`ReleaseBatcher.settle`),
    so a client that closes and comes straight back to the same node resumes, proof or
    not, instead of meeting its own ended connection as a live holder (4509). Releases of
    other sessions hold no HELLO back: under a reconnect storm through a slow Redis each
    HELLO left unanswered ends in a release, and a wait for all of them would add a
    round trip to every HELLO batch.

    One round trip at a time (one lane, whatever ``flush_lanes``): the HELLOs that come
    while it is out go together in the next. A round trip costs the node about as much
    whatever it carries, and with more lanes a resume storm's HELLOs would go a few per
    round trip instead of together (bench/results/2026-12-04-resume.md); the node goes on
    reading handshakes and HELLOs meanwhile.
    """

    def __init__(self, store: Store, releases: ReleaseBatcher) -> None:
        super().__init__(store)
        self.releases = releases

    async def flush(self) -> None:
        batch, self.waiting = list(self.waiting), {}
        requests = []
        for link in batch:
            session = link.session
            assert session.claims is not None
            c = session.claims
            requests.append(
                HelloRequest(
                    c.tid,
                    c.sub,
                    c.prio,
                    c.iat,
                    c.exp,
                    session.conn,
                    session.shown_proof,
                    session.next_proof,
                    session.token_digest,
                    session.unverified is None,
                )
            )
        await self.releases.settle({str(request.tid) for request in requests})
        try:
            answers = await self.store.hellos(requests)
        except Exception as exc:  # StoreUnavailable (1013) or a script error (1011)
            if not isinstance(exc, StoreUnavailable):
                log.exception("hello flush failed")
            unavailable = isinstance(exc, StoreUnavailable)
            for link in batch:
                link.hello_failed(unavailable)
            return
        for link, answer in zip(batch, answers, strict=True):
            link.hello_answered(answer)


# Seconds over which the heartbeat rate is taken, and the weight of one round trip in
# their moving mean (1/8: a few round trips tell, one slow one does not).
RATE_WINDOW = 0.25
ROUND_TRIP_WEIGHT = 8


def gathers(rate: float, round_trip: float, lanes: int = 1) -> bool:
    """Whether a heartbeat that finds no round trip in flight waits for others to share
    its trip, at ``rate`` heartbeats per second, ``round_trip`` seconds a trip and up to
    ``lanes`` trips in flight at once: only while fewer than ``lanes`` come, on average,
    during one round trip. Below that a lane is idle nearly whenever one comes, and each
    trip would carry one heartbeat or a few (the production cadence: many idle sessions,
    a heartbeat every few milliseconds, on a machine busy enough to make round trips
    last a millisecond or more); the wait saves trips. At or above it the lanes are
    busy, trips fill as they are (each finds the next heartbeats waiting), and a wait
    would only idle clients that wait for their ACK (bench heartbeat's closed loop)."""
    return rate * round_trip < lanes


class HeartbeatBatcher(Batcher[seams.SessionLink]):
    """Heartbeats of many links in one store call per flush; ACKs written from it.

    A flush takes at most ``batch_size`` connections; when more wait (Redis or the
    node is overloaded), the best-ranked go first (``Session.batch_rank``: on cadence, then
    :func:`tokend.core.lifecycle.serving_rank`)
    and the rest wait for the next flush. A heartbeat that finds no round trip in flight
    waits up to ``gather`` seconds for others to share its trip, while fewer heartbeats
    come per round trip than there are lanes (:func:`gathers`); under load one is
    always in flight, and nothing waits.

    While Redis is unavailable the heartbeats are acknowledged from what the session
    knows and kept in :attr:`unstored`; they are stored, marked as replayed (not
    judged late), in the first flush after Redis is back. The outage is logged once
    when it starts and once when it ends, with counts.
    """

    def __init__(
        self, store: Store, batch_size: int, gather: float = 0.0, leave_after: float | None = None
    ) -> None:
        super().__init__(store)
        self.batch_size = batch_size
        # Seconds a heartbeat that finds no round trip in flight waits for others to share
        # its round trip (settings.heartbeat_gather): a round trip costs the node and Redis
        # about as much for one heartbeat as for ten (bench/results/2026-12-04-heartbeat-gather.md).
        self.gather = gather
        self.in_flight = 0  # store round trips of this batcher awaiting their answer
        self.lanes = 1  # round trips it keeps in flight at most (run's lanes)
        # Links submitted since the rate was last taken (at a flush, every RATE_WINDOW at
        # most), and when; the rate then, per second; the seconds a round trip takes
        # (a moving mean): whether a gather is worth its wait (gathers).
        self.arrived = 0
        self._rate_since = time.monotonic()
        self.rate = 0.0
        self.round_trip = 0.0
        # Links with heartbeats acknowledged during an outage, not yet stored, each with
        # when its first unstored heartbeat was taken (monotonic s). A link told to leave
        # stays after its connection ended: its last heartbeat is still stored (replayed)
        # once Redis is back, which keeps its session for the client's resume.
        self.unstored: dict[seams.SessionLink, float] = {}
        self.held = 0  # heartbeats acknowledged unstored since the outage began
        # Seconds a link's heartbeats go unstored before it is told to leave (closed 1013
        # for its client to resume on a node that reaches Redis); None: never.
        self.leave_after = leave_after
        self.left: set[seams.SessionLink] = set()  # told to leave in this outage
        # Work for a lane came (a heartbeat to wait, a kick) since a lane last took some.
        self.due = False
        # The lanes waiting for work, each on its own future: one is woken at a time (an
        # event would wake all of them, and all but one would find nothing to take).
        self.idle: deque[asyncio.Future[None]] = deque()

    def submit(self, link: seams.SessionLink) -> None:
        # A link whose heartbeats are in a flight already is submitted again when that
        # flush answers (see flush): one flight per link at a time.
        if not link.session.storing:
            self.arrived += 1
            waiting = self.waiting
            waiting[link] = None
            count = len(waiting)
            if count == 1:
                # Only the first of those that wait calls a lane: a lane takes them all at
                # once (_take, which calls another for those it leaves). While a round trip
                # is in flight, or heartbeats come faster than round trips, the node is busy
                # enough to make batches as it is: at once.
                if (
                    self.gather
                    and not self.in_flight
                    and self.batch_size > 1
                    and gathers(self.rate, self.round_trip, self.lanes)
                ):
                    asyncio.get_running_loop().call_later(self.gather, self._call_lane)
                else:
                    self._call_lane()
            elif count == self.batch_size:
                self._call_lane()  # a flush's worth waits for nothing more

    def forget(self, link: seams.SessionLink) -> None:
        super().forget(link)
        if link not in self.left:
            self.unstored.pop(link, None)

    def kick(self) -> None:
        if self.unstored:
            self._call_lane()

    def _call_lane(self) -> None:
        """Work is due: wake one idle lane; with none idle, a busy one takes it when its
        flush ends."""
        self.due = True
        idle = self.idle
        while idle:
            lane = idle.pop()
            if not lane.done():  # not cancelled (the node stops)
                lane.set_result(None)
                return

    async def run(self, node: Running, lanes: int = 1) -> None:
        self.lanes = lanes
        await super().run(node, lanes)

    async def _lane(self, node: Running) -> None:
        loop = asyncio.get_running_loop()
        while node.running:
            if not self.due:
                woken = loop.create_future()
                self.idle.append(woken)
                await woken
                continue
            self.due = False
            await self.flush()

    def _timed(self, began: float) -> None:
        """A round trip begun at ``began`` was answered: the moving mean of round trips,
        and the rate of heartbeats, taken at most every :data:`RATE_WINDOW`."""
        now = time.monotonic()
        self.round_trip += (now - began - self.round_trip) / ROUND_TRIP_WEIGHT
        since = now - self._rate_since
        if since >= RATE_WINDOW:
            self.rate = self.arrived / since
            self.arrived, self._rate_since = 0, now

    @property
    def unstored_links(self) -> int:
        """How many links have heartbeats acknowledged during an outage and not stored yet."""
        return len(self.unstored)

    def _take(self) -> list[seams.SessionLink]:
        """Remove and return the next flush's links, best-ranked first."""
        if len(self.waiting) <= self.batch_size:  # all of them: no copy
            taken, self.waiting = list(self.waiting), {}
        else:
            taken = heapq.nsmallest(
                self.batch_size,
                self.waiting,
                key=lambda link: link.session.batch_rank,
            )
            self._call_lane()  # the rest go in the next flush
            for link in taken:
                del self.waiting[link]
        for link in taken:
            link.session.take_heartbeats()
        return taken

    async def flush(self) -> None:
        batch = self._take()
        unstored = self.unstored
        if not batch and not unstored:  # the other lane took them: no round trip to make
            return
        replays = []
        if unstored:
            taken = set(batch)
            replays = [c for c in unstored if c not in taken]
        # A link whose earlier heartbeat is still unstored was not silent, whatever
        # Redis last recorded: its new heartbeat is not judged late either.
        links = batch + replays
        # Every link here was attached (given its request) at WELCOME, before its heartbeats.
        requests = cast(list[HeartbeatRequest], [link.heartbeat_request for link in links])
        replayed = [p in unstored for p in batch] + [True] * len(replays) if unstored else ()
        self.in_flight += 1
        began = time.monotonic()
        try:
            answers = await self.store.record_heartbeats(
                requests, replayed, lambda i: links[i].known()
            )
            self._timed(began)
        except StoreUnavailable as exc:
            if not self.held:
                log.warning("store unavailable: acknowledging heartbeats unstored", error=str(exc))
            for link in batch:
                self.held += len(link.session.unanswered)
                unstored.setdefault(link, began)
                link.heartbeats_held()
            if self.leave_after is not None:
                self._send_away(began - self.leave_after)
            return
        except Exception:  # a script error: close these links, keep serving the rest
            log.exception("heartbeat flush failed")
            for link in batch:
                link.close(CloseCode.INTERNAL_ERROR, "internal_error")
            return
        finally:
            self.in_flight -= 1
        if self.held:
            log.warning(
                "store back: heartbeats held stored",
                held=self.held,
                replayed=len(replays),
                left=len(self.left),
            )
            self.held = 0
        for link, answer in zip(batch, answers, strict=False):
            if unstored:
                unstored.pop(link, None)
            link.heartbeats_stored(answer)
            if link.session.unanswered:  # more came in meanwhile
                self.submit(link)
        left = self.left
        for link, answer in zip(replays, answers[len(batch) :], strict=True):
            unstored.pop(link, None)
            if link in left:  # its connection is closed (or closing): nothing to tell it
                left.discard(link)
            else:
                link.replayed(answer)

    def _send_away(self, due: float) -> None:
        """Tell each link whose heartbeats have gone unstored since ``due`` or before to
        leave: the rest of the cluster has its session in WARN by now, and expires it
        unless its client resumes on a node that reaches Redis."""
        leaving = [
            link for link, since in self.unstored.items() if since <= due and link not in self.left
        ]
        if not leaving:
            return
        log.warning("store unavailable: connections closed to resume elsewhere", count=len(leaving))
        self.left.update(leaving)
        for link in leaving:
            self.waiting.pop(link, None)  # its heartbeats from now on go unanswered
            link.leave()


class ReleaseBatcher(Batcher[ReleaseRequest]):
    """Sessions whose connection ended, released in one store call per flush (release.lua):
    no connection holds them now, and those the server closed with 1001 are parked
    (docs/protocol.md §5, "When a connection ends").

    A release Redis could not take is not retried: its session keeps its clocks, and
    counts as held live by the ended connection (spec "Resume proof") until that has been
    silent for ``heartbeat_interval`` + 15 s. Except the release of a HELLO whose answer
    was lost (on ``conn`` alone): Redis may have given the session to a connection whose
    client never got its WELCOME and holds the key before it, whose resume is then
    refused 4509 while that connection looks live. Those are owed, tried again at each
    :meth:`kick` until Redis takes them, for ``owed_for`` seconds at most. An outage is
    logged when it starts and when it ends, with the count; the node's stop
    (:meth:`finish`) once, with its own.
    """

    def __init__(self, store: Store, owed_for: float = 0.0) -> None:
        super().__init__(store)
        self.owed: dict[ReleaseRequest, float] = {}  # each with when it was first lost
        self.owed_for = owed_for
        self.in_flight: Counter[str] = Counter()  # sent to Redis, not answered yet, per tid
        self._landing = asyncio.Event()  # set (and replaced) whenever a round trip ends
        self.lost = 0  # releases Redis could not take since the outage began
        self.stopping = False
        self.released: Counter[ReleaseOutcome] = Counter()
        self.round_trips = 0  # answered, and the seconds they took
        self.seconds = 0.0

    async def record(self, batch: list[ReleaseRequest]) -> bool:
        """Release ``batch`` in one round trip; False when Redis could not take it."""
        self.in_flight.update(request.tid for request in batch)  # counted if the stop cancels
        started = time.perf_counter()
        try:
            outcomes = await self.store.releases(batch)
        except Exception as exc:  # StoreUnavailable, or a script error
            self._landed(batch)
            if not isinstance(exc, StoreUnavailable):
                log.exception("release failed")
            return False
        self._landed(batch)
        if self.owed:
            for request in batch:
                self.owed.pop(request, None)
        self.round_trips += 1
        self.seconds += time.perf_counter() - started
        self.released.update(outcomes)
        if self.lost and not self.stopping:
            log.warning("store back: sessions not released meanwhile", count=self.lost)
            self.lost = 0
        return True

    def _landed(self, batch: list[ReleaseRequest]) -> None:
        in_flight = self.in_flight
        for request in batch:
            in_flight[request.tid] -= 1
            if not in_flight[request.tid]:
                del in_flight[request.tid]
        self._landing.set()
        self._landing = asyncio.Event()

    async def settle(self, tids: set[str]) -> None:
        """Record the waiting releases of the sessions ``tids`` and wait for those under
        way (answered or failed): what of them ended before this call is released in
        Redis when it returns. Other sessions' releases are not waited for."""
        if any(request.tid in tids for request in self.waiting):
            await self.flush()
        while not tids.isdisjoint(self.in_flight):
            await self._landing.wait()

    async def flush(self) -> None:
        batch, self.waiting = list(self.waiting), {}
        if batch and not await self.record(batch):
            if not self.lost and not self.stopping:
                log.warning("store unavailable: sessions not released", count=len(batch))
            self.lost += len(batch)
            now = time.monotonic()
            for request in batch:
                if request.since_ms == SINCE_UNKNOWN:
                    self.owed.setdefault(request, now)

    def kick(self) -> None:
        """Submit the owed releases again (those owed longer than ``owed_for`` are let go:
        their sessions' clocks have run out by then)."""
        if not self.owed:
            return
        due = time.monotonic() - self.owed_for
        for request, since in list(self.owed.items()):
            if since < due:
                del self.owed[request]
            elif request not in self.waiting:
                self.submit(request)

    async def finish(self, lanes: asyncio.Task[None] | None, timeout: float) -> None:
        """At the node's stop (it no longer runs): record the releases under way and those
        waiting, within ``timeout``; what Redis could not take is logged once, counted."""
        self.stopping = True
        lost_before = self.lost
        self._wake.set()  # a lane waiting for work flushes what waits, then ends
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                if lanes is not None:
                    await lanes  # the flush under way, if any, ends first
                await self.flush()  # what came in meanwhile
        lost = self.lost - lost_before + self.in_flight.total() + len(self.waiting)
        if lost:
            log.warning("sessions not released at stop: store unavailable", count=lost)
        if self.released:
            log.info(
                "sessions released",
                parked=self.released[ReleaseOutcome.PARKED],
                released=self.released[ReleaseOutcome.RELEASED],
                not_held=self.released[ReleaseOutcome.NOT_HELD],
                round_trips=self.round_trips,
                seconds=round(self.seconds, 3),
            )
