"""The node's batchers (tokend/server/batchers.py) on a real Redis, without sockets.

A :class:`Waiter` stands where a connection's
:class:`tokend.server.link.SessionLink` stands: a :class:`tokend.server.seams.SessionLink`
with a real session core (:mod:`tokend.core.session`), started in Redis with a real
HELLO, whose methods record what the node gave them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import structlog
from structlog.testing import capture_logs

from testkit.proxies import LatencyProxy
from testkit.redis_servers import RedisProcess
from testkit.tokens import minter
from testkit.waiting import eventually
from tokend.config import Settings
from tokend.core import protocol as p
from tokend.core import session
from tokend.core.claims import Claims
from tokend.core.session import Ask, Cadence, Close, Session, Welcome
from tokend.core.store_messages import (
    HeartbeatReply,
    HeartbeatRequest,
    HelloAnswer,
    Known,
    heartbeat_outcome,
)
from tokend.server import batchers as batchers_module
from tokend.server import seams
from tokend.server.batchers import (
    RATE_WINDOW,
    HeartbeatBatcher,
    HelloBatcher,
    ReleaseBatcher,
    gathers,
)
from tokend.server.node import Node
from tokend.store.redis_client import open_client
from tokend.store.sessions import HelloRequest, Store
from tokend.tokens.service import TokenService

CADENCE = Cadence(1_000, 30_000, 40_000, 0)


class TokenNode(session.Node):
    """A session's node (tokend.core.session.Node) with real tokens."""

    def __init__(self, tokens: TokenService) -> None:
        self.tokens = tokens

    def check(self, token: str, signature: bool) -> tuple[Claims, str]:
        return self.tokens.check(token, time.time(), signature=signature)

    def sign(self, claims: Claims, iat_s: int, exp_s: int) -> tuple[bytes, str]:
        return self.tokens.reissue(claims, iat_s, exp_s)

    def sub_is_full(self, claims: Claims) -> bool:
        return False


class Waiter(seams.SessionLink):
    """A connection as the batchers see it; records what they hand it."""

    def __init__(
        self, token_node: TokenNode, store: Store, name: str, prio: int = 5, sub: str | None = None
    ) -> None:
        self.session = Session(token_node, CADENCE, f"node-a/{name}", time.monotonic)
        self.token = token_node.tokens.mint(sub or name, prio=prio)
        self.store = store
        self.heartbeat_request: HeartbeatRequest | None = None
        self.calls: list[tuple[str, Any]] = []
        self.welcome: p.Welcome | None = None
        self.seq = 0

    def hello(self) -> None:
        assert self.session.receive(p.Hello(self.token)) is Ask.START

    def hello_answered(self, answer: HelloAnswer) -> None:
        out = self.session.started(answer)
        self.calls.append(("hello_answered", answer))
        if isinstance(out, Welcome):
            welcome = p.decode(out.frame)
            assert isinstance(welcome, p.Welcome) and self.session.claims is not None
            self.welcome = welcome
            self.heartbeat_request = self.store.heartbeat_request(
                self.session.claims.tid, self.session.conn
            )

    def hello_failed(self, unavailable: bool) -> None:
        self.calls.append(("hello_failed", unavailable))

    def beat(self) -> None:
        assert self.welcome is not None
        self.seq += 1
        hb = p.make_heartbeat(
            self.welcome.session_key, self.welcome.tid, self.seq, self.welcome.exp_ms
        )
        assert self.session.receive(hb) is Ask.HEARTBEAT

    def heartbeats_stored(self, answer: HeartbeatReply) -> None:
        acks = self.session.stored(answer)
        assert isinstance(acks, list)
        self.calls.append(("stored", [p.decode(a) for a in acks]))

    def heartbeats_held(self) -> None:
        self.calls.append(("held", self.session.held_back()))

    def leave(self) -> None:
        self.calls.append(("leave", self.session.store_unavailable()))

    def replayed(self, answer: HeartbeatReply) -> None:
        self.calls.append(("replayed", answer))
        self.session.replayed(answer)

    def close(self, code: p.CloseCode, reason: str) -> None:
        self.calls.append(("close", code))

    def send_close(self, close: Close | None) -> None:
        self.calls.append(("send_close", close))

    def known(self) -> None:
        return None  # nothing to restore a session with (tests/test_failover.py does)

    def bye_answered(self, confirmed: bool) -> None:
        self.calls.append(("bye_answered", confirmed))

    def bye_failed(self) -> None:
        self.calls.append(("bye_failed", None))

    def warn(self) -> None:
        self.calls.append(("warn", self.session.warn()))

    def told_to_close(self, code: int | None) -> None:
        self.calls.append(("told_to_close", code))

    @property
    def tid(self) -> str:
        """Its session's tid, as its heartbeat requests name it."""
        assert self.heartbeat_request is not None
        return self.heartbeat_request.tid


@dataclass
class RunningNode:
    """A node as its batchers' lanes read it (tokend.server.batchers.Running)."""

    running: bool = True


@pytest.fixture
def token_node(settings: Settings) -> TokenNode:
    return TokenNode(minter(settings))


@pytest.fixture
async def store(settings: Settings) -> AsyncIterator[Store]:
    client = open_client(settings.redis_url, settings)
    yield Store(client, settings, "node-a")
    await client.aclose()


async def started(
    token_node: TokenNode,
    store: Store,
    names: list[str],
    prios: list[int] | None = None,
    subs: list[str] | None = None,
) -> list[Waiter]:
    """Waiters whose sessions HELLO started, through one HelloBatcher flush (the sub of
    each is its name, unless ``subs`` says)."""
    hellos = HelloBatcher(store, ReleaseBatcher(store))
    waiters = [
        Waiter(token_node, store, name, prio, sub)
        for name, prio, sub in zip(names, prios or [5] * len(names), subs or names, strict=True)
    ]
    for waiter in waiters:
        waiter.hello()
        hellos.submit(waiter)
    await hellos.flush()
    assert all(w.welcome is not None for w in waiters)
    return waiters


async def test_hellos_waiting_together_share_one_round_trip(
    token_node: TokenNode, store: Store
) -> None:
    round_trips: list[str] = []
    store.observe = lambda script, seconds: round_trips.append(script)
    waiters = await started(token_node, store, [f"h-{n}" for n in range(20)])
    assert round_trips == ["hello"]
    for waiter in waiters:
        [(what, answer)] = waiter.calls
        assert what == "hello_answered" and answer.outcome == "started"
        assert waiter.session.claims is not None
        view = await store.queries.session(waiter.session.claims.tid)
        assert view is not None and view.conn == waiter.session.conn


async def test_a_hello_after_its_own_connection_ended_resumes_without_a_proof(
    token_node: TokenNode, store: Store
) -> None:
    """A connection that ended before a HELLO came is released in Redis before that HELLO
    is sent (HelloBatcher's invariant): a client that closes and comes straight back to
    the same node resumes, proof or not, instead of meeting its own ended connection as
    a live holder (4509). Its release waits in the batcher, not yet flushed, as on a
    node whose release lane is behind."""
    (first,) = await started(token_node, store, ["back"])
    claims = first.session.claims
    assert claims is not None
    releases = ReleaseBatcher(store)
    releases.submit(
        store.release_request(claims.tid, first.session.conn, first.session.since_ms, "")
    )
    assert await reconnect_outcome(token_node, store, first, releases) == "resumed"
    assert releases.pending == 0


async def reconnect_outcome(
    token_node: TokenNode, store: Store, first: Waiter, releases: ReleaseBatcher
) -> str:
    """The outcome of a HELLO with ``first``'s token and no proof (a v1 client coming
    back), sent by a HelloBatcher that settles ``releases`` first."""
    again = Waiter(token_node, store, "again", sub="again")
    again.token = first.token
    again.hello()
    hellos = HelloBatcher(store, releases)
    hellos.submit(again)
    await hellos.flush()
    [(what, answer)] = again.calls
    assert what == "hello_answered"
    return str(answer.outcome)


@contextlib.asynccontextmanager
async def release_under_way(
    make_settings: Callable[..., Settings],
    redis_server: RedisProcess,
    ended: Waiter,
    delay: float,
) -> AsyncIterator[ReleaseBatcher]:
    """A ReleaseBatcher with the release of ``ended``'s connection out to a Redis that
    gets it ``delay`` seconds late (a store through a :class:`LatencyProxy`;
    ``redis_timeout`` 5 s)."""
    claims = ended.session.claims
    assert claims is not None
    async with LatencyProxy(redis_server.port) as proxy:
        settings = make_settings(redis_url=proxy.url, redis_timeout=5.0)
        client = open_client(settings.redis_url, settings)
        slow = Store(client, settings, "node-a")
        # A release of no session first, at full speed (connections made, script known):
        # only the release under test is late.
        await slow.releases([slow.release_request(uuid.uuid4(), "nobody", 0, "")])
        proxy.delay = delay
        releases = ReleaseBatcher(slow)
        releases.submit(
            slow.release_request(claims.tid, ended.session.conn, ended.session.since_ms, "")
        )
        under_way = asyncio.create_task(releases.flush())
        try:
            await eventually(
                lambda: str(claims.tid) in releases.in_flight, what="the release is out"
            )
            yield releases
        finally:
            under_way.cancel()
            await client.aclose()


async def test_a_release_under_way_holds_back_the_hello_of_its_own_session(
    token_node: TokenNode,
    store: Store,
    make_settings: Callable[..., Settings],
    redis_server: RedisProcess,
) -> None:
    """The release of a connection that ended is out to a slow Redis when its client's
    HELLO comes: the HELLO waits for it, and resumes."""
    (first,) = await started(token_node, store, ["back"])
    async with release_under_way(make_settings, redis_server, first, 0.3) as releases:
        assert await reconnect_outcome(token_node, store, first, releases) == "resumed"
        assert not releases.in_flight


async def test_a_release_under_way_holds_back_no_hello_of_another_session(
    token_node: TokenNode,
    store: Store,
    make_settings: Callable[..., Settings],
    redis_server: RedisProcess,
) -> None:
    """Under a reconnect storm through a slow Redis each unanswered HELLO ends in a
    release: a HELLO does not wait for the releases of other sessions."""
    (ended,) = await started(token_node, store, ["ended"])
    async with release_under_way(make_settings, redis_server, ended, 3.0) as releases:
        newcomer = Waiter(token_node, store, "newcomer")
        newcomer.hello()
        hellos = HelloBatcher(store, releases)
        hellos.submit(newcomer)
        await hellos.flush()
        assert newcomer.welcome is not None
        assert releases.in_flight  # answered while the release is out


class AnswerLost(Waiter):
    """A connection whose HELLO Redis ran but whose answer never reached it (the store
    call timed out after the script was sent)."""

    def hello_answered(self, answer: HelloAnswer) -> None:
        self.calls.append(("answer lost", answer))


@pytest.mark.parametrize("timed_out", [False, True], ids=["open", "hello-timed-out"])
async def test_a_hello_whose_answer_was_lost_is_released_at_its_close(
    token_node: TokenNode, store: Store, timed_out: bool
) -> None:
    """1013 store_unavailable after a HELLO that Redis ran all the same: the close releases
    the session (its since unknown), so the client's next connection resumes it instead of
    meeting a session held by a connection that no longer exists (4509). The same when
    hello_timeout had closed the connection while the HELLO was out."""
    lost = AnswerLost(token_node, store, "lost")
    lost.hello()
    hellos = HelloBatcher(store, ReleaseBatcher(store))
    hellos.submit(lost)
    await hellos.flush()
    [(what, answer)] = lost.calls
    assert (what, answer.outcome) == ("answer lost", "started")
    if timed_out:
        assert lost.session.hello_timed_out() is not None
        assert lost.session.take_release() is None  # its detach: nothing known held yet
    closed = lost.session.hello_lost()
    assert (
        (closed is None)
        if timed_out
        else (closed == (p.CloseCode.TRY_AGAIN_LATER, "store_unavailable"))
    )
    release = lost.session.take_release()
    claims = lost.session.claims
    assert release is not None and claims is not None
    releases = ReleaseBatcher(store)
    releases.submit(store.release_request(claims.tid, lost.session.conn, lost.session.since_ms, ""))
    # The client retries its 1013 with the same token.
    assert await reconnect_outcome(token_node, store, lost, releases) == "resumed"


async def test_a_hello_batch_fails_together_when_redis_is_gone(
    token_node: TokenNode, make_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    gone = RedisProcess(tmp_path / "gone")
    settings = make_settings(redis_url=gone.url, redis_timeout=0.3)
    client = open_client(settings.redis_url, settings)
    try:
        dead = Store(client, settings, "node-a")
        hellos = HelloBatcher(dead, ReleaseBatcher(dead))
        waiters = [Waiter(token_node, dead, f"g-{n}") for n in range(3)]
        for waiter in waiters:
            waiter.hello()
            hellos.submit(waiter)
        await hellos.flush()
        assert [w.calls for w in waiters] == [[("hello_failed", True)]] * 3
    finally:
        await client.aclose()


async def test_an_overloaded_batcher_serves_high_prio_first_and_warn_last(
    token_node: TokenNode, store: Store
) -> None:
    """More heartbeats waiting than one flush takes: served in serving_rank order."""
    # (prio, warned), submitted worst first so that arrival order cannot pass the test.
    kinds = [(0, True), (9, True), (0, False), (5, False), (9, False), (7, False)]
    waiters = await started(
        token_node, store, [f"p{prio}-{warned}" for prio, warned in kinds], [k[0] for k in kinds]
    )
    batcher = HeartbeatBatcher(store, batch_size=2)
    for waiter, (_, warned) in zip(waiters, kinds, strict=True):
        if warned:
            waiter.session.warn()
        waiter.beat()
        batcher.submit(waiter)
    flushes = []
    while batcher.pending:
        before = {id(w): len(w.calls) for w in waiters}
        await batcher.flush()
        flushes.append(
            {kind for w, kind in zip(waiters, kinds, strict=True) if len(w.calls) > before[id(w)]}
        )
    assert flushes == [{(9, False), (7, False)}, {(5, False), (0, False)}, {(9, True), (0, True)}]
    for waiter in waiters:
        (what, [ack]) = waiter.calls[-1]
        assert what == "stored" and isinstance(ack, p.HeartbeatAck) and ack.seq == 1


async def test_a_heartbeat_arriving_during_a_flush_goes_in_the_next(
    token_node: TokenNode, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    [waiter] = await started(token_node, store, ["late"])
    batcher = HeartbeatBatcher(store, batch_size=10)
    waiter.beat()
    batcher.submit(waiter)

    async def beat_meanwhile(tids: list[str]) -> None:
        waiter.beat()  # the client's next heartbeat lands while Redis works on the first
        batcher.submit(waiter)

    before_each_round_trip(store, beat_meanwhile, monkeypatch)
    await batcher.flush()
    monkeypatch.undo()  # the store's own round trips again
    assert [ack.seq for ack in waiter.calls[-1][1]] == [1]
    assert batcher.pending == 1 and batcher.is_waiting(waiter)
    await batcher.flush()
    assert [ack.seq for ack in waiter.calls[-1][1]] == [2]


async def test_running_lanes_answer_every_heartbeat_however_they_come(
    token_node: TokenNode, store: Store
) -> None:
    """The lanes' wake is set by the first heartbeat to wait (not by each): heartbeats
    that come while others wait, while a flush is out, or more than a flush takes, are
    all answered, and nothing is left waiting."""
    waiters = await started(token_node, store, [f"w{n}" for n in range(7)])
    batcher = HeartbeatBatcher(store, batch_size=2)
    node = RunningNode()
    lanes = asyncio.create_task(batcher.run(node, lanes=2))

    def answered(rounds: int) -> bool:
        return all(
            sum(len(acks) for what, acks in w.calls if what == "stored") == rounds for w in waiters
        )

    try:
        for rounds in range(1, 4):
            for n, waiter in enumerate(waiters):
                waiter.beat()
                batcher.submit(waiter)
                if n % 3 == 2:
                    await asyncio.sleep(0)  # a lane may start a flush among them
            await eventually(functools.partial(answered, rounds), what="every heartbeat answered")
            assert batcher.pending == 0
    finally:
        node.running = False
        lanes.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await lanes


@contextlib.asynccontextmanager
async def running_lanes(batcher: HeartbeatBatcher, lanes: int = 2) -> AsyncIterator[None]:
    node = RunningNode()
    task = asyncio.create_task(batcher.run(node, lanes=lanes))
    try:
        yield
    finally:
        node.running = False
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def before_each_round_trip(
    store: Store, do: Callable[[list[str]], Awaitable[None]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Await ``do(tids)`` before each heartbeat round trip the store makes from now (the
    batch's tids), until ``monkeypatch`` undoes it."""
    original = store.record_heartbeats

    async def wrapped(
        batch: Sequence[HeartbeatRequest],
        replayed: Sequence[bool] = (),
        known: Callable[[int], Known | None] | None = None,
    ) -> list[HeartbeatReply]:
        await do([r.tid for r in batch])
        return await original(batch, replayed, known)

    monkeypatch.setattr(store, "record_heartbeats", wrapped)


def spied_round_trips(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> list[tuple[float, list[str]]]:
    """(loop time, tids) of each heartbeat round trip the store is asked for from now."""
    asked: list[tuple[float, list[str]]] = []

    async def spy(tids: list[str]) -> None:
        asked.append((asyncio.get_running_loop().time(), tids))

    before_each_round_trip(store, spy, monkeypatch)
    return asked


async def test_a_heartbeat_that_finds_the_store_idle_waits_for_others_to_share_its_trip(
    token_node: TokenNode, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """heartbeat_gather: the first heartbeat to wait with no round trip in flight is
    flushed ``gather`` later, with every heartbeat that came meanwhile (one round trip)."""
    waiters = await started(token_node, store, ["g-1", "g-2", "g-3"])
    batcher = HeartbeatBatcher(store, batch_size=10, gather=0.05)
    asked = spied_round_trips(store, monkeypatch)
    loop = asyncio.get_running_loop()

    def beat(waiter: Waiter) -> None:
        waiter.beat()
        batcher.submit(waiter)

    async with running_lanes(batcher):
        first = loop.time()
        beat(waiters[0])
        beat(waiters[1])
        # Timers run in the order they are due: this one always before the gather's.
        loop.call_later(0.02, beat, waiters[2])
        await eventually(lambda: all(w.calls[-1][0] == "stored" for w in waiters), what="ACKs")
    [(at, tids)] = asked
    assert tids == [w.tid for w in waiters]
    # call_later may fire within the clock's resolution before the time it was given.
    assert at >= first + 0.05 - max(time.get_clock_info("monotonic").resolution, 0.001)


async def test_a_heartbeat_waits_for_no_gather_while_a_round_trip_is_in_flight(
    token_node: TokenNode, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flush's worth waiting goes at once, and so does a heartbeat that comes while a
    round trip is in flight (the node is busy: batches form as it is). A gather of an
    hour shows that neither waited for it."""
    full, busy = (
        await started(token_node, store, ["full-1", "full-2"]),
        await started(token_node, store, ["busy-1", "busy-2"]),
    )
    batcher = HeartbeatBatcher(store, batch_size=2, gather=3600)
    asked = spied_round_trips(store, monkeypatch)
    released = asyncio.Event()

    async def held_while_unreleased(tids: list[str]) -> None:
        if tids == [busy[0].tid]:
            await released.wait()

    before_each_round_trip(store, held_while_unreleased, monkeypatch)

    def stored(waiter: Waiter) -> bool:
        return waiter.calls[-1][0] == "stored"

    async with running_lanes(batcher):
        for waiter in full:
            waiter.beat()
            batcher.submit(waiter)
        await eventually(lambda: all(map(stored, full)), what="the full flush answered")
        busy[0].beat()
        batcher.submit(busy[0])  # the store is idle: it would wait the hour...
        in_flight = asyncio.create_task(batcher.flush())  # ...but is flushed here, and held
        await eventually(lambda: batcher.in_flight == 1, what="a round trip in flight")
        busy[1].beat()
        batcher.submit(busy[1])
        await eventually(lambda: stored(busy[1]), what="busy-2 answered at once")
        assert not stored(busy[0])  # still held in flight
        released.set()
        await in_flight
    assert stored(busy[0])
    assert [tids for _, tids in asked] == [
        [w.tid for w in full],
        [busy[1].tid],
        [busy[0].tid],
    ]


def test_a_gather_waits_only_while_fewer_heartbeats_come_per_round_trip_than_lanes() -> None:
    # The production cadence: 20,000 idle sessions at 30 s, a 0.3 ms round trip.
    assert gathers(20_000 / 30, 0.0003, 4)
    # The same on a busy machine, a 3 ms round trip: two a trip, over four lanes each
    # trip would still carry about one.
    assert gathers(20_000 / 30, 0.003, 4)
    assert not gathers(20_000 / 30, 0.003, 1)  # one lane: the trips fill as they are
    # A closed loop of 100 clients answered in 3 ms: each trip finds the next waiting.
    assert not gathers(100 / 0.003, 0.0003, 4)
    assert gathers(0.0, 0.0, 4)  # nothing measured yet
    assert not gathers(1000.0, 0.004, 4)  # as many per round trip as lanes: no wait


async def test_heartbeats_faster_than_round_trips_wait_for_no_gather(
    token_node: TokenNode, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rate and the round trip are taken from the flushes: after a quarter second of
    heartbeats that came faster than one per round trip, a heartbeat that finds the
    store idle goes at once. A gather of an hour shows that it did not wait for it."""
    waiters = await started(token_node, store, ["fast-1", "fast-2"])
    batcher = HeartbeatBatcher(store, batch_size=10, gather=3600)
    batcher.round_trip = 0.001  # as if measured
    batcher.arrived = 10_000  # in the quarter second under way: 40,000 a second
    batcher._rate_since -= RATE_WINDOW

    async with running_lanes(batcher):
        waiters[0].beat()
        batcher.submit(waiters[0])  # the rate is not taken yet: it waits the hour
        assert batcher.pending == 1
        await batcher.flush()  # flushed here; the rate taken
        assert batcher.rate > 1 / batcher.round_trip
        waiters[1].beat()
        batcher.submit(waiters[1])
        await eventually(lambda: waiters[1].calls[-1][0] == "stored", what="answered at once")


async def test_an_outage_is_logged_once_and_held_heartbeats_are_replayed(
    token_node: TokenNode,
    make_settings: Callable[..., Settings],
    own_redis: RedisProcess,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = make_settings(redis_url=own_redis.url, redis_timeout=0.3)
    client = open_client(settings.redis_url, settings)
    try:
        outage_store = Store(client, settings, "node-a")
        waiters = await started(token_node, outage_store, ["o-1", "o-2"])
        batcher = HeartbeatBatcher(outage_store, batch_size=10)
        own_redis.kill()
        with capture_logs() as logs:
            # A logger made now, so that it is not one cached before the capture.
            monkeypatch.setattr(batchers_module, "log", structlog.get_logger("tokend.node"))
            for _ in range(3):  # three heartbeats each, three failed flushes
                for waiter in waiters:
                    waiter.beat()
                    batcher.submit(waiter)
                await batcher.flush()
            own_redis.start()
            await batcher.flush()  # nothing new waits: the held ones are replayed
        events = [(entry["event"], entry.get("held"), entry.get("replayed")) for entry in logs]
        assert events == [
            ("store unavailable: acknowledging heartbeats unstored", None, None),
            ("store back: heartbeats held stored", 6, 2),
        ]
        for waiter in waiters:
            kinds = [what for what, _ in waiter.calls[1:]]
            assert kinds == ["held", "held", "held", "replayed"]
            assert heartbeat_outcome(waiter.calls[-1][1]) == "ok"
            assert not waiter.session.held
        assert batcher.unstored_links == 0
    finally:
        await client.aclose()


# The node itself: its background tasks and its bookkeeping of the sessions it holds.


@pytest.fixture
async def node(make_settings: Callable[..., Settings]) -> AsyncIterator[Node]:
    """A node on the test Redis, not started; stopped (if started) at teardown."""
    settings = make_settings(max_sessions_per_sub=2)
    client = open_client(settings.redis_url, settings)
    made = Node(settings, client, minter(settings))
    yield made
    if made.running:
        await made.stop()
    await client.aclose()


async def test_a_started_node_is_subscribed_and_names_a_background_task_that_ended(
    node: Node,
) -> None:
    await node.start()
    assert node.subscribed.is_set() and node.failed_task() is None
    # Found by its name, the one failed_task() reports (and /readyz shows).
    [sweeper] = [t for t in asyncio.all_tasks() if t.get_name() == "sweeper"]
    sweeper.cancel()  # stands in for a task that crashed
    with contextlib.suppress(asyncio.CancelledError):
        await sweeper
    assert node.failed_task() == "sweeper"


async def test_connection_ids_are_unique_and_name_the_node(node: Node) -> None:
    assert [node.new_conn_id() for _ in range(3)] == ["node-a/1", "node-a/2", "node-a/3"]


async def test_the_node_counts_the_sessions_it_holds_per_sub_and_state(node: Node) -> None:
    token_node = TokenNode(node.tokens)
    alice_1, alice_2, bob = await started(
        token_node, node.store, ["alice-1", "alice-2", "bob"], subs=["alice", "alice", "bob"]
    )
    for waiter in (alice_1, alice_2, bob):
        node.attach(waiter)
    alice_2.session.warn()
    assert node.metrics.sessions_by_state() == {"ACTIVE": 2, "WARN": 1}
    claims = alice_1.session.claims
    assert claims is not None
    # Alice holds two sessions here: at the cap of 2 for a third, not for a resume of one.
    registry = node.registry
    assert registry.other_sessions_of("alice", uuid.uuid4()) == 2
    assert registry.other_sessions_of("alice", claims.tid) == 1
    assert node.sub_is_full(replace(claims, tid=uuid.uuid4()))
    assert not node.sub_is_full(claims)
    assert sorted(registry.ranks()) == sorted(w.session.rank for w in (alice_1, alice_2, bob))
    node.detach(alice_1)
    node.detach(alice_1)  # twice: a connection ends once, whatever calls it
    assert registry.other_sessions_of("alice", uuid.uuid4()) == 1
    assert node.metrics.sessions_by_state() == {"ACTIVE": 1, "WARN": 1}
    node.detach(alice_2)
    node.detach(bob)
    assert len(registry) == 0 and registry.per_sub == {}


async def test_a_node_sends_one_hello_round_trip_at_a_time(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HELLOs that come while one hello round trip is out go together in the next, two
    lanes of flush_lanes or not (a round trip costs the node the same whatever it carries:
    bench/results/2026-12-04-resume.md)."""
    assert node.settings.flush_lanes > 1
    await node.start()
    token_node = TokenNode(node.tokens)
    first, second, third = (
        Waiter(token_node, node.store, name) for name in ("one", "two", "three")
    )
    original = node.store.hellos
    sent: list[int] = []
    entered, answer = asyncio.Event(), asyncio.Event()

    async def held(batch: Sequence[HelloRequest]) -> list[HelloAnswer]:
        if not batch:  # no round trip (a lane woken with the others, nothing left for it)
            return await original(batch)
        sent.append(len(batch))
        entered.set()
        await answer.wait()
        return await original(batch)

    monkeypatch.setattr(node.store, "hellos", held)
    first.hello()
    node.submit_hello(first)
    await entered.wait()
    second.hello()
    node.submit_hello(second)
    # Turns of the loop, not time: more than a free lane takes from its wake to the store.
    for _ in range(20):
        await asyncio.sleep(0)
    third.hello()
    node.submit_hello(third)
    assert sent == [1]
    answer.set()
    await eventually(lambda: third.welcome is not None)
    assert sent == [1, 2]
    assert first.welcome is not None and second.welcome is not None


async def test_a_bye_goes_through_the_node_and_its_answer_to_the_peer(node: Node) -> None:
    """BYE (docs/protocol.md 0x05): the node ends the session in the store, then tells
    the peer. Attached first: the node gives the peer its heartbeat request at WELCOME."""
    [waiter] = await started(TokenNode(node.tokens), node.store, ["leaving"])
    waiter.heartbeat_request = None
    node.attach(waiter)
    assert waiter.heartbeat_request is not None
    assert waiter.heartbeat_request.conn == waiter.session.conn
    node.end(waiter)
    await asyncio.wait_for(asyncio.gather(*node.background.tasks), 10)
    assert waiter.calls[-1] == ("bye_answered", True)
    claims = waiter.session.claims
    assert claims is not None
    view = await node.store.queries.session(claims.tid)
    assert view is not None and view.ended == "closed"


# Releases: the sessions of connections that ended (docs/protocol.md §5).

CALM = {"heartbeat_interval": 5, "warn_after": 20, "expire_after": 40, "redis_timeout": 0.5}


@contextlib.asynccontextmanager
async def running_node(settings: Settings) -> AsyncIterator[Node]:
    client = open_client(settings.redis_url, settings)
    made = Node(settings, client, minter(settings))
    await made.start()
    try:
        yield made
    finally:
        if made.running:
            await made.stop()
        await client.aclose()


async def test_a_release_waiting_when_the_node_stops_is_recorded_before_redis_is_closed(
    make_settings: Callable[..., Settings], redis: Any
) -> None:
    async with running_node(make_settings(**CALM)) as node:
        [waiter] = await started(TokenNode(node.tokens), node.store, ["parked"])
        before = await node.store.redis.time()
        waiter.session.close(p.CloseCode.GOING_AWAY, "going_away")  # as the drain closes it
        node.release(waiter)
        await node.stop()  # at once: the release still waits for its flush
    claims = waiter.session.claims
    assert claims is not None
    fields = await redis.hgetall(node.store.keys.session_keys(claims.tid)[0])
    assert "conn" not in fields and fields["left"] == waiter.session.conn
    # Parked: the close is its heartbeat.
    assert int(fields["pk"]) == int(fields["hb"]) >= before[0] * 1000


async def test_releases_redis_cannot_take_at_the_stop_are_logged_once_and_the_stop_goes_on(
    make_settings: Callable[..., Settings],
    own_redis: RedisProcess,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = make_settings(redis_url=own_redis.url, **CALM)
    async with running_node(settings) as node:
        waiters = await started(TokenNode(node.tokens), node.store, ["gone-1", "gone-2"])
        own_redis.kill()
        with capture_logs() as logs:
            monkeypatch.setattr(batchers_module, "log", structlog.get_logger("tokend.node"))
            for waiter in waiters:
                waiter.session.close(p.CloseCode.GOING_AWAY, "going_away")
                node.release(waiter)
            began = time.monotonic()
            await node.stop()
            stopped_in = time.monotonic() - began
    lines = [(e["event"], e.get("count")) for e in logs if "release" in e["event"]]
    assert lines == [("sessions not released at stop: store unavailable", 2)]
    # Bounded by redis_timeout (then the background tasks' own stop, of what is left).
    assert stopped_in < settings.redis_timeout + 5
