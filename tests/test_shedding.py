"""Load shedding (tokend/shedding.py): the session core's input, the steps, the loop probe.

The session core is driven as in tests/test_session.py (real tokens, no Redis); the
Shedder's steps with given ranks; its probe on a real event loop made late on purpose.
"""

from __future__ import annotations

import asyncio
import time

from testkit.pure import FakeClock, clock, tokens
from testkit.session_core import (
    CADENCE,
    EXP_MS,
    IAT_S,
    SESSION_S,
    Host,
    heartbeat,
    host,
    session,
    welcome,
)
from testkit.waiting import eventually
from tokend import protocol as p
from tokend.answers import HelloAnswer, HelloOutcome
from tokend.clocks import RANKS, serving_rank
from tokend.session import OVERLOADED, Ask, Close, Session
from tokend.shedding import CALM_FOR, WINDOW, Shedder
from tokend.tokens import TokenService

__all__ = ["clock", "host", "session", "tokens"]  # fixtures of testkit

SHED = Close(p.CloseCode.TRY_AGAIN_LATER, OVERLOADED)


def heartbeat_key(session: Session) -> p.Welcome:
    """The store starts the session asked for (HELLO given): its WELCOME."""
    out = session.started(HelloAnswer(HelloOutcome.STARTED, EXP_MS, IAT_S))
    assert isinstance(out, bytes)
    frame = p.decode(out)
    assert isinstance(frame, p.Welcome)
    return frame


def test_a_heartbeat_ranked_among_the_shed_is_refused_with_1013(
    session: Session, tokens: TokenService
) -> None:
    w = welcome(session, tokens)  # prio 5, ACTIVE
    assert session.receive(heartbeat(w, 1), serving_rank(4, False)) is Ask.HEARTBEAT
    # The next one at once: faster than the cadence.
    assert session.receive(heartbeat(w, 2), serving_rank(5, False)) == SHED
    assert session.receive(heartbeat(w, 3), RANKS) is None  # closed: nothing more


def test_a_heartbeat_on_cadence_is_not_shed_unless_the_session_is_in_warn(
    session: Session, tokens: TokenService, clock: FakeClock
) -> None:
    """A client that keeps its cadence costs one heartbeat per interval: shedding it
    would save nothing and cost it its session. Only what comes faster is shed."""
    w = welcome(session, tokens)
    shed_from = serving_rank(9, warned=False)  # everything below prio 9 is shed
    # The first of the connection (clients send one on WELCOME): served.
    assert session.receive(heartbeat(w, 1), shed_from) is Ask.HEARTBEAT
    clock.now += CADENCE.heartbeat_ms / 1000 / 2
    assert session.receive(heartbeat(w, 2), shed_from) is Ask.HEARTBEAT
    session.warn()  # it missed heartbeats before: WARN is shed even on cadence
    clock.now += CADENCE.heartbeat_ms / 1000
    assert session.receive(heartbeat(w, 3), shed_from) == SHED


def test_a_heartbeat_on_cadence_is_stored_before_floods_of_better_ranked_sessions(
    host: Host, tokens: TokenService, clock: FakeClock
) -> None:
    low = Session(host, CADENCE, "node-a/1", clock)
    assert low.receive(p.Hello(tokens.mint("bob", ttl_s=SESSION_S, iat=IAT_S, prio=0))) is Ask.START
    w = heartbeat_key(low)
    high = Session(host, CADENCE, "node-a/2", clock)
    h = welcome(high, tokens)  # prio 5
    assert high.receive(heartbeat(h, 1)) is Ask.HEARTBEAT
    clock.now += 0.1
    assert high.receive(heartbeat(h, 2)) is Ask.HEARTBEAT  # a flood
    assert low.receive(heartbeat(w, 1)) is Ask.HEARTBEAT  # the first of its connection
    assert low.rank > high.rank and low.batch_rank < high.batch_rank


def test_a_heartbeat_faster_than_the_cadence_is_shed(
    session: Session, tokens: TokenService, clock: FakeClock
) -> None:
    w = welcome(session, tokens)
    assert session.receive(heartbeat(w, 1), RANKS) is Ask.HEARTBEAT
    clock.now += 0.1  # a flood: the next one 100 ms later
    assert session.receive(heartbeat(w, 2), serving_rank(5, False)) == SHED


def test_a_session_in_warn_is_shed_before_an_active_one_of_any_prio(
    host: Host, tokens: TokenService
) -> None:
    shed_from = serving_rank(9, warned=True)  # only WARN sessions, down to prio 9
    active = Session(host, CADENCE, "node-a/1", time.monotonic)
    w = welcome(active, tokens)
    assert active.receive(heartbeat(w, 1), shed_from) is Ask.HEARTBEAT
    assert active.receive(heartbeat(w, 2), shed_from) is Ask.HEARTBEAT  # prio 5: not shed
    warned = Session(host, CADENCE, "node-a/2", time.monotonic)
    w = welcome(warned, tokens)
    warned.warn()
    assert warned.receive(heartbeat(w, 1), shed_from) == SHED


def test_a_hello_ranked_among_the_shed_is_refused_before_the_store(
    host: Host, tokens: TokenService
) -> None:
    shed_from = serving_rank(4, False)  # ACTIVE sessions of prio 4 and below, every WARN
    low = Session(host, CADENCE, "node-a/1", time.monotonic)
    hello = p.Hello(tokens.mint("bob", ttl_s=SESSION_S, iat=IAT_S, prio=4))
    assert low.receive(hello, shed_from) == SHED
    high = Session(host, CADENCE, "node-a/2", time.monotonic)
    hello = p.Hello(tokens.mint("carol", ttl_s=SESSION_S, iat=IAT_S, prio=5))
    assert high.receive(hello, shed_from) is Ask.START


class Held:
    """The ranks a node holds, and whether heartbeats are backlogged."""

    def __init__(self, *ranks: int) -> None:
        self.ranks = list(ranks)
        self.backlog = False

    def shedder(self, shed_lag: float = 0.01) -> Shedder:
        return Shedder(shed_lag, lambda: self.ranks, lambda: self.backlog)


def test_steps_go_down_the_ranks_held_but_never_to_the_best_and_back_up() -> None:
    held = Held(serving_rank(9, False), serving_rank(5, False), serving_rank(0, False))
    held.ranks.append(serving_rank(5, True))
    shedder = held.shedder()
    order = []
    for _ in range(5):
        shedder.step_down(lag=0.05)
        order.append(shedder.shed_from)
    # WARN first, then the lowest prio, then the next; prio 9 (the best held) never.
    best = serving_rank(9, False)
    assert (
        order
        == [serving_rank(5, True), serving_rank(0, False), serving_rank(5, False)]
        + [serving_rank(5, False)] * 2
    )
    assert shedder.shed_from > best and shedder.saturated  # handshakes refused now
    for expected in (serving_rank(0, False), serving_rank(5, True), RANKS):
        shedder.step_up()
        assert shedder.shed_from == expected and not shedder.saturated
    assert not shedder.active


def test_sessions_that_all_rank_alike_are_never_shed() -> None:
    shedder = Held(*[serving_rank(5, False)] * 100).shedder()
    shedder.step_down(lag=1.0)
    assert not shedder.active


async def test_a_late_loop_makes_the_node_shed_and_a_calm_one_stop() -> None:
    held = Held(serving_rank(9, False), serving_rank(0, False))
    shedder = held.shedder(shed_lag=0.01)
    running = True
    task = asyncio.create_task(shedder.run(lambda: running))
    loop = asyncio.get_running_loop()
    busy = True

    def hog() -> None:  # an iteration of 30 ms, again and again: a saturated node
        if busy:
            time.sleep(0.03)
            loop.call_soon(hog)

    try:
        hog()
        await eventually(lambda: shedder.active, 20 * WINDOW, interval=WINDOW / 4)
        assert shedder.shed_from == serving_rank(0, False)
        busy = False
        await eventually(lambda: not shedder.active, 10 * CALM_FOR, interval=WINDOW / 4)
    finally:
        running = busy = False
        await task


async def test_a_heartbeat_backlog_makes_the_node_shed() -> None:
    held = Held(serving_rank(9, False), serving_rank(0, False))
    held.backlog = True
    shedder = held.shedder(shed_lag=10.0)  # the loop is never that late
    running = True
    task = asyncio.create_task(shedder.run(lambda: running))
    try:
        await eventually(lambda: shedder.active, 20 * WINDOW, interval=WINDOW / 4)
    finally:
        running = False
        await task
