"""The Python SDK (tokend.client) against a real tokend and a real Redis."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import jwt
import pytest
from websockets.asyncio.server import ServerConnection, serve

from testkit.clients import RawClient
from testkit.events import EventLog
from testkit.net import LOOPBACK, free_port
from testkit.redis_servers import RedisProcess
from testkit.tokens import minter
from testkit.waiting import eventually
from tokend import protocol as p
from tokend.client import (
    AuthError,
    Backoff,
    Change,
    Lifecycle,
    ProtocolViolation,
    RetriesExhausted,
    Revoked,
    Session,
    SessionExpired,
    TakenOver,
    TokendError,
    classify,
    connect,
)
from tokend.protocol import CloseCode, SessionState
from tokend.server import App
from tokend.tokens import TokenService

FAST = Backoff(base=0.05, cap=0.5)
StartApp = Callable[..., Awaitable[App]]


def url_of(port: int) -> str:
    return f"ws://{LOOPBACK}:{port}{p.WS_PATH}"


class Recorder:
    """Reads a session's changes in order, keeping what it saw."""

    def __init__(self, session: Session) -> None:
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


# Pure parts


def test_backoff_is_full_jitter_exponential_and_capped():
    backoff = Backoff(base=0.5, cap=4.0)
    assert [backoff.ceiling(n) for n in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert backoff.ceiling(100_000) == 4.0
    draws = [backoff.delay(2) for _ in range(4000)]
    assert all(0.0 <= d <= 2.0 for d in draws)
    assert 0.9 < sum(draws) / len(draws) < 1.1  # uniform(0, 2) has mean 1
    assert min(draws) < 0.1 and max(draws) > 1.9
    with pytest.raises(ValueError):
        Backoff(base=0)
    with pytest.raises(ValueError):
        Backoff(base=2, cap=1)


def test_close_codes_map_to_reconnect_or_an_error_family():
    for code in p.RECONNECTABLE:
        assert classify(code) is None
    assert classify(None) is None
    assert classify(CloseCode.INVALID_TOKEN) is AuthError
    assert classify(CloseCode.TOKEN_EXPIRED) is AuthError
    assert classify(CloseCode.SESSION_EXPIRED) is SessionExpired
    assert classify(CloseCode.TOKEN_REVOKED) is Revoked
    assert classify(CloseCode.TAKEN_OVER) is TakenOver
    for code in (CloseCode.MESSAGE_TOO_BIG, CloseCode.PROTOCOL_ERROR, CloseCode.BAD_HEARTBEAT):
        assert classify(code) is ProtocolViolation
    assert classify(1000) is TokendError
    assert classify(4999) is TokendError
    assert str(Revoked(4506, "session revoked")) == "4506 token revoked: session revoked"


def test_a_token_that_is_not_a_jwt_is_refused_before_connecting():
    with pytest.raises(AuthError) as refused:
        Session(url_of(free_port()), "not-a-token")
    assert refused.value.code is None


# Against a real tokend


async def test_heartbeats_renew_and_bye(
    start_app: StartApp, tokens: TokenService, events: EventLog
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
    start_app: StartApp, tokens: TokenService, events: EventLog
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
    assert len(renewals) >= 8
    assert len(events.of("TOKEN_RENEWED", tid)) == len(renewals) == session.stats.renewals
    assert not events.of("TOKEN_EXPIRED", tid)
    assert not events.of("SESSION_WARN", tid)
    await events.wait_for("SESSION_CLOSED", tid)


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
        assert going.delay is not None and going.delay <= FAST.base
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


async def test_revocation_is_terminal(start_app: StartApp, tokens: TokenService):
    app = await start_app()
    token = tokens.mint("revoked")
    async with connect(url_of(app.port), token, backoff=FAST) as session:
        recorder = Recorder(session)
        await recorder.until(Change.CONNECTED)
        assert app.node is not None
        await app.node.store.end(
            session.tid, conn="", event="TOKEN_REVOKED", tomb="revoked", code=4506
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
    start_app: StartApp, tokens: TokenService, monkeypatch: pytest.MonkeyPatch
):
    app = await start_app(token_ttl=30, renew_window=9)
    old_token = tokens.mint("twice", ttl_s=5)
    welcomes: list[p.Welcome] = []
    welcomed = Session._welcome
    monkeypatch.setattr(Session, "_welcome", lambda s, w: (welcomes.append(w), welcomed(s, w))[1])
    async with connect(url_of(app.port), old_token, backoff=FAST) as first:
        first_changes = Recorder(first)
        await first_changes.until(Change.RENEWED)  # first now holds a newer token
        # The newcomer holds the old token and the key of first's WELCOME: a session held
        # live is taken only with that proof (spec "Resume proof"; tests/test_resume_proof.py).
        (welcome,) = welcomes
        async with RawClient.connect(app.port) as second:
            proof = p.resume_proof(welcome.session_key, welcome.tid)
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
    session = Session(url_of(free_port()), _unsigned_token(), backoff=backoff)
    with pytest.raises(RetriesExhausted) as gave_up:
        await session.start()
    assert gave_up.value.code is None
    assert session.stats.reconnects == 3
    assert "cannot connect" in str(gave_up.value)


def _unsigned_token() -> str:
    """A JWT-shaped token for servers that do not verify it (or are not there)."""
    claims = {"jti": str(uuid.uuid4()), "sub": "nobody", "exp": int(time.time()) + 60}
    return jwt.encode(claims, "k" * 32, algorithm="HS256")


# A client whose event loop is blocked (it runs in a thread, with its own loop,
# so that blocking it does not block the in-process server) until the server has
# done what the test waits for.


def _run_blocking_client(
    url: str, token: str, release: threading.Event
) -> tuple[list[Lifecycle], Session]:
    async def main() -> tuple[list[Lifecycle], Session]:
        session = Session(url, token, backoff=FAST)
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
) -> tuple[list[Lifecycle], Session]:
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
    await events.wait_for("SESSION_RECOVERED", str(session.tid))
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


@contextlib.asynccontextmanager
async def fake_server(
    handler: Callable[[ServerConnection], Awaitable[None]],
) -> AsyncIterator[str]:
    async with serve(
        handler,
        LOOPBACK,
        0,
        select_subprotocol=lambda _conn, _offered: p.SUBPROTOCOL,
        compression=None,
        ping_interval=None,
    ) as server:
        yield url_of(server.sockets[0].getsockname()[1])


def _welcome_for(hello: bytes, heartbeat_ms: int, warn_ms: int) -> bytes:
    frame = p.decode(hello)
    assert isinstance(frame, p.Hello)
    claims = jwt.decode(frame.token, options={"verify_signature": False})
    exp_ms = claims["exp"] * 1000
    key = os.urandom(p.SESSION_KEY_LENGTH)
    return p.encode(
        p.Welcome(uuid.UUID(claims["jti"]).bytes, exp_ms, heartbeat_ms, warn_ms, 2 * warn_ms, key)
    )


async def test_a_server_breaking_the_protocol_is_terminal():
    async def handler(ws: ServerConnection) -> None:
        await ws.send(_welcome_for(await ws.recv(), 50, 300))
        await ws.send(b"\x09")  # unknown frame type
        await ws.wait_closed()

    async with fake_server(handler) as url:
        session = Session(url, _unsigned_token(), backoff=FAST)
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
        await ws.send(_welcome_for(await ws.recv(), 50, 300))
        async for message in ws:  # take heartbeats, never ACK them
            if message == p.encode(p.Bye()):
                return

    async with (
        fake_server(handler) as url,
        connect(url, _unsigned_token(), backoff=FAST) as session,
    ):
        recorder = Recorder(session)
        dropped = await recorder.until(Change.RECONNECTING)
        assert dropped.code is None and "no heartbeat ACK for 0.3 s" in dropped.detail
        await recorder.until(Change.CONNECTED)
        assert connections == 2


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
        try:
            yield cls(process)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()

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
