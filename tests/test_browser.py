"""The browser SDK (sdk/js/tokend.js) in headless Chromium against a real tokend.

The page (tests/browser/sdk.html, served over loopback HTTP) reports every
lifecycle change of its session; the test acts on the server (restart, revoke)
and checks what the page saw against the server's events.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jwt
import pytest
from websockets.asyncio.server import ServerConnection

import tokend_client
from testkit.certificates import tls_node
from testkit.clients import RawClient
from testkit.events import EventLog
from testkit.fake_servers import fake_server, unsigned_token, welcome_for
from testkit.net import LOOPBACK, url_of
from testkit.procs import killed_on_exit
from testkit.proxies import Link
from testkit.reconnects import (
    PROOF_CLOCKS,
    SPREAD_SESSIONS,
    SPREAD_WINDOW,
    assert_spread,
    balanced,
    resumed_at,
)
from testkit.shedding import BEST_PRIO, FLOOD_PRIO, FLOOD_S, SHED_SETTINGS, shed_period
from testkit.tokens import WallClockTokens, minter
from tokend.core import protocol as p
from tokend.ops.app import App
from tokend.server.admission import RETRY_AFTER_S
from tokend.tokens.service import TokenService

if TYPE_CHECKING:
    from tests.browser.harness import BrowserPage, BrowserTools, StaticSite

pytest_plugins = ["tests.browser.harness"]

StartApp = Callable[..., Awaitable[App]]
ROOT = Path(__file__).resolve().parent.parent
SDK_TYPES = ROOT / "sdk" / "js" / "tokend.d.ts"
# Backoff of the page's sessions, ms: reconnects are quick but still jittered.
FAST_BACKOFF = {"base": 50, "cap": 500, "goingAwayWindow": 500}
# A short openTimeout, ms, so that a session can be held for several of them quickly.
OPEN_TIMEOUT = 1000
# Heartbeats every half second, and WARN far off: a busy machine cannot make the held
# session anything but steady.
STEADY_CLOCKS = {"heartbeat_interval": 0.5, "warn_after": 20, "expire_after": 30}


@pytest.fixture
async def page(browser: BrowserPage, site: StaticSite) -> BrowserPage:
    """The SDK test page, loaded."""
    await browser.goto(f"{site.origin}/test/sdk.html")  # its module has run at "load"
    assert await browser.eval("typeof tokend.connect") == "function"
    return browser


async def open_session(page: BrowserPage, server: int | str, token: str, **options: Any) -> str:
    """Start a session in the page on tokend's port (or a URL); 'started', or the name
    of the error it ended with."""
    url = url_of(server) if isinstance(server, int) else server
    args = ", ".join(json.dumps(a) for a in (url, token, options))
    return str(await page.eval(f"openSession({args})"))


def changes(page: BrowserPage, kind: str) -> list[dict[str, Any]]:
    return [r for r in page.reports if r["kind"] == kind]


async def wait_change(
    page: BrowserPage, kind: str, count: int = 1, timeout: float = 5
) -> dict[str, Any]:
    """The ``count``-th change of ``kind`` the page reported."""
    found = await page.wait_for(
        lambda: len(changes(page, kind)) >= count and changes(page, kind),
        timeout,
        f"{count} '{kind}' change(s)",
    )
    return found[count - 1]


async def stats(page: BrowserPage) -> dict[str, Any]:
    return dict(await page.eval("session.stats"))


# The module's surface


def test_the_declarations_type_the_documented_usage(tools: BrowserTools):
    checked = subprocess.run(
        [
            str(tools.tsc),
            "--strict",
            "--noEmit",
            "--target",
            "es2022",
            "--module",
            "es2022",
            "--moduleResolution",
            "bundler",
            "--lib",
            "es2022,dom",
            str(ROOT / "tests" / "browser" / "typecheck.ts"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


async def test_every_export_is_declared(page: BrowserPage):
    declared = re.findall(
        r"^export declare (?:const|class|function) (\w+)", SDK_TYPES.read_text(), re.M
    )
    exported = await page.eval("Object.keys(tokend)")
    assert sorted(exported) == sorted(declared)


# The codec, byte for byte against tokend.core.protocol


async def test_frames_match_the_python_codec(page: BrowserPage):
    key = bytes(range(32))
    tid = uuid.uuid4()
    expected = p.encode(p.make_heartbeat(key, tid.bytes, 7, 1_764_680_000_123))
    hello = p.encode(p.Hello("a.b.c"))
    proof = p.resume_proof(key, tid.bytes)
    welcome = p.Welcome(tid.bytes, 1_764_680_000_000, 30_000, 90_000, 120_000, key, resumed=True)
    ack = p.HeartbeatAck(9, 1_764_680_900_000, "x.y.z", renewed=True, was_warn=True)
    result = await page.eval(
        f"""(async () => {{
          const hex = (b) => Array.from(b, (x) => x.toString(16).padStart(2, '0')).join('');
          const bytes = (h) => Uint8Array.from(h.match(/../g), (x) => parseInt(x, 16));
          const key = await tokend.importSessionKey(bytes('{key.hex()}'));
          const decode = (h) => {{
            try {{
              const f = tokend.decodeServerFrame(bytes(h).buffer);
              for (const k of ['tid', 'sessionKey']) if (f[k]) f[k] = hex(f[k]);
              return f;
            }} catch (e) {{ return e.name + ': ' + e.message; }}
          }};
          return {{
            heartbeat: hex(await tokend.encodeHeartbeat(key, bytes('{tid.hex}'), 7, 1764680000123)),
            hello: hex(tokend.encodeHello('a.b.c')),
            proof: hex(await tokend.resumeProof(bytes('{key.hex()}'), bytes('{tid.hex}'))),
            proven: hex(tokend.encodeHello('a.b.c', bytes('{proof.hex()}'))),
            bye: hex(tokend.encodeBye()),
            welcome: decode('{p.encode(welcome).hex()}'),
            ack: decode('{p.encode(ack).hex()}'),
            notice: decode('{p.encode(p.Notice()).hex()}'),
            short: decode('{p.encode(welcome)[:-1].hex()}'),
            reserved: decode('04f8' + '{p.encode(ack).hex()[4:]}'),
            client: decode('{p.encode(p.Bye()).hex()}'),
          }};
        }})()"""
    )
    assert result["heartbeat"] == expected.hex()
    assert result["hello"] == hello.hex()
    assert result["proof"] == proof.hex()
    assert result["proven"] == p.encode(p.Hello("a.b.c", proof=proof)).hex()
    assert result["bye"] == "05"
    assert result["welcome"] == {
        "type": "welcome",
        "tid": tid.hex,
        "expMs": welcome.exp_ms,
        "heartbeatMs": 30_000,
        "warnMs": 90_000,
        "expireMs": 120_000,
        "sessionKey": key.hex(),
        "resumed": True,
    }
    assert result["ack"] == {
        "type": "ack",
        "seq": 9,
        "expMs": ack.exp_ms,
        "token": "x.y.z",
        "renewed": True,
        "resent": False,
        "wasWarn": True,
    }
    assert result["notice"] == {"type": "notice", "state": "WARN"}
    assert result["short"] == "ProtocolError: welcome is 72 bytes, got 71"
    assert result["reserved"] == "ProtocolError: ack has reserved flag bits set"
    assert result["client"] == "ProtocolError: client frame BYE from the server"


# Against a real tokend


async def test_connects_renews_and_logs_out(
    page: BrowserPage, start_app: StartApp, tokens: WallClockTokens, events: EventLog
):
    app = await start_app(token_ttl=3, renew_window=2)
    token = tokens.mint("browser", ttl_s=3)
    assert await open_session(page, app.port, token, backoff=FAST_BACKOFF) == "started"
    connected = await wait_change(page, "connected")
    assert connected["detail"] == "new session"
    tid = await page.eval("session.tid")
    assert tid == str(tokens.verify(token).tid)
    await events.wait_for("SESSION_STARTED", tid)
    # A 3 s token with a 2 s renew window renews about every second.
    second = await wait_change(page, "renewed", count=2, timeout=6)
    assert second["detail"] == "renewed" and second["hasToken"]
    held = await page.eval("[session.token, session.exp]")
    claims = tokens.verify(held[0])  # the page holds a token the server signed
    assert str(claims.tid) == tid and claims.exp * 1000 == held[1]
    assert held[1] >= second["exp"] > tokens.verify(token).exp * 1000
    await page.eval("session.close()")
    ended = await wait_change(page, "ended")
    assert (ended["code"], ended["meaning"], ended["error"]) == (1000, "bye", None)
    assert ended["detail"] == "logged out (BYE)"
    await events.wait_for("SESSION_CLOSED", tid)
    sent = await stats(page)
    assert sent["renewals"] == len(changes(page, "renewed")) == len(events.of("TOKEN_RENEWED", tid))
    assert sent["reconnects"] == 0 and sent["acks"] >= sent["renewals"]


async def test_warn_recover_then_expire_when_heartbeats_stop(
    page: BrowserPage, app: App, tokens: TokenService, events: EventLog
):
    assert await open_session(page, app.port, tokens.mint("sleepy")) == "started"
    tid = await page.eval("session.tid")
    await page.eval("session.pauseHeartbeats()")
    await wait_change(page, "warned")  # NOTICE after warn_after (0.6 s) without heartbeats
    assert await page.eval("session.state") == "WARN"
    await events.wait_for("SESSION_WARN", tid)
    await page.eval("session.resumeHeartbeats()")
    await wait_change(page, "recovered")
    assert await page.eval("session.state") == "ACTIVE"
    await events.wait_for("SESSION_RECOVERED", tid)
    # Stopped for longer than expire_after (1.2 s): the server ends the session.
    await page.eval("session.pauseHeartbeats()")
    ended = await wait_change(page, "ended")
    assert (ended["code"], ended["meaning"]) == (4505, "session expired")
    assert ended["error"] == {
        "name": "SessionExpired",
        "code": 4505,
        "meaning": "session expired",
        "reason": "session_expired",
    }
    assert ended["reason"] == "session_expired"
    expired = await events.wait_for("TOKEN_EXPIRED", tid)
    assert expired[0]["reason"] == "heartbeat_timeout"
    assert not changes(page, "reconnecting")


async def test_resumes_after_a_server_restart_with_its_newest_token(
    page: BrowserPage, start_app: StartApp, tokens: WallClockTokens, events: EventLog
):
    clocks = {"token_ttl": 4, "renew_window": 3}  # renewals about every second
    app = await start_app(**clocks)
    port = app.port
    token = tokens.mint("restart", ttl_s=4)
    assert await open_session(page, port, token, backoff=FAST_BACKOFF) == "started"
    tid = await page.eval("session.tid")
    await wait_change(page, "renewed")  # it holds a newer token than it started with
    await app.stop()
    going = await wait_change(page, "reconnecting")
    assert (going["code"], going["meaning"]) == (1001, "server going away")
    assert 0 <= going["delay"] <= FAST_BACKOFF["goingAwayWindow"]
    await start_app(port=port, **clocks)  # the same Redis, the same port
    resumed = await wait_change(page, "resumed")
    assert resumed["detail"] == "the same session goes on"
    await events.wait_for("SESSION_RESUMED", tid)
    # HELLO carried the newest token: nothing to re-send, and renewals go on.
    renewals = len(changes(page, "renewed"))
    after = await wait_change(page, "renewed", count=renewals + 1)
    assert after["detail"] == "renewed"
    assert all(c["detail"] == "renewed" for c in changes(page, "renewed"))
    held = await page.eval("[session.connected, session.token]")
    assert held[0] and held[1] != token and str(tokens.verify(held[1]).tid) == tid
    assert not changes(page, "ended")


async def test_revocation_ends_the_session_without_reconnecting(
    page: BrowserPage, app: App, tokens: TokenService
):
    assert await open_session(page, app.port, tokens.mint("revoked"), backoff=FAST_BACKOFF) == (
        "started"
    )
    tid = uuid.UUID(await page.eval("session.tid"))
    assert app.node is not None
    await app.node.store.end(
        tid, conn="", event="TOKEN_REVOKED", tomb="revoked", code=p.CloseCode.TOKEN_REVOKED
    )
    ended = await wait_change(page, "ended")
    assert (ended["code"], ended["meaning"]) == (4506, "token revoked")
    assert ended["error"] == {
        "name": "Revoked",
        "code": 4506,
        "meaning": "token revoked",
        "reason": "session_revoked",
    }
    assert await page.eval("session.wait().then(() => 'ok', (e) => e instanceof tokend.Revoked)")
    assert not changes(page, "reconnecting")
    assert (await stats(page))["reconnects"] == 0


# Every WELCOME the page's WebSockets receive, as lists of bytes, in window.welcomes.
RECORD_WELCOMES = """(() => {
  window.welcomes = [];
  const Native = window.WebSocket;
  window.WebSocket = class extends Native {
    constructor(...args) {
      super(...args);
      this.addEventListener('message', (event) => {
        const bytes = new Uint8Array(event.data);
        if (event.data instanceof ArrayBuffer && bytes[0] === 0x02) {
          window.welcomes.push(Array.from(bytes));
        }
      });
    }
  };
  return true;
})()"""


async def test_a_newer_connection_takes_the_session_over(
    page: BrowserPage, app: App, tokens: TokenService
):
    token = tokens.mint("twice")
    # The newcomer shows the proof of the key of the page's WELCOME (the session is held
    # live: spec "Resume proof"), read off the page's own connection.
    await page.eval(RECORD_WELCOMES)
    assert await open_session(page, app.port, token, backoff=FAST_BACKOFF) == "started"
    first = p.decode(bytes(await page.eval("window.welcomes[0]")))
    assert isinstance(first, p.Welcome)
    async with RawClient.connect(app.port) as newcomer:
        welcome = await newcomer.hello(token, p.resume_proof(first.session_key, first.tid))
        assert welcome.resumed
        ended = await wait_change(page, "ended")
    assert (ended["code"], ended["meaning"]) == (4507, "session taken over")
    assert ended["error"]["name"] == "TakenOver"
    assert await page.eval("session.error instanceof tokend.Revoked")  # a kind of revocation
    assert not changes(page, "reconnecting")


async def test_gives_up_after_max_attempts_and_closes_while_reconnecting(
    page: BrowserPage, app: App, tokens: TokenService
):
    limited = {"base": 20, "cap": 40, "maxAttempts": 2}
    assert await open_session(page, app.port, tokens.mint("a"), backoff=limited) == "started"
    await page.eval("window.first = session")
    patient = {"base": 60_000, "cap": 60_000}  # its retries wait up to a minute
    assert await open_session(page, app.port, tokens.mint("b"), backoff=patient) == "started"
    await app.stop()
    gave_up = await wait_change(page, "ended")
    assert gave_up["code"] is None and gave_up["error"]["name"] == "RetriesExhausted"
    assert gave_up["detail"] == "gave up after 2 reconnect attempts; last: cannot connect"
    assert await page.eval("first.stats.reconnects") == 2
    # The other one waits for its next attempt: close() cannot say BYE, and ends it.
    await page.until("session.stats.reconnects >= 1")
    await page.eval("session.close()")
    closed = await wait_change(page, "ended", count=2)
    assert (closed["code"], closed["error"]) == (None, None)
    assert closed["detail"] == "closed while not connected; the session stays until it expires"


async def test_a_server_breaking_the_protocol_is_left_with_4503(
    page: BrowserPage, tokens: TokenService
):
    received: list[int | None] = []

    async def handler(ws: ServerConnection) -> None:
        await ws.send(welcome_for(await ws.recv(decode=False), 1000, 3000))
        await ws.send(b"\x09")  # an unknown frame type
        await ws.wait_closed()
        received.append(ws.close_code)

    async with fake_server(handler) as url:
        assert await open_session(page, url, tokens.mint("x"), backoff=FAST_BACKOFF) == "started"
        ended = await wait_change(page, "ended")
        assert ended["error"]["name"] == "ProtocolViolation" and ended["code"] is None
        assert ended["detail"] == "unknown frame type 0x09"
    assert received == [p.CloseCode.PROTOCOL_ERROR]
    assert not changes(page, "reconnecting")


async def test_a_bad_token_is_refused_with_4501(
    page: BrowserPage, app: App, settings: Any, tmp_path: Path
):
    stranger = minter(settings, tmp_path / "other-keys")
    outcome = await open_session(page, app.port, stranger.mint("mallory"), backoff=FAST_BACKOFF)
    assert outcome == "AuthError"
    ended = await wait_change(page, "ended")
    assert (ended["code"], ended["meaning"]) == (4501, "invalid token")
    assert ended["reason"] == ended["error"]["reason"] == "unknown_kid"
    assert not changes(page, "reconnecting") and not changes(page, "connected")
    # Not a JWT at all: refused before connecting.
    refused = await page.eval(
        "(() => { try { new tokend.Session('ws://127.0.0.1:9/v1/ws', 'nope'); }"
        " catch (e) { return [e.name, e.code, e.message]; } })()"
    )
    assert refused[0] == "AuthError" and refused[1] is None


async def test_a_tab_back_in_view_sends_an_overdue_heartbeat_at_once_and_no_burst(
    page: BrowserPage, start_app: StartApp, tokens: TokenService
):
    app = await start_app(heartbeat_interval=1, warn_after=5, expire_after=6)
    assert await open_session(page, app.port, tokens.mint("tabs")) == "started"
    # Right after an ACK the next heartbeat is about 1 s away: becoming visible sends none.
    # Then the main thread is kept busy past the due time (as a throttled background
    # tab would be) and the tab becomes visible: one heartbeat goes at once, not two.
    # Its ACK comes long before the next heartbeat is due: by then the timer that was
    # due during the busy spell has fired, and it must have sent nothing.
    sent = await page.eval(
        """(async () => {
          const visible = () => {
            const before = session.stats.heartbeats;
            document.dispatchEvent(new Event('visibilitychange'));
            return session.stats.heartbeats - before;
          };
          await until(() => session.stats.acks > 0);
          const notDue = visible();
          const busyUntil = performance.now() + 1500;
          while (performance.now() < busyUntil);
          const overdue = visible();
          const [heartbeats, acks] = [session.stats.heartbeats, session.stats.acks];
          await until(() => session.stats.acks > acks);
          const extra = session.stats.heartbeats - heartbeats;
          return { notDue, overdue, extra, state: document.visibilityState };
        })()"""
    )
    assert sent == {"notDue": 0, "overdue": 1, "extra": 0, "state": "visible"}
    assert (await stats(page))["maxLag"] >= 400  # it went half a second late, at least
    assert not changes(page, "reconnecting") and not changes(page, "ended")


async def one_connection_then_logout(events: EventLog, tid: str) -> None:
    """The server saw the session start once and log out: no resume in between."""
    await events.wait_for("SESSION_CLOSED", tid)
    kinds = [e["type"] for e in events.events if e["tid"] == tid]
    assert kinds == ["SESSION_STARTED", "SESSION_CLOSED"]


async def test_a_session_outlives_open_timeout_without_reconnecting(
    page: BrowserPage, start_app: StartApp, tokens: TokenService, events: EventLog
):
    """openTimeout bounds the wait for WELCOME, not the connection's life."""
    app = await start_app(**STEADY_CLOCKS)
    options = {"openTimeout": OPEN_TIMEOUT, "backoff": FAST_BACKOFF}
    assert await open_session(page, app.port, tokens.mint("steady"), **options) == "started"
    tid = await page.eval("session.tid")
    held = await page.eval(
        f"new Promise((ok) => setTimeout(() => ok(session.stats), {3 * OPEN_TIMEOUT}))"
    )
    assert held["reconnects"] == 0 and held["acks"] >= 3, held
    assert [c["kind"] for c in page.reports] == ["connected"]
    await page.eval("session.close()")
    assert (await wait_change(page, "ended"))["code"] == 1000
    await one_connection_then_logout(events, tid)


async def test_open_timeout_still_ends_a_connection_without_welcome(
    page: BrowserPage, tokens: TokenService
):
    hellos = 0

    async def silent(ws: ServerConnection) -> None:
        nonlocal hellos
        await ws.recv()
        hellos += 1
        await ws.wait_closed()

    async with fake_server(silent) as url:
        options = {"openTimeout": OPEN_TIMEOUT, "backoff": {"base": 50, "cap": 50}}
        await page.eval(
            f"openSession({json.dumps(url)}, {json.dumps(tokens.mint('x'))}, "
            f"{json.dumps(options)}); 0"
        )
        retry = await wait_change(page, "reconnecting", timeout=OPEN_TIMEOUT / 1000 + 5)
        assert retry["code"] is None and retry["detail"].startswith("no WELCOME in time")
        await page.eval("session.close()")
    assert hellos >= 1
    ended = await wait_change(page, "ended")
    assert ended["detail"] == "closed before a session was made"


# No stampede after a drain


async def test_after_a_drain_the_first_reconnects_spread_over_the_window(
    page: BrowserPage, start_app: StartApp, tokens: TokenService, events: EventLog
):
    backoff = {**FAST_BACKOFF, "goingAwayWindow": SPREAD_WINDOW * 1000}
    minted = [tokens.mint(f"b{n}") for n in range(SPREAD_SESSIONS)]
    async with balanced(start_app) as nodes:
        tids = await page.eval(
            f"""(async () => {{
              window.drained = {{}};  // tid -> the first 'reconnecting' change
              window.many = {json.dumps(minted)}.map((token) => {{
                const session = new tokend.Session({json.dumps(nodes.url)}, token, {{
                  backoff: {json.dumps(backoff)},
                }});
                session.on('reconnecting', ({{ code, delay }}) => {{
                  drained[session.tid] ??= {{ code, delay }};
                }});
                return session;
              }});
              await Promise.all(many.map((session) => session.start()));
              return many.map((session) => session.tid);
            }})()"""
        )
        began = await nodes.drain_first()
        going = await page.until(f"Object.keys(drained).length >= {len(tids)} && drained")
        assert {change["code"] for change in going.values()} == {1001}
        resumed = await resumed_at(events, tids, timeout=SPREAD_WINDOW + 10)
        delays = {tid: change["delay"] / 1000 for tid, change in going.items()}
        assert_spread(began, delays, resumed, SPREAD_WINDOW)
        await page.eval("Promise.all(many.map((session) => session.close()))")


async def test_a_browser_sees_a_503_as_any_failed_handshake(
    page: BrowserPage, start_app: StartApp, tokens: TokenService
):
    """The WebSocket API hides the HTTP status of a refused handshake (and so Retry-After):
    the page can only retry with its backoff. Under Node with ws it sees both (below)."""
    app = await start_app(max_pending_hellos=1, hello_timeout=30)
    async with RawClient.connect(app.port):  # the one pending slot: connected, no HELLO
        await page.eval(
            f"openSession({json.dumps(url_of(app.port))}, {json.dumps(tokens.mint('x'))}, "
            f"{json.dumps({'backoff': FAST_BACKOFF})}); 0"
        )
        refused = await wait_change(page, "reconnecting")
    assert (refused["code"], refused["detail"]) == (
        None,
        f"cannot connect; attempt 1 in {refused['delay'] / 1000:.2f} s",
    )
    assert refused["delay"] <= FAST_BACKOFF["base"]
    await wait_change(page, "connected")
    await page.eval("session.close()")


# The resume proof (spec "Resume proof", revision 2)


def _renewed(token: str, by_s: int) -> str:
    """A token like ``token`` (unsigned: for servers that do not verify), ``by_s`` longer."""
    claims = jwt.decode(token, options={"verify_signature": False})
    return jwt.encode({**claims, "exp": claims["exp"] + by_s}, "k" * 32, algorithm="HS256")


async def test_a_reloaded_page_proves_its_resume_with_what_storage_kept(
    page: BrowserPage, site: StaticSite
):
    """With storage: sessionStorage the page keeps its newest token and the last WELCOME's
    key: after a reload, the same session's HELLO carries both; 4509 is retried; the
    entry goes when the session ends."""
    token = unsigned_token()
    renewed = _renewed(token, 60)
    keys = [os.urandom(p.SESSION_KEY_LENGTH) for _ in range(2)]
    hellos: list[p.Hello] = []

    async def handler(ws: ServerConnection) -> None:
        data = await ws.recv(decode=False)
        hello = p.decode(data)
        assert isinstance(hello, p.Hello)
        hellos.append(hello)
        if len(hellos) == 1:  # a new session, renewed by the first ACK
            await ws.send(welcome_for(data, 1000, 3000, keys[0]))
            beat = p.decode(await ws.recv(decode=False))
            assert isinstance(beat, p.Heartbeat)
            exp_ms = jwt.decode(renewed, options={"verify_signature": False})["exp"] * 1000
            await ws.send(p.encode(p.HeartbeatAck(beat.seq, exp_ms, renewed, renewed=True)))
            await ws.wait_closed()  # the reload
        elif len(hellos) == 2:  # as a server does while another connection holds it live
            await ws.close(p.CloseCode.SESSION_IN_USE, "session_in_use")
        else:
            await ws.send(welcome_for(data, 1000, 3000, keys[1], resumed=True))
            await ws.wait_closed()

    options = {"backoff": FAST_BACKOFF, "storage": "sessionStorage"}
    async with fake_server(handler) as url:
        assert await open_session(page, url, token, **options) == "started"
        tid = await page.eval("session.tid")
        await wait_change(page, "renewed")
        kept = json.loads(await page.eval(f"sessionStorage.getItem('tokend:{tid}')"))
        assert kept == {"token": renewed, "key": keys[0].hex()}
        await page.goto(f"{site.origin}/test/sdk.html")  # the session's socket goes with it
        assert await open_session(page, url, token, **options) == "started"  # the old token
        in_use = await wait_change(page, "reconnecting")
        assert (in_use["code"], in_use["meaning"]) == (4509, "session in use by another connection")
        resumed = await wait_change(page, "connected", count=2)  # the reloaded page's first
        assert resumed["detail"] == "resumed an existing session"
        kept = json.loads(await page.eval(f"sessionStorage.getItem('tokend:{tid}')"))
        assert kept == {"token": renewed, "key": keys[1].hex()}
        await page.eval("session.close()")
        assert await page.eval(f"sessionStorage.getItem('tokend:{tid}')") is None
    proof = p.resume_proof(keys[0], uuid.UUID(tid).bytes)
    assert [(hello.token, hello.proof) for hello in hellos] == [
        (token, None),
        (renewed, proof),  # after the reload: the newest token, and the key kept
        (renewed, proof),  # after 4509: the same (no WELCOME came in between)
    ]


async def test_a_reloaded_page_takes_its_session_back_from_a_live_connection(
    page: BrowserPage, site: StaticSite, start_app: StartApp, tokens: TokenService, events: EventLog
):
    """Against tokend: the network goes (the server holds the old connection live and
    hears nothing, not even the reload's close), the page reloads, and the session of the
    same token resumes at once, proved with the key storage kept: no 4509."""
    app = await start_app(**PROOF_CLOCKS)
    token = tokens.mint("reloaded")
    options = {"backoff": FAST_BACKOFF, "storage": "sessionStorage"}
    async with Link(app.port) as link:
        assert await open_session(page, link.url, token, **options) == "started"
        tid = await page.until("session.stats.acks > 0 && session.tid")
        link.blackhole()
        await page.goto(f"{site.origin}/test/sdk.html")
        reloaded = await open_session(page, url_of(app.port), token, **options)
        assert reloaded == "started", page.reports
        assert not changes(page, "reconnecting"), page.reports
        assert (await wait_change(page, "connected", count=2))["detail"] == (
            "resumed an existing session"
        )
        await events.wait_for("SESSION_RESUMED", tid)
        await page.eval("session.close()")


async def test_the_ca_option_is_refused_where_it_cannot_apply(page: BrowserPage):
    refused = await page.eval(
        """(() => {
          const token = 'e30.' + btoa(JSON.stringify({
            jti: crypto.randomUUID(), exp: 2e9 })).replace(/=+$/, '') + '.x';
          const attempt = (url) => {
            try { new tokend.Session(url, token, { ca: 'PEM' }); return 'accepted'; }
            catch (e) { return `${e.name}: ${e.message}`; }
          };
          return [attempt('wss://127.0.0.1:9/v1/ws'), attempt('ws://127.0.0.1:9/v1/ws')];
        })()"""
    )
    assert refused == [
        "TypeError: the ca option needs the ws package's WebSocket (Node); a browser trusts "
        "its own CAs",
        "TypeError: the ca option is for wss:// URLs",
    ]


# The same module under Node (sdk/js/README.md: Node 22's WebSocket, or ws on Node 20)


class NodeSession:
    """tests/browser/node_session.mjs running: a session of the SDK under Node, its JSON
    lines read as they come. Closing its stdin (:meth:`finish`) logs the session out."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.lines: list[dict[str, Any]] = []
        self._looked = 0  # lines that until() has looked at

    @classmethod
    @contextlib.asynccontextmanager
    async def run(
        cls,
        node_dir: Path,
        url: str,
        token: str,
        hold_ms: int,
        flood_ms: int = 0,
        **options: Any,
    ) -> AsyncIterator[NodeSession]:
        config = json.dumps(
            {
                "url": url,
                "token": token,
                "options": options,
                "holdMs": hold_ms,
                "floodMs": flood_ms,
            }
        )
        process = await asyncio.create_subprocess_exec(
            shutil.which("node") or "node",
            str(ROOT / "tests" / "browser" / "node_session.mjs"),
            config,
            env={**os.environ, "NODE_DIR": str(node_dir)},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        async with killed_on_exit(process):
            yield cls(process)

    def changes(self, kind: str) -> list[dict[str, Any]]:
        return [line["change"] for line in self.lines if line.get("change", {}).get("kind") == kind]

    async def _next(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        raw = await self.process.stdout.readline()
        if not raw:
            assert self.process.stderr is not None
            error = (await self.process.stderr.read()).decode()
            raise AssertionError(f"node ended after {self.lines}: {error}")
        self.lines.append(json.loads(raw))
        return self.lines[-1]

    async def until(self, kind: str, timeout: float = 10) -> dict[str, Any]:
        """The first change of ``kind`` after the one the previous call returned."""
        async with asyncio.timeout(timeout):
            while True:
                if self._looked == len(self.lines):
                    await self._next()
                line = self.lines[self._looked]
                self._looked += 1
                if line.get("change", {}).get("kind") == kind:
                    return line["change"]

    async def finish(self, timeout: float, *, stop: bool = True) -> list[dict[str, Any]]:
        """Every line to the end: at once (``stop``: stdin closed), or after ``hold_ms``."""
        assert self.process.stdin is not None
        if stop:
            self.process.stdin.close()
        async with asyncio.timeout(timeout):
            while not (self.lines and "done" in self.lines[-1]):
                await self._next()
            await self.process.wait()
        assert self.process.returncode == 0
        return self.lines


async def run_in_node(
    node_dir: Path, url: str, token: str, hold_ms: int, **options: Any
) -> list[dict[str, Any]]:
    """tests/browser/node_session.mjs: hold a session for ``hold_ms``; its JSON lines."""
    async with NodeSession.run(node_dir, url, token, hold_ms, **options) as node:
        return await node.finish(hold_ms / 1000 + 30, stop=False)


async def test_under_node_a_session_outlives_open_timeout_without_reconnecting(
    node_dir: Path, start_app: StartApp, tokens: WallClockTokens, events: EventLog
):
    app = await start_app(**STEADY_CLOCKS)
    token = tokens.mint("node")
    tid = str(tokens.verify(token).tid)
    options = {"openTimeout": OPEN_TIMEOUT, "backoff": FAST_BACKOFF}
    lines = await run_in_node(node_dir, url_of(app.port), token, 3 * OPEN_TIMEOUT, **options)
    kinds = [line["change"]["kind"] for line in lines if "change" in line]
    held = next(line["held"] for line in lines if "held" in line)
    assert kinds == ["connected", "ended"], lines
    assert held["connected"] and held["stats"]["reconnects"] == 0, held
    assert held["stats"]["acks"] >= 3
    assert lines[-1] == {"done": {"error": None}}
    await one_connection_then_logout(events, tid)


async def test_under_node_a_flood_client_stays_connected_through_a_shed_period(
    node_dir: Path, start_app: StartApp, tokens: WallClockTokens
):
    """The SDK under Node heartbeating faster than the cadence, of a class the node
    sheds: its extra heartbeats go unanswered, its reading is paused, and it keeps its
    connection (it waits warn_after for an ACK; one comes every half interval)."""
    app = await start_app(**SHED_SETTINGS)
    url = url_of(app.port)
    metrics = app.node.metrics
    async with tokend_client.connect(
        url, tokens.mint("best", prio=BEST_PRIO), backoff=tokend_client.Backoff(base=0.05)
    ) as best:
        token = tokens.mint("flood", prio=FLOOD_PRIO)
        options = {"backoff": FAST_BACKOFF}
        flood_ms = int(FLOOD_S * 1000)
        async with NodeSession.run(node_dir, url, token, 60_000, flood_ms, **options) as node:
            # The node's ACKs but the best session's: the flood client's.
            await shed_period(app, lambda: metrics.acked_heartbeats - best.stats.acks)
            lines = await node.finish(30)
    kinds = [line["change"]["kind"] for line in lines if "change" in line]
    held = next(line["held"] for line in lines if "held" in line)
    assert kinds == ["connected", "ended"], lines
    assert held["connected"] and held["stats"]["reconnects"] == 0, held
    assert held["stats"]["heartbeats"] > held["stats"]["acks"] >= 4, held
    assert lines[-1] == {"done": {"error": None}}


async def test_under_node_open_timeout_ends_a_handshake_that_never_finishes(
    node_dir: Path, tokens: WallClockTokens
):
    """ws closed while still connecting raises an error event: it must not kill Node."""

    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # never answers the opening handshake
        writer.close()

    server = await asyncio.start_server(mute, LOOPBACK, 0)
    async with server:
        url = url_of(server.sockets[0].getsockname()[1])
        options = {"openTimeout": OPEN_TIMEOUT, "backoff": {"base": 50, "cap": 50}}
        lines = await run_in_node(node_dir, url, tokens.mint("x"), 2 * OPEN_TIMEOUT, **options)
    retries = [
        line["change"] for line in lines if line.get("change", {}).get("kind") == "reconnecting"
    ]
    assert retries and retries[0]["detail"].startswith("no WELCOME in time"), lines
    assert lines[-1] == {"done": {"error": None}}


async def test_under_node_a_503_with_retry_after_is_waited_out(
    node_dir: Path, start_app: StartApp, tokens: WallClockTokens, events: EventLog
):
    """ws shows the refused handshake's status and Retry-After: the SDK waits at least that
    long, jittered, then starts the session."""
    app = await start_app(max_pending_hellos=1, hello_timeout=30)
    token = tokens.mint("patient")
    async with contextlib.AsyncExitStack() as running:
        async with RawClient.connect(app.port):  # the one pending slot: connected, no HELLO
            began = time.time()
            node = await running.enter_async_context(
                NodeSession.run(node_dir, url_of(app.port), token, 30_000, backoff=FAST_BACKOFF)
            )
            refused = await node.until("reconnecting")
        assert refused["code"] is None
        assert refused["detail"].startswith("HTTP 503 at the opening handshake"), refused
        # FAST_BACKOFF's own first wait would be 50 ms at most.
        assert 1000 * RETRY_AFTER_S <= refused["delay"] <= 2000 * RETRY_AFTER_S
        await node.until("connected")
        started = await events.wait_for("SESSION_STARTED", str(tokens.verify(token).tid))
        assert started[0]["at"] + 1 >= 1000 * began + refused["delay"]
        assert (await node.finish(10))[-1] == {"done": {"error": None}}


async def test_under_node_wss_is_verified_and_the_ca_option_trusted(
    node_dir: Path, start_app: StartApp, tokens: WallClockTokens, events: EventLog, tmp_path: Path
):
    tls = await tls_node(start_app, tmp_path)
    # Not trusted: retried as any failed handshake is, the reason in the detail.
    wary = tokens.mint("wary")
    async with NodeSession.run(node_dir, tls.url, wary, 30_000, backoff=FAST_BACKOFF) as node:
        untrusted = await node.until("reconnecting")
        assert re.search("certificate|verify", untrusted["detail"]), untrusted
        await node.finish(10)
    token = tokens.mint("tls")
    ca = tls.ca_file.read_text()
    lines = await run_in_node(node_dir, tls.url, token, 1000, ca=ca, backoff=FAST_BACKOFF)
    kinds = [line["change"]["kind"] for line in lines if "change" in line]
    held = next(line["held"] for line in lines if "held" in line)
    assert kinds == ["connected", "ended"], lines
    assert held["connected"] and held["stats"]["acks"] >= 1
    await one_connection_then_logout(events, str(tokens.verify(token).tid))
    assert not events.of("SESSION_STARTED", str(tokens.verify(wary).tid))
