"""A rolling reload's handoff (tokend/server/handoff.py) and its fallbacks, on real workers
and real sockets: a TLS connection falls back to a close (1001) and resumes; a handoff
format the new worker does not speak falls back; a new worker killed in the middle of its
handoff leaves every connection with exactly one worker (those it had not taken stay with
the old one, open; those it had taken die with it and resume), and the supervisor serves
on. (Many connections reloaded with no close at the client: tests/test_workers.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from redis import asyncio as aioredis
from websockets.frames import Frame, Opcode

from testkit.certificates import Authority
from testkit.clients import RawClient, WireClient, tid_of
from testkit.events import read_events
from testkit.reconnects import HeldSession
from testkit.tokend_process import CALM_CLOCKS, TokendProcess, node_env
from testkit.waiting import eventually
from tokend.config import Settings
from tokend.core import protocol as p
from tokend.core.handoff import (
    HANDOFF_VERSION,
    MAX_BATCH,
    BatchStatus,
    Moving,
    Taken,
    decode_batch,
    encode_reply,
)
from tokend.ops import pidfile
from tokend.ops.app import App
from tokend.ops.supervisor import HANDOFFS_AT_ONCE
from tokend.server.handoff import RECEIVE_BUFFER, Giver, Taker
from tokend.server.seams import SessionLink
from tokend.store.keyspace import Keyspace, node_of
from tokend.tokens.service import TokenService

RELOAD = {**CALM_CLOCKS, "drain_period": 1.0, "reload_drain_period": 1.0}


async def holding(clients: list[HeldSession], until: asyncio.Event) -> list[asyncio.Task[None]]:
    tasks = [asyncio.create_task(c.run(until)) for c in clients]
    await eventually(lambda: all(c.counts["started"] for c in clients), timeout=30)
    return tasks


def stop_first_replaced(supervisor: TokendProcess) -> dict[str, Any]:
    """SIGSTOP the new worker of the first slot replaced, as soon as it is: its log line."""
    replaced = supervisor.wait_logged("worker replaced", 1, 60)[0]
    os.kill(replaced["pid"], signal.SIGSTOP)
    return replaced


def supervisor_of(settings: Settings, workers: int) -> TokendProcess:
    return TokendProcess({**node_env(settings), "TOKEND_WORKERS": str(workers)})


def tid_held(link: SessionLink) -> str:
    """The tid of a session a node holds (WELCOMEd, so its claims are known)."""
    claims = link.session.claims
    assert claims is not None
    return str(claims.tid)


def tid_moved(record: Moving) -> str:
    """The tid of a session a batch hands over (WELCOMEd, so its claims are known)."""
    claims = record.session.claims
    assert claims is not None
    return str(claims.tid)


def holder(redis: aioredis.Redis, settings: Settings, tid: str) -> Awaitable[Any]:
    return redis.hget(Keyspace(settings.key_prefix).session_keys(uuid.UUID(tid))[0], "conn")


async def test_tls_connections_fall_back_to_a_close_and_resume(
    make_settings: Callable[..., Settings],
    tokens: TokenService,
    redis: aioredis.Redis,
    tmp_path: Path,
) -> None:
    authority = Authority.create()
    cert, key = authority.issue(tmp_path / "cert.pem", tmp_path / "key.pem")
    settings = make_settings(
        **RELOAD, node_name="tls", tls_cert_file=str(cert), tls_key_file=str(key)
    )
    context = authority.client_context(tmp_path / "ca.pem")
    supervisor = supervisor_of(settings, 2)
    supervisor.start()
    until = asyncio.Event()
    clients = [HeldSession(supervisor.port, tokens.mint(f"tls-{n}"), context) for n in range(5)]
    try:
        tasks = await holding(clients, until)
        began_ms = int(time.time() * 1000)
        finished = await asyncio.to_thread(supervisor.reload)
        reloaded = time.monotonic()
        await eventually(lambda: all(c.last_ack > reloaded for c in clients), timeout=20)
        until.set()
        await asyncio.gather(*tasks)
    finally:
        until.set()
        assert await asyncio.to_thread(supervisor.stop) == 0

    assert finished["result"] == "ok", finished
    assert (finished["moved"], finished["fell_back"]) == (0, {"tls": 5}), finished
    # Logged once for the reason, with its count.
    fallbacks = supervisor.logged("handoff: connections fall back to a close (1001)")
    assert {e["reason"] for e in fallbacks} == {"tls"} and sum(e["count"] for e in fallbacks) == 5
    assert len(fallbacks) == len({e["node"] for e in fallbacks})
    for client in clients:
        assert client.counts == Counter(started=1, resumed=1, **{"close 1001": 1}), client.counts
    kinds = Counter(e["type"] for e in await read_events(redis, settings.key_prefix, began_ms))
    assert kinds["TOKEN_EXPIRED"] == 0 and kinds["SESSION_RESUMED"] == 5, kinds


async def test_a_new_worker_killed_mid_handoff_leaves_each_connection_with_one_worker(
    make_settings: Callable[..., Settings], tokens: TokenService, redis: aioredis.Redis
) -> None:
    settings = make_settings(**RELOAD, node_name="kill", max_connections_per_ip=0)
    supervisor = supervisor_of(settings, 2)
    supervisor.start()
    until = asyncio.Event()
    # Heartbeats every 2 s: this process's loop is not the one to be late.
    clients = [
        HeldSession(supervisor.port, tokens.mint(f"k-{n}"), beat_every=2.0) for n in range(600)
    ]
    try:
        tasks = await holding(clients, until)
        before = Counter([node_of(await holder(redis, settings, c.tid)) for c in clients])
        began_ms = int(time.time() * 1000)
        assert supervisor.process is not None
        supervisor.process.send_signal(signal.SIGHUP)
        # The first slot's new worker is stopped as its handoff begins (from the thread
        # that sees the log line: at once), then killed: it may have taken a batch or
        # two (the old worker sends two before it waits for a reply), or none.
        replaced = await asyncio.to_thread(stop_first_replaced, supervisor)
        moved_before_kill = Counter(
            [node_of(await holder(redis, settings, c.tid) or "") for c in clients]
        )
        os.kill(replaced["pid"], signal.SIGKILL)
        [finished] = await asyncio.to_thread(supervisor.wait_logged, "reload finished", 1, 60)
        after = time.monotonic()
        await eventually(lambda: all(c.last_ack > after for c in clients), timeout=60)
        holders = [await holder(redis, settings, c.tid) for c in clients]
        until.set()
        await asyncio.gather(*tasks)
    finally:
        until.set()
        status = await asyncio.to_thread(supervisor.stop)

    # The supervisor logged the failed reload and served on: the first slot with its old
    # worker (the second slot's may have been replaced meanwhile: it finished its move).
    assert status == 0
    assert finished["result"] == "failed" and "during the handoff" in finished["reason"]
    assert finished["nodes"][0] == "kill-w1", finished
    assert supervisor.logged("new worker failed")
    taken = moved_before_kill["kill-w1.2"]
    # What the first slot's old worker had (and, if the second slot was replaced, its
    # too, with clients of the dead worker that reconnected to it meanwhile) either moved
    # or stayed, for that one reason.
    failed = finished["fell_back"].get("new_worker_failed", 0)
    assert finished["moved"] + failed >= before["kill-w1"], (finished, before)
    assert set(finished["fell_back"]) <= {"new_worker_failed"}, finished
    # Every session is held by one live worker now, and was never held by two: those the
    # new worker had not taken stayed open (no close, no resume); those it had taken lost
    # their connection with it (no close frame) and resumed. No session ended.
    assert {node_of(conn) for conn in holders} <= set(finished["nodes"]), Counter(holders)
    stayed = [c for c in clients if c.counts == Counter(started=1)]
    resumed = [c for c in clients if c.counts["resumed"]]
    assert len(stayed) + len(resumed) == len(clients), [c.counts for c in clients]
    for client in resumed:
        closes = {k for k in client.counts if k.startswith("close")}
        assert closes <= {"close None", "close 1006"}, client.counts
        assert client.counts["started"] == 1 and client.counts["resumed"] >= 1, client.counts
    assert len(resumed) >= taken, (len(resumed), finished, taken)
    kinds = Counter(e["type"] for e in await read_events(redis, settings.key_prefix, began_ms))
    assert kinds["TOKEN_EXPIRED"] == 0 and kinds["SESSION_STARTED"] == 0, kinds


async def test_tokend_reload_and_the_status_file_say_what_moved(
    make_settings: Callable[..., Settings], tokens: TokenService
) -> None:
    settings = make_settings(**RELOAD, node_name="said")
    supervisor = supervisor_of(settings, 2)
    supervisor.start()
    try:
        async with RawClient.connect(supervisor.port) as client:
            await client.hello(tokens.mint("said"))
            reload = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-m", "tokend", "reload"],
                env=supervisor.env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            await client.heartbeat()  # answered by the new worker, on the same connection
            status = pidfile.read_status(Path(supervisor.env["TOKEND_DATA_DIR"]))
    finally:
        assert await asyncio.to_thread(supervisor.stop) == 0
    assert reload.returncode == 0, reload.stderr
    assert reload.stdout.startswith("tokend reload: reloaded in"), reload.stdout
    assert reload.stdout.rstrip().endswith(
        "generation 2: said-w1.2, said-w2.2; 1 connection moved, 0 fell back"
    ), reload.stdout
    assert (status["last_reload"]["moved"], status["last_reload"]["fell_back"]) == (1, {})


async def test_a_reload_hands_over_so_many_slots_at_once_and_no_more(
    make_settings: Callable[..., Settings], tokens: TokenService
) -> None:
    """One slot more than HANDOFFS_AT_ONCE, and the first slot's new worker stopped as its
    handoff begins (so that handoff lasts): the last slot's old worker begins its handoff
    only once another has ended its own. (An old worker logs ``handed over`` before it
    tells the supervisor, which then replaces the next slot's worker.)"""
    workers = HANDOFFS_AT_ONCE + 1
    settings = make_settings(**RELOAD, node_name="turns", max_connections_per_ip=0)
    supervisor = supervisor_of(settings, workers)
    supervisor.start()
    async with contextlib.AsyncExitStack() as stack:
        clients = []
        for n in range(10 * workers):  # some on every slot
            client = await stack.enter_async_context(RawClient.connect(supervisor.port))
            await client.hello(tokens.mint(f"turns-{n}"))
            clients.append(client)
        try:
            assert supervisor.process is not None
            supervisor.process.send_signal(signal.SIGHUP)
            stopped = await asyncio.to_thread(stop_first_replaced, supervisor)
            await asyncio.to_thread(supervisor.wait_logged, "worker replaced", workers, 60)
            os.kill(stopped["pid"], signal.SIGCONT)
            [finished] = await asyncio.to_thread(supervisor.wait_logged, "reload finished", 1, 60)
            for client in clients:
                await client.heartbeat()  # answered by a new worker, on the same connection
        finally:
            assert await asyncio.to_thread(supervisor.stop) == 0

    assert finished["result"] == "ok" and finished["moved"] == len(clients), finished
    handing = 0
    most = 0
    for entry in supervisor.log_lines:
        if entry.get("event") == "worker replaced":
            handing += 1
            most = max(most, handing)
        elif entry.get("event") == "handed over":
            handing -= 1
    assert handing == 0 and most == HANDOFFS_AT_ONCE, supervisor.log_lines


@pytest.fixture
async def two_nodes(
    start_app: Callable[..., Awaitable[App]],
) -> tuple[App, App]:
    """Two nodes on one Redis: an old worker and a new one, in this process; calm clocks,
    so that no session expires while a test opens hundreds of them on a busy machine."""
    old = await start_app(**CALM_CLOCKS, node_name="old", max_connections_per_ip=0)
    new = await start_app(**CALM_CLOCKS, node_name="new")
    return old, new


def handing_over(old: App, new: App) -> Giver:
    """A giver of ``old``'s connections to a taker of ``new``'s, over a socketpair."""
    give, take = handoff_channel()
    assert new.admission is not None and old.admission is not None
    Taker(new.admission, new.node, take, lambda: True).start()
    return Giver(old.admission.connections, old.node, give, new.node.name)


async def test_an_unknown_handoff_version_falls_back_and_the_connection_stays(
    two_nodes: tuple[App, App], tokens: TokenService, redis: aioredis.Redis
) -> None:
    old, new = two_nodes
    async with RawClient.connect(old.port) as client:
        welcome = await client.hello(tokens.mint("alice"))
        await client.heartbeat()
        giver = handing_over(old, new)
        giver.version = HANDOFF_VERSION + 1
        report = await giver.run()

        assert (report.moved, dict(report.fell_back)) == (0, {"unknown_version": 1})
        assert old.node.metrics.handoff_fell_back == {"unknown_version": 1}
        assert new.node.metrics.handoff_taken == 0
        assert new.admission is not None and not new.admission.connections
        # The connection stayed with the old worker: still its session, still answered.
        conn = await holder(redis, old.settings, tid_of(welcome))
        assert node_of(conn) == "old"
        ack = await client.heartbeat()
        assert ack.seq == 2


async def test_a_connection_already_closing_is_not_moved_and_ends_as_it_was_going_to(
    two_nodes: tuple[App, App], tokens: TokenService
) -> None:
    old, new = two_nodes
    assert old.admission is not None
    async with (
        RawClient.connect(old.port) as leaving,
        RawClient.connect(old.port) as staying,
    ):
        leaving_welcome = await leaving.hello(tokens.mint("leaving"))
        await staying.hello(tokens.mint("staying"))
        (closing,) = [
            c
            for c in old.admission.connections
            if c.link is not None and tid_held(c.link) == tid_of(leaving_welcome)
        ]
        closing.close(p.CloseCode.GOING_AWAY, "going away")  # its closing handshake begun
        report = await handing_over(old, new).run()

        assert (report.moved, dict(report.fell_back)) == (1, {"closing": 1})
        assert (await leaving.expect_close()).code == p.CloseCode.GOING_AWAY
        assert (await staying.heartbeat()).seq == 1  # moved, answered by the new worker
    assert new.node.metrics.handoff_taken == 1


def handoff_channel() -> tuple[socket.socket, socket.socket]:
    """The giver's end (non-blocking, as a worker's) and the taker's end of a handoff."""
    give, take = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    give.setblocking(False)
    return give, take


async def welcomed(
    stack: contextlib.AsyncExitStack, port: int, tokens: TokenService, count: int, name: str
) -> list[RawClient]:
    """``count`` clients, each WELCOMEd right after its connect (hello_timeout runs from
    the connect), open until ``stack`` closes."""
    clients = []
    for n in range(count):
        client = await stack.enter_async_context(RawClient.connect(port))
        await client.hello(tokens.mint(f"{name}-{n}"))
        clients.append(client)
    return clients


async def test_a_new_worker_that_fails_after_one_batch_leaves_every_other_connection_here(
    two_nodes: tuple[App, App], tokens: TokenService
) -> None:
    """The new worker takes the first batch, then closes its end: the second batch, sent
    and unanswered, stays with the old worker, as do the connections not sent yet; each
    connection is counted once, and every one left here is still served."""
    old, _ = two_nodes
    give, take = handoff_channel()
    assert old.admission is not None
    count = MAX_BATCH + 60
    async with contextlib.AsyncExitStack() as stack:
        clients = await welcomed(stack, old.port, tokens, count, "many")
        giver = Giver(old.admission.connections, old.node, give, "new")
        running = asyncio.create_task(giver.run())
        loop = asyncio.get_running_loop()
        data, fds, _, _ = await loop.run_in_executor(
            None, lambda: socket.recv_fds(take, RECEIVE_BUFFER, MAX_BATCH)
        )
        first = decode_batch(data, old.node, old.admission.cadence, time.monotonic)
        take.send(encode_reply(first.number, BatchStatus.READ, [Taken.TAKEN] * len(fds)))
        for fd in fds:
            os.close(fd)  # what a new worker that dies does to the connections it took
        take.close()
        report = await running

        # A full batch, unless some were not quiet yet (a WELCOME still unsent) when it went.
        taken = len(first.records)
        assert report.moved == taken and 0 < taken <= MAX_BATCH
        assert dict(report.fell_back) == {"new_worker_failed": count - taken}
        assert len(old.admission.connections) == count - taken
        held_here = {tid_held(link) for link in old.node.sessions.values()}
        assert len(held_here) == count - taken
        assert held_here.isdisjoint(tid_moved(r) for r in first.records)
        served = 0
        for client in clients:
            assert client.welcome is not None
            if tid_of(client.welcome) in held_here:
                assert (await client.heartbeat()).seq == 1  # still here, reading again
                served += 1
        assert served == count - taken


async def test_a_batch_is_gathered_and_held_only_once_the_window_has_room_for_it(
    two_nodes: tuple[App, App], tokens: TokenService
) -> None:
    """With one batch in flight at most, the connections of the next batch go on being
    read until the first batch is answered: a heartbeat they send meanwhile waits for
    their own batch's round trip, not for the batches ahead of it."""
    old, _ = two_nodes
    give, take = handoff_channel()
    assert old.admission is not None
    count = MAX_BATCH + 60
    async with contextlib.AsyncExitStack() as stack:
        await welcomed(stack, old.port, tokens, count, "window")
        by_tid = {tid_held(c.link): c for c in old.admission.connections if c.link is not None}
        giver = Giver(old.admission.connections, old.node, give, "new")
        giver.window = 1
        running = asyncio.create_task(giver.run())
        loop = asyncio.get_running_loop()
        sent: set[str] = set()
        held_elsewhere = []  # when each batch came: held connections not in it or before
        while True:
            # The giver waits for this batch's reply by the time its message is read here
            # (it sends, then waits, with nothing in between).
            data, fds, _, _ = await loop.run_in_executor(
                None, lambda: socket.recv_fds(take, RECEIVE_BUFFER, MAX_BATCH)
            )
            if not data:
                break
            batch = decode_batch(data, old.node, old.admission.cadence, time.monotonic)
            sent |= {tid_moved(r) for r in batch.records}
            held_elsewhere.append(sum(c.moving for tid, c in by_tid.items() if tid not in sent))
            take.send(encode_reply(batch.number, BatchStatus.READ, [Taken.TAKEN] * len(fds)))
            for fd in fds:
                os.close(fd)
        report = await running
        take.close()

    assert len(by_tid) == count and report.moved == count and sent == set(by_tid)
    assert len(held_elsewhere) >= 2
    assert held_elsewhere == [0] * len(held_elsewhere)


async def test_a_heartbeat_split_across_the_sighup_is_acked_by_the_new_worker(
    make_settings: Callable[..., Settings], tokens: TokenService, redis: aioredis.Redis
) -> None:
    """Half a heartbeat frame before the reload, the rest after it: the old worker hands
    the half it read over with the connection, and the new worker ACKs the whole."""
    settings = make_settings(**RELOAD, node_name="split")
    supervisor = supervisor_of(settings, 2)
    supervisor.start()
    client = await WireClient.open(supervisor.port)
    try:
        await client.send(Frame(Opcode.BINARY, p.encode(p.Hello(tokens.mint("split")))))
        welcome = await client.welcome()
        tid = tid_of(welcome)
        holder_before = await holder(redis, settings, tid)
        beat = p.encode(p.make_heartbeat(welcome.session_key, welcome.tid, 1, welcome.exp_ms))
        frame = Frame(Opcode.BINARY, beat).serialize(mask=True)
        half = len(frame) // 2
        await client.send_raw(frame[:half])
        finished = await asyncio.to_thread(supervisor.reload)
        await client.send_raw(frame[half:])
        async with asyncio.timeout(10):
            while len(client.frames) < 2:
                assert await client._read(), "closed"
        ack = p.decode(bytes(client.frames[1].data))
        holder_after = await holder(redis, settings, tid)
    finally:
        client.close()
        assert await asyncio.to_thread(supervisor.stop) == 0

    assert finished["result"] == "ok" and finished["moved"] == 1, finished
    assert isinstance(ack, p.HeartbeatAck) and ack.seq == 1, ack
    # The new worker held the session when it stored that heartbeat, on the connection
    # the client never left.
    assert node_of(holder_before) in ("split-w1", "split-w2")
    assert node_of(holder_after) == node_of(holder_before) + ".2"
    assert client.protocol.close_rcvd is None
