"""A resume skips the signature of a token the store knows, and nothing else
(docs/security.md, "A resume skips the signature of a token the store knows").

Real tokend apps on the test Redis, clients built from the spec's bytes. The node's
token checks are watched (recorded, then done as always) to see which HELLO had its
signature checked: a fresh login at once, a resume with the token its session was last
verified with never, a resume with any other token after the store said so. Each
refusal a verified HELLO would meet is met the same: expired, revoked, a removed key,
another token of the session (verified, then resumed), a forged signature on a token
that looks like the known one.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis

from testkit import replies
from testkit.clients import Closed, RawClient, tid_of
from testkit.events import EventLog
from tokend.core import protocol as p
from tokend.core.claims import TokenError
from tokend.ops.app import App
from tokend.tokens.keys import KeyRing
from tokend.tokens.service import TokenService, token_digest

StartApp = Callable[..., Awaitable[App]]


def watch_signatures(app: App, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Record, for each token check of the node, whether the signature was checked."""
    service = app.node.tokens
    check = service.check
    checked: list[bool] = []

    def recording(token: str, now: float, *, signature: bool) -> tuple[object, str]:
        checked.append(signature)
        return check(token, now, signature=signature)

    monkeypatch.setattr(service, "check", recording)
    return checked


async def session_started(app: App, token: str) -> p.Welcome:
    """A session started with ``token`` whose connection then ended: the store keeps it."""
    async with RawClient.connect(app.port) as client:
        return await client.hello(token)


def proof_of(welcome: p.Welcome) -> bytes:
    return p.resume_proof(welcome.session_key, welcome.tid)


async def hello(app: App, token: str, proof: bytes | None) -> p.Welcome | tuple[int, str]:
    """A HELLO on a new connection: its WELCOME, or its close (code, reason)."""
    async with RawClient.connect(app.port) as client:
        await client.send(p.encode(p.Hello(token, proof=proof)))
        try:
            frame = await client.recv()
        except Closed as closed:
            return closed.code or 0, closed.reason
        assert isinstance(frame, p.Welcome), frame
        return frame


async def resume(app: App, token: str, welcome: p.Welcome) -> p.Welcome | tuple[int, str]:
    """A resume with ``token`` and the proof of ``welcome``: its WELCOME, or its close."""
    return await hello(app, token, proof_of(welcome))


async def kept_digest(app: App, redis: Redis, tid: bytes) -> str | None:
    key = app.node.store.keys.session_keys(uuid.UUID(bytes=tid))[0]
    kept = await redis.hget(key, "tok")
    return None if kept is None else replies.text(kept)


def digest_of(app: App, token: str) -> str:
    return app.node.tokens.check(token, time.time(), signature=True)[1]


async def test_a_fresh_login_is_verified_at_once_and_its_resume_is_not(
    start_app: StartApp,
    tokens: TokenService,
    redis: Redis,
    events: EventLog,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = await start_app()
    checked = watch_signatures(app, monkeypatch)
    token = tokens.mint("alice")
    first = await session_started(app, token)
    assert checked == [True]  # no proof: verified before the store is asked, once
    assert await kept_digest(app, redis, first.tid) == digest_of(app, token)
    checked.clear()
    again = await resume(app, token, first)
    assert isinstance(again, p.Welcome) and again.resumed
    assert checked == [False]  # the store knew the token: its signature was not checked
    assert len(events.of("SESSION_RESUMED", tid_of(first))) == 1


async def test_another_token_of_the_session_is_verified_then_resumed_and_kept(
    start_app: StartApp, tokens: TokenService, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A token the store does not know (here: re-issued for the same session, as a
    renewal's is): VERIFY, verified, resumed, and its digest is the one kept now."""
    app = await start_app()
    tid = uuid.uuid4()
    now = int(time.time())
    first = await session_started(app, tokens.mint("alice", tid=tid, iat=now - 10))
    other = tokens.mint("alice", tid=tid, iat=now)
    checked = watch_signatures(app, monkeypatch)
    again = await resume(app, other, first)
    assert isinstance(again, p.Welcome) and again.resumed
    assert checked == [False, True]
    assert await kept_digest(app, redis, first.tid) == digest_of(app, other)


async def test_the_token_a_renewal_gave_is_kept_and_its_resume_skips_the_signature(
    start_app: StartApp, tokens: TokenService, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node signed it: the heartbeat after the ACK that gave it records its digest
    (heartbeat.lua), once; a resume with it is then not verified, as with the token the
    session was verified with. Before, every resume after a renewal paid the signature
    and a second round trip: with 15-minute tokens, most resumes of a reload."""
    app = await start_app(renew_window=30)
    ttl = app.settings.token_ttl_s
    # 20 s left: inside the renew window, so the first heartbeat renews.
    token = tokens.mint("alice", iat=int(time.time()) - ttl + 20)
    async with RawClient.connect(app.port) as client:
        welcome = await client.hello(token)
        renewal = await client.heartbeat()
        assert renewal.renewed and renewal.token is not None
        renewed = renewal.token
        assert await kept_digest(app, redis, welcome.tid) == digest_of(app, token)
        await client.heartbeat()  # the flight after the renewal's ACK
        assert await kept_digest(app, redis, welcome.tid) == digest_of(app, renewed)
        # Carried by that one flight only: a digest written over is not written back.
        await redis.hset(app.node.store.keys.session_keys(tid_uuid(welcome))[0], "tok", "x")
        await client.heartbeat()
        assert await kept_digest(app, redis, welcome.tid) == "x"
        await redis.hset(
            app.node.store.keys.session_keys(tid_uuid(welcome))[0],
            "tok",
            digest_of(app, renewed),
        )
    checked = watch_signatures(app, monkeypatch)
    again = await resume(app, renewed, welcome)
    assert isinstance(again, p.Welcome) and again.resumed
    assert checked == [False]


async def test_a_resume_with_an_older_token_is_given_the_current_one_and_the_store_keeps_it(
    start_app: StartApp, tokens: TokenService, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that resumes with the token it held before a renewal (the renewed ACK
    was lost) is verified, and re-sent the current token: the store keeps that one next."""
    app = await start_app(renew_window=30)
    ttl = app.settings.token_ttl_s
    token = tokens.mint("alice", iat=int(time.time()) - ttl + 20)
    async with RawClient.connect(app.port) as client:
        welcome = await client.hello(token)
        renewed = (await client.heartbeat()).token  # the client loses it
        await client.heartbeat()
    assert renewed is not None
    assert await kept_digest(app, redis, welcome.tid) == digest_of(app, renewed)
    checked = watch_signatures(app, monkeypatch)
    async with RawClient.connect(app.port) as client:
        again = await client.hello(token, proof_of(welcome))
        assert again.resumed
        assert checked == [False, True]  # not the token kept: verified
        assert await kept_digest(app, redis, welcome.tid) == digest_of(app, token)
        resent = await client.heartbeat(exp_ms=token_exp_ms(token))
        assert resent.resent and resent.token == renewed
        await client.heartbeat()
        assert await kept_digest(app, redis, welcome.tid) == digest_of(app, renewed)


def tid_uuid(welcome: p.Welcome) -> uuid.UUID:
    return uuid.UUID(bytes=welcome.tid)


def token_exp_ms(token: str) -> int:
    payload = token.split(".")[1]
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    return int(claims["exp"]) * 1000


async def test_a_forged_signature_on_the_known_token_is_4501_and_nothing_is_written(
    start_app: StartApp,
    tokens: TokenService,
    redis: Redis,
    events: EventLog,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The known token's header and claims with another signature: another digest, so
    the store asks for it verified, and the signature fails."""
    app = await start_app()
    token = tokens.mint("alice")
    first = await session_started(app, token)
    kept = await kept_digest(app, redis, first.tid)
    head, _, signature = token.rpartition(".")
    forged = f"{head}.{'A' if signature[0] != 'A' else 'B'}{signature[1:]}"
    checked = watch_signatures(app, monkeypatch)
    assert await resume(app, forged, first) == (p.CloseCode.INVALID_TOKEN, "bad_signature")
    assert checked == [False, True]
    assert await kept_digest(app, redis, first.tid) == kept
    assert events.of("SESSION_RESUMED", tid_of(first)) == []


async def test_a_known_token_past_its_exp_is_4502(
    start_app: StartApp, tokens: TokenService, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = await start_app(leeway=0)
    now = time.time()
    token = tokens.mint("alice", iat=int(now) - 10, ttl_s=12)  # exp 1 to 2 s from now
    first = await session_started(app, token)
    exp = int(now) + 2
    await asyncio.sleep(max(0.0, exp - time.time()) + 0.05)  # the clock past exp
    checked = watch_signatures(app, monkeypatch)
    assert await resume(app, token, first) == (p.CloseCode.TOKEN_EXPIRED, "expired")
    # Refused by the claims, then verified: the reason is the one a verify gives first.
    assert checked == [False, True]


async def test_a_known_token_revoked_is_4506(
    start_app: StartApp, tokens: TokenService, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = await start_app()
    token = tokens.mint("alice")
    first = await session_started(app, token)
    assert await app.node.store.revoke(uuid.UUID(bytes=first.tid), by="cli:test") is not None
    checked = watch_signatures(app, monkeypatch)
    closed = await resume(app, token, first)
    assert closed == (p.CloseCode.TOKEN_REVOKED, "session_revoked")
    # Told to its token only: the store answered VERIFY first, the token was verified.
    assert checked == [False, True]


async def test_a_known_token_of_a_removed_key_is_4501(
    start_app: StartApp, tokens: TokenService, keys_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = await start_app()
    token = tokens.mint("alice")
    first = await session_started(app, token)
    ring = KeyRing.open(keys_dir)
    old = ring.kids[-1]
    ring.rotate()
    (keys_dir / f"{old}.pem").unlink()
    app.node.tokens.keys.refresh()  # as the node's timer would
    assert old not in app.node.tokens.keys.kids
    checked = watch_signatures(app, monkeypatch)
    assert await resume(app, token, first) == (p.CloseCode.INVALID_TOKEN, "unknown_kid")
    assert checked == [False, True]


def test_the_digest_binds_the_token_to_its_key() -> None:
    """Another key under the same kid, or another token, is another digest."""
    assert token_digest(b"k" * 32, "a.b.c") != token_digest(b"K" * 32, "a.b.c")
    assert token_digest(b"k" * 32, "a.b.c") != token_digest(b"k" * 32, "a.b.d")
    # 128 bits of SHA-256 (no fewer: nothing weakened by the shorter text), as base64url.
    digest = token_digest(b"k" * 32, "a.b.c")
    assert len(digest) == 22
    assert (
        base64.urlsafe_b64decode(digest + "==")
        == hashlib.sha256(b"k" * 32 + b"a.b.c").digest()[:16]
    )


@pytest.mark.parametrize("proof", [None, bytes(16)], ids=["fresh", "with-proof"])
async def test_a_token_never_seen_is_verified_before_anything_is_written(
    start_app: StartApp, tokens: TokenService, redis: Redis, proof: bytes | None
) -> None:
    """A HELLO with a proof for a session the store does not know: VERIFY, then as a
    fresh login (started, not resumed); a forged one is refused without a trace."""
    app = await start_app()
    token = tokens.mint("bob")
    head, _, signature = token.rpartition(".")
    forged = f"{head}.{'A' if signature[0] != 'A' else 'B'}{signature[1:]}"
    assert await hello(app, forged, proof) == (p.CloseCode.INVALID_TOKEN, "bad_signature")
    tid = app.node.tokens.check(token, time.time(), signature=True)[0].tid
    assert not await redis.exists(*app.node.store.keys.session_keys(tid))
    welcome = await hello(app, token, proof)
    assert isinstance(welcome, p.Welcome) and not welcome.resumed


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(position=st.integers(min_value=0), char=st.sampled_from("AZaz09-_.=+/ \x00é"))
def test_a_check_without_the_signature_refuses_all_a_verify_refuses_but_the_signature(
    tokens: TokenService, position: int, char: str
) -> None:
    """On a token with one character changed anywhere: the same claims or refusal as a
    verify; where only the signature would refuse it, never the known token's digest
    (so the store asks for it verified)."""
    token = tokens.mint("carol")
    position %= len(token)
    changed = token[:position] + char + token[position + 1 :]
    now = time.time()

    def outcome(signature: bool) -> tuple[object, str]:
        try:
            return tokens.check(changed, now, signature=signature)
        except TokenError as exc:
            return exc.reason, ""

    verified, (unverified, digest) = outcome(True), outcome(False)
    if verified[0] == "bad_signature":
        assert digest != tokens.check(token, now, signature=True)[1]
    else:
        assert unverified == verified[0]


async def test_a_refused_unverified_hello_gets_the_reason_a_verified_one_gets(
    start_app: StartApp, tokens: TokenService
) -> None:
    """Expired and with a forged signature, shown with a proof: 4501 bad_signature (a
    verify looks at the signature first), as before; not the claims' 4502."""
    app = await start_app(leeway=0)
    token = tokens.mint("erin", iat=int(time.time()) - 100, ttl_s=50)
    head, _, signature = token.rpartition(".")
    forged = f"{head}.{'A' if signature[0] != 'A' else 'B'}{signature[1:]}"
    assert await hello(app, forged, bytes(16)) == (p.CloseCode.INVALID_TOKEN, "bad_signature")
    assert await hello(app, token, bytes(16)) == (p.CloseCode.TOKEN_EXPIRED, "expired")


async def test_the_sub_cap_is_told_to_a_verified_token_only(
    start_app: StartApp, tokens: TokenService
) -> None:
    """A forged token with a proof, naming a sub at its cap: 4501, not the 4029 that would
    tell of that sub's sessions; the true token (another session of the sub) is 4029."""
    app = await start_app(max_sessions_per_sub=1)
    async with RawClient.connect(app.port) as holder:
        await holder.hello(tokens.mint("carl"))
        another = tokens.mint("carl")
        head, _, signature = another.rpartition(".")
        forged = f"{head}.{'A' if signature[0] != 'A' else 'B'}{signature[1:]}"
        proof = bytes(16)
        assert await hello(app, forged, proof) == (p.CloseCode.INVALID_TOKEN, "bad_signature")
        assert await hello(app, another, proof) == (p.CloseCode.RATE_LIMITED, "too_many_sessions")
