"""Load shedding (tokend/server/shedding.py): the session core's input, the steps, the loop probe,
the penalty of a client just shed.

The session core is driven as in tests/test_session.py (real tokens, no Redis); the
Shedder's steps with given ranks; its probe on a real event loop made late on purpose;
the penalties on a real tokend (its probe off: the test steps its shedder).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import hypothesis
import pytest
from hypothesis import HealthCheck
from hypothesis import strategies as st
from websockets.exceptions import InvalidStatus

from testkit.clients import RawClient
from testkit.pure import FakeClock, clock, tokens
from testkit.session_core import (
    CADENCE,
    EXP_MS,
    IAT_S,
    SESSION_S,
    TokenNode,
    heartbeat,
    node,
    session,
    welcome,
)
from testkit.tokens import minter
from testkit.waiting import eventually
from tokend.config import Settings
from tokend.core import protocol as p
from tokend.core.lifecycle import RANKS, Clocks, State, due_transition, serving_rank
from tokend.core.session import OVERLOADED, Ask, Close, Session, Unanswered, Welcome
from tokend.core.store_messages import HelloAnswer, HelloOutcome
from tokend.ops.app import App
from tokend.server.shedding import (
    CALM_FOR,
    HELD_FOR,
    MAX_CALM_FOR,
    RELAPSE_WITHIN,
    WINDOW,
    Shedder,
    steps_for,
    unverified_sub,
)
from tokend.tokens.service import TokenService

__all__ = ["clock", "node", "session", "tokens"]  # fixtures of testkit

SHED = Close(p.CloseCode.TRY_AGAIN_LATER, OVERLOADED)


def heartbeat_key(session: Session) -> p.Welcome:
    """The store starts the session asked for (HELLO given): its WELCOME."""
    out = session.started(HelloAnswer(HelloOutcome.STARTED, EXP_MS, IAT_S))
    assert isinstance(out, Welcome)
    frame = p.decode(out.frame)
    assert isinstance(frame, p.Welcome)
    return frame


HALF_S = CADENCE.heartbeat_ms / 2000  # half an interval: the cadence's bound


def test_a_heartbeat_of_a_shed_class_faster_than_the_cadence_is_checked_and_unanswered(
    session: Session, tokens: TokenService, clock: FakeClock
) -> None:
    """Spec revision 3: checked (mac, tid, seq), its seq consumed, nothing recorded, no
    answer, and the connection stays."""
    w = welcome(session, tokens)  # prio 5, ACTIVE
    assert session.receive(heartbeat(w, 1), serving_rank(4, False)) is Ask.HEARTBEAT
    clock.now += 0.1  # the next one at once: faster than the cadence
    assert session.receive(heartbeat(w, 2), serving_rank(5, False)) is Unanswered.SHED
    assert [seq for seq, _ in session.unanswered] == [1] and session.last_seq == 2
    # Served again: the next one is recorded and answered, at any pace.
    assert session.receive(heartbeat(w, 3), RANKS) is Ask.HEARTBEAT
    # Its seq was consumed: shown again, it is a replay.
    assert session.receive(heartbeat(w, 2), serving_rank(5, False)) == Close(
        p.CloseCode.BAD_HEARTBEAT, "old_seq"
    )


def test_a_shed_heartbeat_with_a_bad_proof_is_closed_as_always(
    session: Session, tokens: TokenService, clock: FakeClock
) -> None:
    w = welcome(session, tokens)
    assert session.receive(heartbeat(w, 1)) is Ask.HEARTBEAT
    forged = dataclasses.replace(heartbeat(w, 2), mac=bytes(p.MAC_LENGTH))
    assert session.receive(forged, 0) == Close(p.CloseCode.BAD_HEARTBEAT, "bad_mac")


def test_a_heartbeat_at_the_cadence_is_recorded_even_in_warn_and_only_faster_ones_are_shed(
    session: Session, tokens: TokenService, clock: FakeClock
) -> None:
    """A client that keeps its cadence costs one heartbeat per interval: it is never shed,
    in WARN neither (its heartbeat recovers the session); in WARN, as in ACTIVE, only
    what comes faster is."""
    w = welcome(session, tokens)
    shed_all = 0  # every rank is shed
    # The first of the connection (clients send one on WELCOME): recorded.
    assert session.receive(heartbeat(w, 1), shed_all) is Ask.HEARTBEAT
    clock.now += HALF_S
    assert session.receive(heartbeat(w, 2), shed_all) is Ask.HEARTBEAT
    session.warn()
    clock.now += 2 * HALF_S
    assert session.receive(heartbeat(w, 3), shed_all) is Ask.HEARTBEAT
    clock.now += 0.01
    assert session.receive(heartbeat(w, 4), shed_all) is Unanswered.SHED


def test_the_cadence_runs_from_the_last_heartbeat_recorded_not_the_last_received(
    session: Session, tokens: TokenService, clock: FakeClock
) -> None:
    w = welcome(session, tokens)
    shed_all = 0
    assert session.receive(heartbeat(w, 1), shed_all) is Ask.HEARTBEAT
    recorded_at = clock.now
    for seq in range(2, 6):  # a flood, 0.1 s apart: shed
        clock.now += 0.1
        assert session.receive(heartbeat(w, seq), shed_all) is Unanswered.SHED
    assert session.recorded_from == recorded_at + HALF_S
    clock.now = recorded_at + HALF_S  # 0.1 s after the last one, half an interval after
    assert session.receive(heartbeat(w, 6), shed_all) is Ask.HEARTBEAT


def test_a_heartbeat_on_cadence_is_stored_before_floods_of_better_ranked_sessions(
    node: TokenNode, tokens: TokenService, clock: FakeClock
) -> None:
    low = Session(node, CADENCE, "node-a/1", clock)
    assert low.receive(p.Hello(tokens.mint("bob", ttl_s=SESSION_S, iat=IAT_S, prio=0))) is Ask.START
    w = heartbeat_key(low)
    high = Session(node, CADENCE, "node-a/2", clock)
    h = welcome(high, tokens)  # prio 5
    assert high.receive(heartbeat(h, 1)) is Ask.HEARTBEAT
    clock.now += 0.1
    assert high.receive(heartbeat(h, 2)) is Ask.HEARTBEAT  # a flood
    assert low.receive(heartbeat(w, 1)) is Ask.HEARTBEAT  # the first of its connection
    assert low.rank > high.rank and low.batch_rank < high.batch_rank


def test_a_session_in_warn_is_shed_before_an_active_one_of_any_prio(
    node: TokenNode, tokens: TokenService, clock: FakeClock
) -> None:
    shed_from = serving_rank(9, warned=True)  # only WARN sessions, down to prio 9
    active = Session(node, CADENCE, "node-a/1", clock)
    w = welcome(active, tokens)
    assert active.receive(heartbeat(w, 1), shed_from) is Ask.HEARTBEAT
    assert active.receive(heartbeat(w, 2), shed_from) is Ask.HEARTBEAT  # prio 5: not shed
    warned = Session(node, CADENCE, "node-a/2", clock)
    w = welcome(warned, tokens)
    warned.warn()
    assert warned.receive(heartbeat(w, 1), shed_from) is Ask.HEARTBEAT  # on cadence
    assert warned.receive(heartbeat(w, 2), shed_from) is Unanswered.SHED


# Arrival patterns: (seconds since the heartbeat before, shedding every rank or none).
ARRIVALS = st.lists(
    st.tuples(st.floats(0, 2 * CADENCE.heartbeat_ms / 1000), st.booleans()),
    min_size=1,
    max_size=60,
)


def arrive(
    node: TokenNode, tokens: TokenService, arrivals: list[tuple[float, bool]]
) -> list[tuple[float, bool, Ask | Close | Unanswered | None]]:
    """A session (no frame-rate limit) given a heartbeat at each arrival, the store
    answering each one recorded at once: (when, shedding, outcome) of each."""
    clock = FakeClock()
    session = Session(node, dataclasses.replace(CADENCE, max_frame_rate=0), "node-a/1", clock)
    w = welcome(session, tokens)
    seen = []
    for seq, (gap, shedding) in enumerate(arrivals, 1):
        clock.now += gap
        outcome = session.receive(heartbeat(w, seq), 0 if shedding else RANKS)
        if outcome is Ask.HEARTBEAT:
            session.take_heartbeats()
            assert isinstance(session.stored(EXP_MS), list)
        seen.append((clock.now, shedding, outcome))
    return seen


@hypothesis.settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@hypothesis.given(arrivals=ARRIVALS)
def test_every_heartbeat_is_recorded_unless_shed_and_faster_than_the_cadence(
    node: TokenNode, tokens: TokenService, arrivals: list[tuple[float, bool]]
) -> None:
    last_recorded = -math.inf
    for at, shedding, outcome in arrive(node, tokens, arrivals):
        on_cadence = at >= last_recorded + HALF_S
        if shedding and not on_cadence:
            assert outcome is Unanswered.SHED
        else:
            assert outcome is Ask.HEARTBEAT
            last_recorded = at


@hypothesis.settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@hypothesis.given(
    arrivals=st.lists(
        st.tuples(st.floats(0, CADENCE.heartbeat_ms / 1000), st.booleans()),
        min_size=1,
        max_size=60,
    )
)
def test_a_client_at_the_cadence_is_never_expired_by_shedding(
    node: TokenNode, tokens: TokenService, arrivals: list[tuple[float, bool]]
) -> None:
    """A client that sends at least one heartbeat per interval (and any number more),
    whatever the node sheds meanwhile: by the session clocks, no heartbeat of it finds
    its session due to WARN (let alone expire) since the last one recorded."""
    clocks = Clocks(CADENCE.warn_ms, CADENCE.expire_ms)
    last_ms: int | None = None
    for at, _, outcome in arrive(node, tokens, arrivals):
        now_ms = int(at * 1000)
        if last_ms is not None:
            assert due_transition(State.ACTIVE, last_ms, EXP_MS, now_ms, clocks) is None
        if outcome is Ask.HEARTBEAT:
            last_ms = now_ms


def test_a_hello_ranked_among_the_shed_is_refused_before_the_store(
    node: TokenNode, tokens: TokenService
) -> None:
    shed_from = serving_rank(4, False)  # ACTIVE sessions of prio 4 and below, every WARN
    low = Session(node, CADENCE, "node-a/1", time.monotonic)
    hello = p.Hello(tokens.mint("bob", ttl_s=SESSION_S, iat=IAT_S, prio=4))
    assert low.receive(hello, shed_from) == SHED
    high = Session(node, CADENCE, "node-a/2", time.monotonic)
    hello = p.Hello(tokens.mint("carol", ttl_s=SESSION_S, iat=IAT_S, prio=5))
    assert high.receive(hello, shed_from) is Ask.START


def test_while_shedding_a_fresh_login_is_ranked_before_its_signature_is_checked(
    node: TokenNode, tokens: TokenService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connect storm meets a node that sheds already: a fresh login (no resume proof)
    of a shed class is refused 1013 without an Ed25519 verify, forged or not; one that
    is served is verified at once (a forgery: 4501), and is not penalised by sub."""
    shed_from = serving_rank(4, False)
    checked: list[bool] = []
    check = node.check

    def recording(token: str, signature: bool) -> tuple[object, str]:
        checked.append(signature)
        return check(token, signature)

    monkeypatch.setattr(node, "check", recording)
    low = Session(node, CADENCE, "node-a/1", time.monotonic)
    assert low.receive(p.Hello(tokens.mint("bob", prio=4)), shed_from) == SHED
    assert checked == [False] and not low.verified
    checked.clear()
    high = Session(node, CADENCE, "node-a/2", time.monotonic)
    assert high.receive(p.Hello(tokens.mint("carol", prio=5)), shed_from) is Ask.START
    assert checked == [False, True] and high.verified
    checked.clear()
    head, _, signature = tokens.mint("carol", prio=5).rpartition(".")
    forged = f"{head}.{'A' if signature[0] != 'A' else 'B'}{signature[1:]}"
    refused = Session(node, CADENCE, "node-a/3", time.monotonic)
    closed = refused.receive(p.Hello(forged), shed_from)
    assert closed == Close(p.CloseCode.INVALID_TOKEN, "bad_signature")
    assert checked == [False, True]
    # Not shedding: verified at once, as always.
    checked.clear()
    calm = Session(node, CADENCE, "node-a/4", time.monotonic)
    assert calm.receive(p.Hello(tokens.mint("dave", prio=4))) is Ask.START
    assert checked == [True]


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


def test_a_relapse_doubles_the_calm_before_the_next_step_up_and_a_new_episode_resets_it() -> None:
    """Shedding again within RELAPSE_WITHIN of a step up is the same flood: the node
    waits twice as long before it serves the class again (up to MAX_CALM_FOR); an
    overload that comes later starts from CALM_FOR."""
    held = Held(serving_rank(9, False), serving_rank(0, False))
    clock = FakeClock()
    shedder = Shedder(0.01, lambda: held.ranks, lambda: held.backlog, clock)
    shedder.step_down(lag=0.05)
    assert shedder.calm_for == CALM_FOR
    waits = []
    for _ in range(7):
        clock.now += shedder.calm_for
        shedder.step_up()
        clock.now += RELAPSE_WITHIN / 2
        shedder.step_down(lag=0.05)
        waits.append(shedder.calm_for)
    assert waits == [2.0, 4.0, 8.0, 16.0, MAX_CALM_FOR, MAX_CALM_FOR, MAX_CALM_FOR]
    clock.now += shedder.calm_for
    shedder.step_up()
    clock.now += RELAPSE_WITHIN
    shedder.step_down(lag=0.05)
    assert shedder.calm_for == CALM_FOR


def test_a_loop_far_later_than_shed_lag_sheds_a_class_per_doubling_in_one_step() -> None:
    lags = (0.0, 0.01, 0.015, 0.02, 0.039, 0.04, 0.3)
    assert [steps_for(lag, 0.01) for lag in lags] == [1, 1, 1, 2, 2, 3, 5]
    held = Held(*(serving_rank(prio, False) for prio in (9, 7, 5, 3, 0)))
    shedder = held.shedder()
    shedder.step_down(lag=0.04, steps=steps_for(0.04, 0.01))  # three classes at once
    assert shedder.shed_from == serving_rank(5, False)
    shedder.step_down(lag=1.0, steps=10)  # never the best
    assert shedder.shed_from == serving_rank(7, False)
    for expected in (serving_rank(5, False), serving_rank(3, False), serving_rank(0, False)):
        shedder.step_up()  # back up one class at a time
        assert shedder.shed_from == expected


def test_the_classes_held_are_read_from_the_sessions_once_per_held_for() -> None:
    """Each overloaded window steps: reading every session's rank each time would cost a
    loop already late milliseconds per step at 19,000 sessions."""
    held = Held(serving_rank(9, False), serving_rank(5, False), serving_rank(0, False))
    reads = 0

    def ranks() -> list[int]:
        nonlocal reads
        reads += 1
        return held.ranks

    now = 0.0
    shedder = Shedder(0.01, ranks, lambda: False, clock=lambda: now)
    for _ in range(3):  # three overloaded windows within HELD_FOR: one read
        shedder.step_down(lag=0.05)
        now += WINDOW
    assert reads == 1 and shedder.shed_from == serving_rank(5, False)
    held.ranks.remove(serving_rank(5, False))  # its sessions left
    now += HELD_FOR
    shedder.step_up()
    shedder.step_down(lag=0.05)  # read again: prio 5 is not held now
    assert reads == 2 and shedder.shed_from == serving_rank(0, False)


def test_a_shed_flood_keeps_its_class_shed_until_it_ends() -> None:
    """The node keeps seeing the flood it sheds: a class whose unanswered heartbeats
    would bring back more than half of what the node recorded when it fell behind is not
    served again, however punctual its loop; once the flood ends, it is."""
    held = Held(serving_rank(9, False), serving_rank(0, False))
    recorded = 0
    shedder = Shedder(0.01, lambda: held.ranks, lambda: False, recorded=lambda: recorded)
    recorded += 2000
    shedder.window_ended(WINDOW)  # 10,000 a second recorded, and the loop late
    shedder.step_down(lag=0.05)
    low = serving_rank(0, False)
    assert shedder.shed_from == low and shedder.capacity == 2000 / WINDOW
    for _ in range(1000):  # a window of the flood, shed: 5,000 a second would come back
        shedder.shed_heartbeat(low)
    recorded += 20
    shedder.window_ended(WINDOW)
    assert not shedder.returning_fits()
    for _ in range(100):  # a tenth of it: fits in the half
        shedder.shed_heartbeat(low)
    shedder.window_ended(WINDOW)
    assert shedder.returning_fits()
    shedder.window_ended(WINDOW)  # over
    assert shedder.returning_fits()
    shedder.step_up()
    assert not shedder.active and shedder.capacity == 0 and shedder.shed_in_episode == 0


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


# The penalty of a client just shed ------------------------------------------

# Far longer than a test: a penalty seen ending was ended by its class being served.
PENALTY_S = 60.0
SHED_PRIO, BEST_PRIO = 0, 9
# Loopback addresses of the clients (tokend caps nothing per address here).
SHED_FROM, OTHER, FORGER = "127.0.0.2", "127.0.0.3", "127.0.0.4"


@pytest.fixture
async def shedding(
    start_app: Callable[..., Awaitable[App]], tokens: TokenService
) -> AsyncIterator[App]:
    """A tokend holding a session of the best prio and one of the lowest, shedding the
    lowest (stepped by the test: shed_lag 0 runs no probe that would step back up)."""
    app = await start_app(
        shed_lag=0, shed_penalty=PENALTY_S, shed_pause=0, max_connections_per_ip=0
    )
    async with RawClient.connect(app.port) as best, RawClient.connect(app.port) as low:
        await best.hello(tokens.mint("best-held", prio=BEST_PRIO))
        await low.hello(tokens.mint("low-held", prio=SHED_PRIO))
        await eventually(lambda: len(app.node.sessions) == 2, what="both sessions held")
        app.node.shedder.step_down(lag=1.0)
        assert app.node.shedder.shed_from == serving_rank(SHED_PRIO, warned=False)
        yield app


async def hello_closed(port: int, token: str, source: str) -> tuple[int | None, str]:
    """HELLO with ``token`` from ``source``: the close the server answers it with."""
    async with RawClient.connect(port, source=source) as client:
        await client.send(p.encode(p.Hello(token)))
        closed = await client.expect_close()
    return closed.code, closed.reason


async def shed_at_a_heartbeat(app: App, token: str, source: str) -> tuple[int | None, str]:
    """A session of ``token`` from ``source``, WELCOMEd while its class is served, then
    shed at a heartbeat faster than the cadence by a node that sheds all it can and
    does not pause reading (``shed_pause`` 0): the close the server answers it with."""
    shedder = app.node.shedder
    shedder.step_up()
    async with RawClient.connect(app.port, source=source) as client:
        await client.hello(token)
        await client.heartbeat()
        shedder.step_down(lag=1.0)
        shedder.step_down(lag=1.0)  # nothing more to shed: saturated
        assert shedder.saturated
        await client.send(client.heartbeat_bytes())
        closed = await client.expect_close()
    shedder.saturated = False  # handshakes admitted again, the low class still shed
    return closed.code, closed.reason


async def test_a_hello_shed_before_its_signature_penalises_its_address_not_its_sub(
    shedding: App, tokens: TokenService
) -> None:
    """A fresh login of a shed prio is shed before its signature is checked: its
    address is refused 503 for the penalty (the sender's own), its sub is not (the
    token may be a forgery naming someone else's)."""
    port = shedding.port
    shed = (p.CloseCode.TRY_AGAIN_LATER, OVERLOADED)
    assert await hello_closed(port, tokens.mint("shed-me", prio=SHED_PRIO), SHED_FROM) == shed
    assert (await refused_status(port, SHED_FROM))[0] == 503
    async with RawClient.connect(port, source=OTHER) as client:
        assert (await client.hello(tokens.mint("shed-me", prio=BEST_PRIO))).tid


async def refused_status(port: int, source: str) -> tuple[int, str | None]:
    """A handshake from ``source`` the server refuses: its status and Retry-After."""
    with pytest.raises(InvalidStatus) as refused:
        async with RawClient.connect(port, source=source):
            pass
    response = refused.value.response
    return response.status_code, response.headers.get("Retry-After")


def stranger_tokens(make_settings: Callable[..., Settings], tmp_path: Path) -> TokenService:
    """Tokens signed with keys tokend does not know: any claims, forged."""
    return minter(make_settings(), tmp_path / "stranger-keys")


async def test_a_shed_client_is_refused_before_its_handshake_and_its_token_check(
    shedding: App,
    tokens: TokenService,
    make_settings: Callable[..., Settings],
    tmp_path: Path,
) -> None:
    """Shed at a heartbeat (a session of a shed prio, flooding): from its address the
    next handshake gets 503 with Retry-After; from anywhere its sub's next HELLO gets
    1013 before the token is checked (a forged token of that sub: 1013, not 4501)."""
    port = shedding.port
    shed = (p.CloseCode.TRY_AGAIN_LATER, OVERLOADED)
    token = tokens.mint("shed-me", prio=SHED_PRIO)
    assert await shed_at_a_heartbeat(shedding, token, SHED_FROM) == shed
    status, retry_after = await refused_status(port, SHED_FROM)
    assert status == 503 and retry_after is not None and 1 <= int(retry_after) <= PENALTY_S
    forged = stranger_tokens(make_settings, tmp_path).mint("shed-me", prio=BEST_PRIO)
    assert await hello_closed(port, forged, OTHER) == shed
    # Another sub's forgery is refused by its token check, another sub's token served.
    nobody = stranger_tokens(make_settings, tmp_path).mint("nobody", prio=BEST_PRIO)
    assert (await hello_closed(port, nobody, OTHER))[0] == p.CloseCode.INVALID_TOKEN
    async with RawClient.connect(port, source=OTHER) as client:
        assert (await client.hello(tokens.mint("served", prio=BEST_PRIO))).tid
    assert shedding.node.metrics.shed_handshakes == 2


async def test_a_penalty_ends_once_the_shed_class_is_served_again(
    shedding: App, tokens: TokenService
) -> None:
    port = shedding.port
    token = tokens.mint("shed-me", prio=SHED_PRIO)
    assert (await hello_closed(port, token, SHED_FROM))[0] == p.CloseCode.TRY_AGAIN_LATER
    assert (await refused_status(port, SHED_FROM))[0] == 503
    shedding.node.shedder.step_up()  # the lowest prio is served again
    async with RawClient.connect(port, source=SHED_FROM) as client:
        assert (await client.hello(token)).tid


async def test_a_forged_sub_does_not_penalise_its_victim(
    shedding: App,
    tokens: TokenService,
    make_settings: Callable[..., Settings],
    tmp_path: Path,
) -> None:
    """A forgery naming the victim's sub at a shed prio: of an unknown key, refused by
    its token check (4501); of a known key with a forged signature, shed before the
    signature is checked (1013, no verify spent on it). Neither adds a penalty by sub:
    only the shed of a session whose signature was checked does."""
    port = shedding.port
    stranger = stranger_tokens(make_settings, tmp_path).mint("victim", prio=SHED_PRIO)
    assert (await hello_closed(port, stranger, SHED_FROM))[0] == p.CloseCode.INVALID_TOKEN
    async with RawClient.connect(port, source=SHED_FROM) as again:  # nor its sender's address
        assert (await again.hello(tokens.mint("someone", prio=BEST_PRIO))).tid
    head, _, signature = tokens.mint("victim", prio=SHED_PRIO).rpartition(".")
    forged = f"{head}.{'A' if signature[0] != 'A' else 'B'}{signature[1:]}"
    shed = (p.CloseCode.TRY_AGAIN_LATER, OVERLOADED)
    assert await hello_closed(port, forged, FORGER) == shed
    async with RawClient.connect(port, source=OTHER) as victim:
        assert (await victim.hello(tokens.mint("victim", prio=BEST_PRIO))).tid


def test_the_unverified_sub_is_read_from_the_payload_or_not_at_all(
    tokens: TokenService,
) -> None:
    assert unverified_sub(tokens.mint("alice")) == "alice"
    for junk in ("", "a.b", "a.!!!.c", "a.bm90IGpzb24.c", "a.WzFd.c", "a.eyJzdWIiOjF9.c"):
        assert unverified_sub(junk) is None
