"""The live dashboard (tokend/ops/dashboard/) in headless Chromium, on the real admin listener.

Live sessions from the Python SDK and from ``tokend connect`` clients, one of them
SIGKILLed, one revoked; two nodes on one Redis; a reload. The page's numbers must be the
server's (GET /v1/stats, /v1/nodes, /v1/history), the cluster's counts must show a
session in WARN whose client went away, the charts must show the history from the first
load, and the admin token must never travel in a URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from redis import asyncio as aioredis

from testkit import replies
from testkit.clients import RawClient
from testkit.events import EventLog
from testkit.net import LOOPBACK, admin_json, free_port, http_request, url_of
from testkit.tokend_process import CALM_CLOCKS
from testkit.tokens import WallClockTokens
from testkit.waiting import eventually
from tokend.core import protocol as p
from tokend.ops.app import App
from tokend_client import connect

if TYPE_CHECKING:
    from tests.browser.harness import BrowserPage

pytest_plugins = ["tests.browser.harness"]

ADMIN_TOKEN = "dashboard-admin-token-32-characters"
StartApp = Callable[..., Awaitable[App]]
LIVE_SESSIONS = 3
SCREENSHOT = Path(tempfile.gettempdir()) / "tokend-dashboard.png"
SCREENSHOT_ALL = Path(tempfile.gettempdir()) / "tokend-dashboard-all.png"
# Clocks a page polling every 200 ms sees each state in: WARN lasts 2 s.
WATCHED_CLOCKS = {
    "heartbeat_interval": 0.5,
    "warn_after": 2.0,
    "expire_after": 4.0,
    "sweep_interval": 0.05,
    "history_interval": 0.5,
}
CLIENTS = 5


async def admin_get(app: App, path: str) -> Any:
    assert app.admin is not None
    return await admin_json(app.admin.port, ADMIN_TOKEN, path)


admin_stats = functools.partial(admin_get, path="/v1/stats")


async def ring_subscribed(redis: aioredis.Redis, app: App) -> bool:
    """The admin listener's event ring is subscribed: it sees the events that follow."""
    channel = f"{app.settings.key_prefix}:events"
    return bool((await redis.pubsub_numsub(channel))[0][1])


def dashboard_url(app: App, **fragment: str) -> str:
    assert app.admin is not None
    extra = "".join(f"&{k}={v}" for k, v in fragment.items())
    return f"http://{LOOPBACK}:{app.admin.port}/dashboard/index.html#token={ADMIN_TOKEN}{extra}"


def card(name: str) -> str:
    """The JavaScript expression of a card's text."""
    return f"document.querySelector('[data-stat=\"{name}\"]').textContent"


async def shown(page: BrowserPage) -> dict[str, Any]:
    """What the page displays: the cards, the tables by first cell, the charts."""
    return dict(
        await page.eval(
            """(() => {
              const texts = (tr) => [...tr.cells].map((cell) => cell.textContent);
              const table = (id) => Object.fromEntries(
                [...document.querySelectorAll(`#${id} tbody tr`)].map(
                  (tr) => [texts(tr)[0], texts(tr).slice(1)]));
              const charts = Object.fromEntries([...document.querySelectorAll('svg.chart')].map(
                (svg) => [svg.id, {
                  samples: Number(svg.dataset.samples),
                  max: Number(svg.dataset.max),
                  ticks: [...svg.querySelectorAll('text.tick')].map((t) => t.textContent),
                  series: Object.fromEntries([...svg.querySelectorAll('polyline')].map(
                    (line) => [line.dataset.series,
                               {count: Number(line.dataset.count), last: line.dataset.last}])),
                }]));
              return {
                stats: Object.fromEntries([...document.querySelectorAll('[data-stat]')].map(
                  (e) => [e.dataset.stat, e.textContent])),
                closeCodes: table('close-codes'),
                expiries: table('expiries'),
                stages: table('stages'),
                nodes: table('nodes'),
                health: Object.fromEntries([...document.querySelectorAll('#health tbody tr')].map(
                  (tr) => [tr.dataset.check, texts(tr).slice(1)])),
                healthOf: [...document.querySelectorAll('#health thead th')].slice(1).map(
                  (th) => th.textContent),
                charts,
                events: [...document.querySelectorAll('#events tbody tr')].map(
                  (tr) => [tr.dataset.type, tr.dataset.tid]),
                status: document.querySelector('#status').textContent,
              };
            })()"""
        )
    )


class ConnectClient:
    """``tokend connect`` as a child process holding one session."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.lines: list[str] = []

    @classmethod
    @contextlib.asynccontextmanager
    async def running(cls, port: int, token: str) -> AsyncIterator[ConnectClient]:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tokend",
            "connect",
            "--token",
            token,
            "--url",
            url_of(port),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
        client = cls(process)
        try:
            await client.wait_for("connected")
            yield client
        finally:
            if process.returncode is None:
                process.terminate()  # SIGTERM: BYE
            await process.wait()

    async def wait_for(self, kind: str, timeout: float = 20) -> str:
        assert self.process.stdout is not None
        async with asyncio.timeout(timeout):
            while True:
                line = (await self.process.stdout.readline()).decode()
                assert line, f"tokend connect ended: {self.lines}"
                self.lines.append(line)
                if line.split()[1] == kind:
                    return line

    async def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        await self.process.wait()


async def test_dashboard_shows_the_servers_numbers_and_events(
    browser: BrowserPage,
    start_app: StartApp,
    tokens: WallClockTokens,
    events: EventLog,
    redis: aioredis.Redis,
):
    # Clocks no busy moment of a shared machine turns a live session's WARN.
    app = await start_app(admin_token=ADMIN_TOKEN, **WATCHED_CLOCKS)
    assert app.admin is not None
    dashboard = f"http://{LOOPBACK}:{app.admin.port}/dashboard"

    await eventually(functools.partial(ring_subscribed, redis, app))

    # Without a token the page asks for one; a wrong one is refused and forgotten.
    await browser.goto(dashboard)
    assert await browser.eval("document.querySelector('#login').hidden") is False
    await browser.eval(
        "document.querySelector('#token').value = 'wrong';"
        "document.querySelector('#login').requestSubmit()"
    )
    refused = await browser.until("document.querySelector('#login-error').textContent")
    assert "401" in refused
    assert await browser.eval("sessionStorage.getItem('tokend-admin-token')") is None

    # The token in the fragment: kept in sessionStorage, wiped from the address. The
    # page polls from before the sessions start, so its chart shows them come and go.
    await browser.goto(f"{dashboard}/index.html#token={ADMIN_TOKEN}&poll=200")
    await browser.until("document.querySelector('#status').textContent.startsWith('updated')")

    async with contextlib.AsyncExitStack() as stack:
        url = url_of(app.port)
        live = [
            await stack.enter_async_context(connect(url, tokens.mint(f"user-{n}")))
            for n in range(LIVE_SESSIONS)
        ]
        # One more session that says HELLO and then nothing: WARN, then expired (4505).
        quiet_token = tokens.mint("quiet")
        quiet_tid = str(tokens.verify(quiet_token).tid)
        async with RawClient.connect(app.port) as quiet:
            await quiet.hello(quiet_token)
            closed = await quiet.expect_close(timeout=10)
            assert closed.code == p.CloseCode.SESSION_EXPIRED
        await events.wait_for("TOKEN_EXPIRED", quiet_tid)

        await browser.until(
            f'document.querySelector(\'#events tr[data-type="TOKEN_EXPIRED"]'
            f'[data-tid="{quiet_tid}"]\')',
        )
        assert await browser.eval("location.href") == f"{dashboard}/index.html"
        assert await browser.eval("sessionStorage.getItem('tokend-admin-token')") == ADMIN_TOKEN
        # Every heartbeat stage has samples (one heartbeat in 16 is timed), and the
        # charts a few samples.
        await browser.until(
            "document.querySelectorAll('#stages tbody tr').length === 4"
            " && Number(document.querySelector('#chart-rates').dataset.samples) >= 3",
        )
        # The page's stats poll has seen the expiry too (its events poll, above, may
        # come first on a busy machine).
        await browser.until(
            f"{card('ended.expired')} === '1' && {card('cluster.WARN')} === '0'"
            f" && {card('cluster.ACTIVE')} === '{LIVE_SESSIONS}'"
            # and the expired connection gone (a poll may count it as it closes)
            f" && {card('connections')} === '{LIVE_SESSIONS}'"
        )
        # The counters that hold still while the sessions just heartbeat: one poll of
        # the page and one of ours see the same values.
        page = await shown(browser)
        server = await admin_stats(app)
        assert server["cluster"]["sessions"] == {"ACTIVE": LIVE_SESSIONS, "WARN": 0}
        assert server["cluster"]["ended"] == {"expired": 1, "revoked": 0, "closed": 0}
        assert page["stats"]["connections"] == str(server["connections"]) == "3"
        assert page["stats"]["held.ACTIVE"] == str(server["held"]["ACTIVE"]) == "3"
        assert page["stats"]["nodes"] == "1"
        assert server["expiries_total"] == {"heartbeat_timeout": 1, "token_expired": 0}
        assert page["expiries"] == {"heartbeat_timeout": ["1"], "token_expired": ["0"]}
        assert page["closeCodes"]["4505"] == ["1"] == [str(server["close_codes"]["4505"])]
        assert set(page["stages"]) == set(server["heartbeat_stage_ms"])
        assert page["nodes"]["node-a"][:2] == ["yes", "3"]
        assert page["healthOf"] == ["node-a"]
        assert page["health"]["ready"] == ["yes"]
        assert page["health"]["redis"][0].startswith("reachable, PING")
        assert page["health"]["shedding"] == ["no"]
        assert "per_ip 0" in page["health"]["refused-429"][0]
        assert "too_many_sessions 0" in page["health"]["refused-4029"][0]
        assert page["health"]["files"][0].split()[0].replace(",", "").isdigit()
        assert "gather waits up to 2 ms" in page["health"]["store"][0]
        assert float(page["health"]["store"][0].split()[0]) > 0  # heartbeats were timed
        assert ["SESSION_WARN", quiet_tid] in page["events"]
        started = {tid for kind, tid in page["events"] if kind == "SESSION_STARTED"}
        assert {str(s.tid) for s in live} | {quiet_tid} <= started
        assert page["status"].startswith("updated")
        # Every chart has a time axis and a scale; the heartbeats are in the rates.
        for chart in page["charts"].values():
            assert len(chart["ticks"]) == 9 and chart["max"] > 0, chart
        assert float(page["charts"]["chart-rates"]["series"]["heartbeats/s"]["last"]) > 0
        assert page["charts"]["chart-ended"]["series"]["EXPIRED"]["count"] >= 1

        # The token went in headers only: no request of the page carried it in its URL.
        urls = await browser.eval(
            "performance.getEntriesByType('resource').map((e) => e.name)"
            ".concat(performance.getEntriesByType('navigation').map((e) => e.name))"
        )
        assert any("/v1/stats" in u for u in urls)
        assert any("/v1/history" in u for u in urls)
        assert not [u for u in urls if ADMIN_TOKEN in u.partition("#")[0]]

        await browser.screenshot(SCREENSHOT)
        print(f"dashboard screenshot: {SCREENSHOT}")


async def test_a_killed_clients_session_shows_in_warn_then_expired(
    browser: BrowserPage,
    start_app: StartApp,
    tokens: WallClockTokens,
    events: EventLog,
    redis: aioredis.Redis,
):
    """Five ``tokend connect`` clients, one SIGKILLed: its session is in WARN on the page
    (the cluster's counts: no node holds its connection) before it expires, then it
    counts as EXPIRED; one revoked counts as REVOKED."""
    app = await start_app(admin_token=ADMIN_TOKEN, **WATCHED_CLOCKS)
    warn_ms, expire_ms = app.settings.ms("warn_after"), app.settings.ms("expire_after")
    await browser.goto(dashboard_url(app, poll="200"))
    minted = [tokens.mint(f"client-{n}") for n in range(CLIENTS)]
    tids = [str(tokens.verify(token).tid) for token in minted]
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(ConnectClient.running(app.port, token))
            for token in minted
        ]
        await browser.until(f"{card('cluster.ACTIVE')} === '{CLIENTS}'")
        await clients[0].kill()
        await browser.until(
            f"{card('cluster.WARN')} === '1' && {card('cluster.ACTIVE')} === '{CLIENTS - 1}'",
            timeout=expire_ms / 1000,
        )
        # Shown while in WARN: before the session's TOKEN_EXPIRED.
        assert not events.of("TOKEN_EXPIRED", tids[0])
        last_heartbeat = int(
            replies.text(
                await redis.hget(app.node.store.keys.session_keys(uuid.UUID(tids[0]))[0], "hb")
            )
        )
        warned = (await events.wait_for("SESSION_WARN", tids[0]))[0]
        stats = await admin_stats(app)
        assert stats["cluster"]["sessions"] == {"ACTIVE": CLIENTS - 1, "WARN": 1}
        assert stats["held"] == {"ACTIVE": CLIENTS - 1, "WARN": 0}  # its node holds none
        await browser.until(
            f"{card('ended.expired')} === '1' && {card('cluster.WARN')} === '0'",
            timeout=expire_ms / 1000 + 5,
        )
        expired = (await events.wait_for("TOKEN_EXPIRED", tids[0]))[0]
        # WARN came warn_after after its last heartbeat (as Redis stored it), with at
        # most a sweep between (and a second's slack on a shared machine), EXPIRED
        # expire_after after it: the session's clocks, in Redis time.
        late = warned["at"] - last_heartbeat - warn_ms
        assert 0 <= late <= app.settings.ms("sweep_interval") + 1000, (warned, last_heartbeat)
        assert expired["at"] - last_heartbeat >= expire_ms, (expired, last_heartbeat)
        # A revocation: REVOKED 1, its client closed 4506.
        assert app.admin is not None
        revoked = await http_request(
            app.admin.port,
            "DELETE",
            f"/v1/sessions/{tids[1]}",
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        )
        assert revoked.json()["result"] == "revoked"
        await clients[1].wait_for("ended")
        await browser.until(
            f"{card('ended.revoked')} === '1' && {card('cluster.ACTIVE')} === '{CLIENTS - 2}'"
        )
        page = await shown(browser)
        assert page["stats"]["cluster.WARN"] == "0" and page["stats"]["ended.expired"] == "1"
        states = page["charts"]["chart-states"]["series"]
        assert states["ACTIVE"]["count"] >= 3 and states["WARN"]["count"] >= 3
    # The others logged out with BYE.
    await browser.until(f"{card('ended.closed')} === '{CLIENTS - 2}'")
    assert (await admin_stats(app))["cluster"]["sessions"] == {"ACTIVE": 0, "WARN": 0}


async def test_two_nodes_show_the_same_cluster_and_each_node_or_all(
    browser: BrowserPage, start_app: StartApp, tokens: WallClockTokens
):
    settings = {"admin_token": ADMIN_TOKEN, "history_interval": 0.5, **CALM_CLOCKS}
    a = await start_app(node_name="node-a", **settings)
    b = await start_app(node_name="node-b", **settings)
    async with contextlib.AsyncExitStack() as stack:
        for app, count in ((a, 2), (b, 3)):
            for n in range(count):
                client = await stack.enter_async_context(RawClient.connect(app.port))
                await client.hello(tokens.mint(f"{app.node.name}-{n}"))
        await browser.goto(dashboard_url(a, poll="200"))
        await browser.until(
            f"{card('cluster.ACTIVE')} === '5' && {card('nodes')} === '2'"
            f" && {card('connections')} === '2'"
            # node-b's view, published once a second, since its sessions began
            " && document.querySelector('#nodes tr[data-key=\"node-b\"]').cells[2]"
            ".textContent === '3'"
        )
        page = await shown(browser)
        for app in (a, b):
            cluster = (await admin_stats(app))["cluster"]
            assert cluster["sessions"] == {"ACTIVE": 5, "WARN": 0}
            assert page["stats"]["cluster.ACTIVE"] == str(cluster["sessions"]["ACTIVE"])
        assert page["nodes"]["node-b"][:2] == ["yes", "3"]

        # node-b, chosen in the picker: its connections, its health.
        select = "document.querySelector('#node-select')"
        await browser.eval(
            f"{select}.value = 'node-b'; {select}.dispatchEvent(new Event('change'))"
        )
        await browser.until(
            f"{card('connections')} === '3'"
            " && document.querySelector('#health td[data-node=\"node-b\"]')"
            " && document.querySelector('#chart-rates').dataset.samples > 0"
        )
        assert "node-b" in await browser.eval("document.querySelector('#shown-title').textContent")
        # All nodes: the sums, and each node's health side by side.
        await browser.eval(f"{select}.value = 'all'; {select}.dispatchEvent(new Event('change'))")
        await browser.until(
            f"{card('connections')} === '5' && {card('held.ACTIVE')} === '5'"
            " && document.querySelectorAll('#health thead th').length === 3"
        )
        await browser.screenshot(SCREENSHOT_ALL)
        print(f"dashboard screenshot, all nodes: {SCREENSHOT_ALL}")
        # Clicking a node's row shows it.
        await browser.eval("document.querySelector('#nodes tr[data-key=\"node-a\"]').click()")
        await browser.until(f"{card('connections')} === '2' && {select}.value === 'node-a'")


async def test_after_a_reload_the_charts_show_the_last_minutes(
    browser: BrowserPage, start_app: StartApp, tokens: WallClockTokens
):
    app = await start_app(admin_token=ADMIN_TOKEN, history_interval=0.25, **CALM_CLOCKS)
    async with contextlib.AsyncExitStack() as stack:
        for n in range(3):
            client = await stack.enter_async_context(RawClient.connect(app.port))
            await client.hello(tokens.mint(f"kept-{n}"))

        async def history() -> list[dict[str, Any]]:
            samples = (await admin_get(app, "/v1/history"))["samples"]
            with_three = [s for s in samples if s["sessions"] == {"ACTIVE": 3, "WARN": 0}]
            return samples if len(with_three) >= 8 else []

        before = await eventually(history, 10)
        first_render = (
            "document.querySelector('#status').textContent.startsWith('updated')"
            " && document.querySelector('#chart-states').dataset.samples"
        )
        for visit in ("first load", "reload"):
            await browser.goto(dashboard_url(app, poll="60000"))  # no second poll meanwhile
            samples = int(await browser.until(first_render))
            assert samples >= len(before), visit
            page = await shown(browser)
            states = page["charts"]["chart-states"]
            assert states["series"]["ACTIVE"]["count"] >= len(before), visit
            assert states["series"]["ACTIVE"]["last"] == "3", visit
            # A time axis over the samples: the first sample's interval to the last.
            assert len(states["ticks"]) == 9 and states["max"] >= 3, visit


async def test_dashboard_follows_a_blip_and_a_restarted_node(
    browser: BrowserPage, start_app: StartApp, tokens: WallClockTokens, redis: aioredis.Redis
):
    admin_port = free_port()
    settings = {"admin_token": ADMIN_TOKEN, "admin_port": admin_port}
    app = await start_app(**settings)
    dashboard = f"http://{LOOPBACK}:{admin_port}/dashboard/index.html"
    await browser.goto(f"{dashboard}#token={ADMIN_TOKEN}&poll=200")
    rows = "document.querySelectorAll('#events tbody tr').length"
    unreachable = "document.querySelector('#status').textContent.includes('unreachable')"
    updated = "document.querySelector('#status').textContent.startsWith('updated')"
    for generation in (1, 2):
        await eventually(functools.partial(ring_subscribed, redis, app))
        token = tokens.mint(f"generation-{generation}")
        async with RawClient.connect(app.port) as client:
            await client.hello(token)
            await client.heartbeat()
            await client.send(p.encode(p.Bye()))
            await client.expect_close()
        tid = str(tokens.verify(token).tid)
        shown = f"document.querySelectorAll('#events tr[data-tid=\"{tid}\"]').length"
        assert await browser.until(f"{shown} === 2 && {shown}")  # STARTED and CLOSED
        if generation == 1:
            # A blip (the page's requests fail for a while): the page reads the whole
            # ring again afterwards, and shows no event twice.
            await browser.eval(
                "window.realFetch = fetch; window.fetch = () => Promise.reject(new Error('blip'))"
            )
            await browser.until(unreachable)
            await browser.eval("window.fetch = window.realFetch")
            await browser.until(updated)
            assert await browser.eval(rows) == 2
            # A restart: the new node numbers its events from 1 again; the page must
            # still show them.
            await app.stop()
            await browser.until(unreachable)
            app = await start_app(**settings)
    assert await browser.eval(rows) == 4  # the first node's events are still there, once
