"""The Python SDK (tokend_client) against a real tokend and a real Redis."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import ssl
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import jwt
import pytest
from websockets.asyncio.server import ServerConnection

from testkit.certificates import tls_node
from testkit.clients import Closed, RawClient
from testkit.events import EventLog
from testkit.fake_servers import fake_server, unsigned_token, welcome_for
from testkit.net import free_port, url_of
from testkit.procs import killed_on_exit
from testkit.proxies import Link
from testkit.reconnects import (
    HELD_LIVE_FOR,
    PROOF_CLOCKS,
    SPREAD_SESSIONS,
    SPREAD_WINDOW,
    assert_spread,
    balanced,
    resumed_at,
)
from testkit.redis_servers import RedisProcess
from testkit.shedding import BEST_PRIO, FLOOD_PRIO, FLOOD_S, SHED_SETTINGS, shed_period
from testkit.tokens import WallClockTokens, minter
from testkit.waiting import eventually
from tokend.core import protocol as p
from tokend.core.protocol import CloseCode
from tokend.ops.app import App
from tokend.server.admission import RETRY_AFTER_S
from tokend.tokens.service import TokenService
from tokend_client import (
    AuthError,
    Backoff,
    CertificateError,
    Change,
    ClientSession,
    Lifecycle,
    ProtocolViolation,
    RetriesExhausted,
    Revoked,
    SessionExpired,
    TakenOver,
    connect,
)
from tokend_client.protocol import SessionState

FAST = Backoff(base=0.05, cap=0.5, going_away_window=0.5)
StartApp = Callable[..., Awaitable[App]]


class Recorder:
    """Reads a session's changes in order, keeping what it saw."""

    def __init__(self, session: ClientSession) -> None:
        self.seen: list[Lifecycle] = []
        self._changes = session.changes()

    async def until(self, *kinds: Change, timeout: float = 5.0) -> Lifecycle:
        if self.seen and self.seen[-1].kind is Change.ENDED and Change.ENDED in kinds:
            return self.seen[-1]
        async with asyncio.timeout(timeout):
            async for change in self._changes:
                self.seen.append(change)
                if change.kind in kinds:
                    return change
        raise AssertionError(f"session ended before {kinds}: {self.seen}")

    def kinds(self) -> list[Change]:
        return [change.kind for change in self.seen]


# The constructor


def test_a_token_that_is_not_a_jwt_is_refused_before_connecting():
    with pytest.raises(AuthError) as refused:
        ClientSession(url_of(free_port()), "not-a-token")
    assert refused.value.code is None


# Against a real tokend


async def test_heartbeats_renew_and_bye(
    start_app: StartApp, tokens: WallClockTokens, events: EventLog
):
    app = await start_app(token_ttl=3, renew_window=2)
    token = tokens.mint("alice", ttl_s=3)
    first_exp = tokens.verify(token).exp * 1000
    async with connect(url_of(app.port), token, backoff=FAST) as session:
        recorder = Recorder(session)
        connected = await recorder.until(Change.CONNECTED)
        assert connected.detail == "new session"
        assert session.tid == tokens.verify(token).tid
        assert session.sub == "alice"
        assert session.heartbeat_interval == 0.2
        renewed = await recorder.until(Change.RENEWED, timeout=4)
        assert renewed.token == session.token != token
        claims = tokens.verify(session.token)
        assert claims.tid == session.tid
        assert claims.exp * 1000 == session.exp == renewed.exp > first_exp
        assert session.state is SessionState.ACTIVE
        assert session.stats.acks > 0 and session.stats.renewals >= 1
        assert session.stats.last_rtt is not None and session.stats.last_rtt < 1
    ended = await recorder.until(Change.ENDED)
    assert (ended.code, ended.error, session.error) == (1000, None, None)
    assert session.ended and not session.connected
    await events.wait_for("SESSION_CLOSED", str(session.tid))
    await session.wait()  # ended by close(): no error to raise


async def test_no_renewal_missed_over_accelerated_minutes(
    start_app: StartApp, tokens: WallClockTokens, events: EventLog
):
    """10 s at a 0.2 s cadence is 50 heartbeat periods (25 min at the default 30 s);
    a 4 s token renewed 3 s before its exp renews every second: ~10 renewal cycles.
    (WARN and expiry are seconds away, and each token has 3 s left when it is renewed:
    a busy machine's stalls cannot end the session.)"""
    app = await start_app(token_ttl=4, renew_window=3, warn_after=5, expire_after=10)
    token = tokens.mint("marathon", ttl_s=4)
    held_exp = tokens.verify(token).exp * 1000
    renewals: list[Lifecycle] = []
    async with connect(url_of(app.port), token, backoff=FAST) as session:
        recorder = Recorder(session)
        await recorder.until(Change.CONNECTED)
        deadline = time.monotonic() + 10
        while (left := deadline - time.monotonic()) > 0:
            with contextlib.suppress(TimeoutError):
                change = await recorder.until(*Change, timeout=left)
                assert change.kind is Change.RENEWED, change
                assert change.token is not None
                claims = tokens.verify(change.token)
                assert claims.tid == session.tid and claims.sub == "marathon"
                if change.detail != "renewed":
                    # A heartbeat sent before the renewing one's ACK came back (a slow
                    # round trip) said the older exp: the current token comes again.
                    assert change.detail.startswith("token re-sent"), change
                    assert claims.exp * 1000 == change.exp == held_exp
                    continue
                # Renewed while the token we held was still valid, never later.
                assert time.time() * 1000 < held_exp
                assert claims.exp * 1000 == change.exp > held_exp
                held_exp = change.exp
                renewals.append(change)
        stats = session.stats
        assert stats.heartbeats - stats.acks <= 1  # every heartbeat ACKed but one in flight
        assert stats.reconnects == 0
    tid = str(session.tid)
    # Events come in the order they were published: once SESSION_CLOSED is here, so is
    # every TOKEN_RENEWED before it (a busy machine delivered the last one late).
    await events.wait_for("SESSION_CLOSED", tid)
    assert len(renewals) >= 8
    # A renewal may also come between the 10 s and the logout: count them all.
    seen = [change async for change in session.changes()]  # its whole (short) history
    renewed = [c for c in seen if c.kind is Change.RENEWED and c.detail == "renewed"]
    assert len(renewed) == session.stats.renewals
    # A heartbeat still unanswered at the logout may have renewed the token in Redis
    # (its TOKEN_RENEWED published) with its ACK never read: at most one per such beat.
    unanswered = session.stats.heartbeats - session.stats.acks
    assert len(renewed) <= len(events.of("TOKEN_RENEWED", tid)) <= len(renewed) + unanswered
    assert not events.of("TOKEN_EXPIRED", tid)
    assert not events.of("SESSION_WARN", tid)


async def test_resumes_after_a_server_restart(
    start_app: StartApp, tokens: TokenService, events: EventLog
):
    app = await start_app()
    port = app.port
    async with connect(url_of(port), tokens.mint("restart"), backoff=FAST) as session:
        recorder = Recorder(session)
        await recorder.until(Change.CONNECTED)
        await eventually(lambda: session.stats.acks > 0)
        await app.stop()
        going = await recorder.until(Change.RECONNECTING)
        assert going.code == CloseCode.GOING_AWAY
        assert going.delay is not None and going.delay <= FAST.going_away_window
        await start_app(port=port)
        resumed = await recorder.until(Change.RESUMED)
        assert resumed.exp == session.exp
        await events.wait_for("SESSION_RESUMED", str(session.tid))
        acks = session.stats.acks
        await eventually(lambda: session.stats.acks > acks)
        assert session.connected and session.error is None
    assert Change.ENDED not in recorder.kinds()[:-1]


async def test_survives_a_redis_outage(
    start_app: StartApp, tokens: TokenService, own_redis: RedisProcess
):
    # The node stopped while Redis was away could not release the session (docs/protocol.md
    # §5): it counts as held live for heartbeat_interval + 15 s, which this client, showing
    # no resume proof, waits out with 4509s. Its clocks outlast that.
    clocks = {
        "redis_url": own_redis.url,
        "warn_after": 20,
        "expire_after": 25,
        "redis_timeout": 0.5,
    }
    app = await start_app(**clocks)
    port = app.port
    async with connect(url_of(port), tokens.mint("outage"), backoff=FAST) as session:
        recorder = Recorder(session)
        await recorder.until(Change.CONNECTED)
        await eventually(lambda: session.stats.acks > 0)
        own_redis.kill()
        # The open connection is still answered, from what the node knows.
        acks = session.stats.acks
        await eventually(lambda: session.stats.acks >= acks + 3)
        # A node restarting meanwhile refuses HELLO with 1013: the client backs off.
        await app.stop()
        await start_app(port=port, **clocks)
        while (await recorder.until(Change.RECONNECTING)).code != CloseCode.TRY_AGAIN_LATER:
            pass
        await recorder.until(Change.RECONNECTING)  # and keeps backing off while Redis is away
        await asyncio.to_thread(own_redis.start)
        resumed = await recorder.until(Change.RESUMED, timeout=25)
        assert resumed.detail == "the same session goes on"  # the store still had it
        acks = session.stats.acks
        await eventually(lambda: session.stats.acks > acks)
    reconnecting = [c for c in recorder.seen if c.kind is Change.RECONNECTING]
    assert all(c.delay is not None and c.delay <= FAST.cap for c in reconnecting)
    assert session.error is None


async def test_a_flood_client_stays_connected_through_a_shed_period(
    start_app: StartApp, tokens: WallClockTokens
):
    """A client heartbeating faster than the cadence, of a class the node sheds: its
    extra heartbeats go unanswered (spec revision 3), even its reading paused, and it
    keeps its connection and its session (an ACK at least every half interval, well
    within the warn_after it waits for one)."""
    app = await start_app(**SHED_SETTINGS)
    url = url_of(app.port)
    best = connect(url, tokens.mint("best", prio=BEST_PRIO), backoff=FAST)
    flood = ClientSession(url, tokens.mint("flood", prio=FLOOD_PRIO), backoff=FAST, cadence=FLOOD_S)
    async with best, flood:
        await shed_period(app, lambda: flood.stats.acks)
        assert flood.connected and flood.error is None
        assert flood.stats.reconnects == 0 and best.stats.reconnects == 0
        assert flood.stats.heartbeats > flood.stats.acks


async def test_revocation_is_terminal(start_app: StartApp, tokens: WallClockTokens):
    app = await start_app()
    token = tokens.mint("revoked")
    async with connect(url_of(app.port), token, backoff=FAST) as session:
        recorder = Recorder(session)
        await recorder.until(Change.CONNECTED)
        assert app.node is not None
        await app.node.store.end(
            session.tid,
            conn="",
            event="TOKEN_REVOKED",
            tomb="revoked",
            code=CloseCode.TOKEN_REVOKED,
        )
        ended = await recorder.until(Change.ENDED)
        assert ended.code == CloseCode.TOKEN_REVOKED
        assert type(ended.error) is Revoked and ended.error is session.error
        assert ended.meaning == "token revoked"
        with pytest.raises(Revoked):
            await session.wait()
    assert Change.RECONNECTING not in recorder.kinds()
    assert session.stats.reconnects == 0
    # The tombstone refuses the token from now on, at once.
    with pytest.raises(Revoked):
        await connect(url_of(app.port), token, backoff=FAST).start()


async def test_takeover_is_terminal_and_the_newcomer_gets_the_current_token(
    start_app: StartApp, tokens: WallClockTokens
):
    app = await start_app(token_ttl=30, renew_window=9)
    old_token = tokens.mint("twice", ttl_s=5)
    async with connect(url_of(app.port), old_token, backoff=FAST) as first:
        first_changes = Recorder(first)
        await first_changes.until(Change.RENEWED)  # first now holds a newer token
        # The newcomer holds the old token and the key of first's WELCOME: a session held
        # live is taken only with that proof (spec "Resume proof"; tests/test_resume_proof.py).
        assert first.session_key is not None
        async with RawClient.connect(app.port) as second:
            proof = p.resume_proof(first.session_key, first.tid.bytes)
            assert (await second.hello(old_token, proof)).resumed
            ended = await first_changes.until(Change.ENDED)
            assert ended.code == CloseCode.TAKEN_OVER
            assert isinstance(ended.error, TakenOver) and isinstance(ended.error, Revoked)
            second.exp_ms = tokens.verify(old_token).exp * 1000  # the token it holds
            resent = await second.heartbeat()
            assert resent.resent and resent.token is not None
            assert resent.exp_ms == first.exp == tokens.verify(resent.token).exp * 1000
    assert first.stats.reconnects == 0


async def test_refused_tokens_end_without_retrying(
    app: App, tokens: TokenService, settings, tmp_path: Path
):
    foreign = minter(settings, tmp_path / "other-keys").mint("mallory")
    expired = tokens.mint("late", ttl_s=10, iat=int(time.time()) - 100)
    cases = ((foreign, CloseCode.INVALID_TOKEN, "unknown_kid"), (expired, 4502, "expired"))
    for token, code, reason in cases:
        session = connect(url_of(app.port), token, backoff=FAST)
        with pytest.raises(AuthError) as refused:
            await session.start()
        assert (refused.value.code, refused.value.reason) == (code, reason)
        assert str(refused.value).endswith(f": {reason}")
        ended = [change async for change in session.changes()][-1]
        assert (ended.kind, ended.code, ended.reason) == (Change.ENDED, code, reason)
        assert session.stats.reconnects == 0


async def test_gives_up_after_max_attempts_when_nothing_listens():
    backoff = Backoff(base=0.01, cap=0.05, max_attempts=3)
    session = ClientSession(url_of(free_port()), unsigned_token(), backoff=backoff)
    with pytest.raises(RetriesExhausted) as gave_up:
        await session.start()
    assert gave_up.value.code is None
    assert session.stats.reconnects == 3
    assert "cannot connect" in str(gave_up.value)


# A client whose event loop is blocked (it runs in a thread, with its own loop,
# so that blocking it does not block the in-process server) until the server has
# done what the test waits for.


def _run_blocking_client(
    url: str, token: str, release: threading.Event
) -> tuple[list[Lifecycle], ClientSession]:
    async def main() -> tuple[list[Lifecycle], ClientSession]:
        session = ClientSession(url, token, backoff=FAST)
        recorder = Recorder(session)
        await session.start()
        await recorder.until(Change.CONNECTED)
        acks = session.stats.acks
        await eventually(lambda: session.stats.acks > acks)  # right after a heartbeat
        # The point: a loop that cannot keep the cadence, until the test lets it go on.
        assert release.wait(30)
        with contextlib.suppress(TimeoutError):
            change = await recorder.until(Change.RECOVERED, Change.ENDED, timeout=10)
            if change.kind is Change.RECOVERED:
                acks = session.stats.acks
                await eventually(lambda: session.stats.acks > acks + 2)
        await session.close()
        await recorder.until(Change.ENDED)
        return recorder.seen, session

    return asyncio.run(main())


async def blocked_until(
    app: App, token: str, events: EventLog, kind: str
) -> tuple[list[Lifecycle], ClientSession]:
    """Run a client whose loop blocks after an ACK until the server emits ``kind``."""
    release = threading.Event()
    client = asyncio.create_task(
        asyncio.to_thread(_run_blocking_client, url_of(app.port), token, release)
    )
    try:
        tid = str(uuid.UUID(jwt.decode(token, options={"verify_signature": False})["jti"]))
        await events.wait_for(kind, tid, timeout=10)
    finally:
        release.set()
    return await client


async def test_blocked_loop_warns_then_recovers(
    start_app: StartApp, tokens: TokenService, events: EventLog
):
    # Blocked until the server warns (after warn_after, 0.6 s): its next heartbeat, as
    # soon as the loop runs again, comes long before expire_after (5 s here).
    app = await start_app(expire_after=5)
    seen, session = await blocked_until(app, tokens.mint("sleepy"), events, "SESSION_WARN")
    kinds = [change.kind for change in seen]
    assert Change.WARNED in kinds and Change.RECOVERED in kinds, kinds
    assert kinds[-1] is Change.ENDED and session.error is None  # logged out by us
    # Blocked from an ACK until warn_after had passed: late by warn_after less a cadence.
    assert session.stats.max_lag >= app.settings.warn_after - app.settings.heartbeat_interval
    # Events come in order: an expiry would have come before the logout's SESSION_CLOSED.
    await events.wait_for("SESSION_CLOSED", str(session.tid))
    assert events.of("SESSION_RECOVERED", str(session.tid))
    assert not events.of("TOKEN_EXPIRED", str(session.tid))


async def test_blocked_past_expiry_ends_with_session_expired(
    app: App, tokens: TokenService, events: EventLog
):
    seen, session = await blocked_until(app, tokens.mint("asleep"), events, "TOKEN_EXPIRED")
    assert seen[-1].kind is Change.ENDED
    assert seen[-1].code == CloseCode.SESSION_EXPIRED
    assert isinstance(session.error, SessionExpired)
    assert session.stats.reconnects == 0
    expired = events.of("TOKEN_EXPIRED", str(session.tid))
    assert expired[0]["reason"] == "heartbeat_timeout"


# Against servers that misbehave


async def test_a_server_breaking_the_protocol_is_terminal():
    async def handler(ws: ServerConnection) -> None:
        await ws.send(welcome_for(await ws.recv(decode=False), 50, 300))
        await ws.send(b"\x09")  # unknown frame type
        await ws.wait_closed()

    async with fake_server(handler) as url:
        session = ClientSession(url, unsigned_token(), backoff=FAST)
        recorder = Recorder(session)
        await session.start()
        ended = await recorder.until(Change.ENDED)
    assert isinstance(ended.error, ProtocolViolation)
    assert "unknown frame type" in ended.detail
    assert session.stats.reconnects == 0


async def test_a_silent_server_is_left_and_the_client_reconnects():
    connections = 0

    async def handler(ws: ServerConnection) -> None:
        nonlocal connections
        connections += 1
        await ws.send(welcome_for(await ws.recv(decode=False), 50, 300))
        async for message in ws:  # take heartbeats, never ACK them
            if message == p.encode(p.Bye()):
                return

    async with (
        fake_server(handler) as url,
        connect(url, unsigned_token(), backoff=FAST) as session,
    ):
        recorder = Recorder(session)
        dropped = await recorder.until(Change.RECONNECTING)
        assert dropped.code is None and "no heartbeat ACK for 0.3 s" in dropped.detail
        await recorder.until(Change.CONNECTED)
        assert connections == 2


# The resume proof (spec "Resume proof", revision 2), against a server that checks it


async def test_every_resume_proves_with_the_key_of_the_last_welcome():
    """The first HELLO of a session has no proof; each later one proves with the session key
    of the last WELCOME received, through any close in between (4509 included)."""
    keys = [os.urandom(p.SESSION_KEY_LENGTH) for _ in range(2)]
    hellos: list[p.Hello] = []

    async def handler(ws: ServerConnection) -> None:
        data = await ws.recv(decode=False)
        hello = p.decode(data)
        assert isinstance(hello, p.Hello)
        hellos.append(hello)
        if len(hellos) == 1:  # a new session; closed after its first heartbeat
            await ws.send(welcome_for(data, 50, 300, keys[0]))
            await ws.recv()
            await ws.close(CloseCode.INTERNAL_ERROR)
        elif len(hellos) == 2:  # as a server does when another connection holds it live
            await ws.close(CloseCode.SESSION_IN_USE, "session_in_use")
        else:
            await ws.send(welcome_for(data, 50, 300, keys[1], resumed=True))
            async for message in ws:  # until BYE
                if message == p.encode(p.Bye()):
                    return

    async with fake_server(handler) as url:
        session = ClientSession(url, unsigned_token(), backoff=FAST)
        recorder = Recorder(session)
        async with session:
            await recorder.until(Change.RESUMED)
            assert session.session_key == keys[1]
    tid = session.tid.bytes
    assert [hello.proof for hello in hellos] == [None, *[p.resume_proof(keys[0], tid)] * 2]
    retries = [c for c in recorder.seen if c.kind is Change.RECONNECTING]
    assert [(c.code, c.meaning) for c in retries] == [
        (1011, "internal error"),
        (4509, "session in use by another connection"),
    ]


async def test_a_session_key_kept_from_before_proves_the_first_hello():
    """A program that kept ``token`` and ``session_key`` across its own restart proves at once."""
    kept = os.urandom(p.SESSION_KEY_LENGTH)
    hellos: list[p.Hello] = []

    async def handler(ws: ServerConnection) -> None:
        data = await ws.recv(decode=False)
        hello = p.decode(data)
        assert isinstance(hello, p.Hello)
        hellos.append(hello)
        await ws.send(welcome_for(data, 50, 300, resumed=True))
        await ws.recv()  # BYE

    token = unsigned_token()
    async with fake_server(handler) as url, connect(url, token, session_key=kept) as session:
        assert session.session_key != kept  # the new WELCOME's
    assert [hello.proof for hello in hellos] == [p.resume_proof(kept, session.tid.bytes)]
    with pytest.raises(ValueError):
        ClientSession(url_of(free_port()), token, session_key=b"short")


# The resume proof end to end: a real tokend that checks it


async def test_a_copied_token_cannot_take_a_live_session_from_its_client(
    start_app: StartApp, tokens: TokenService, events: EventLog
):
    """A thief holding only the token is closed 4509 while the rightful client's
    connection is live, and the rightful client goes on untouched."""
    app = await start_app(**PROOF_CLOCKS)
    token = tokens.mint("owner")
    async with connect(url_of(app.port), token, backoff=FAST) as session:
        await eventually(lambda: session.stats.acks > 0)
        async with RawClient.connect(app.port) as thief:
            await thief.send(p.encode(p.Hello(token)))
            with pytest.raises(Closed) as refused:
                await thief.recv()
        assert (refused.value.code, refused.value.reason) == (4509, "session_in_use")
        acks = session.stats.acks
        await eventually(lambda: session.stats.acks > acks + 2)  # still heartbeating
        assert session.connected and session.stats.reconnects == 0
    # Events come in order: a resume by the thief would have come before the logout's.
    await events.wait_for("SESSION_CLOSED", str(session.tid))
    assert not events.of("SESSION_RESUMED", str(session.tid))


async def test_a_client_that_lost_its_network_takes_its_session_back_at_once(
    start_app: StartApp, tokens: TokenService, events: EventLog
):
    """Its old connection is still held live by the server (which noticed nothing), yet
    its resume, proved with the last WELCOME's key, is taken at once: no 4509."""
    app = await start_app(**PROOF_CLOCKS)
    async with (
        Link(app.port) as link,
        connect(link.url, tokens.mint("roaming"), backoff=FAST) as session,
    ):
        recorder = Recorder(session)
        await eventually(lambda: session.stats.acks > 0)
        cut_at = time.monotonic()
        link.cut()
        await recorder.until(Change.RESUMED, timeout=HELD_LIVE_FOR)
        took = time.monotonic() - cut_at
        retries = [c for c in recorder.seen if c.kind is Change.RECONNECTING]
        assert [c.code for c in retries] == [None], retries  # lost; no 4509 after it
        assert took < HELD_LIVE_FOR / 3, took
        await events.wait_for("SESSION_RESUMED", str(session.tid))
        acks = session.stats.acks
        await eventually(lambda: session.stats.acks > acks)


# No stampede after a drain or a refusal, against real tokend nodes


async def test_after_a_drain_the_first_reconnects_spread_over_the_window(
    start_app: StartApp, tokens: TokenService, events: EventLog
):
    backoff = Backoff(base=0.05, cap=0.5, going_away_window=SPREAD_WINDOW)
    async with balanced(start_app) as nodes, contextlib.AsyncExitStack() as stack:
        sessions = [
            await stack.enter_async_context(
                connect(nodes.url, tokens.mint(f"s{n}"), backoff=backoff)
            )
            for n in range(SPREAD_SESSIONS)
        ]
        recorders = [Recorder(session) for session in sessions]
        began = await nodes.drain_first()
        going = [await recorder.until(Change.RECONNECTING) for recorder in recorders]
        assert {change.code for change in going} == {CloseCode.GOING_AWAY}
        tids = [str(session.tid) for session in sessions]
        resumed = await resumed_at(events, tids, timeout=SPREAD_WINDOW + 10)
        delays = {tid: change.delay or 0.0 for tid, change in zip(tids, going, strict=True)}
        assert_spread(began, delays, resumed, SPREAD_WINDOW)
        for recorder in recorders:
            await recorder.until(Change.RESUMED)


async def test_a_503_with_retry_after_is_waited_out_then_the_session_starts(
    start_app: StartApp, tokens: TokenService, events: EventLog
):
    """A node at max_pending_hellos answers a new handshake 503 with Retry-After: the SDK
    waits at least that long, jittered, before it tries again."""
    app = await start_app(max_pending_hellos=1, hello_timeout=30)
    async with RawClient.connect(app.port):  # the one pending slot: connected, no HELLO
        began = time.time()
        session = ClientSession(url_of(app.port), tokens.mint("patient"), backoff=FAST)
        recorder = Recorder(session)
        session.open()
        refused = await recorder.until(Change.RECONNECTING)
    try:
        assert refused.code is None
        assert refused.detail.startswith("HTTP 503 at the opening handshake")
        # FAST's own first wait would be 0.05 s at most.
        assert refused.delay is not None and RETRY_AFTER_S <= refused.delay <= 2 * RETRY_AFTER_S
        await recorder.until(Change.CONNECTED)
        started = await events.wait_for("SESSION_STARTED", str(session.tid))
        assert started[0]["at"] + 1 >= (began + refused.delay) * 1000
    finally:
        await session.close()


# Our load generators after a drain: the same spread

ROOT = Path(__file__).resolve().parent.parent


async def heartbeating(app: App, count: int) -> None:
    """Wait until ``app`` holds ``count`` connections that have each sent a heartbeat."""

    def beaten() -> bool:
        sessions = [c.session for c in app.connections]
        return len(sessions) == count and all(s is not None and s.last_seq > 0 for s in sessions)

    await eventually(beaten, timeout=20)


def assert_spread_without_delays(began: float, resumed: Mapping[str, int], window: float) -> None:
    """For clients that do not say what they drew: every resume after the closes began,
    spread over a third of the window at least."""
    assert min(resumed.values()) + 1 >= began * 1000
    span = (max(resumed.values()) - min(resumed.values())) / 1000
    assert span >= window / 3, f"all {len(resumed)} resumed within {span:.3f} s"


class LoadGenerator:
    """``bench/loadgen.py`` as a child process, driven by its JSON lines."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @classmethod
    @contextlib.asynccontextmanager
    async def run(
        cls, tmp_path: Path, url: str, tokens: list[str], **job: Any
    ) -> AsyncIterator[LoadGenerator]:
        (tmp_path / "tokens.txt").write_text("\n".join(tokens) + "\n")
        job = {"url": url, "proto": "tokend", "tokens": str(tmp_path / "tokens.txt"),
               "first": 0, "count": len(tokens), **job}  # fmt: skip
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.loadgen", json.dumps(job), cwd=ROOT,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        async with killed_on_exit(process):
            yield cls(process)
            await cls(process).send("exit")
            await asyncio.wait_for(process.wait(), 10)

    async def send(self, command: str, **args: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"cmd": command, **args}).encode() + b"\n")
        await self.process.stdin.drain()

    async def reply(self, timeout: float = 30) -> dict[str, Any]:
        assert self.process.stdout is not None
        answer = json.loads(await asyncio.wait_for(self.process.stdout.readline(), timeout))
        assert answer["ok"], answer
        return dict(answer)


@contextlib.asynccontextmanager
async def locust_users(url: str, users: int, keys_dir: Path, *args: str) -> AsyncIterator[None]:
    """``load_tests/locustfile.py`` headless: ``users`` users on ``url``, minting their
    tokens with the keys of ``keys_dir``; stopped (SIGTERM) on leaving."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKEND_")}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "locust", "-f", str(ROOT / "load_tests" / "locustfile.py"),
        "--headless", "-u", str(users), "-r", str(users), "-t", "60s", "--host", url,
        "--loglevel", "WARNING", *args,
        env={**env, "TOKEND_KEYS_DIR": str(keys_dir)}, cwd=ROOT,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    async with killed_on_exit(process):
        yield
        process.terminate()
        await asyncio.wait_for(process.wait(), 20)


async def test_the_load_generator_spreads_its_first_reconnects_after_a_drain(
    start_app: StartApp, tokens: WallClockTokens, events: EventLog, tmp_path: Path
):
    minted = [tokens.mint(f"g{n}") for n in range(SPREAD_SESSIONS)]
    tids = [str(tokens.verify(token).tid) for token in minted]
    async with (
        balanced(start_app) as nodes,
        LoadGenerator.run(tmp_path, nodes.url, minted, going_away_window=SPREAD_WINDOW) as gen,
    ):
        await gen.send("connect", concurrency=len(minted))
        assert (await gen.reply())["opened"] == len(minted)
        await gen.send("soak", interval=0.5, duration=SPREAD_WINDOW + 4, reconnect=True)
        await heartbeating(nodes.first, len(minted))
        began = await nodes.drain_first()
        resumed = await resumed_at(events, tids, timeout=SPREAD_WINDOW + 10)
        soaked = await gen.reply()
    assert soaked["closes"] == {"1001": len(minted)} and not soaked["gave_up"], soaked
    assert sum(soaked["resumed_at"].values()) == len(minted)
    assert_spread_without_delays(began, resumed, SPREAD_WINDOW)


async def test_the_load_generator_spreads_heartbeats_of_sessions_opened_together(
    start_app: StartApp, tokens: TokenService, tmp_path: Path
):
    """Sessions opened in the same moment heartbeat in the same moment of every interval;
    ``soak`` with ``spread`` moves them to an even share of it (load_tests/overload.py's
    baseline), keeping each on cadence."""
    count, interval = 40, 4.0
    app = await start_app(
        heartbeat_interval=interval, warn_after=3 * interval, expire_after=4 * interval
    )
    minted = [tokens.mint(f"h{n}") for n in range(count)]

    def busiest_second(soaked: dict[str, Any]) -> int:
        assert soaked["acks"] == soaked["sent"] > 0 and not soaked["closes"], soaked
        return max(acks for acks, *_ in soaked["timeline"].values())

    async with LoadGenerator.run(tmp_path, url_of(app.port), minted) as gen:
        await gen.send("connect", concurrency=count, heartbeat=interval, heartbeat_for=60)
        assert (await gen.reply())["opened"] == count
        # Kept cadence: every one's heartbeat a whole interval after its WELCOME's.
        await gen.send("soak", interval=interval, duration=interval + 0.2)
        together = await gen.reply()
        assert busiest_second(together) >= together["acks"] / 2
        await gen.send("soak", interval=interval, duration=interval + 0.2, spread=True)
        spread = await gen.reply()
    # About a quarter of them in each second of the interval.
    assert busiest_second(spread) <= spread["acks"] / 3, spread["timeline"]


async def test_the_locust_user_spreads_its_first_reconnects_after_a_drain(
    start_app: StartApp, events: EventLog, keys_dir: Path
):
    users = SPREAD_SESSIONS
    async with (
        balanced(start_app) as nodes,
        locust_users(nodes.url, users, keys_dir, "--going-away-window", str(SPREAD_WINDOW)),
    ):
        await heartbeating(nodes.first, users)
        tids = [event["tid"] for event in events.of("SESSION_STARTED")]
        began = await nodes.drain_first()
        resumed = await resumed_at(events, tids, timeout=SPREAD_WINDOW + 10)
    assert len(resumed) == users
    assert_spread_without_delays(began, resumed, SPREAD_WINDOW)


class FirstCloser:
    """A server in the test that speaks enough protocol v1 to watch clients resume: each
    session's first connection gets a key in its WELCOME and a close 1011 after its first
    heartbeat; the HELLO of the next is kept (``resumes``), and that one is welcomed and
    kept until BYE."""

    def __init__(self) -> None:
        self.keys: dict[bytes, bytes] = {}  # tid -> the first WELCOME's key
        self.resumes: dict[bytes, p.Hello] = {}  # tid -> the HELLO that came next

    async def handler(self, ws: ServerConnection) -> None:
        data = await ws.recv(decode=False)
        hello = p.decode(data)
        assert isinstance(hello, p.Hello)
        claims = jwt.decode(hello.token, options={"verify_signature": False})
        tid = uuid.UUID(claims["jti"]).bytes
        if tid not in self.keys:
            self.keys[tid] = os.urandom(p.SESSION_KEY_LENGTH)
            await ws.send(welcome_for(data, 200, 5000, self.keys[tid]))
            await ws.recv()  # its first heartbeat
            await ws.close(CloseCode.INTERNAL_ERROR)
            return
        self.resumes.setdefault(tid, hello)
        await ws.send(welcome_for(data, 200, 5000, resumed=True))
        async for message in ws:  # heartbeats, unanswered; BYE ends it
            if message == p.encode(p.Bye()):
                return

    def proofs(self) -> dict[bytes, tuple[bytes | None, bytes]]:
        """tid -> (the proof its resume carried, the proof its first WELCOME's key makes)."""
        return {
            tid: (hello.proof, p.resume_proof(self.keys[tid], tid))
            for tid, hello in self.resumes.items()
        }


async def test_the_load_generator_tells_where_a_connect_timed_out(
    tokens: TokenService, tmp_path: Path
):
    """A connect given up is named by its stage: before the upgrade's answer (a server
    that accepts and says nothing) or awaiting WELCOME (one that upgrades and does not
    answer the HELLO): the soak's restart tells an accept queue from a late HELLO."""

    async def mute(connection: ServerConnection) -> None:
        await connection.recv()  # the HELLO, left unanswered
        await connection.wait_closed()

    held: list[asyncio.StreamWriter] = []

    async def accept_only(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # the upgrade request is never answered

    silent = await asyncio.start_server(accept_only, "127.0.0.1", 0)
    minted = [tokens.mint("late")]
    async with silent, fake_server(mute) as upgrading:
        urls = {
            "timeout before the upgrade": url_of(silent.sockets[0].getsockname()[1]),
            "timeout awaiting WELCOME": upgrading,
        }
        for stage, url in urls.items():
            async with LoadGenerator.run(tmp_path, url, minted, connect_timeout=0.5) as gen:
                await gen.send("connect", concurrency=1)
                opened = await gen.reply()
            assert opened["errors"] == {stage: 1}, opened
        for writer in held:
            writer.close()


async def test_the_load_generators_prove_their_resumes(
    tokens: TokenService, keys_dir: Path, tmp_path: Path
):
    server = FirstCloser()
    count = 4
    async with fake_server(server.handler) as url:
        minted = [tokens.mint(f"p{n}") for n in range(count)]
        async with LoadGenerator.run(tmp_path, url, minted) as gen:
            await gen.send("connect", concurrency=count)
            assert (await gen.reply())["opened"] == count
            await gen.send("soak", interval=0.2, duration=3, reconnect=True)
            await gen.reply()
            assert len(server.resumes) == count
        async with locust_users(url, count, keys_dir):
            await eventually(lambda: len(server.resumes) == 2 * count, timeout=30)
    proofs = server.proofs()
    assert len(proofs) == 2 * count
    assert all(sent == made for sent, made in proofs.values()), proofs


# wss:// with the server's certificate verified


async def test_wss_verifies_the_certificate_and_trusts_the_ca_file_given(
    start_app: StartApp, tokens: TokenService, events: EventLog, tmp_path: Path
):
    node = await tls_node(start_app, tmp_path)
    # The system's CAs do not know the test CA: refused before HELLO, not retried.
    wary = ClientSession(node.url, tokens.mint("wary"), backoff=FAST)
    with pytest.raises(CertificateError) as untrusted:
        await wary.start()
    assert untrusted.value.code is None and wary.stats.reconnects == 0
    assert "certificate is not trusted" in str(untrusted.value)
    # Trusting the CA file (or a context of one's own), the session works over TLS.
    trusted = ssl.create_default_context(cafile=node.ca_file)
    for options in ({"ca_file": node.ca_file}, {"ssl": trusted}):
        async with connect(node.url, tokens.mint("tls"), backoff=FAST, **options) as session:
            await eventually(lambda: session.stats.acks > 0)
        await events.wait_for("SESSION_CLOSED", str(session.tid))
    assert not [e for e in events.events if e["tid"] == str(wary.tid)]
    with pytest.raises(ValueError):  # TLS options for a plain ws:// URL
        ClientSession(url_of(node.app.port), tokens.mint("plain"), ca_file=node.ca_file)


async def test_over_wss_a_restart_is_reconnected_verified_and_resumed(
    start_app: StartApp, tokens: TokenService, events: EventLog, tmp_path: Path
):
    node = await tls_node(start_app, tmp_path)
    async with connect(node.url, tokens.mint("tls"), backoff=FAST, ca_file=node.ca_file) as session:
        recorder = Recorder(session)
        await eventually(lambda: session.stats.acks > 0)
        port = node.app.port
        await node.app.stop()
        assert (await recorder.until(Change.RECONNECTING)).code == CloseCode.GOING_AWAY
        await start_app(port=port, **node.settings)
        await recorder.until(Change.RESUMED)
        await events.wait_for("SESSION_RESUMED", str(session.tid))
        acks = session.stats.acks
        await eventually(lambda: session.stats.acks > acks)


# The command a newcomer runs


class ConnectCommand:
    """``tokend connect ARGS`` as a child process, its output read line by line."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.lines: list[str] = []

    @classmethod
    @contextlib.asynccontextmanager
    async def run(cls, *args: str) -> AsyncIterator[ConnectCommand]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOKEND_")}
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tokend", "connect", *args, "--log-level", "warning",
            stdout=asyncio.subprocess.PIPE, env=env,
        )  # fmt: skip
        async with killed_on_exit(process):
            yield cls(process)

    async def until(self, word: str) -> str:
        """The next line of kind ``word`` (connected, renewed, ..., ended)."""
        assert self.process.stdout is not None
        async with asyncio.timeout(10):
            while True:
                line = (await self.process.stdout.readline()).decode()
                assert line, f"tokend connect exited early: {self.lines}"
                self.lines.append(line)
                if line.split()[1] == word:
                    return line

    async def exit_status(self) -> int:
        return await asyncio.wait_for(self.process.wait(), 10)


async def test_tokend_connect_prints_renewals_and_logs_out_on_ctrl_c(
    start_app: StartApp, keys_dir: Path, events: EventLog
):
    app = await start_app(token_ttl=3, renew_window=2)
    async with ConnectCommand.run(
        "--sub", "newcomer", "--ttl", "3", "--url", url_of(app.port), "--keys-dir", str(keys_dir)
    ) as command:
        connected = await command.until("connected")
        assert "sub=newcomer" in connected and "heartbeat=0.2 s" in connected
        await command.until("renewed")
        await command.until("renewed")
        command.process.send_signal(signal.SIGINT)
        ended = await command.until("ended")
        assert "code=1000 reason=bye" in ended and "logged out" in ended
        assert await command.exit_status() == 0
    tid = connected.split("tid=")[1].split()[0]
    await events.wait_for("SESSION_CLOSED", tid)


async def test_tokend_connect_prints_why_a_token_is_refused(app: App, settings, tmp_path: Path):
    foreign = minter(settings, tmp_path / "other-keys").mint("mallory")
    async with ConnectCommand.run("--token", foreign, "--url", url_of(app.port)) as command:
        ended = await command.until("ended")
        assert "code=4501 reason=unknown_kid" in ended and "[AuthError]" in ended
        assert await command.exit_status() == 1


async def test_tokend_connect_stopped_before_any_session_says_none_was_made(
    start_app: StartApp, own_redis: RedisProcess, tokens: TokenService
):
    """Ctrl-C while no session was ever made (nothing listening, or Redis down) must not
    claim that a session stays on the server."""
    app = await start_app(redis_url=own_redis.url)
    own_redis.kill()
    dead = url_of(free_port())
    for url, retry in ((dead, "cannot connect"), (url_of(app.port), "reason=store_unavailable")):
        async with ConnectCommand.run("--token", tokens.mint("nobody"), "--url", url) as command:
            assert retry in await command.until("reconnecting")
            command.process.send_signal(signal.SIGINT)
            ended = await command.until("ended")
            assert "closed before a session was made" in ended, command.lines
            assert "stays until it expires" not in ended
            assert await command.exit_status() == 0


async def test_tokend_connect_verifies_wss_and_trusts_its_ca_file(
    start_app: StartApp, tokens: TokenService, tmp_path: Path
):
    node = await tls_node(start_app, tmp_path)
    token = tokens.mint("tls-cli")
    async with ConnectCommand.run("--token", token, "--url", node.url) as command:
        ended = await command.until("ended")
        assert "the server's certificate is not trusted" in ended, command.lines
        assert "[CertificateError]" in ended
        assert await command.exit_status() == 1
    trusting = ("--token", token, "--url", node.url, "--ca-file", str(node.ca_file))
    async with ConnectCommand.run(*trusting) as command:
        assert "sub=tls-cli" in await command.until("connected")
        command.process.send_signal(signal.SIGINT)
        assert "logged out" in await command.until("ended")
        assert await command.exit_status() == 0
