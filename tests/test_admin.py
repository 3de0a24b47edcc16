"""The admin listener (tokend/ops/admin/) on a real App: routes, auth, errors, admin API."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from redis import asyncio as aioredis

from testkit.clients import RawClient
from testkit.events import EventLog
from testkit.net import HttpReply, http_request
from testkit.redis_servers import RedisProcess
from testkit.tokend_process import TokendProcess
from testkit.tokens import WallClockTokens
from testkit.waiting import eventually
from tokend import cli as tokend_cli
from tokend.config import Settings
from tokend.core import protocol as p
from tokend.ops.app import App
from tokend.server.admission import connection_budget

ADMIN_TOKEN = "s3cret-admin-token-of-32-characters"
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
StartApp = Callable[..., Awaitable[App]]


@pytest.fixture
async def admin_app(start_app: StartApp) -> App:
    return await start_app(admin_token=ADMIN_TOKEN)


def admin_port(app: App) -> int:
    assert app.admin is not None
    return app.admin.port


async def call(app: App, method: str, path: str, **kwargs: Any) -> HttpReply:
    return await http_request(admin_port(app), method, path, **kwargs)


async def api(app: App, method: str, path: str, body: bytes = b"") -> HttpReply:
    return await call(app, method, path, headers=AUTH, body=body)


def assert_error(reply: HttpReply, status: int, error: str) -> None:
    assert reply.status == status, reply
    assert reply.headers["content-type"] == "application/json"
    body = reply.json()
    assert set(body) == {"error", "detail"} and body["error"] == error, body


async def mint(app: App, sub: str, **fields: Any) -> dict[str, Any]:
    reply = await api(app, "POST", "/v1/tokens", p_json({"sub": sub, **fields}))
    assert reply.status == 201, reply
    return dict(reply.json())


def p_json(value: Any) -> bytes:
    return json.dumps(value).encode()


@contextlib.asynccontextmanager
async def raw_clients(port: int, count: int) -> AsyncIterator[list[RawClient]]:
    """``count`` RawClients on ``port``, closed together."""
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(RawClient.connect(port)) for _ in range(count)]


# --- always-on routes, and the admin API turned off -------------------------------------------


async def test_disabled_without_admin_token_but_health_and_metrics_served(app: App) -> None:
    for path in ("/v1/stats", "/v1/sessions", "/dashboard", "/dashboard/index.html"):
        assert_error(await call(app, "GET", path, headers=AUTH), 404, "admin_disabled")
    health = await call(app, "GET", "/healthz")
    assert (health.status, health.json()) == (200, {"status": "ok", "node": "node-a"})
    ready = await call(app, "GET", "/readyz")
    assert (ready.status, ready.json()) == (200, {"status": "ready"})
    metrics = await call(app, "GET", "/metrics")
    assert metrics.status == 200 and metrics.headers["content-type"].startswith("text/plain")
    assert_error(await call(app, "GET", "/nowhere"), 404, "not_found")
    assert_error(await call(app, "POST", "/metrics"), 405, "method_not_allowed")


async def test_listener_can_be_turned_off(start_app: StartApp) -> None:
    app = await start_app(admin_port=-1, admin_token=ADMIN_TOKEN)
    assert app.admin is None


# --- authentication and request errors --------------------------------------------------------


async def test_admin_token_required(admin_app: App) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": ADMIN_TOKEN}):
        reply = await call(admin_app, "GET", "/v1/stats", headers=headers)
        assert_error(reply, 401, "unauthorized")
        assert reply.headers["www-authenticate"].startswith("Bearer")
    assert (await api(admin_app, "GET", "/v1/stats")).status == 200


async def test_request_errors_have_precise_statuses(start_app: StartApp) -> None:
    app = await start_app(admin_token=ADMIN_TOKEN, admin_max_body=64)
    reply = await api(app, "PUT", "/v1/tokens")
    assert_error(reply, 405, "method_not_allowed")
    assert reply.headers["allow"] == "POST"
    assert_error(await api(app, "GET", "/v1/nothing"), 404, "not_found")
    assert_error(await api(app, "POST", "/v1/tokens", b"x" * 65), 413, "body_too_large")
    assert_error(await api(app, "POST", "/v1/tokens", b"{not json"), 400, "invalid_json")
    bad: object
    for bad in (
        [],
        {},
        {"sub": ""},
        {"sub": "a", "prio": 12},
        {"sub": "a", "ttl": "60"},
        {"sub": "a", "ttl": True},
        {"sub": "a", "extra": 1},
    ):
        assert_error(await api(app, "POST", "/v1/tokens", p_json(bad)), 400, "invalid_request")
    assert_error(await api(app, "GET", "/v1/sessions/not-a-uuid"), 400, "invalid_request")
    for query in ("state=EXPIRED", "limit=0", "limit=x", "cursor=99:x", "cursor=junk"):
        reply = await api(app, "GET", f"/v1/sessions?{query}")
        assert_error(reply, 400, "invalid_request")
    raw = await call(app, "", "", raw=b"NONSENSE\r\n\r\n")
    assert_error(raw, 400, "bad_request")
    chunked = b"POST /v1/tokens HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n"
    assert_error(await call(app, "", "", raw=chunked), 411, "length_required")
    huge_head = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Pad: " + b"a" * 20000 + b"\r\n\r\n"
    assert_error(await call(app, "", "", raw=huge_head), 431, "head_too_large")


async def test_a_request_that_never_completes_gets_408(admin_app: App) -> None:
    # hello_timeout is 1 s in the test settings; the reply comes, the connection closes.
    reply = await call(admin_app, "", "", raw=b"GET /healthz HTTP/1.1\r\n", timeout=5)
    assert_error(reply, 408, "timeout")


# --- the admin API on live sessions -----------------------------------------------------------


async def test_mint_show_list_revoke(admin_app: App, tokens: WallClockTokens) -> None:
    minted = await mint(admin_app, "alice", ttl=120, prio=7)
    claims = tokens.verify(minted["token"])
    assert str(claims.tid) == minted["tid"] and claims.prio == 7
    assert minted["exp"] == claims.exp * 1000 and claims.exp - claims.iat == 120
    async with RawClient.connect(admin_app.port) as client:
        await client.hello(minted["token"])
        shown = await api(admin_app, "GET", f"/v1/sessions/{minted['tid']}")
        assert shown.status == 200
        view = shown.json()
        assert view["state"] == "ACTIVE" and view["sub"] == "alice" and view["node"] == "node-a"
        assert view["exp"] == minted["exp"] and view["last_heartbeat"] > 0 and view["prio"] == 7

        revoked = await api(admin_app, "DELETE", f"/v1/sessions/{minted['tid']}")
        assert revoked.json() == {"tid": minted["tid"], "result": "revoked"}
        assert (await client.expect_close()).code == p.CloseCode.TOKEN_REVOKED
    ended = (await api(admin_app, "GET", f"/v1/sessions/{minted['tid']}")).json()
    assert ended["state"] == "ENDED" and ended["ended"] == "revoked"
    again = await api(admin_app, "DELETE", f"/v1/sessions/{minted['tid']}")
    assert again.json()["result"] == "already_ended"
    unknown = uuid.uuid4()
    assert_error(await api(admin_app, "GET", f"/v1/sessions/{unknown}"), 404, "session_not_found")
    barred = await api(admin_app, "DELETE", f"/v1/sessions/{unknown}")
    assert barred.json()["result"] == "barred"


async def test_list_pages_through_every_session_and_filters_by_state(
    start_app: StartApp, events: EventLog
) -> None:
    # Clocks wide enough that heartbeats keep four sessions far from WARN however busy
    # the machine, while the fifth, silent, gets there.
    admin_app = await start_app(
        admin_token=ADMIN_TOKEN, heartbeat_interval=0.5, warn_after=3, expire_after=30
    )
    minted = [await mint(admin_app, f"user-{n}") for n in range(5)]
    async with raw_clients(admin_app.port, 5) as clients:
        for client, m in zip(clients, minted, strict=True):
            await client.hello(m["token"])
        seen: list[str] = []
        cursor = ""
        for _ in range(10):  # bounded: 5 sessions in pages of 2
            reply = (await api(admin_app, "GET", f"/v1/sessions?limit=2&cursor={cursor}")).json()
            assert len(reply["sessions"]) <= 2
            seen += [s["tid"] for s in reply["sessions"]]
            if reply["cursor"] is None:
                break
            cursor = reply["cursor"]
        assert sorted(seen) == sorted(m["tid"] for m in minted)
        # Keep all but the first heartbeating, together: the first alone goes to WARN.
        warned = minted[0]["tid"]
        waiter = asyncio.create_task(events.wait_for("SESSION_WARN", warned, timeout=10))
        while not waiter.done():
            await asyncio.gather(*(client.heartbeat() for client in clients[1:]))
            await asyncio.sleep(0.5)
        await waiter
        reply = (await api(admin_app, "GET", "/v1/sessions?state=WARN")).json()
        assert [s["tid"] for s in reply["sessions"]] == [warned] and reply["cursor"] is None
        assert events.of("SESSION_WARN") == events.of("SESSION_WARN", warned)


# --- the dashboard's feeds --------------------------------------------------------------------


async def test_stats_has_exactly_the_dashboard_shape(admin_app: App) -> None:
    minted = await mint(admin_app, "carol")
    async with RawClient.connect(admin_app.port) as client:
        await client.hello(minted["token"])
        for _ in range(16):  # one heartbeat in 16 has its stages timed
            await client.heartbeat()
        stats = (await api(admin_app, "GET", "/v1/stats")).json()
    assert set(stats) == {
        "node",
        "at",
        "cluster",
        "ready",
        "problems",
        "connections",
        "held",
        "heartbeats_total",
        "renewals_total",
        "expiries_total",
        "close_codes",
        "refused",
        "history_interval",
        "rates",
        "redis",
        "shedding",
        "loop_lag_ms",
        "open_files",
        "heartbeat_stage_ms",
        "redis_ms",
        "store_stage",
    }
    assert stats["node"] == "node-a" and isinstance(stats["at"], int)
    cluster = stats["cluster"]
    assert cluster["sessions"] == {"ACTIVE": 1, "WARN": 0} and cluster["fresh"] is True
    assert cluster["ended"] == {"expired": 0, "revoked": 0, "closed": 0}
    assert stats["held"] == {"ACTIVE": 1, "WARN": 0} and stats["connections"] == 1
    assert stats["heartbeats_total"] == 16 and stats["renewals_total"] == 0
    assert stats["refused"]["429"] == {"per_ip": 0}
    assert set(stats["refused"]) == {"429", "503", "4029"}
    assert set(stats["heartbeat_stage_ms"]) == {"decode", "verify", "store", "send"}
    for summary in [*stats["heartbeat_stage_ms"].values(), *stats["redis_ms"].values()]:
        assert set(summary) == {"p50", "p95", "count"} and summary["count"] >= 1
        assert 0 <= summary["p50"] <= summary["p95"]
    assert {"hello", "heartbeat"} <= set(stats["redis_ms"])
    assert stats["shedding"] == {"active": False, "classes": "none", "refusing_handshakes": False}
    assert stats["open_files"]["open"] > 0 and stats["open_files"]["limit"] > 0
    store = stats["store_stage"]
    assert store["store_p50_ms"] == stats["heartbeat_stage_ms"]["store"]["p50"]
    assert store["script_p50_ms"] == stats["redis_ms"]["heartbeat"]["p50"]
    assert store["gather_ms"] == admin_app.settings.heartbeat_gather * 1000


async def test_events_feed_from_the_ring(admin_app: App, redis: aioredis.Redis) -> None:
    channel = f"{admin_app.settings.key_prefix}:events"

    async def subscribed() -> bool:  # the ring's subscription is up before events flow
        return bool((await redis.pubsub_numsub(channel))[0][1])

    await eventually(subscribed)
    minted = await mint(admin_app, "dave")
    async with RawClient.connect(admin_app.port) as client:
        await client.hello(minted["token"])
        await client.send(p.encode(p.Bye()))
        await client.expect_close()

    async def both_events() -> dict[str, Any] | None:
        feed = (await api(admin_app, "GET", "/v1/events?after=0")).json()
        return dict(feed) if len(feed["events"]) >= 2 else None

    feed = await eventually(both_events)
    first, second = feed["events"][:2]
    assert (first["type"], second["type"]) == ("SESSION_STARTED", "SESSION_CLOSED")
    assert first["tid"] == minted["tid"] and isinstance(first["at"], int)
    assert second["seq"] == first["seq"] + 1 and feed["next"] == feed["events"][-1]["seq"]
    rest = (await api(admin_app, "GET", f"/v1/events?after={first['seq']}&limit=1")).json()
    assert [e["seq"] for e in rest["events"]] == [second["seq"]]
    empty = (await api(admin_app, "GET", f"/v1/events?after={feed['next']}")).json()
    assert empty == {"events": [], "next": feed["next"]}


async def test_dashboard_files_served_safely(admin_app: App, tmp_path: Path) -> None:
    assert admin_app.admin is not None
    admin_app.admin.dashboard_dir = tmp_path / "dash"
    (tmp_path / "dash" / "js").mkdir(parents=True)
    files = {
        "index.html": "text/html",
        "app.js": "text/javascript",
        "style.css": "text/css",
        "logo.svg": "image/svg+xml",
        "js/chart.js": "text/javascript",
    }
    for name in files:
        (tmp_path / "dash" / name).write_text(f"content of {name}")
    (tmp_path / "dash" / "secret.txt").write_text("no")
    (tmp_path / "dash" / ".hidden.js").write_text("no")
    (tmp_path / "outside.html").write_text("no")
    for name, kind in files.items():
        reply = await call(admin_app, "GET", f"/dashboard/{name}")
        assert reply.status == 200 and reply.headers["content-type"].startswith(kind), name
        assert reply.body == f"content of {name}".encode()
    for path in ("/dashboard", "/dashboard/"):
        assert (await call(admin_app, "GET", path)).body == b"content of index.html"
    for path in (
        "/dashboard/secret.txt",
        "/dashboard/.hidden.js",
        "/dashboard/../outside.html",
        "/dashboard/%2e%2e/outside.html",
        "/dashboard/js/../../outside.html",
        "/dashboard/missing.js",
        "/dashboard/js",
    ):
        assert_error(await call(admin_app, "GET", path), 404, "not_found")
    assert_error(await call(admin_app, "DELETE", "/dashboard/app.js"), 405, "method_not_allowed")


async def test_cli_reads_sessions_through_the_same_store_functions(
    admin_app: App, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = admin_app.settings
    flags = ["--redis-url", settings.redis_url, "--key-prefix", settings.key_prefix]
    # The test process's log settings, which cli.main() configures again.
    flags += ["--log-format", "console", "--log-level", "warning"]

    async def cli(*args: str) -> tuple[int, str]:
        status = await asyncio.to_thread(tokend_cli.main, [*args, *flags])
        return status, capsys.readouterr().out

    minted = [await mint(admin_app, f"cli-{n}") for n in range(3)]
    async with raw_clients(admin_app.port, 3) as clients:
        for client, m in zip(clients, minted, strict=True):
            await client.hello(m["token"])
        status, out = await cli("sessions", "show", minted[0]["tid"])
        api_view = (await api(admin_app, "GET", f"/v1/sessions/{minted[0]['tid']}")).json()
        assert status == 0 and json.loads(out) == api_view
        status, out = await cli("sessions", "list")
        listed = [json.loads(line) for line in out.splitlines()]
        api_list = (await api(admin_app, "GET", "/v1/sessions")).json()["sessions"]
        assert status == 0 and listed == api_list and len(listed) == 3
        status, out = await cli("sessions", "list", "--limit", "2")
        assert out.count("\n") == 2
        status, out = await cli("sessions", "list", "--state", "WARN")
        assert (status, out) == (0, "")
    status, _ = await cli("sessions", "show", str(uuid.uuid4()))
    assert status == 1


async def test_every_admin_call_logged_without_tokens(
    make_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    base = make_settings()
    node = TokendProcess(
        {
            "TOKEND_REDIS_URL": base.redis_url,
            "TOKEND_KEY_PREFIX": base.key_prefix,
            "TOKEND_KEYS_DIR": base.keys_dir,
            "TOKEND_DATA_DIR": str(tmp_path / "data"),
            "TOKEND_ADMIN_TOKEN": ADMIN_TOKEN,
        }
    )
    node.start()
    try:
        body = p_json({"sub": "logged"})
        minted = await http_request(node.admin_port, "POST", "/v1/tokens", headers=AUTH, body=body)
        assert minted.status == 201
        wrong = {"Authorization": "Bearer not-the-token"}
        denied = await http_request(node.admin_port, "GET", "/v1/stats?x=1", headers=wrong)
        assert denied.status == 401
    finally:
        assert node.stop(signal.SIGTERM) == 0
    calls = [e for e in node.log_lines if e.get("event") == "admin request"]
    assert [(e["method"], e["path"], e["status"]) for e in calls] == [
        ("POST", "/v1/tokens", 201),
        ("GET", "/v1/stats", 401),
    ]
    text = json.dumps(node.log_lines)
    for secret in (ADMIN_TOKEN, "not-the-token", minted.json()["token"]):
        assert secret not in text


async def test_redis_down_is_503_store_unavailable_and_the_stats_say_so(
    start_app: StartApp, own_redis: RedisProcess
) -> None:
    app = await start_app(admin_token=ADMIN_TOKEN, redis_url=own_redis.url)
    assert (await api(app, "GET", "/v1/stats")).json()["cluster"]["fresh"] is True
    own_redis.kill()
    # The stats say what is wrong instead of failing: the last counts, not fresh.
    stats = (await api(app, "GET", "/v1/stats")).json()
    assert stats["cluster"]["fresh"] is False and stats["cluster"]["sessions"] is not None

    async def seen_down() -> dict[str, Any]:
        stats = (await api(app, "GET", "/v1/stats")).json()
        return stats if not stats["redis"]["reachable"] else {}

    down = await eventually(seen_down)
    assert down["redis"]["error"] and down["ready"] is False and "redis" in down["problems"]
    assert_error(await api(app, "GET", "/v1/sessions"), 503, "store_unavailable")
    ready = await call(app, "GET", "/readyz")
    assert ready.status == 503 and "redis" in ready.json()
    assert (await call(app, "GET", "/metrics")).status == 200


# --- malformed requests, Host, connection cap --------------------------------------

GOOD = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


def with_host(request_line: bytes, *headers: bytes) -> bytes:
    return b"\r\n".join([request_line, b"Host: localhost", *headers]) + b"\r\n\r\n"


POST = b"POST /v1/tokens HTTP/1.1"
GET = b"GET /healthz HTTP/1.1"
# Each malformed request, by the one answer it must get.
MALFORMED_BY_ANSWER: dict[tuple[int, str], dict[str, bytes]] = {
    (400, "bad_request"): {
        "Content-Length ²": with_host(POST, "Content-Length: ²".encode()),
        "negative Content-Length": with_host(POST, b"Content-Length: -1"),
        "Content-Length +1": with_host(POST, b"Content-Length: +1"),
        "Content-Length 1 2": with_host(POST, b"Content-Length: 1 2"),
        "Content-Length overflow": with_host(POST, b"Content-Length: " + b"9" * 30),
        "two Content-Lengths": with_host(POST, b"Content-Length: 1", b"Content-Length: 2"),
        "Content-Length, chunked": with_host(
            POST, b"Content-Length: 3", b"Transfer-Encoding: chunked"
        ),
        "no Host": GET + b"\r\n\r\n",
        "two Hosts": with_host(GET, b"Host: 127.0.0.1"),
        "HTTP/2 preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        "unknown method": b"NONSENSE\r\n\r\n",
        "byte 0xff in the target": with_host(b"GET /\xff HTTP/1.1"),
        "space in a header name": with_host(GET, b"Bad Header: x"),
        "NUL in a header value": with_host(GET, b"X: a\x00b"),
        "folded header": with_host(GET, b"X: a", b" folded"),
        "bare LF": b"GET /healthz HTTP/1.1\nHost: localhost\n\n",
        "cut short": b"GET /healthz HTTP/1.1\r\nHost: loc",
    },
    (411, "length_required"): {
        "chunked": with_host(POST, b"Transfer-Encoding: chunked"),
        "gzip transfer coding": with_host(POST, b"Transfer-Encoding: gzip"),
    },
    (413, "body_too_large"): {"body too large": with_host(POST, b"Content-Length: 65")},
    (414, "target_too_long"): {"target too long": with_host(b"GET /" + b"a" * 9000 + b" HTTP/1.1")},
    (421, "wrong_host"): {
        "DNS rebinding": b"GET /metrics HTTP/1.1\r\nHost: evil.example\r\n\r\n",
        "absolute target elsewhere": with_host(b"GET http://evil.example/readyz HTTP/1.1"),
    },
    (431, "head_too_large"): {
        "header too long": with_host(GET, b"X-Pad: " + b"a" * 20000),
        "too many headers": with_host(GET, *[b"X-%d: 1" % n for n in range(101)]),
    },
    (505, "version_not_supported"): {
        "HTTP/2.0 request line": with_host(b"GET /healthz HTTP/2.0"),
        "HTTP/0.9": b"GET /healthz\r\nHost: localhost\r\n\r\n",
    },
}
MALFORMED = [
    (case, raw, status, error)
    for (status, error), cases in MALFORMED_BY_ANSWER.items()
    for case, raw in cases.items()
]


async def send_and_half_close(port: int, raw: bytes, timeout: float = 5.0) -> bytes:
    """Send ``raw``, end the sending side, read the answer until the server closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        writer.write_eof()
        async with asyncio.timeout(timeout):
            return await reader.read()
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def admin_lines(captured: str) -> list[str]:
    return [line for line in captured.splitlines() if "admin request" in line]


@pytest.mark.parametrize(
    ("case", "raw", "status", "error"), MALFORMED, ids=[m[0] for m in MALFORMED]
)
async def test_a_malformed_request_gets_its_4xx_and_one_log_line(
    start_app: StartApp,
    capsys: pytest.CaptureFixture[str],
    case: str,
    raw: bytes,
    status: int,
    error: str,
) -> None:
    app = await start_app(admin_token=ADMIN_TOKEN, admin_max_body=64)
    capsys.readouterr()
    reply = await send_and_half_close(admin_port(app), raw)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == str(status).encode(), (case, reply[:200])
    assert json.loads(body)["error"] == error
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = admin_lines(err)
    assert len(lines) == 1 and f"status={status}" in lines[0] and f"error={error}" in lines[0]
    assert (await call(app, "GET", "/healthz")).status == 200  # and the listener serves on


async def test_a_slow_loris_gets_408_while_still_sending(admin_app: App) -> None:
    """hello_timeout (1 s here) bounds the whole request, however the bytes trickle in."""
    reader, writer = await asyncio.open_connection("127.0.0.1", admin_port(admin_app))

    async def trickle() -> None:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")
        while True:
            writer.write(b"a")
            await asyncio.sleep(0.05)

    dribbler = asyncio.create_task(trickle())
    try:
        async with asyncio.timeout(10):
            reply = await reader.read()
        assert reply.startswith(b"HTTP/1.1 408 ") and not dribbler.done()
    finally:
        dribbler.cancel()
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


FUZZ_SEED = int(os.environ.get("TOKEND_FUZZ_SEED", random.randrange(2**32)))
FUZZ_REQUESTS = 200
FUZZ_BASES = [
    GOOD,
    b'POST /v1/tokens HTTP/1.1\r\nHost: localhost:1\r\nContent-Length: 13\r\n\r\n{"sub": "a"}\n',
    b"GET /v1/sessions?limit=2 HTTP/1.1\r\nHost: [::1]\r\nAuthorization: Bearer x\r\n\r\n",
]
FUZZ_BYTES = b'\x00\r\n :;\t"%?/\xff\xc2\xb2-+9aZ'


def mutate(rng: random.Random) -> bytes:
    """A request from :data:`FUZZ_BASES` with bytes flipped, inserted, cut or repeated."""
    raw = bytearray(rng.choice(FUZZ_BASES))
    for _ in range(rng.randint(1, 4)):
        if not raw:
            break
        at = rng.randrange(len(raw))
        match rng.randrange(5):
            case 0:
                raw[at] ^= 1 << rng.randrange(8)
            case 1:
                raw[at:at] = bytes(rng.choices(FUZZ_BYTES, k=rng.randint(1, 8)))
            case 2:
                del raw[at : at + rng.randint(1, 8)]
            case 3:
                raw[at:at] = raw[at : at + rng.randint(1, 40)] * rng.randint(2, 300)
            case _:
                raw = raw[:at]
    return bytes(raw) or b"\r\n"


async def test_fuzzed_requests_get_a_4xx_never_a_500_and_the_listener_serves_on(
    start_app: StartApp, capsys: pytest.CaptureFixture[str]
) -> None:
    app = await start_app(admin_token=ADMIN_TOKEN)
    rng = random.Random(FUZZ_SEED)
    statuses: list[int] = []
    for _ in range(FUZZ_REQUESTS):
        raw = mutate(rng)
        reply = await send_and_half_close(admin_port(app), raw)
        status = int(reply.split(b" ", 2)[1])
        assert status < 500 or status == 505, (FUZZ_SEED, raw[:200], reply[:200])
        statuses.append(status)
    assert "Traceback" not in capsys.readouterr().err, FUZZ_SEED
    assert sum(400 <= s < 500 for s in statuses) > FUZZ_REQUESTS // 2, statuses
    assert (await call(app, "GET", "/healthz")).status == 200


async def test_host_names_answered_by_default_and_by_setting(start_app: StartApp) -> None:
    app = await start_app()
    port = admin_port(app)
    for host in ("127.0.0.1", f"127.0.0.1:{port}", "localhost", f"LOCALHOST:{port}", "[::1]"):
        reply = await call(
            app, "", "", raw=f"GET /readyz HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
        )
        assert reply.status == 200, host
    # A page of evil.example whose name now resolves to 127.0.0.1 (DNS rebinding).
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.2", "localhost.evil.example"):
        for path in ("/metrics", "/readyz", "/healthz"):
            raw = f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
            assert_error(await call(app, "", "", raw=raw), 421, "wrong_host")
    named = await start_app(admin_allowed_hosts="admin.internal, admin.internal:9000")
    ok = b"GET /healthz HTTP/1.1\r\nHost: admin.internal:9000\r\n\r\n"
    assert (await call(named, "", "", raw=ok)).status == 200
    assert_error(await call(named, "GET", "/healthz"), 421, "wrong_host")  # 127.0.0.1:port
    anyone = await start_app(admin_allowed_hosts="*")
    evil = b"GET /healthz HTTP/1.1\r\nHost: evil.example\r\n\r\n"
    assert (await call(anyone, "", "", raw=evil)).status == 200


async def test_admin_connections_beyond_the_cap_get_503_and_one_log_line(
    start_app: StartApp, capsys: pytest.CaptureFixture[str]
) -> None:
    app = await start_app(admin_max_connections=2, hello_timeout=30)
    assert app.admin is not None
    port = admin_port(app)
    idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
    await eventually(lambda: app.admin is not None and app.admin.listener.open == 2)
    capsys.readouterr()
    assert_error(await call(app, "GET", "/healthz"), 503, "too_many_connections")
    lines = admin_lines(capsys.readouterr().err)
    assert len(lines) == 1 and "error=too_many_connections" in lines[0]
    for _, writer in idle:
        writer.close()
    await eventually(lambda: app.admin is not None and app.admin.listener.open == 0)
    assert (await call(app, "GET", "/healthz")).status == 200


def test_the_main_port_budget_keeps_the_admin_connections_free(
    make_settings: Callable[..., Settings],
) -> None:
    with_admin = connection_budget(make_settings(admin_max_connections=64))
    without = connection_budget(make_settings(admin_port=-1, admin_max_connections=64))
    assert without - with_admin == 64
    assert with_admin - connection_budget(make_settings(admin_max_connections=100)) == 36
