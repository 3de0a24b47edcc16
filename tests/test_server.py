"""Conformance: a client built from the spec's bytes against a real tokend and Redis."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
import uuid
from collections.abc import Callable

import jwt
import pytest
import redis as redis_lib

from testkit.clients import RawClient, tid_of
from testkit.events import EventLog, after_a_full_sweep, left_to_judge, read_events
from testkit.net import http_get, http_request
from testkit.redis_servers import RedisProcess
from testkit.tokend_process import CALM_CLOCKS, TokendProcess, node_env
from testkit.tokens import WallClockTokens, minter
from testkit.waiting import eventually
from tokend.config import KEYS_REFRESH_INTERVAL, Settings
from tokend.core import protocol as p
from tokend.ops.app import App
from tokend.store.redis_client import open_client
from tokend.store.sessions import Store
from tokend.tokens.service import TokenService


async def test_hello_welcome_and_heartbeat_ack(app: App, tokens: WallClockTokens, events: EventLog):
    token = tokens.mint("alice")
    async with RawClient.connect(app.port) as client:
        assert client.ws.subprotocol == p.SUBPROTOCOL
        welcome = await client.hello(token)
        assert not welcome.resumed
        assert welcome.heartbeat_ms == 200
        assert welcome.warn_ms == 600
        assert welcome.expire_ms == 1200
        claims = tokens.verify(token)
        assert welcome.tid == claims.tid.bytes
        assert welcome.exp_ms == claims.exp * 1000
        ack = await client.heartbeat()
        assert ack.seq == 1
        assert ack.exp_ms == welcome.exp_ms
        assert ack.token is None and not ack.renewed and not ack.resent and not ack.was_warn
        started = await events.wait_for("SESSION_STARTED", str(claims.tid))
        assert started[0]["sub"] == "alice"
        assert started[0]["node"] == "node-a"
        assert started[0]["v"] == 1


async def test_renewal_inside_window(start_app, tokens: WallClockTokens, events: EventLog):
    app = await start_app(token_ttl=30, renew_window=9)
    token = tokens.mint("bob", ttl_s=5)
    async with RawClient.connect(app.port) as client:
        welcome = await client.hello(token)
        ack = await client.heartbeat()
        assert ack.renewed and ack.token is not None
        assert ack.exp_ms > welcome.exp_ms
        renewed = tokens.verify(ack.token)
        assert renewed.tid.bytes == welcome.tid
        assert renewed.sub == "bob"
        assert renewed.exp * 1000 == ack.exp_ms
        assert renewed.exp - renewed.iat == 30
        await events.wait_for("TOKEN_RENEWED", tid_of(welcome))
        # The next heartbeat, holding the new exp, is outside the window: no renewal.
        ack2 = await client.heartbeat()
        assert not ack2.renewed and ack2.token is None


async def test_stale_exp_gets_token_resent(start_app, tokens: WallClockTokens):
    app = await start_app(token_ttl=30, renew_window=9)
    async with RawClient.connect(app.port) as client:
        welcome = await client.hello(tokens.mint("carol", ttl_s=5))
        first = await client.heartbeat(exp_ms=welcome.exp_ms)
        assert first.renewed
        # The client "lost" that ACK and still says the old exp.
        again = await client.heartbeat(exp_ms=welcome.exp_ms)
        assert again.resent and not again.renewed
        assert again.exp_ms == first.exp_ms
        assert again.token is not None
        assert tokens.verify(again.token).exp * 1000 == first.exp_ms


async def test_warn_notice_then_recovery(app: App, tokens: TokenService, events: EventLog):
    async with RawClient.connect(app.port) as client:
        welcome = await client.hello(tokens.mint("dave"))
        tid = tid_of(welcome)
        notice = await client.recv(timeout=3)
        assert notice == p.Notice(p.SessionState.WARN)
        await events.wait_for("SESSION_WARN", tid)
        ack = await client.heartbeat()
        assert ack.was_warn
        await events.wait_for("SESSION_RECOVERED", tid)
        ack = await client.heartbeat()
        assert not ack.was_warn


async def test_silence_expires_once(app: App, tokens: TokenService, events: EventLog, redis):
    async with RawClient.connect(app.port) as client:
        welcome = await client.hello(tokens.mint("erin"))
        tid = tid_of(welcome)
        assert isinstance(await client.recv(timeout=3), p.Notice)
        closed = await client.expect_close(timeout=3)
        assert closed.code == p.CloseCode.SESSION_EXPIRED
    expired = await events.wait_for("TOKEN_EXPIRED", tid)
    assert expired[0]["reason"] == "heartbeat_timeout"
    assert app.admin is not None
    await after_a_full_sweep(app.admin.port)  # no sweep has a duplicate left to write
    assert await left_to_judge(redis, app.settings.key_prefix, [tid]) == []
    stream = [e for e in await read_events(redis, app.settings.key_prefix) if e["tid"] == tid]
    assert [e["type"] for e in stream] == ["SESSION_STARTED", "SESSION_WARN", "TOKEN_EXPIRED"]


@pytest.mark.parametrize("first", [b"", b"\x09", p.encode(p.Bye())])
async def test_protocol_errors_before_welcome(app: App, first: bytes):
    async with RawClient.connect(app.port) as client:
        await client.send(first)
        closed = await client.expect_close()
        assert closed.code == p.CloseCode.PROTOCOL_ERROR


async def test_text_message_is_protocol_error(app: App, tokens: TokenService):
    async with RawClient.connect(app.port) as client:
        await client.hello(tokens.mint("t"))
        await client.send("hello")
        assert (await client.expect_close()).code == p.CloseCode.PROTOCOL_ERROR


async def test_hello_after_welcome_is_protocol_error(app: App, tokens: TokenService):
    token = tokens.mint("t")
    async with RawClient.connect(app.port) as client:
        await client.hello(token)
        await client.send(p.encode(p.Hello(token)))
        assert (await client.expect_close()).code == p.CloseCode.PROTOCOL_ERROR


async def test_unknown_version_is_protocol_error(app: App, tokens: TokenService):
    async with RawClient.connect(app.port) as client:
        await client.send(p.encode(p.Hello(tokens.mint("t"), version=2)))
        assert (await client.expect_close()).code == p.CloseCode.PROTOCOL_ERROR


async def test_message_too_big(app: App):
    async with RawClient.connect(app.port) as client:
        await client.send(b"\x01" * (16384 + 1))
        assert (await client.expect_close()).code == p.CloseCode.MESSAGE_TOO_BIG


async def test_no_hello_in_time(app: App):
    async with RawClient.connect(app.port) as client:
        # hello_timeout is 1 s in the test settings.
        closed = await client.expect_close(timeout=3)
        assert (closed.code, closed.reason) == (p.CloseCode.HELLO_TIMEOUT, "hello_timeout")


async def refused_at_hello(port: int, token: str) -> tuple[int | None, str]:
    """The close code and reason a HELLO with ``token`` gets."""
    async with RawClient.connect(port) as client:
        await client.send(p.encode(p.Hello(token)))
        closed = await client.expect_close()
    return closed.code, closed.reason


@pytest.mark.parametrize(
    "token", ["garbage", "a.b.c", "eyJhbGciOiJub25lIn0.eyJzdWIiOiJ4In0."], ids=str
)
async def test_invalid_token(app: App, token: str):
    assert await refused_at_hello(app.port, token) == (p.CloseCode.INVALID_TOKEN, "malformed")


async def test_token_from_other_keys_is_invalid(app: App, tmp_path, settings):

    stranger = minter(settings, tmp_path / "other-keys").mint("mallory")
    assert await refused_at_hello(app.port, stranger) == (p.CloseCode.INVALID_TOKEN, "unknown_kid")


async def test_refusals_name_their_reason(app: App, tokens: TokenService, make_settings):
    """Each refusal's close reason is its stable word (docs/protocol.md §7), never a
    library's class name."""
    head, body, signature = tokens.mint("t").split(".")
    flipped = signature[:10] + ("A" if signature[10] != "A" else "B") + signature[11:]
    bad_signature = f"{head}.{body}.{flipped}"
    foreign = TokenService(make_settings(audience="elsewhere"), tokens.keys).mint("t")
    cases = {bad_signature: "bad_signature", foreign: "wrong_audience"}
    for token, reason in cases.items():
        assert await refused_at_hello(app.port, token) == (p.CloseCode.INVALID_TOKEN, reason)


async def test_expired_token_at_hello(app: App, tokens: TokenService):
    import time

    old = tokens.mint("t", ttl_s=10, iat=int(time.time()) - 60)
    assert await refused_at_hello(app.port, old) == (p.CloseCode.TOKEN_EXPIRED, "expired")


@pytest.mark.parametrize(
    ("fault", "reason"),
    [("mac", "bad_mac"), ("tid", "wrong_tid"), ("replay", "old_seq"), ("zero_seq", "old_seq")],
)
async def test_bad_heartbeat_proof(app: App, tokens: TokenService, fault: str, reason: str):
    async with RawClient.connect(app.port) as client:
        welcome = await client.hello(tokens.mint("t"))
        if fault == "mac":
            tampered = bytearray(client.heartbeat_bytes())
            tampered[-1] ^= 0x01
            await client.send(bytes(tampered))
        elif fault == "tid":
            other = uuid.uuid4().bytes
            hb = p.make_heartbeat(welcome.session_key, other, 1, welcome.exp_ms)
            await client.send(p.encode(hb))
        elif fault == "replay":
            frame = client.heartbeat_bytes()
            await client.send(frame)
            assert isinstance(await client.recv(), p.HeartbeatAck)
            await client.send(frame)
        else:
            await client.send(client.heartbeat_bytes(seq=0))
        closed = await client.expect_close()
        assert (closed.code, closed.reason) == (p.CloseCode.BAD_HEARTBEAT, reason)


async def test_other_subprotocol_refused_with_400(app: App):
    from websockets.exceptions import InvalidStatus

    with pytest.raises(InvalidStatus) as refused:
        async with RawClient.connect(app.port, subprotocols=["chat.v2"]):
            pass
    assert refused.value.response.status_code == 400


async def test_no_subprotocol_offered_is_accepted(app: App, tokens: TokenService):
    async with RawClient.connect(app.port, subprotocols=[]) as client:
        assert client.ws.subprotocol is None
        await client.hello(tokens.mint("t"))


async def test_bye_closes_1000_and_leaves_tombstone(
    app: App, tokens: TokenService, events: EventLog
):
    token = tokens.mint("frank")
    async with RawClient.connect(app.port) as client:
        welcome = await client.hello(token)
        await client.send(p.encode(p.Bye()))
        assert (await client.expect_close()).code == p.CloseCode.NORMAL
    await events.wait_for("SESSION_CLOSED", tid_of(welcome))
    async with RawClient.connect(app.port) as client:
        await client.send(p.encode(p.Hello(token)))
        assert (await client.expect_close()).code == p.CloseCode.TOKEN_REVOKED


async def test_expired_session_tombstone_refuses_hello(
    app: App, tokens: TokenService, events: EventLog
):
    token = tokens.mint("gina")
    async with RawClient.connect(app.port) as client:
        welcome = await client.hello(token)
    # Dropped without BYE: the session expires server-side with no connection.
    expired = await events.wait_for("TOKEN_EXPIRED", tid_of(welcome), timeout=5)
    assert expired[0]["reason"] == "heartbeat_timeout"
    async with RawClient.connect(app.port) as client:
        await client.send(p.encode(p.Hello(token)))
        assert (await client.expect_close()).code == p.CloseCode.SESSION_EXPIRED
    assert len(events.of("TOKEN_EXPIRED", tid_of(welcome))) == 1


async def test_resume_after_drop_with_older_token(
    start_app, tokens: WallClockTokens, events: EventLog
):
    app = await start_app(token_ttl=30, renew_window=9)
    old_token = tokens.mint("hank", ttl_s=5)
    async with RawClient.connect(app.port) as client:
        welcome = await client.hello(old_token)
        renewed = await client.heartbeat()
        assert renewed.renewed
    # The renewed token was "lost"; the client resumes with the old one.
    async with RawClient.connect(app.port) as client:
        resumed = await client.hello(old_token)
        assert resumed.resumed
        assert resumed.tid == welcome.tid
        assert resumed.exp_ms == renewed.exp_ms
        assert resumed.session_key != welcome.session_key
        # The client may even echo WELCOME's exp: it still has not been given that token.
        ack = await client.heartbeat(exp_ms=resumed.exp_ms)
        assert ack.resent and ack.token is not None
        assert tokens.verify(ack.token).exp * 1000 == renewed.exp_ms
    await events.wait_for("SESSION_RESUMED", tid_of(welcome))


async def test_takeover_closes_older_connection(app: App, tokens: TokenService, events: EventLog):
    token = tokens.mint("ivy")
    async with RawClient.connect(app.port) as first, RawClient.connect(app.port) as second:
        welcome = await first.hello(token)
        # Held live by the first: the proof of its key (spec "Resume proof").
        resumed = await second.hello(token, p.resume_proof(welcome.session_key, welcome.tid))
        assert resumed.resumed
        assert (await first.expect_close(timeout=2)).code == p.CloseCode.TAKEN_OVER
        assert isinstance(await second.heartbeat(), p.HeartbeatAck)


async def test_revoke_closes_connection_and_bars_token(
    app: App, tokens: WallClockTokens, events: EventLog
):
    token = tokens.mint("jack")
    claims = tokens.verify(token)
    async with RawClient.connect(app.port) as client:
        await client.hello(token)
        assert app.node is not None
        ended = await app.node.store.end(
            claims.tid,
            conn="",
            event="TOKEN_REVOKED",
            tomb="revoked",
            code=p.CloseCode.TOKEN_REVOKED,
        )
        assert ended == 1
        assert (await client.expect_close(timeout=2)).code == p.CloseCode.TOKEN_REVOKED
    await events.wait_for("TOKEN_REVOKED", str(claims.tid))
    async with RawClient.connect(app.port) as client:
        await client.send(p.encode(p.Hello(token)))
        assert (await client.expect_close()).code == p.CloseCode.TOKEN_REVOKED


async def test_shutdown_closes_1001_and_session_resumes(
    start_app, tokens: TokenService, events: EventLog
):
    app = await start_app()
    token = tokens.mint("kim")
    async with RawClient.connect(app.port) as client:
        welcome = await client.hello(token)
        await app.stop()
        assert (await client.expect_close()).code == p.CloseCode.GOING_AWAY
    app2 = await start_app()
    async with RawClient.connect(app2.port) as client:
        assert (await client.hello(token)).resumed
    assert not events.of("TOKEN_EXPIRED", tid_of(welcome))


async def test_http_routes(app: App):

    assert await http_get(app.port, "/healthz") == (200, {"status": "ok", "node": "node-a"})
    assert await http_get(app.port, "/readyz") == (200, {"status": "ready"})
    status, jwks = await http_get(app.port, "/.well-known/jwks.json")
    assert status == 200 and jwks["keys"][0]["crv"] == "Ed25519"
    assert (await http_get(app.port, "/nope"))[0] == 404


async def test_resume_from_warn_recovers(app: App, tokens: TokenService, events: EventLog):
    token = tokens.mint("lena")
    async with RawClient.connect(app.port) as client:
        welcome = await client.hello(token)
    tid = tid_of(welcome)
    await events.wait_for("SESSION_WARN", tid, timeout=3)
    async with RawClient.connect(app.port) as client:
        assert (await client.hello(token)).resumed
        assert not (await client.heartbeat()).was_warn
    await events.wait_for("SESSION_RECOVERED", tid)
    assert [e["type"] for e in events.events if e["tid"] == tid] == [
        "SESSION_STARTED",
        "SESSION_WARN",
        "SESSION_RESUMED",
        "SESSION_RECOVERED",
    ]


async def test_late_heartbeat_and_resume_expire_even_before_a_sweep(
    start_app, tokens: WallClockTokens, events: EventLog
):
    # One sweep at start, then none for a minute: only the scripts can judge silence.
    app = await start_app(sweep_interval=60)
    late_hb, late_hello = tokens.mint("mia"), tokens.mint("ned")
    async with RawClient.connect(app.port) as client, RawClient.connect(app.port) as other:
        await client.hello(late_hb)
        await other.hello(late_hello)
        await asyncio.sleep(1.3)  # let expire_after (1.2 s) pass in silence
        await client.send(client.heartbeat_bytes())
        assert (await client.expect_close()).code == p.CloseCode.SESSION_EXPIRED
    async with RawClient.connect(app.port) as client:
        await client.send(p.encode(p.Hello(late_hello)))
        assert (await client.expect_close()).code == p.CloseCode.SESSION_EXPIRED
    for token in (late_hb, late_hello):
        tid = str(tokens.verify(token).tid)
        expired = await events.wait_for("TOKEN_EXPIRED", tid)
        assert [e["reason"] for e in expired] == ["heartbeat_timeout"]
        assert not events.of("SESSION_RESUMED", tid)


async def rotate_keys(settings) -> str:
    """``tokend keys rotate`` in a process of its own; the new kid."""
    rotated = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tokend", "keys", "rotate",
        env={"PATH": "/usr/bin:/bin", "TOKEND_KEYS_DIR": settings.keys_dir},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(rotated.communicate(), 30)
    assert rotated.returncode == 0, err
    return out.decode().strip()


async def until_due(app: App, kid: str) -> None:
    """Wait until ``kid`` signs on ``app`` (key_publish_delay after it was made)."""
    await asyncio.sleep(max(0.0, app.node.tokens.schedule.signs_from(kid) - time.time()))


async def test_renewals_cross_a_key_rotation(start_app, tokens: WallClockTokens, settings):
    # Clocks long enough to span a `tokend keys rotate` subprocess.
    app = await start_app(
        token_ttl=30,
        renew_window=29,
        warn_after=10,
        expire_after=20,
        key_publish_delay=2,
        jwks_max_age=1,
    )
    async with RawClient.connect(app.port) as client:
        await client.hello(tokens.mint("rosa", ttl_s=5))
        before = await client.heartbeat()
        assert before.renewed and before.token is not None
        old_kid = jwt.get_unverified_header(before.token)["kid"]
        new_kid = await rotate_keys(settings)
        assert new_kid > old_kid
        await until_due(app, new_kid)
        after = await client.heartbeat()
        assert after.renewed and after.token is not None
        assert jwt.get_unverified_header(after.token)["kid"] == new_kid
        assert tokens.verify(after.token).sub == "rosa"
    # The token signed with the old key still opens the session.
    async with RawClient.connect(app.port) as client:
        assert (await client.hello(before.token)).resumed


class JwksVerifier:
    """A third party that knows only a node's JWKS URL: it keeps the JWKS for as long
    as its Cache-Control allows, and never refetches early for an unknown kid (the
    strictest such verifier; pyjwt's PyJWKClient, for one, would)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.keys: dict[str, jwt.PyJWK] = {}
        self.fresh_until = 0.0

    async def fetch(self) -> dict[str, jwt.PyJWK]:
        reply = await http_request(self.port, "GET", "/.well-known/jwks.json")
        assert reply.status == 200
        directive = reply.headers["cache-control"]
        found = re.fullmatch(r"public, max-age=(\d+)", directive)
        assert found is not None, directive
        max_age = int(found[1])
        self.fresh_until = time.monotonic() + max_age
        self.keys = {jwk["kid"]: jwt.PyJWK(jwk) for jwk in reply.json()["keys"]}
        return self.keys

    async def verify(self, token: str) -> str:
        """The token's sub; raises (jwt.PyJWTError, KeyError) if it does not verify."""
        if time.monotonic() >= self.fresh_until:
            await self.fetch()
        key = self.keys[jwt.get_unverified_header(token)["kid"]]
        claims = jwt.decode(token, key, algorithms=["EdDSA"], audience="tokend", issuer="tokend")
        return str(claims["sub"])


async def test_a_verifier_that_knows_only_the_jwks_url_accepts_every_token_across_a_rotation(
    start_app, settings
):
    """``tokend keys rotate`` on two nodes, one busy (a session renewing), one idle: the
    new key is in both JWKS within a refresh, signs only once every cached JWKS has expired, and
    the old key stays published until every token it signed has expired."""
    # Calm session clocks: the busy session must outlive the slowest loop of this test.
    clocks = {
        **CALM_CLOCKS,
        **{"key_publish_delay": 3, "jwks_max_age": 1, "token_ttl": 4, "leeway": 0},
    }
    busy = await start_app(**clocks)
    idle = await start_app(node_name="node-b", **clocks)
    verifiers = [JwksVerifier(busy.port), JwksVerifier(idle.port)]
    old_kid = busy.node.tokens.signing_kid(time.time())
    for verifier in verifiers:
        assert list(await verifier.fetch()) == [old_kid]  # cached before the rotation
    async with RawClient.connect(busy.port) as client:
        await client.hello(busy.node.tokens.mint("busy"))
        new_kid = await rotate_keys(settings)

        async def published() -> bool:  # on every node, at its next keys refresh
            return all([list(await v.fetch()) == [new_kid, old_kid] for v in verifiers])

        await eventually(published, timeout=10 * KEYS_REFRESH_INTERVAL)
        retired_at = busy.node.tokens.schedule.retires_at(old_kid, [old_kid, new_kid])
        signers: set[str] = set()
        while time.time() < retired_at:
            # Renewed on the busy node, minted (as `tokend issue` would) on the idle one.
            ack = await client.heartbeat()
            minted = [ack.token] if ack.token else []
            minted.append(idle.node.tokens.mint("idle"))
            for token in minted:
                signers.add(jwt.get_unverified_header(token)["kid"])
                for verifier in verifiers:
                    assert await verifier.verify(token) in ("busy", "idle")
            await asyncio.sleep(0.2)
    assert signers == {old_kid, new_kid}
    # Every token of the old key has expired: it is no longer published, anywhere.
    for verifier in verifiers:
        assert list(await verifier.fetch()) == [new_kid]


async def test_sweeper_wakes_for_each_deadline_it_knows(start_app, make_settings, events):
    """Deadlines known at a sweep are each met when they fall due, not a sweep interval
    later: the interval here is longer than the test lasts."""
    settings = make_settings(sweep_interval=60, warn_after=10, expire_after=20)
    # Sessions whose tokens end 2, 3 and 4 s from now, made before the node starts, so
    # that its first sweep knows the first deadline.
    client = open_client(settings.redis_url, settings)
    store = Store(client, settings, "elsewhere")
    now = int(time.time())
    exps = {str(tid): now + n for n, tid in enumerate((uuid.uuid4() for _ in range(3)), 2)}
    for tid, exp in exps.items():
        started = await store.hello(uuid.UUID(tid), "wake", 5, now, exp, "elsewhere/1")
        assert started.outcome == "started"
    await client.aclose()
    await start_app(sweep_interval=60, warn_after=10, expire_after=20)
    for tid, exp in exps.items():
        (expired,) = await events.wait_for("TOKEN_EXPIRED", tid, timeout=20)
        assert expired["reason"] == "token_expired"
        assert 0 <= expired["at"] - exp * 1000 < 20_000  # not the 60 s of the interval


def test_listening_line_names_the_redis_without_its_password(
    own_redis: RedisProcess, make_settings
):
    redis_lib.Redis(port=own_redis.port).config_set("requirepass", "s3cret")
    url = f"redis://:s3cret@127.0.0.1:{own_redis.port}/0"
    node = TokendProcess(node_env(make_settings(redis_url=url, **CALM_CLOCKS)))
    node.start()
    try:
        (listening,) = node.logged("listening")
        assert listening["redis"] == f"redis://:***@127.0.0.1:{own_redis.port}/0"
    finally:
        node.stop()
    assert "s3cret" not in json.dumps(node.log_lines)


def test_clocks_that_let_a_session_expire_while_a_lost_connection_holds_it_are_logged(
    make_settings: Callable[..., Settings],
) -> None:
    warning = "expire_after does not outlast a lost connection's hold"
    calm = TokendProcess(node_env(make_settings(**CALM_CLOCKS)))  # 5 s + 15 s against 30 s
    calm.start()
    assert calm.stop() == 0 and not calm.logged(warning)
    short = TokendProcess(node_env(make_settings()))  # 0.2 s + 15 s against 1.2 s
    short.start()
    assert short.stop() == 0
    (line,) = short.logged(warning)
    assert (line["heartbeat_interval"], line["expire_after"]) == (0.2, 1.2)
