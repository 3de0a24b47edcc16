"""Random faults from a seed, and a checker of tokend's promises over what the clients saw.

Starts a Redis master with a replica and three Sentinels, three tokend nodes (node 0 a
supervisor of two workers, nodes 1 and 2 single processes; each reaches the current
master through a relay of its own, :class:`testkit.fault_proxies.RedisLink`), and
``--sessions`` SDK clients (``tokend_client``) on short clocks through one round-robin
front (:class:`testkit.fault_proxies.ClientFront`). Then it applies the faults of
:func:`testkit.fault_schedule.schedule` for ``--seed`` (printed; the same seed gives the
same schedule): SIGKILL and restart a node, SIGSTOP/SIGCONT one past warn_after, a
rolling reload, a Sentinel failover, links node<->Redis and client<->node cut, delayed or
blackholed, revocations (``tokend revoke`` and the admin API), logouts, clients silent on
purpose, takeovers. Each revoked token is tried again after every failover and at the end.

Every client records its WELCOMEs, heartbeats, ACKs (seq, exp, token) and closes; the run
records each fault as applied, reads the event stream (XRANGE) and a consumer group, and
:func:`testkit.fault_checker.check` judges it all. Exit status 0 when no promise was
broken; ``--json FILE`` writes the summary (seed, faults by kind, sessions by outcome,
excused sessions by reason, violations). docs/security.md, "Faults and the promises".

    python load_tests/faults.py --seed 7 --duration 600 --json faults.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import gc
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from a checkout: testkit/, load_tests/

import redis  # noqa: E402
from redis import asyncio as aioredis  # noqa: E402
from redis.asyncio.sentinel import Sentinel  # noqa: E402

from testkit import fault_history as h  # noqa: E402
from testkit import fault_schedule as fs  # noqa: E402
from testkit import planted, replies  # noqa: E402
from testkit.fault_checker import Verdict, check, stories  # noqa: E402
from testkit.fault_proxies import ClientFront, Faults, RedisLink  # noqa: E402
from testkit.net import LOOPBACK, http_request, url_of  # noqa: E402
from testkit.redis_servers import (  # noqa: E402
    RedisProcess,
    RedisSentinelProcess,
    wait_sentinels_settled,
)
from testkit.tokend_process import TokendProcess, node_env  # noqa: E402
from testkit.tokens import WallClockTokens, minter  # noqa: E402
from testkit.waiting import eventually_sync  # noqa: E402
from tokend import config  # noqa: E402
from tokend.store.keyspace import Keyspace  # noqa: E402
from tokend_client import Backoff, ClientSession, TokendError  # noqa: E402
from tokend_client import protocol as p  # noqa: E402
from tokend_client.core import ON_A_CONNECTION, ClientCore, Phase  # noqa: E402

ADMIN_TOKEN = "faults-admin-token-of-32-characters"
GROUP = "faults-checker"
NODES = fs.NODES
REPLICA_ARGS = ("--repl-diskless-sync-delay", "0")
# A reconnect storm (a third of the clients at once, after a node's death) on a busy
# 2-core machine: the handshakes are answered, late, rather than retried as a storm.
OPEN_TIMEOUT = 5.0
STALL = 0.5  # the driver's loop this late (s) is a stall: its clients and relays stood still
# The client port of the connection being opened, per session task (the front names its node).
OPENING_PORT: contextvars.ContextVar[int] = contextvars.ContextVar("opening_port", default=0)


class Recorder:
    """Where every client's records go, with wall-clock times."""

    def __init__(self, front: ClientFront) -> None:
        self.front = front
        self.records: list[h.Record] = []

    def add(self, tid: str, kind: str, client: int, conn: int = 0, **fields: Any) -> None:
        self.records.append(h.Record(time.time(), tid, kind, client, conn, **fields))


class RecordingCore(ClientCore):
    """The SDK's client core, recording what it is told and sends."""

    def __init__(self, token: str, recorder: Recorder, client: int, **options: Any) -> None:
        super().__init__(token, **options)
        self.recorder = recorder
        self.client = client
        self.conn = 0
        self.node: int | None = None

    def _add(self, kind: str, **fields: Any) -> None:
        self.recorder.add(str(self.tid), kind, self.client, self.conn, **fields)

    def opened(self, subprotocol: str | None) -> None:
        if self.phase is Phase.CONNECT:
            self.conn += 1
            self.node = self.recorder.front.node_of.get(OPENING_PORT.get())
        super().opened(subprotocol)

    def refused(self, status: int, retry_after_header: str | None = None) -> None:
        self._add(h.REFUSED, code=status)
        super().refused(status, retry_after_header)

    def lost(self, detail: str) -> None:
        self._add(h.REFUSED)

        super().lost(detail)

    def receive(self, data: bytes | str) -> None:
        if self.phase in ON_A_CONNECTION and isinstance(data, bytes):
            with contextlib.suppress(p.ProtocolError):
                frame = p.decode(data)
                if isinstance(frame, p.Welcome):
                    self._add(h.WELCOME, node=self.node, exp=frame.exp_ms, resumed=frame.resumed)
                elif isinstance(frame, p.HeartbeatAck):
                    self._add(h.ACK, seq=frame.seq, exp=frame.exp_ms, token=frame.token)
        super().receive(data)

    def closed(self, received: Any, sent: Any = None) -> None:
        if self.phase in ON_A_CONNECTION:
            self._add(h.CLOSE, code=None if received is None else received.code)
        super().closed(received, sent)

    def _heartbeat(self, now: float) -> None:
        super()._heartbeat(now)
        self._add(h.HEARTBEAT, seq=self._seq)


class RecordingSession(ClientSession):
    def __init__(
        self, url: str, token: str, recorder: Recorder, client: int = 0, **options: Any
    ) -> None:
        super().__init__(url, token, **options)
        old = self._core
        self._core = RecordingCore(
            token,
            recorder,
            client,
            clock=self._now,
            backoff=old.backoff,
            session_key=old.session_key,
            open_timeout=old.open_timeout,
            close_timeout=old.close_timeout,
        )

    @property
    def node(self) -> int | None:
        """The node of the connection opened last."""
        assert isinstance(self._core, RecordingCore)
        return self._core.node

    def silence(self) -> None:
        """Stop for good without a BYE: the session is left to expire."""
        if self._runner is not None:
            self._runner.cancel()


def _install_port_probe() -> None:
    """Each connection the SDK opens tells its session task its local port."""
    import tokend_client.asyncio as sdk

    opener = vars(sdk)["ws_connect"]

    async def probed(*args: Any, **kwargs: Any) -> Any:
        ws = await opener(*args, **kwargs)
        OPENING_PORT.set(int(ws.transport.get_extra_info("sockname")[1]))
        return ws

    vars(sdk)["ws_connect"] = probed


class Cluster:
    """Redis (master, replica, Sentinels), the relays and the tokend nodes of a run."""

    def __init__(self, scratch: Path, clocks: fs.Clocks, package: Path | None) -> None:
        self.scratch = scratch
        self.clocks = clocks
        self.package = package  # a tokend package to run instead of this checkout's
        self.redis = [
            RedisProcess(scratch / "redis-a", extra_args=REPLICA_ARGS),
            RedisProcess(scratch / "redis-b", extra_args=REPLICA_ARGS),
        ]
        self.master = 0
        self.sentinels: list[RedisSentinelProcess] = []
        self.redis_faults = Faults(NODES)
        self.links = [
            RedisLink(n, self.redis_faults, lambda: self.redis[self.master].port)
            for n in range(NODES)
        ]
        self.nodes: list[TokendProcess] = []
        self.started: list[tuple[int, TokendProcess]] = []  # every process a node ran as
        self.settings = config.load(
            {
                "keys_dir": str(scratch / "keys"),
                "heartbeat_interval": clocks.heartbeat_interval,
                "warn_after": clocks.warn_after,
                "expire_after": clocks.expire_after,
                "redis_timeout": clocks.redis_timeout,
                "sweep_interval": 0.1,
                "hello_timeout": 2.0,
                "token_ttl": 60,
                "renew_window": 30,
                "durable_timeout": 0.5,
                "failover_check_interval": 0.2,
                "stream_maxlen": 10_000_000,
                "admin_token": ADMIN_TOKEN,
                "max_connections_per_ip": 0,
                "max_pending_hellos": 0,
                "drain_period": 1.0,
                "reload_drain_period": 1.0,
            },
            environ={},
        )

    @property
    def sentinel_url(self) -> str:
        hosts = ",".join(f"{LOOPBACK}:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/tokend/0"

    def start_redis(self) -> None:
        self.redis[0].start()
        replica = self.redis[1]
        replica.extra_args = (*REPLICA_ARGS, "--replicaof", LOOPBACK, str(self.redis[0].port))
        replica.start()
        self.redis[0].wait_replicas(1)
        options = {"down-after-milliseconds": 500, "failover-timeout": 10000}
        self.sentinels = [
            RedisSentinelProcess(
                self.scratch / f"sentinel-{n}", self.redis[0], quorum=2, options=options
            )
            for n in range(3)
        ]
        for sentinel in self.sentinels:
            sentinel.start()
        wait_sentinels_settled(self.sentinels, 1, 30)

    def node_env(self, n: int) -> dict[str, str]:
        env = {
            **node_env(self.settings),
            "TOKEND_NODE_NAME": f"node-{n}",
            "TOKEND_REDIS_URL": self.links[n].url,
            "TOKEND_WORKERS": "2" if n == fs.RELOADING_NODE else "1",
            "TOKEND_ADMIN_PORT": "0",
            "TOKEND_DATA_DIR": str(self.scratch / f"node-{n}"),  # its own pid file
        }
        if self.package is not None:
            env["PYTHONPATH"] = str(self.package)
        return env

    def start_nodes(self) -> None:
        self.nodes = [TokendProcess(self.node_env(n)) for n in range(NODES)]
        self.started = [(n, node) for n, node in enumerate(self.nodes)]
        for node in self.nodes:
            node.launch()
        for n, node in enumerate(self.nodes):
            try:
                node.wait_listening(60)
            except RuntimeError as exc:
                raise RuntimeError(f"node {n} did not start: {node.log_lines[-5:]}") from exc

    def restart(self, n: int) -> None:
        old = self.nodes[n]
        self.nodes[n] = TokendProcess(self.node_env(n), old.port)
        self.started.append((n, self.nodes[n]))
        self.nodes[n].start(60)

    def fail_over(self) -> int:
        """SIGKILL the master; return once the Sentinels have promoted the replica."""
        old = self.master
        self.redis[old].kill()
        new = 1 - old
        clients = [s.client() for s in self.sentinels]

        def promoted() -> bool:
            with contextlib.suppress(redis.RedisError):
                return all(
                    replies.address(c.sentinel_get_master_addr_by_name("tokend"))[1]
                    == self.redis[new].port
                    for c in clients
                )
            return False

        eventually_sync(promoted, 60, interval=0.05, what="sentinels promote the replica")
        eventually_sync(
            lambda: self.redis[new].client().info("replication")["role"] == "master",
            30,
            what="role",
        )
        self.master = new
        return old

    def rejoin(self, old: int) -> None:
        """The old master back, as a replica of the new one, in sync."""
        server = self.redis[old]
        server.extra_args = (
            *REPLICA_ARGS,
            "--replicaof",
            LOOPBACK,
            str(self.redis[self.master].port),
        )
        port = server.port
        server.start()
        assert server.port == port, "the old master's port was taken"
        self.redis[self.master].wait_replicas(1, timeout=60)

    def stop(self) -> None:
        for node in self.nodes:
            if node.process is not None and node.process.poll() is None:
                node.process.send_signal(signal.SIGCONT)
                node.kill()
        for sentinel in self.sentinels:
            sentinel.stop()
        for server in self.redis:
            server.stop()


class Run:
    def __init__(self, args: argparse.Namespace, cluster: Cluster, faults: list[fs.Fault]) -> None:
        self.args = args
        self.cluster = cluster
        self.faults = faults
        self.tokens: WallClockTokens = minter(cluster.settings)
        self.front = ClientFront(NODES)
        self.recorder = Recorder(self.front)
        self.windows: list[h.Window] = []
        self.applied: Counter[str] = Counter()
        self.sessions: list[RecordingSession] = []
        self.revoked: list[RecordingSession] = []
        self.extra: list[RecordingSession] = []
        self.group: list[dict[str, Any]] = []
        self.problems: list[str] = []
        # The driver's stalls: (s into the faults, s late).
        self.stalls: list[tuple[float, float]] = []

    def session(self, token: str, client: int = 0, **options: Any) -> RecordingSession:
        backoff = options.pop("backoff", Backoff(0.2, 2.0))
        return RecordingSession(
            url_of(self.front.port),
            token,
            self.recorder,
            client,
            backoff=backoff,
            open_timeout=OPEN_TIMEOUT,
            close_timeout=2.0,
            **options,
        )

    async def open_sessions(self) -> None:
        for n in range(self.args.sessions):
            session = self.session(self.tokens.mint(f"user-{n}"))
            self.sessions.append(session)
            session.open()
            if n % 50 == 49:
                await asyncio.sleep(0.1)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if all(s.connected or s.ended for s in self.sessions):
                break
            await asyncio.sleep(0.5)

    async def read_group(self, stop: asyncio.Event) -> None:
        """A consumer group over every stream shard, all along: each delivery recorded."""
        sentinel = Sentinel([(LOOPBACK, s.port) for s in self.cluster.sentinels], socket_timeout=2)
        master = sentinel.master_for("tokend", decode_responses=True, socket_timeout=2)
        streams = Keyspace(self.cluster.settings.key_prefix).streams()
        for stream in streams:
            with contextlib.suppress(redis.ResponseError):
                await master.xgroup_create(stream, GROUP, id="0", mkstream=True)
        idle = 0
        while idle < 3:
            try:
                answer = await master.xreadgroup(
                    GROUP, "checker", dict.fromkeys(streams, ">"), count=2000, block=300
                )
            except (redis.RedisError, OSError):
                await asyncio.sleep(0.2)
                continue
            for stream, reply in answer or []:
                entries = replies.entries(reply)
                for entry_id, fields in entries:
                    event = json.loads(fields["event"])
                    self.group.append({"id": f"{stream}/{entry_id}", "event": event})
                with contextlib.suppress(redis.RedisError, OSError):
                    await master.xack(stream, GROUP, *[e for e, _ in entries])
            idle = idle + 1 if stop.is_set() and not answer else 0
        await master.aclose()

    async def read_stream(self) -> list[dict[str, Any]]:
        master = aioredis.Redis(
            host=LOOPBACK, port=self.cluster.redis[self.cluster.master].port, decode_responses=True
        )
        entries = []
        for stream in Keyspace(self.cluster.settings.key_prefix).streams():
            start = "-"
            while chunk := replies.entries(await master.xrange(stream, start, "+", count=5000)):
                entries += [
                    {"id": f"{stream}/{i}", "event": json.loads(f["event"])} for i, f in chunk
                ]
                start = f"({chunk[-1][0]}"
        await master.aclose()
        return entries

    def window(self, kind: str, start: float, node: int | None = None, amount: float = 0.0) -> None:
        self.windows.append(h.Window(kind, start, time.time(), node, amount))
        self.applied[kind] += 1

    async def apply(self, fault: fs.Fault) -> None:
        c = self.cluster
        start = time.time()
        node = fault.node
        kind = fault.kind
        if kind == fs.NODE_KILL and node is not None:
            self.front.faults.down[node] = True
            await asyncio.to_thread(c.nodes[node].kill)
            await asyncio.sleep(fault.duration)
            await asyncio.to_thread(c.restart, node)
            self.front.faults.down[node] = False
        elif kind == fs.NODE_PAUSE and node is not None:
            process = c.nodes[node].process
            assert process is not None
            self.front.faults.down[node] = True
            process.send_signal(signal.SIGSTOP)
            await asyncio.sleep(fault.duration)
            process.send_signal(signal.SIGCONT)
            self.front.faults.down[node] = False
        elif kind == fs.NODE_RELOAD and node is not None:
            await asyncio.to_thread(c.nodes[node].reload, 60)
        elif kind == fs.REDIS_FAILOVER:
            old = await asyncio.to_thread(c.fail_over)
            self.window(kind, start)
            await asyncio.sleep(fault.duration)
            await asyncio.to_thread(c.rejoin, old)
            await self.try_revoked()
            return
        elif kind in (fs.NODE_REDIS_CUT, fs.CLIENT_CUT) and node is not None:
            links = c.redis_faults if kind == fs.NODE_REDIS_CUT else self.front.faults
            links.sever(node, both=kind == fs.NODE_REDIS_CUT)
            await asyncio.sleep(fault.duration)
            links.mend(node)
        elif kind in (fs.NODE_REDIS_DELAY, fs.CLIENT_DELAY) and node is not None:
            links = c.redis_faults if kind == fs.NODE_REDIS_DELAY else self.front.faults
            links.delay[node] = fault.amount
            await asyncio.sleep(fault.duration)
            links.delay[node] = 0.0
        elif kind == fs.CLIENT_DROP and node is not None:
            self.front.faults.blackhole(node)
            await asyncio.sleep(c.clocks.warn_after)
        else:
            await self.act(fault)
            return
        self.window(kind, start, node, fault.amount)

    async def act(self, fault: fs.Fault) -> None:
        assert fault.session is not None
        session = self.sessions[fault.session]
        if fault.node is not None:  # the n-th session held on that node
            held = [s for s in self.sessions if s.connected and s.node == fault.node]
            session = held[fault.session % len(held)]
        tid = str(session.tid)
        self.applied[fault.kind] += 1
        if fault.kind == fs.LOGOUT:
            self.recorder.add(tid, h.LOGOUT, 0)
            await session.close()
        elif fault.kind == fs.SILENCE:
            self.recorder.add(tid, h.SILENCE, 0)
            session.silence()
        elif fault.kind == fs.TAKEOVER:
            if session.session_key is None:
                return
            self.recorder.add(tid, h.TAKEOVER, 0)
            thief = self.session(session.token, 1, session_key=session.session_key)
            self.extra.append(thief)
            thief.open()
        elif fault.kind == fs.REVOKE:
            confirmed = await (
                self.revoke_cli(tid) if fault.via == "cli" else self.revoke_admin(tid)
            )
            self.recorder.add(tid, h.REVOKED if confirmed else h.UNCONFIRMED, 0)
            if confirmed:
                self.revoked.append(session)

    async def revoke_cli(self, tid: str) -> bool:
        env = {
            **os.environ,
            **node_env(self.cluster.settings),
            "TOKEND_REDIS_URL": self.cluster.sentinel_url,
        }
        if self.cluster.package is not None:
            env["PYTHONPATH"] = str(self.cluster.package)
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tokend",
            "revoke",
            tid,
            env=env,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        return await process.wait() == 0

    async def revoke_admin(self, tid: str) -> bool:
        for node in self.cluster.nodes[1:]:
            with contextlib.suppress(OSError, TimeoutError, ValueError, IndexError):
                reply = await http_request(
                    node.admin_port,
                    "DELETE",
                    f"/v1/sessions/{tid}",
                    headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                    timeout=5.0,
                )
                return reply.status == 200
        return False

    async def try_revoked(self) -> None:
        """Each revoked token tried again (with its session key): it must not resume."""
        tries = []
        for session in self.revoked:
            again = self.session(
                session.token,
                2,
                session_key=session.session_key,
                backoff=Backoff(0.1, 0.5, max_attempts=2),
            )
            self.extra.append(again)
            again.open()
            tries.append(again)
        for again in tries:
            with contextlib.suppress(TokendError, TimeoutError):
                async with asyncio.timeout(10):
                    await again.wait()
            await again.close()

    async def run(self) -> Verdict:
        async with contextlib.AsyncExitStack() as stack:
            for link in self.cluster.links:
                await stack.enter_async_context(link)
            await asyncio.to_thread(self.cluster.start_nodes)
            self.front.nodes = [n.port for n in self.cluster.nodes]
            await stack.enter_async_context(self.front)
            stop_reading = asyncio.Event()
            reader = asyncio.create_task(self.read_group(stop_reading))
            await self.open_sessions()
            started = time.monotonic()
            print(f"faults: {len(self.sessions)} sessions open; faults begin", flush=True)
            progress = asyncio.create_task(self.progress(started))
            running: list[asyncio.Task[None]] = []
            for fault in self.faults:
                await asyncio.sleep(max(0.0, started + fault.at - time.monotonic()))
                running.append(asyncio.create_task(self.apply(fault)))
            await asyncio.sleep(max(0.0, started + self.args.duration - time.monotonic()))
            for task in running:
                with contextlib.suppress(Exception):
                    await task
            for task in running:
                if task.done() and task.exception() is not None:
                    self.problems.append(f"a fault failed to apply: {task.exception()!r}")
            progress.cancel()
            await self.try_revoked()
            # Every session's story ends inside the run: what is due is judged by now.
            await asyncio.sleep(self.cluster.clocks.expire_after + 2)
            stream = await self.read_stream()
            stop_reading.set()
            await reader
            for session in self.sessions + self.extra:
                session.silence()
        history = h.History(self.recorder.records, self.windows, stream, self.group)
        if self.args.history is not None:
            self.args.history.write_text(json.dumps(h.as_json(history)) + "\n")
        if self.args.logs is not None:
            self.write_logs(self.args.logs)
        return check(history, self.cluster.clocks, self.verify)

    def write_logs(self, folder: Path) -> None:
        """Each node process's log lines, one file per process in the order they started."""
        folder.mkdir(parents=True, exist_ok=True)
        for k, (n, node) in enumerate(self.cluster.started):
            lines = "".join(json.dumps(line) + "\n" for line in node.log_lines)
            (folder / f"{k:03d}-node-{n}.jsonl").write_text(lines)

    async def progress(self, started: float) -> None:
        """A line every 10 s: how the run goes, and how starved its own loop was (every
        client and relay of the run shares it: a late loop is a late client)."""
        tick = 0.1
        worst = 0.0
        cpu = time.process_time()
        ticked = time.monotonic()
        while True:
            before = time.monotonic()
            await asyncio.sleep(tick)
            now = time.monotonic()
            late = now - before - tick
            worst = max(worst, late)
            if late >= STALL:
                self.stalls.append((round(now - started - late, 1), round(late, 2)))
            if now - ticked < 10:
                continue
            # The records are kept to the end: frozen, the collector's full passes no
            # longer walk them (they grew to stalls of a second as the history grew).
            gc.freeze()
            connected = sum(s.connected for s in self.sessions)
            used = time.process_time()
            print(
                f"faults: {now - started:.0f} s: {connected} sessions connected, "
                f"{len(self.recorder.records)} records, {sum(self.applied.values())} faults; "
                f"driver: {100 * (used - cpu) / (now - ticked):.0f} % CPU, "
                f"loop late by {1000 * worst:.0f} ms at worst",
                flush=True,
            )
            worst, cpu, ticked = 0.0, used, now

    def verify(self, token: str, at: float) -> tuple[str, int] | None:
        try:
            claims = self.tokens.verify(token, at)
        except Exception:
            return None
        return str(claims.tid), claims.exp * 1000


# Summary entries too long for the terminal (each violation is printed on its own line).
SHOWN_APART = ("schedule", "excused", "violations", "stories")


def summary(run: Run, verdict: Verdict, seed: int) -> dict[str, Any]:
    told = stories(h.History(run.recorder.records))
    resumes = sum(1 for r in run.recorder.records if r.kind == h.WELCOME and r.resumed)
    return {
        "seed": seed,
        "duration_s": run.args.duration,
        "sessions": run.args.sessions,
        "schedule": [fault.as_json() for fault in run.faults],
        "faults_by_kind": dict(sorted(run.applied.items())),
        "resumes": resumes,
        "sessions_by_outcome": dict(sorted(verdict.outcomes.items())),
        "excused_by_reason": verdict.excused_by_reason(),
        "excused": [vars_of(e) for e in verdict.excused],
        "violations": [vars_of(v) for v in verdict.violations],
        # The whole story of each session with a violation.
        "stories": {v.tid: told[v.tid].telling() for v in verdict.violations if v.tid in told},
        "problems": run.problems,
        "driver_stalls": run.stalls,
    }


def vars_of(item: Any) -> dict[str, Any]:
    return {name: getattr(item, name) for name in item.__slots__}


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--seed", type=int, default=None, help="the schedule's seed (random if not given)"
    )
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of faults and calm")
    parser.add_argument("--sessions", type=int, default=1500)
    parser.add_argument("--json", type=Path, default=None, help="write the summary here")
    parser.add_argument(
        "--history", type=Path, default=None, help="write every record, fault window and event here"
    )
    parser.add_argument(
        "--logs", type=Path, default=None, help="write every node process's log lines here"
    )
    parser.add_argument(
        "--plant",
        choices=sorted(planted.DEFECTS),
        default=None,
        help="run a copy of tokend with this known defect planted (the checker must catch it)",
    )
    parser.add_argument(
        "--planted-schedule",
        action="store_true",
        help="the short schedule under which every planted defect shows, instead of the random one",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    print(f"faults: seed {seed}", flush=True)
    clocks = fs.Clocks()
    if args.planted_schedule:
        faults = fs.planted_schedule(seed, args.sessions, clocks)
    else:
        faults = fs.schedule(seed, args.duration, args.sessions, clocks, NODES)
    _install_port_probe()
    # Stopped (SIGTERM), the run still stops the processes it started (the finally below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="tokend-faults-") as scratch:
        # `python -m tokend` looks in its working directory first: not in a checkout's.
        os.chdir(scratch)
        package = None
        if args.plant is not None:
            package = planted.planted_copy(args.plant, Path(scratch) / "planted")
            print(f"faults: tokend with {args.plant} planted", flush=True)
        cluster = Cluster(Path(scratch), clocks, package)
        try:
            cluster.start_redis()
            run = Run(args, cluster, faults)
            verdict = asyncio.run(run.run())
        finally:
            cluster.stop()
    result = summary(run, verdict, seed)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    for violation in result["violations"]:
        print(
            f"VIOLATION {violation['promise']}: session {violation['tid']}: {violation['detail']}"
        )
    for story in result["stories"].values():  # each session's whole story, once
        print(story)
    print(
        json.dumps(
            {k: v for k, v in result.items() if k not in SHOWN_APART},
            indent=1,
        )
    )
    print(f"faults: seed {seed}: {len(verdict.violations)} violation(s)", flush=True)
    return 1 if verdict.violations or run.problems else 0


if __name__ == "__main__":
    sys.exit(main())
