"""Several tokend nodes as real processes on one Redis: any node accepts any
session, revocation reaches every node, a SIGKILLed node's clocks live on.
(``tokend serve --workers N``, N nodes on one port: tests/test_workers.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from redis import asyncio as aioredis

from testkit.clients import RawClient, proof_of, tid_of
from testkit.events import EventLog, after_a_full_sweep, left_to_judge, read_events
from testkit.tokend_process import CALM_CLOCKS, TokendProcess, running_nodes
from testkit.waiting import eventually
from tokend.config import Settings
from tokend.core import protocol as p
from tokend.tokens.service import TokenService


async def refused_with(port: int, token: str) -> int | None:
    async with RawClient.connect(port) as client:
        await client.send(p.encode(p.Hello(token)))
        return (await client.expect_close()).code


async def test_session_hops_three_nodes_then_revocation_finds_it(
    make_settings: Callable[..., Settings], tokens: TokenService, redis: aioredis.Redis
):
    settings = make_settings(**CALM_CLOCKS)
    token = tokens.mint("hopper")
    with running_nodes(settings, "node-a", "node-b", "node-c") as nodes:
        a, b, c = nodes
        async with EventLog(redis, f"{settings.key_prefix}:events") as events:
            async with RawClient.connect(a.port) as on_a:
                tid = tid_of(welcome := await on_a.hello(token))
                await on_a.heartbeat()
                # Takeover: B resumes while A's connection is still open (and live: with
                # the proof of its key, spec "Resume proof").
                async with RawClient.connect(b.port) as on_b:
                    welcome = await on_b.hello(token, proof_of(welcome))
                    assert welcome.resumed
                    closed = await on_a.expect_close()
                    assert closed.code == p.CloseCode.TAKEN_OVER
                    await on_b.heartbeat()
            # B's connection dropped without BYE: the session resumes on C.
            async with RawClient.connect(c.port) as on_c:
                assert (await on_c.hello(token, proof_of(welcome))).resumed
                await on_c.heartbeat()
                revoke = await asyncio.to_thread(
                    subprocess.run,
                    [sys.executable, "-m", "tokend", "revoke", tid],
                    env={**a.env, "TOKEND_NODE_NAME": "operator"},
                    capture_output=True,
                    text=True,
                    timeout=30,
                )
                assert revoke.returncode == 0, revoke.stderr
                assert "revoked live session" in revoke.stdout
                closed = await on_c.expect_close()
                assert closed.code == p.CloseCode.TOKEN_REVOKED
            # The tombstone bars the token on every node.
            for node in nodes:
                assert await refused_with(node.port, token) == p.CloseCode.TOKEN_REVOKED
            await events.wait_for("TOKEN_REVOKED", tid)
    history = [
        (e["type"], e["node"], e.get("by")) for e in await read_events(redis, settings.key_prefix)
    ]
    # node: the node holding the session; by: who revoked it (the command, on this host).
    assert history == [
        ("SESSION_STARTED", "node-a", None),
        ("SESSION_RESUMED", "node-b", None),
        ("SESSION_RESUMED", "node-c", None),
        ("TOKEN_REVOKED", "node-c", f"cli:{socket.gethostname()}"),
    ]


async def test_a_restarted_node_keeps_its_new_connections_when_old_sessions_move(
    make_settings: Callable[..., Settings], tokens: TokenService
):
    """A node restarted under the same name numbers its connections afresh: the
    takeover of a session it held before dying must not close the new connection
    that reuses the old one's number."""
    settings = make_settings(**CALM_CLOCKS)
    old_token, new_token = tokens.mint("before-crash"), tokens.mint("after-restart")
    with running_nodes(settings, "node-a", "node-b") as (a, b):
        async with RawClient.connect(a.port) as before:
            welcome = await before.hello(old_token)
            a.kill()
        restarted = TokendProcess(a.env, port=a.port)
        restarted.start()
        try:
            async with RawClient.connect(restarted.port) as after:
                await after.hello(new_token)
                # The dead node's connection held it live: the proof of its key.
                async with RawClient.connect(b.port) as moved:
                    assert (await moved.hello(old_token, proof_of(welcome))).resumed
                    await moved.heartbeat()
                # Still open: a heartbeat is answered.
                assert isinstance(await after.heartbeat(), p.HeartbeatAck)
        finally:
            assert restarted.stop() == 0


# Enough time for 1,000 HELLOs on a shared 2-core machine before the first expiry.
# A thousand sessions open a hundred at a time, then each heartbeats: on a busy machine
# that takes seconds, which the first session's clocks, and each handshake, must outlast.
KILL_CLOCKS: dict[str, Any] = {
    "heartbeat_interval": 1.0,
    "warn_after": 10.0,
    "expire_after": 12.0,
    "hello_timeout": 5.0,
}
SESSIONS = 1000
CONCURRENCY = 100  # connections opening at once


async def test_sigkill_leaves_each_session_resumed_or_expired_exactly_once(
    make_settings: Callable[..., Settings], tokens: TokenService, redis: aioredis.Redis
):
    # A thousand sessions from 127.0.0.1: no per-address cap.
    settings = make_settings(**KILL_CLOCKS, max_connections_per_ip=0)
    minted = [tokens.mint(f"crowd-{n}") for n in range(SESSIONS)]
    gate = asyncio.Semaphore(CONCURRENCY)
    with running_nodes(settings, "node-a", "node-b") as (doomed, survivor):
        async with contextlib.AsyncExitStack() as held:

            async def hold(token: str) -> tuple[str, RawClient]:
                async with gate:
                    client = await held.enter_async_context(RawClient.connect(doomed.port))
                    return tid_of(await client.hello(token)), client

            sessions = await asyncio.gather(*(hold(token) for token in minted))

            async def beat(client: RawClient) -> tuple[float, float]:
                sent = time.time()
                await client.heartbeat()
                return sent, time.time()

            # Each session's last heartbeat lies between its send and its ACK.
            last_beat = dict(
                zip(
                    (tid for tid, _ in sessions),
                    await asyncio.gather(*(beat(client) for _, client in sessions)),
                    strict=True,
                )
            )
            assert doomed.kill() == -signal.SIGKILL
            async with asyncio.timeout(10):
                await asyncio.gather(*(client.ws.wait_closed() for _, client in sessions))

            async def resume(token: str, before: RawClient) -> None:
                # At once, though the dead node's connections hold the sessions live: with
                # the proof of the key each had (spec "Resume proof").
                assert before.welcome is not None
                async with gate, RawClient.connect(survivor.port) as client:
                    assert (await client.hello(token, proof_of(before.welcome))).resumed
                    await client.send(p.encode(p.Bye()))
                    assert (await client.expect_close()).code == p.CloseCode.NORMAL

            await asyncio.gather(
                *(
                    resume(token, client)
                    for token, (_, client) in zip(minted[::2], sessions[::2], strict=True)
                )
            )
            resumed = {tid for tid, _ in sessions[::2]}
            left = {tid for tid, _ in sessions[1::2]}
            # Once every left session's clock has run out by Redis's clock (its last
            # heartbeat was stored before its ACK came back), the survivor's next whole
            # sweep judges each of them: a dead node's sessions expire on time.
            all_due_ms = int(max(last_beat[tid][1] for tid in left) * 1000)
            all_due_ms += settings.ms("expire_after") + 1

            async def all_due() -> bool:
                seconds, micros = await redis.time()
                return seconds * 1000 + micros // 1000 >= all_due_ms

            await eventually(all_due, settings.expire_after + 10, interval=0.05)
            await after_a_full_sweep(survivor.admin_port)
            assert await left_to_judge(redis, settings.key_prefix, sorted(left)) == []

    history = await read_events(redis, settings.key_prefix)
    counts = Counter((e["tid"], e["type"]) for e in history)
    for tid in resumed:
        assert counts[tid, "SESSION_STARTED"] == 1, tid
        assert counts[tid, "SESSION_RESUMED"] == 1, tid
        assert counts[tid, "SESSION_CLOSED"] == 1, tid
        assert counts[tid, "TOKEN_EXPIRED"] == 0, tid
    for tid in left:
        assert counts[tid, "SESSION_STARTED"] == counts[tid, "SESSION_WARN"] == 1, tid
    for event in history:
        if event["type"] != "TOKEN_EXPIRED":
            continue
        # Held by the dead node-a, expired by the survivor (its log says so, below).
        assert event["tid"] in left and event["node"] == "node-a", event
        assert event["reason"] == "heartbeat_timeout", event
        sent, _ = last_beat[event["tid"]]
        # Not before its clock ran out (in whole ms, as Redis dates it: the stored hb is
        # the ms the heartbeat was stored in).
        assert event["at"] >= int(sent * 1000) + settings.ms("expire_after"), event
    assert sorted(e["tid"] for e in history if e["type"] == "TOKEN_EXPIRED") == sorted(left)
    assert sum(line["count"] for line in survivor.logged("sessions expired")) == len(left)
    kinds = Counter(e["type"] for e in history)
    print(
        f"\nSIGKILL of a node holding {SESSIONS} sessions: "
        f"{kinds['SESSION_RESUMED']} resumed on the other node "
        f"({kinds['SESSION_CLOSED']} then logged out), {kinds['TOKEN_EXPIRED']} expired "
        "(each exactly once), "
        f"{kinds['SESSION_STARTED']} started, {kinds['SESSION_WARN']} warned"
    )
