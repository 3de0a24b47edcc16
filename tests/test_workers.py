"""``tokend serve --workers N`` (tokend/ops/supervisor.py): N nodes on one port whose sockets the
supervisor holds, the rolling reload (SIGHUP, ``tokend reload``), the pid file; socket
activation and readiness notification (tokend/ops/activation.py) for one process too."""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
from redis import asyncio as aioredis

from testkit import replies
from testkit.clients import RawClient
from testkit.events import EventLog, read_events
from testkit.net import LOOPBACK, free_port, http_get
from testkit.reconnects import HeldSession
from testkit.tokend_process import CALM_CLOCKS, TokendProcess, node_env
from testkit.waiting import eventually
from tokend.config import ConfigError, Settings
from tokend.ops import activation, pidfile
from tokend.ops.embedded import socket_url
from tokend.store.keyspace import Keyspace, node_of
from tokend.tokens.service import TokenService

# A reload's drain, short: each old worker closes its connections within a second or
# two (reload_drain_period apart from drain_period, to see which one a drain uses).
RELOAD_CLOCKS: dict[str, Any] = {**CALM_CLOCKS, "drain_period": 1.0, "reload_drain_period": 1.5}


def supervisor_of(settings: Settings, workers: int, **env: str) -> TokendProcess:
    return TokendProcess({**node_env(settings), "TOKEND_WORKERS": str(workers), **env})


def descendants(process: TokendProcess) -> list[psutil.Process]:
    assert process.process is not None
    return psutil.Process(process.process.pid).children(recursive=True)


def started(supervisor: TokendProcess, generation: int = 1) -> dict[str, int]:
    """The workers a supervisor started in ``generation``: pid by node name."""
    return {
        line["node"]: line["pid"]
        for line in supervisor.logged("worker started")
        if line["generation"] == generation
    }


def admin_ports(process: TokendProcess) -> dict[str, int]:
    """Each node's admin port, from its ``admin listening`` line."""
    return {line["node"]: line["port"] for line in process.logged("admin listening")}


def tokend_command(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokend", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


# --- one port, several workers --------------------------------------------------------------


async def test_workers_share_one_port_and_one_redis_and_stop_together(
    make_settings: Callable[..., Settings], tokens: TokenService
):
    # The embedded default: the supervisor starts the one Redis its workers share.
    settings = make_settings(redis_url="", node_name="pool")
    supervisor = supervisor_of(settings, 2)
    supervisor.start()
    children = descendants(supervisor)
    try:
        assert len(children) == 3, children  # two workers and the embedded Redis
        events_redis = aioredis.from_url(
            socket_url(settings.resolved_data_dir), decode_responses=True
        )
        async with EventLog(events_redis, f"{settings.key_prefix}:events") as events:
            for n in range(20):
                async with RawClient.connect(supervisor.port) as client:
                    await client.hello(tokens.mint(f"spread-{n}"))
            opened = await events.wait_for("SESSION_STARTED", count=20)
        await events_redis.aclose()
        # The kernel spread the connections over both workers' sockets (all 20 on one
        # while both listen: a chance of 2**-19).
        assert {e["node"] for e in opened} == {"pool-w1", "pool-w2"}
    finally:
        status = supervisor.stop(signal.SIGTERM)
    assert status == 0
    _, alive = psutil.wait_procs(children, timeout=5)
    assert not alive


async def test_a_dead_worker_stops_the_supervisor_with_status_1(
    make_settings: Callable[..., Settings],
):
    supervisor = supervisor_of(make_settings(node_name="pool"), 2)
    supervisor.start()
    children = descendants(supervisor)
    workers = started(supervisor)
    assert set(workers) == {"pool-w1", "pool-w2"}
    psutil.Process(workers["pool-w2"]).kill()
    assert supervisor.process is not None
    assert await asyncio.to_thread(supervisor.process.wait, 15) == 1
    supervisor.stop()
    (died,) = supervisor.logged("worker died")
    assert died["node"] == "pool-w2" and died["exitcode"] == -signal.SIGKILL
    _, alive = psutil.wait_procs(children, timeout=5)
    assert not alive


# A WebSocket opening handshake (RFC 6455 section 1.3's example key).
UPGRADE = (
    b"GET /v1/ws HTTP/1.1\r\nHost: tokend\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
)


async def test_a_second_signal_kills_workers_still_stopping(make_settings: Callable[..., Settings]):
    supervisor = supervisor_of(make_settings(node_name="pool"), 2)
    supervisor.start()
    children = descendants(supervisor)
    # A client that never answers the close frame holds its worker's graceful stop
    # for close_timeout.
    with socket.create_connection((LOOPBACK, supervisor.port)) as mute:
        mute.sendall(UPGRADE)
        assert mute.recv(1024).startswith(b"HTTP/1.1 101")
        assert supervisor.process is not None
        supervisor.process.send_signal(signal.SIGTERM)
        await asyncio.to_thread(supervisor.wait_logged, "signal received, stopping workers")
        assert supervisor.stop(signal.SIGTERM) == 1
    assert supervisor.logged("signal received again, killing workers")
    _, alive = psutil.wait_procs(children, timeout=5)
    assert not alive


async def test_workers_die_with_a_sigkilled_supervisor(make_settings: Callable[..., Settings]):
    supervisor = supervisor_of(make_settings(redis_url="", node_name="pool"), 2)
    supervisor.start()
    children = descendants(supervisor)
    assert len(children) == 3, children  # two workers and the embedded Redis
    assert supervisor.kill() == -signal.SIGKILL
    _, alive = await asyncio.to_thread(psutil.wait_procs, children, 10)
    assert not alive


def test_workers_stopped_as_soon_as_they_listen_stop_cleanly(
    make_settings: Callable[..., Settings],
):
    # SIGTERM the moment both workers have logged `listening`, before `workers ready`:
    # each worker already stops on it (its handler is set before its start).
    supervisor = supervisor_of(make_settings(node_name="pool"), 2)
    supervisor.start()
    children = descendants(supervisor)
    assert supervisor.stop(signal.SIGTERM) == 0
    assert not supervisor.logged("worker stopped uncleanly"), supervisor.log_lines[-5:]
    _, alive = psutil.wait_procs(children, timeout=5)
    assert not alive


def test_a_supervisor_whose_log_reader_is_gone_still_stops(
    make_settings: Callable[..., Settings],
):
    # The log's pipe broken (its reader died): every line fails to write, and the
    # supervisor and its workers still stop on SIGTERM, with status 0.
    env = {**node_env(make_settings(node_name="pool")), "TOKEND_WORKERS": "2"}
    process = subprocess.Popen(
        [sys.executable, "-m", "tokend", "serve"],
        env={**os.environ, **env, "TOKEND_PORT": str(free_port()), "TOKEND_LOG_FORMAT": "json"},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    assert process.stderr is not None
    try:
        for line in process.stderr:
            if b'"workers ready"' in line:
                break
        children = psutil.Process(process.pid).children(recursive=True)
        process.stderr.close()
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
    _, alive = psutil.wait_procs(children, timeout=5)
    assert not alive


def test_several_workers_need_a_fixed_port(make_settings: Callable[..., Settings]):
    with pytest.raises(ConfigError, match="workers"):
        make_settings(workers=2, port=0)


# --- the rolling reload ------------------------------------------------------------------------

SESSIONS = 200
BEAT_EVERY_S = 0.5  # each held session's heartbeat, during the reload test


def files_under(directory: Path) -> bytes:
    """Every file under ``directory``, read, one after another."""
    return b"".join(path.read_bytes() for path in directory.rglob("*") if path.is_file())


def session_key(settings: Settings, tid: str) -> str:
    return Keyspace(settings.key_prefix).session_keys(uuid.UUID(tid))[0]


async def probe(port: int, until: asyncio.Event) -> Counter[str]:
    """Connect and hang up, again and again until ``until``: accepted and refused."""
    outcomes: Counter[str] = Counter()
    while not until.is_set():
        try:
            _, writer = await asyncio.open_connection(LOOPBACK, port)
        except ConnectionRefusedError:
            outcomes["refused"] += 1
        else:
            writer.close()
            outcomes["accepted"] += 1
        await asyncio.sleep(0.01)
    return outcomes


async def test_a_reload_under_load_hands_every_connection_over_and_no_client_sees_it(
    make_settings: Callable[..., Settings], tokens: TokenService, redis: aioredis.Redis
):
    settings = make_settings(**RELOAD_CLOCKS, node_name="pool")
    supervisor = supervisor_of(settings, 2)
    supervisor.start()
    try:
        old = started(supervisor)
        old_admin = admin_ports(supervisor)
        until = asyncio.Event()
        held = [
            HeldSession(supervisor.port, tokens.mint(f"held-{n}"), beat_every=BEAT_EVERY_S)
            for n in range(SESSIONS)
        ]
        tasks = [asyncio.create_task(session.run(until)) for session in held]
        prober = asyncio.create_task(probe(supervisor.port, until))
        try:
            await eventually(lambda: all(s.counts["started"] for s in held), timeout=20)
            began_ms = int(time.time() * 1000)
            finished = await asyncio.to_thread(supervisor.reload)
            reloaded = time.monotonic()
            # Every session is alive on the new workers: an ACK after the reload.
            await eventually(lambda: all(s.last_ack > reloaded for s in held), timeout=10)
            # Each session is held by a connection of its slot's new worker.
            holders = {
                s.tid: replies.text(await redis.hget(session_key(settings, s.tid), "conn"))
                for s in held
            }
        finally:
            until.set()
            await asyncio.gather(*tasks)
            probes = await prober
    finally:
        assert await asyncio.to_thread(supervisor.stop) == 0

    assert finished["result"] == "ok", finished
    new = started(supervisor, generation=2)
    assert finished["nodes"] == sorted(new) == ["pool-w1.2", "pool-w2.2"]
    # Every connection was handed to its slot's new worker: none fell back.
    assert (finished["moved"], finished["fell_back"]) == (SESSIONS, {}), finished
    handed = [e for e in supervisor.logged("handed over") if e["node"] in old]
    assert sorted(e["node"] for e in handed) == sorted(old)
    assert sum(e["moved"] for e in handed) == SESSIONS
    # No client saw the reload: one WELCOME each, no close, no resume, no refused connect;
    # each one's heartbeats were ACKed by the new worker holding its session now.
    totals = sum((s.counts for s in held), Counter())
    assert totals == Counter(started=SESSIONS), totals
    assert probes["refused"] == 0 and probes["accepted"] > 0, probes
    assert {node_of(conn) for conn in holders.values()} == set(new), holders
    # No session key reached a log or the disk on the way.
    logged = "\n".join(map(str, supervisor.log_lines))
    on_disk = await asyncio.to_thread(files_under, Path(settings.data_dir))
    for session in held:
        key = session.key
        assert key and key.hex() not in logged and base64.b64encode(key).decode() not in logged
        assert key not in on_disk and key.hex().encode() not in on_disk
    # The event bus saw nothing: no resume, no park, no expiry.
    kinds = Counter(e["type"] for e in await read_events(redis, settings.key_prefix, began_ms))
    assert kinds == Counter(), kinds
    # The old workers had nothing left to drain, and have exited.
    assert [e["nodes"] for e in supervisor.logged("draining old workers")] == [sorted(old)]
    assert not any(psutil.pid_exists(pid) for pid in old.values())
    # Each new worker is a fresh `python -m tokend serve --worker`, the supervisor's
    # child, not a fork of an old one; each slot's admin port stayed, now its new worker's.
    for pid in new.values():
        assert pid not in old.values()
    new_admin = admin_ports(supervisor)
    for slot in (1, 2):
        assert new_admin[f"pool-w{slot}.2"] == old_admin[f"pool-w{slot}"]


async def test_new_workers_are_fresh_interpreters_whose_admin_listeners_answer(
    make_settings: Callable[..., Settings],
):
    supervisor = supervisor_of(make_settings(**RELOAD_CLOCKS, node_name="pool"), 2)
    supervisor.start()
    try:
        assert supervisor.process is not None
        assert supervisor.reload()["result"] == "ok"
        for node, pid in started(supervisor, generation=2).items():
            worker = psutil.Process(pid)
            assert worker.ppid() == supervisor.process.pid
            assert worker.cmdline()[1:] == ["-m", "tokend", "serve", "--worker"]
            status, body = await http_get(admin_ports(supervisor)[node], "/healthz")
            assert (status, body["node"]) == (200, node)
    finally:
        assert supervisor.stop() == 0


async def test_a_reload_reads_the_config_file_again_and_a_bad_one_keeps_the_old_workers(
    make_settings: Callable[..., Settings], tokens: TokenService, tmp_path: Path
):
    settings = make_settings(**RELOAD_CLOCKS, node_name="pool")
    config_file = tmp_path / "tokend.toml"
    config_file.write_text("heartbeat_interval = 5\n")
    env = {k: v for k, v in node_env(settings).items() if k != "TOKEND_HEARTBEAT_INTERVAL"}
    supervisor = TokendProcess({**env, "TOKEND_WORKERS": "2", "TOKEND_CONFIG": str(config_file)})
    supervisor.start()
    try:
        config_file.write_text("heartbeat_interval = 4\n")
        assert supervisor.reload()["result"] == "ok"
        async with RawClient.connect(supervisor.port) as client:
            assert (await client.hello(tokens.mint("after-reload"))).heartbeat_ms == 4000
        serving = started(supervisor, generation=2)

        config_file.write_text('heartbeat_interval = "soon"\n')
        # tokend reload reads the file too: it says so, and asks for no reload.
        refused = await asyncio.to_thread(tokend_command, "reload", env=supervisor.env)
        assert refused.returncode == 2 and "configuration error" in refused.stderr
        # Asked all the same (from an environment without the file), the reload fails.
        elsewhere = {**os.environ, "TOKEND_DATA_DIR": supervisor.env["TOKEND_DATA_DIR"]}
        reload = await asyncio.to_thread(tokend_command, "reload", env=elsewhere)
        assert reload.returncode == 1
        assert reload.stderr.count("\n") == 1 and reload.stderr.startswith(
            "tokend reload: reload failed after"
        ), reload.stderr
        assert "new worker pool-w1.3 exited with status 2" in reload.stderr
        (failed,) = supervisor.logged("new worker failed")
        assert failed["kept"] == "pool-w1.2"
        # The old workers serve on, and the supervisor with them.
        assert all(psutil.pid_exists(pid) for pid in serving.values())
        async with RawClient.connect(supervisor.port) as client:
            await client.hello(tokens.mint("after-failed-reload"))
            await client.heartbeat()
        assert supervisor.process is not None and supervisor.process.poll() is None
    finally:
        assert supervisor.stop() == 0


async def test_a_sighup_during_a_reload_brings_one_more_reload(
    make_settings: Callable[..., Settings],
):
    supervisor = supervisor_of(make_settings(**RELOAD_CLOCKS, node_name="pool"), 2)
    supervisor.start()
    try:
        assert supervisor.process is not None
        supervisor.process.send_signal(signal.SIGHUP)
        await asyncio.to_thread(supervisor.wait_logged, "reloading")
        supervisor.process.send_signal(signal.SIGHUP)
        supervisor.process.send_signal(signal.SIGHUP)  # the kernel may merge the two
        finished = await asyncio.to_thread(supervisor.wait_logged, "reload finished", 2)
        assert [line["generation"] for line in finished] == [2, 3]
        assert supervisor.logged("reload requested during a reload: one more follows it")
        status = pidfile.read_status(Path(supervisor.env["TOKEND_DATA_DIR"]))
        # Every request answered: no third reload is pending.
        assert status["reloads_done"] == status["reloads_requested"] >= 2
        assert status["nodes"] == ["pool-w1.3", "pool-w2.3"]
    finally:
        assert supervisor.stop() == 0


async def test_sigterm_during_a_reload_stops_every_worker_gracefully(
    make_settings: Callable[..., Settings],
):
    supervisor = supervisor_of(make_settings(**RELOAD_CLOCKS, node_name="pool"), 2)
    supervisor.start()
    assert supervisor.process is not None
    supervisor.process.send_signal(signal.SIGHUP)
    await asyncio.to_thread(supervisor.wait_logged, "worker replaced")
    children = descendants(supervisor)
    assert supervisor.stop(signal.SIGTERM) == 0
    assert not supervisor.logged("reload finished")
    _, alive = psutil.wait_procs(children, timeout=5)
    assert not alive


# --- tokend reload and the pid file -----------------------------------------------------------


def test_tokend_reload_without_a_server_says_so(tmp_path: Path):
    env = {**os.environ, "TOKEND_DATA_DIR": str(tmp_path)}
    missing = tokend_command("reload", env=env)
    assert missing.returncode == 1
    assert missing.stderr == f"tokend reload: no server runs on {tmp_path} (no tokend.pid)\n"
    # Left by a server that was SIGKILLed: nobody holds its lock.
    (tmp_path / "tokend.pid").write_text("4194304\n")
    stale = tokend_command("reload", env=env)
    assert stale.returncode == 1
    assert stale.stderr == (
        f"tokend reload: no server runs on {tmp_path} (stale tokend.pid, pid 4194304)\n"
    )


async def test_one_process_cannot_reload_and_says_so(make_settings: Callable[..., Settings]):
    node = TokendProcess(node_env(make_settings(**CALM_CLOCKS)))
    node.start()
    try:
        reload = await asyncio.to_thread(tokend_command, "reload", env=node.env)
        assert reload.returncode == 1
        assert "is one process, which cannot replace itself" in reload.stderr
        # A SIGHUP of its own does not stop it either.
        assert node.process is not None
        node.process.send_signal(signal.SIGHUP)
        await asyncio.to_thread(node.wait_logged, "SIGHUP ignored", 1, 10)
        assert (await http_get(node.port, "/readyz"))[0] == 200
    finally:
        assert node.stop() == 0


async def test_a_second_supervisor_on_the_same_data_dir_is_refused(
    make_settings: Callable[..., Settings],
):
    settings = make_settings(node_name="pool")
    first = supervisor_of(settings, 2)
    first.start()
    try:
        second = supervisor_of(settings, 2)
        second.launch()
        assert second.process is not None
        assert await asyncio.to_thread(second.process.wait, 20) == 1
        assert second.stop() == 1
        assert first.process is not None
        (refusal,) = [line["raw"] for line in second.log_lines if "raw" in line]
        assert refusal == (
            f"tokend serve: another tokend serve (pid {first.process.pid}) runs on this data "
            f"directory ({settings.resolved_data_dir / 'tokend.pid'} is locked)\n"
        )
    finally:
        assert first.stop() == 0


# --- one process under socket activation ------------------------------------------------------

ACTIVATED_SESSIONS = 50


def listening_socket() -> socket.socket:
    """What systemd's tokend.socket would hold: a listening socket on a free port."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((LOOPBACK, 0))
    sock.listen(128)
    return sock


async def test_a_socket_activated_process_restarts_without_refusing_a_connection(
    make_settings: Callable[..., Settings], tokens: TokenService
):
    """As systemd runs tokend.socket + tokend.service: the socket outlives the process,
    so a restart makes connections wait in the backlog, never refuses them."""
    settings = make_settings(**RELOAD_CLOCKS)
    with listening_socket() as sock:
        env = node_env(settings)
        first = TokendProcess(env, sockets=[(sock, "tokend.socket")])
        first.start()
        (line,) = first.logged("listening")
        assert line["inherited"] is True and line["port"] == first.port
        until = asyncio.Event()
        held = [
            HeldSession(first.port, tokens.mint(f"activated-{n}"), beat_every=BEAT_EVERY_S)
            for n in range(ACTIVATED_SESSIONS)
        ]
        tasks = [asyncio.create_task(session.run(until)) for session in held]
        second = TokendProcess(env, sockets=[(sock, "tokend.socket")])
        try:
            await eventually(lambda: all(s.counts["started"] for s in held), timeout=20)
            assert await asyncio.to_thread(first.stop) == 0
            # No tokend runs: a connection is accepted into the backlog all the same.
            with socket.create_connection((LOOPBACK, first.port), timeout=10) as waiting:
                waiting.sendall(UPGRADE)
                second.start()  # from this thread: the child dies with its starter
                answer = await asyncio.to_thread(waiting.recv, 1024)
                assert answer.startswith(b"HTTP/1.1 101"), answer
            restarted = time.monotonic()
            await eventually(lambda: all(s.last_ack > restarted for s in held), timeout=20)
        finally:
            until.set()
            await asyncio.gather(*tasks)
            assert await asyncio.to_thread(second.stop) == 0
    totals = sum((s.counts for s in held), Counter())
    assert totals["connect ConnectionRefusedError"] == 0, totals
    assert totals["started"] == ACTIVATED_SESSIONS, totals
    assert all(s.counts["resumed"] >= 1 for s in held), totals


async def test_a_supervisor_refuses_sockets_from_socket_activation(
    make_settings: Callable[..., Settings],
):
    with listening_socket() as sock:
        supervisor = TokendProcess(
            {**node_env(make_settings()), "TOKEND_WORKERS": "2"}, sockets=[(sock, "tokend")]
        )
        supervisor.launch()
        assert supervisor.process is not None
        assert await asyncio.to_thread(supervisor.process.wait, 20) == 2
        supervisor.stop()
    (refusal,) = [line["raw"] for line in supervisor.log_lines if "raw" in line]
    assert refusal.startswith("tokend: configuration error: workers: the supervisor binds")


# --- readiness for systemd (Type=notify) -------------------------------------------------------


class NotifySocket:
    """What systemd listens on for a Type=notify service: its NOTIFY_SOCKET."""

    def __init__(self, tmp_path: Path) -> None:
        self.path = tmp_path / "notify.sock"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(self.path))

    async def next(self, timeout: float = 20) -> dict[str, str]:
        self.sock.settimeout(timeout)
        data = await asyncio.to_thread(self.sock.recv, activation.MAX_NOTIFICATION)
        return activation.parse_notification(data)

    def close(self) -> None:
        self.sock.close()


async def test_the_supervisor_tells_systemd_ready_reloading_and_stopping(
    make_settings: Callable[..., Settings], tmp_path: Path
):
    notify = NotifySocket(tmp_path)
    supervisor = supervisor_of(
        make_settings(**RELOAD_CLOCKS, node_name="pool"), 2, NOTIFY_SOCKET=str(notify.path)
    )
    supervisor.launch()
    try:
        ready = await notify.next()
        assert supervisor.process is not None
        assert ready["READY"] == "1" and ready["MAINPID"] == str(supervisor.process.pid)
        # Every worker was ready before: each logged its listening line.
        assert len(supervisor.logged("listening")) == 2
        supervisor.process.send_signal(signal.SIGHUP)
        reloading = await notify.next()
        assert reloading["RELOADING"] == "1" and int(reloading["MONOTONIC_USEC"]) > 0
        assert (await notify.next())["READY"] == "1"
        await asyncio.to_thread(supervisor.wait_logged, "reload finished")
        supervisor.process.send_signal(signal.SIGTERM)
        assert (await notify.next())["STOPPING"] == "1"
        assert await asyncio.to_thread(supervisor.process.wait, 20) == 0
    finally:
        assert supervisor.stop() == 0
        notify.close()


async def test_one_process_tells_systemd_ready_and_stopping(
    make_settings: Callable[..., Settings], tmp_path: Path
):
    notify = NotifySocket(tmp_path)
    env = {**node_env(make_settings(**CALM_CLOCKS)), "NOTIFY_SOCKET": str(notify.path)}
    node = TokendProcess(env)
    node.launch()
    try:
        assert (await notify.next())["READY"] == "1"
        assert node.logged("listening")
        assert node.process is not None
        node.process.send_signal(signal.SIGTERM)
        assert (await notify.next())["STOPPING"] == "1"
        assert (await notify.next())[activation.DRAINED] == "1"
        assert await asyncio.to_thread(node.process.wait, 20) == 0
    finally:
        assert node.stop() == 0
        notify.close()


# --- tokend/ops/activation.py on its own ----------------------------------------------------------


def test_listen_fds_follow_sd_listen_fds():
    environ = {"LISTEN_PID": "42", "LISTEN_FDS": "2", "LISTEN_FDNAMES": "tokend.socket:admin"}
    assert activation.listen_fds(environ, 42) == [(3, "tokend.socket"), (4, "admin")]
    # Another process's variables (a parent's, inherited): none for this one.
    assert activation.listen_fds(environ, 43) == []
    assert activation.listen_fds({}, 42) == []
    unnamed = {"LISTEN_PID": "42", "LISTEN_FDS": "1"}
    assert activation.listen_fds(unnamed, 42) == [(3, "unknown")]
    with pytest.raises(activation.ActivationError, match="LISTEN_FDS"):
        activation.listen_fds({"LISTEN_PID": "42", "LISTEN_FDS": "two"}, 42)
    with pytest.raises(activation.ActivationError, match="LISTEN_FDNAMES: 1 names for 2"):
        activation.listen_fds({**environ, "LISTEN_FDNAMES": "tokend.socket"}, 42)


def test_the_admin_socket_is_the_one_named_admin():
    assert activation.sort_listeners([(3, "tokend.socket"), (4, "admin")]) == (3, 4)
    assert activation.sort_listeners([(3, "admin"), (4, "web")]) == (4, 3)
    assert activation.sort_listeners([(3, "unknown")]) == (3, None)
    assert activation.sort_listeners([]) == (None, None)
    with pytest.raises(activation.ActivationError, match="expected one listener"):
        activation.sort_listeners([(3, "unknown"), (4, "unknown")])


def test_only_a_listening_stream_socket_is_adopted():
    with listening_socket() as sock:
        adopted = activation.adopt(os.dup(sock.fileno()))
        assert adopted.getsockname() == sock.getsockname()
        assert not adopted.get_inheritable()
        adopted.close()
    with socket.socket() as idle, pytest.raises(activation.ActivationError, match="not a listen"):
        activation.adopt(idle.fileno())
    with open(os.devnull) as file, pytest.raises(activation.ActivationError, match="descriptor"):
        activation.adopt(file.fileno())


def test_take_inherited_removes_the_variables():
    environ = {"LISTEN_PID": "1", "LISTEN_FDS": "1", "LISTEN_FDNAMES": "x", "HOME": "/"}
    assert activation.take_inherited(environ) == activation.Inherited()
    assert environ == {"HOME": "/"}


def test_notifications_round_trip_with_the_senders_pid(tmp_path: Path):
    fields = {"READY": "1", "STATUS": "2 workers ready = fine"}
    assert activation.parse_notification(activation.notification(fields)) == fields
    assert activation.parse_notification(b"READY=1\nnonsense\n") == {"READY": "1"}
    address = f"@tokend-test/{os.getpid()}/{free_port()}"
    with activation.notify_listener(address) as listener:
        environ = {"NOTIFY_SOCKET": address, "HOME": "/"}
        notifier = activation.Notifier.from_environ(environ)
        assert environ == {"HOME": "/"}
        notifier.notify(READY="1")
        assert activation.receive_notification(listener) == (os.getpid(), {"READY": "1"})
        assert activation.receive_notification(listener) is None
    # Nobody asked, or nobody listens any more: nothing happens.
    activation.Notifier(None).notify(READY="1")
    notifier.notify(STOPPING="1")
