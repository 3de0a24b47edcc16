"""The live dashboard (tokend/ops/dashboard/) in headless Chromium, on the real admin listener.

Live sessions from the Python SDK and one session left to expire; the page's
numbers must be the server's (GET /v1/stats), its event feed must show the
TOKEN_EXPIRED we caused, and the admin token must never travel in a URL.
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from redis import asyncio as aioredis

from testkit.clients import RawClient
from testkit.events import EventLog
from testkit.net import LOOPBACK, free_port, http_request
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


async def admin_stats(app: App) -> dict[str, Any]:
    assert app.admin is not None
    reply = await http_request(
        app.admin.port, "GET", "/v1/stats", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
    )
    assert reply.status == 200, reply
    return dict(reply.json())


async def ring_subscribed(redis: aioredis.Redis, app: App) -> bool:
    """The admin listener's event ring is subscribed: it sees the events that follow."""
    channel = f"{app.settings.key_prefix}:events"
    return bool((await redis.pubsub_numsub(channel))[0][1])


async def shown(page: BrowserPage) -> dict[str, Any]:
    """What the page displays: the counters, the tables by first cell, the chart."""
    return dict(
        await page.eval(
            """(() => {
              const texts = (tr) => [...tr.cells].map((cell) => cell.textContent);
              const table = (id) => Object.fromEntries(
                [...document.querySelectorAll(`#${id} tbody tr`)].map(
                  (tr) => [texts(tr)[0], texts(tr).slice(1)]));
              return {
                stats: Object.fromEntries([...document.querySelectorAll('[data-stat]')].map(
                  (e) => [e.dataset.stat, e.textContent])),
                closeCodes: table('close-codes'),
                expiries: table('expiries'),
                stages: table('stages'),
                events: [...document.querySelectorAll('#events tbody tr')].map(
                  (tr) => [tr.dataset.type, tr.dataset.tid]),
                chartPoints: document.querySelector('polyline[data-series="ACTIVE"]')
                  .getAttribute('points').split(' ').filter(Boolean).length,
                status: document.querySelector('#status').textContent,
              };
            })()"""
        )
    )


async def test_dashboard_shows_the_servers_numbers_and_events(
    browser: BrowserPage,
    start_app: StartApp,
    tokens: WallClockTokens,
    events: EventLog,
    redis: aioredis.Redis,
):
    app = await start_app(admin_token=ADMIN_TOKEN)
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
        url = f"ws://{LOOPBACK}:{app.port}{p.WS_PATH}"
        live = [
            await stack.enter_async_context(connect(url, tokens.mint(f"user-{n}")))
            for n in range(LIVE_SESSIONS)
        ]
        # One more session that says HELLO and then nothing: WARN, then expired (4505).
        quiet_token = tokens.mint("quiet")
        quiet_tid = str(tokens.verify(quiet_token).tid)
        async with RawClient.connect(app.port) as quiet:
            await quiet.hello(quiet_token)
            closed = await quiet.expect_close()
            assert closed.code == p.CloseCode.SESSION_EXPIRED
        await events.wait_for("TOKEN_EXPIRED", quiet_tid)

        await browser.until(
            f'document.querySelector(\'#events tr[data-type="TOKEN_EXPIRED"]'
            f'[data-tid="{quiet_tid}"]\')',
        )
        assert await browser.eval("location.href") == f"{dashboard}/index.html"
        assert await browser.eval("sessionStorage.getItem('tokend-admin-token')") == ADMIN_TOKEN
        # Every heartbeat stage has samples (one heartbeat in 16 is timed) and the
        # chart has a few points.
        await browser.until(
            "document.querySelectorAll('#stages tbody tr').length === 4"
            " && document.querySelector('polyline[data-series=\"ACTIVE\"]')"
            ".getAttribute('points').split(' ').length >= 3",
        )
        # The page's stats poll has seen the expiry too (its events poll, above, may
        # come first on a busy machine).
        await browser.until(
            "document.querySelector('[data-stat=\"expiries\"]').textContent === '1'"
            " && document.querySelector('[data-stat=\"sessions.WARN\"]').textContent === '0'"
        )
        # The counters that hold still while the sessions just heartbeat: one poll of
        # the page and one of ours see the same values.
        page = await shown(browser)
        server = await admin_stats(app)
        assert page["stats"]["sessions.ACTIVE"] == str(server["sessions"]["ACTIVE"])
        assert server["sessions"] == {"ACTIVE": LIVE_SESSIONS, "WARN": 0}
        assert page["stats"]["sessions.WARN"] == "0"
        assert page["stats"]["sessions_total"] == str(server["sessions_total"]) == "3"
        assert page["stats"]["connections"] == str(server["connections"]) == "3"
        assert page["stats"]["expiries"] == "1" and server["expiries_total"] == {
            "heartbeat_timeout": 1
        }
        assert page["expiries"] == {"heartbeat_timeout": ["1"]}
        assert page["closeCodes"]["4505"] == ["1"] == [str(server["close_codes"]["4505"])]
        assert set(page["stages"]) == set(server["heartbeat_stage_ms"])
        assert int(page["stats"]["heartbeats_total"].replace(",", "")) > 0
        assert ["SESSION_WARN", quiet_tid] in page["events"]
        started = {tid for kind, tid in page["events"] if kind == "SESSION_STARTED"}
        assert {str(s.tid) for s in live} | {quiet_tid} <= started
        assert page["status"].startswith("updated")

        # The token went in headers only: no request of the page carried it in its URL.
        urls = await browser.eval(
            "performance.getEntriesByType('resource').map((e) => e.name)"
            ".concat(performance.getEntriesByType('navigation').map((e) => e.name))"
        )
        assert any("/v1/stats" in u for u in urls)
        assert not [u for u in urls if ADMIN_TOKEN in u.partition("#")[0]]

        await browser.screenshot(SCREENSHOT)
        print(f"dashboard screenshot: {SCREENSHOT}")


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
